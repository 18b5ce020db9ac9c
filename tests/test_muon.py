"""Muon8bitBlock against a 32-bit Muon written here from DeepSpeed 0.19.8's muon_update and adam_update
(deepspeed/runtime/zero/muon/original_muon.py), its default tagging, checks, checkpoints, memory, and
its partitions (threads standing in for ranks, as in test_layout.py) stepping bit-identically."""
import io
import sys
import threading

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8.optim import path_matrix, rules
from ds_q8.optim.layout import Segment, StateLayout, shared_blocks
from ds_q8.optim.muon import default_use_muon, tag_muon

from helpers.layout import ThreadComm, partitions, run_ranks


A, B, C = 3.4445, -4.7750, 2.0315


def ref_ns(G, steps=5):
    """zeropower_via_newtonschulz5 in fp32, as DeepSpeed writes it."""
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        Am = X @ X.mT
        Bm = B * Am + C * Am @ Am
        X = A * X + Bm @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class RefMuon(torch.optim.Optimizer):
    """32-bit Muon with auxiliary AdamW: DeepSpeed's SingleDeviceMuonWithAuxAdam step with fp32 NS."""

    def __init__(self, groups):
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if g["use_muon"]:
                    m = st.setdefault("momentum_buffer", torch.zeros_like(p))
                    grad = p.grad.clone()
                    m.lerp_(grad, 1 - g["momentum"])
                    u = grad.lerp_(m, g["momentum"])
                    rows, cols = u.shape
                    u = ref_ns(u) * (max(1, rows / cols) ** 0.5)
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    p.add_(u, alpha=-g["lr"])
                else:
                    if not st:
                        st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    st["step"] += 1
                    b1, b2 = g["betas"]
                    st["exp_avg"].lerp_(p.grad, 1 - b1)
                    st["exp_avg_sq"].lerp_(p.grad.square(), 1 - b2)
                    upd = (st["exp_avg"] / (1 - b1 ** st["step"])) / (
                        (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt() + g["eps"])
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    p.add_(upd, alpha=-g["lr"])


SHAPES = [(96, 130), (130, 96), (64, 64), (130,)]
KW = dict(lr=0.01, adam_lr=1e-3, momentum=0.9, betas=(0.8, 0.99), eps=1e-8, weight_decay=1e-2)


def run_pair(steps, ns_method="standard", optim_bits=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=g) for s in SHAPES]
    targets = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [nn.Parameter(w.clone()) for w in w0]
    ref = [nn.Parameter(w.clone()) for w in w0]
    o1 = ds_q8.Muon8bitBlock(ours, ns_method=ns_method, optim_bits=optim_bits, **KW)
    groups = [dict(params=[q for q, s in zip(ref, SHAPES) if len(s) == 2], use_muon=True, lr=0.01, momentum=0.9,
                   weight_decay=1e-2),
              dict(params=[q for q, s in zip(ref, SHAPES) if len(s) < 2], use_muon=False, lr=1e-3, betas=(0.8, 0.99),
                   eps=1e-8, weight_decay=1e-2)]
    o2 = RefMuon(groups)
    for _ in range(steps):
        for p1, p2, t in zip(ours, ref, targets):
            grad = (p2.detach() - t) + torch.randn(p2.shape, generator=g) * 0.5
            p1.grad, p2.grad = grad.clone(), grad.clone()
        o1.step()
        o2.step()
    return ours, ref, w0, o1, o2


def test_newton_schulz_is_deepspeeds():
    """ds_q8's fp32 iterations against DeepSpeed's own functions where they run in fp32 (the CPU)."""
    ds = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    g = torch.Generator().manual_seed(3)
    for shape in [(40, 70), (70, 40), (32, 32)]:
        G = torch.randn(shape, generator=g)
        assert torch.allclose(rules.newton_schulz(G, 5), ref_ns(G), atol=1e-5)
        if ds.ns_compute_dtype("gram") == torch.float32:
            want = ds.zeropower_via_gram_newtonschulz.__wrapped__(G, 5) if hasattr(
                ds.zeropower_via_gram_newtonschulz, "__wrapped__") else ds.zeropower_via_gram_newtonschulz(G, 5)
            assert torch.allclose(rules.gram_newton_schulz(G, 5), want.float(), atol=1e-4)
        # gram and standard are the same polynomial
        assert torch.allclose(rules.gram_newton_schulz(G, 5), rules.newton_schulz(G, 5), atol=2e-3)
    assert rules.muon_scale((96, 24)) == 2.0 and rules.muon_scale((24, 96)) == 1.0


def test_32bit_state_tracks_the_reference_tightly():
    ours, ref, _, _, _ = run_pair(50, optim_bits=32)
    for p1, p2 in zip(ours, ref):
        assert float((p1 - p2).detach().abs().max()) < 2e-4


# measured over 300 steps (seed 0), norm of deviation / distance travelled and the largest element's:
# gram .0087/.018 and standard .0087/.019 on the matrices; the AdamW vector .010/.018. The other 8-bit
# optimizers get 0.03-0.04 / 0.06-0.19 in test_optim.py; these limits are those.
@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_8bit_tracks_the_reference(ns_method):
    ours, ref, w0, o1, _ = run_pair(300, ns_method=ns_method)
    for p1, p2, w in zip(ours, ref, w0):
        travelled = float((p2 - w).norm())
        assert float((p1 - p2).norm()) < 0.035 * travelled
        assert float((p1 - p2).abs().max()) < 0.1 * float((p2 - w).abs().max())
    assert [g["use_muon"] for g in o1.param_groups] == [True, False]
    assert set(o1.state[ours[0]]) == {"step", "state1", "absmax1"}


def test_default_tagging_and_learning_rates():
    model = nn.Module()
    model.embed_tokens = nn.Embedding(50, 16)
    model.fc = nn.Linear(16, 32)
    model.norm = nn.LayerNorm(32)
    model.lm_head = nn.Linear(32, 50, bias=False)
    model.conv = nn.Conv2d(3, 4, 3)
    named = dict(model.named_parameters())
    assert {n: default_use_muon(p, n) for n, p in named.items()} == {
        "embed_tokens.weight": False, "fc.weight": True, "fc.bias": False, "norm.weight": False, "norm.bias": False,
        "lm_head.weight": False, "conv.weight": True, "conv.bias": False}
    named["fc.weight"].use_muon = False  # a tag wins
    assert not default_use_muon(named["fc.weight"])
    del named["fc.weight"].use_muon
    # names reach the optimizer as (name, parameter) pairs
    opt = ds_q8.Muon8bitBlock(list(model.named_parameters()), lr=0.05, adam_lr=1e-3)
    muon, adam = opt.param_groups
    assert muon["use_muon"] and muon["lr"] == 0.05 and {id(p) for p in muon["params"]} == {
        id(model.fc.weight), id(model.conv.weight)}
    assert not adam["use_muon"] and adam["lr"] == 1e-3 and len(adam["params"]) == 6
    # DeepSpeed's defaults without any lr; muon_lr over the shared lr; a group's own lr over both
    d = ds_q8.Muon8bitBlock([nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))])
    assert [g["lr"] for g in d.param_groups] == [0.02, 3e-4]
    e = ds_q8.Muon8bitBlock([{"params": [nn.Parameter(torch.zeros(4, 4))], "lr": 0.3}], lr=0.1, muon_lr=0.2)
    assert e.param_groups[0]["lr"] == 0.3
    f = ds_q8.Muon8bitBlock([nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))], lr=0.1, muon_lr=0.2)
    assert [g["lr"] for g in f.param_groups] == [0.2, 0.1]
    assert tag_muon(model)["fc.weight"] and not model.lm_head.weight.use_muon


@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum=1.0), "momentum must be in [0.0, 1.0)"),
    (dict(momentum=float("nan")), "momentum must be a number"),
    (dict(ns_method="svd"), "ns_method must be one of ('gram', 'standard')"),
    (dict(ns_steps=0), "ns_steps must be an integer in [1, 100]"),
    (dict(ns_steps=2.5), "ns_steps must be an integer"),
    (dict(direction_bits=16), "direction_bits must be 8 or 32"),
    (dict(nesterov=1), "nesterov must be True or False"),
    (dict(muon_lr=-1.0), "muon_lr must be in [0.0, inf)"),
    (dict(adam_lr=float("inf")), "adam_lr must be in [0.0, inf)"),
    (dict(lr=-0.1), "lr must be in [0.0, inf)"),
    (dict(betas=(0.9, 1.0)), "betas[1] must be in [0.0, 1.0)"),
    (dict(eps=-1.0), "eps must be in [0.0, inf)"),
    (dict(weight_decay=-1.0), "weight_decay must be in [0.0, inf)"),
])
def test_invalid_hyperparameters_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as e:
        ds_q8.Muon8bitBlock([nn.Parameter(torch.zeros(8, 8))], **kwargs)
    assert message in str(e.value)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="use_muon: Muon orthogonalizes matrices"):
        ds_q8.Muon8bitBlock([{"params": [nn.Parameter(torch.zeros(8))], "use_muon": True}])
    p = nn.Parameter(torch.zeros(8))
    p.use_muon = True
    with pytest.raises(ValueError, match="shape \\(8,\\) is tagged use_muon=True"):
        ds_q8.Muon8bitBlock([p])
    with pytest.raises(ValueError, match="impl must be 'auto' or 'reference' for a Muon group"):
        ds_q8.Muon8bitBlock([nn.Parameter(torch.zeros(8, 8))], impl="kernel")
    opt = ds_q8.Muon8bitBlock([nn.Parameter(torch.zeros(8, 8))])
    with pytest.raises(ValueError, match="momentum must be in"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))],
                             "momentum": 2.0})
    assert len(opt.param_groups) == 1  # neither half kept


def _train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip_resumes_bit_identically(dtype):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    opt = ds_q8.Muon8bitBlock(params, **KW)
    _train(opt, params, 3, 1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved_params = [p.detach().clone() for p in params]
    _train(opt, params, 3, 2)
    want = [p.detach().clone() for p in params]

    params2 = [nn.Parameter(s.clone()) for s in saved_params]
    opt2 = ds_q8.Muon8bitBlock(params2, **KW)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    assert sd["ds_q8"]["tensor_states"] == {i: {"state_names": ["momentum_buffer"], "state_signed": [True]}
                                            for i in range(3)}
    opt2.load_state_dict(sd)
    _train(opt2, params2, 3, 2)
    for a, b in zip(want, params2):
        assert torch.equal(a, b.detach())
    for p, q in zip(params, params2):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k])
    # the fp32 export names each entry's states by its own rule
    out = ds_q8.Muon8bitBlock.export_fp32_state_dict(opt.state_dict())
    assert set(out["state"][0]) == {"step", "momentum_buffer"} and set(out["state"][3]) == {
        "step", "exp_avg", "exp_avg_sq"}
    # a checkpoint whose groups hold the other kind is refused, naming why
    other = ds_q8.Muon8bitBlock([{"params": params2[:3], "use_muon": False}, {"params": params2[3:]}], **KW)
    with pytest.raises(ValueError, match="keeps states \\['momentum_buffer'\\].*use_muon"):
        other.load_state_dict(opt.state_dict())


def test_momentum_is_one_byte_per_element_plus_block_maxima():
    w = nn.Parameter(torch.randn(256, 300))
    b = nn.Parameter(torch.randn(300))
    opt = ds_q8.Muon8bitBlock([w, b], block_size=256, min_8bit_size=100)
    _train(opt, [w, b], 1, 0)
    qs = opt.quantized_state(w)
    n = w.numel()
    assert qs.nbytes() == {"codes": n, "absmax": 2 * ((n + 255) // 256), "fp32": 0}
    assert opt.state[w]["state1"].dtype == torch.uint8 and "state2" not in opt.state[w]
    assert opt.quantized_state(b).nbytes()["codes"] == 2 * b.numel()  # AdamW: two 8-bit states
    assert set(opt.dequantized_state(w)) == {"momentum_buffer"}


def test_existing_optimizers_write_the_marker_they_always_wrote():
    p = nn.Parameter(torch.randn(64, 80))
    opt = ds_q8.AdamW8bitBlock([p])
    _train(opt, [p], 1, 0)
    assert set(opt.state_dict()["ds_q8"]) == {"optimizer", "format", "state_names", "state_signed", "layouts", "codecs"}


# ---------------------------------------------------------------------------- partitions (threads as ranks)
MAT_SHAPES = [(37, 20), (300,), (129, 13), (50, 70), (77, 51)]
BLOCK = 64


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in MAT_SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in MAT_SHAPES]


def run_plain_muon(steps, kw):
    params = _params()
    opt = ds_q8.Muon8bitBlock(params, **kw)
    for s in range(steps):
        for p, g in zip(params, _grads(s)):
            p.grad = g.clone()
        opt.step()
    return params, opt


def run_sharded_muon(world, stage, steps, kw):
    """Each kind's parameters flattened into one partition per rank (ZeRO 1/2: contiguous ranges;
    stage 3: a slice of each), registered with their shapes as zero_layout registers them."""
    masters = _params()
    kinds = [[i for i, s in enumerate(MAT_SHAPES) if len(s) == 2], [i for i, s in enumerate(MAT_SHAPES) if len(s) < 2]]
    shared = {"buf": [None] * world, "barrier": threading.Barrier(world), "calls": [0] * world}
    ranks = []  # per rank: [(opt, flat, parts, member indices)]
    plans = []
    for members in kinds:
        sizes = [masters[i].numel() for i in members]
        parts, lengths = partitions(sizes, world, stage)
        segs = [[Segment(start, numel, j, pstart, sizes[j], True, f"p{members[j]}") for j, pstart, numel, start in
                 parts[r]] for r in range(world)]
        union = sorted({b for r in range(world) for b in shared_blocks(segs[r], BLOCK)})
        plans.append((members, sizes, parts, lengths, segs, {b: i for i, b in enumerate(union)}))
    for r in range(world):
        flats, groups = [], []
        for (members, sizes, parts, lengths, segs, slots), use_muon in zip(plans, (True, False)):
            flat = nn.Parameter(torch.zeros(lengths[r]))
            for j, pstart, numel, start in parts[r]:
                flat.data[start:start + numel] = masters[members[j]].data.view(-1)[pstart:pstart + numel]
            flats.append(flat)
            groups.append({"params": [masters[i] for i in members], "use_muon": use_muon})
        # as ZeRO does: the optimizer is built over the parameters, then its groups hold the partitions
        opt = ds_q8.Muon8bitBlock(groups, **kw)
        for gi, ((members, sizes, parts, lengths, segs, slots), flat) in enumerate(zip(plans, flats)):
            opt.param_groups[gi]["params"] = [flat]
            layout = StateLayout(flat.shape, segs[r], BLOCK, comm=ThreadComm(world, r, shared), slots=slots,
                                 num_slots=len(slots), num_params=len(members),
                                 group_index=gi, param_shapes=[MAT_SHAPES[i] for i in members])
            opt.register_layout(flat, layout, opt.param_groups[gi])
        ranks.append((opt, flats))

    def loop(r):
        opt, flats = ranks[r]
        for s in range(steps):
            full = _grads(s)
            for (members, sizes, parts, lengths, segs, slots), flat in zip(plans, flats):
                g = torch.zeros(lengths[r])
                for j, pstart, numel, start in parts[r]:
                    g[start:start + numel] = full[members[j]].view(-1)[pstart:pstart + numel]
                flat.grad = g
            opt.step()

    run_ranks(world, loop, shared)
    out = [torch.zeros(s).view(-1) for s in MAT_SHAPES]
    states = [dict() for _ in MAT_SHAPES]
    for r in range(world):
        opt, flats = ranks[r]
        for (members, sizes, parts, lengths, segs, slots), flat in zip(plans, flats):
            dq = opt.dequantized_state(flat)
            for j, pstart, numel, start in parts[r]:
                i = members[j]
                out[i][pstart:pstart + numel] = flat.data[start:start + numel]
                for k, v in dq.items():
                    states[i].setdefault(k, torch.zeros(masters[i].numel()))[pstart:pstart + numel] = \
                        v.view(-1)[start:start + numel]
    exchanged = sum(path_matrix.exchanged_bytes(opt.tensors.layouts[flats[0]]) for opt, flats in ranks)
    return [o.view(s) for o, s in zip(out, MAT_SHAPES)], states, exchanged


@pytest.mark.parametrize("direction_bits", [8, 32])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_partitions_step_bit_identically_to_whole_parameters(world, stage, direction_bits):
    kw = dict(KW, block_size=BLOCK, min_8bit_size=0, direction_bits=direction_bits)
    steps = 4
    params, ref = run_plain_muon(steps, kw)
    got, states, exchanged = run_sharded_muon(world, stage, steps, kw)
    for i, (p, q) in enumerate(zip(params, got)):
        assert torch.equal(p.detach(), q), f"parameter {i} ({MAT_SHAPES[i]}) differs"
        for k, v in ref.dequantized_state(p).items():
            assert torch.equal(v.view(-1), states[i][k]), f"parameter {i} state {k} differs"
    muon_numel = sum(torch.Size(s).numel() for s in MAT_SHAPES if len(s) == 2)
    if world > 1:
        # the exchange moves the matrices cut by edges only: below every rank gathering every matrix's
        # fp32 momentum (4 bytes per element per rank and step)
        fp32_gather = world * steps * 4 * muon_numel
        assert 0 < exchanged <= fp32_gather
        if stage == 2:
            assert exchanged < fp32_gather
        if direction_bits == 8:  # codes and one maximum per block of 64: 1.06 bytes per element
            assert exchanged <= fp32_gather * (1 + 4 / BLOCK) / 4 + world * steps * 4 * len(MAT_SHAPES)


# ---------------------------------------------------------------------------- one DeepSpeed rank (ZeRO-2)
DS_SCRIPT = r'''
import json, sys, torch
from torch import nn
import ds_q8, deepspeed
from ds_q8.optim.muon import tag_muon
torch.set_num_threads(1)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(40, 24)
        self.fc1 = nn.Linear(24, 48)
        self.fc2 = nn.Linear(48, 24)
        self.norm = nn.LayerNorm(24)
        self.lm_head = nn.Linear(24, 40, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1
    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.fc2(torch.relu(self.fc1(h))))
        return nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), x.roll(1, 1).flatten())

def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 40, (4, 8), generator=g) for _ in range(5)]

params = dict(lr=0.02, adam_lr=3e-3, block_size=64, min_8bit_size=0)
ref = Net(); tags = tag_muon(ref)
opt = ds_q8.Muon8bitBlock(ref.parameters(), **params)
for x in batches():
    opt.zero_grad(); ref(x).backward(); opt.step()

model = Net()
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "Muon8bitBlock", "params": params}}
engine, dsopt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ds_tags = {n: bool(p.use_muon) for n, p in model.named_parameters()}
for x in batches():
    loss = engine(x); engine.backward(loss); engine.step()
from deepspeed.utils import safe_get_full_fp32_param
same = {n: bool(torch.equal(safe_get_full_fp32_param(p).float(), q.detach().float()))
        for (n, p), q in zip(model.named_parameters(), ref.parameters())}
base = engine.optimizer.optimizer
keys = sorted({k for st in base.state.values() for k in st})
print("RESULT " + json.dumps({"tags": tags, "ds_tags": ds_tags, "same": same, "keys": keys,
                              "groups": [g["use_muon"] for g in base.param_groups]}))
'''


def test_one_deepspeed_rank_at_zero2_matches_the_plain_loop_with_deepspeeds_tags(tmp_path):
    """deepspeed.initialize tags the parameters as for "type": "Muon"; its own ZeRO-1/2 Muon stays off
    (no fp32 momentum_buffer, no double orthogonalization): the parameters are the plain loop's bits."""
    import json
    import os
    import subprocess
    import sys as _sys

    from helpers.ds_launch import env, free_port

    e = dict(env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    (tmp_path / "s.py").write_text(DS_SCRIPT)
    proc = subprocess.run([_sys.executable, str(tmp_path / "s.py")], env=e, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    assert out["tags"] == out["ds_tags"] == {
        "embed.weight": False, "fc1.weight": True, "fc1.bias": False, "fc2.weight": True, "fc2.bias": False,
        "norm.weight": False, "norm.bias": False, "lm_head.weight": False}
    assert out["groups"] == [True, False]
    assert "momentum_buffer" not in out["keys"] and "state1" in out["keys"]
    assert all(out["same"].values()), out["same"]


@pytest.mark.multirank
def test_two_ranks_at_every_zero_stage_and_offload_match_the_plain_loop(tmp_path):
    """tests/ds_scripts/invariance.py's bag (integer gradients, three matrices of which partitions cut
    some, vectors, a 32-bit embedding) with Muon8bitBlock: 2 DeepSpeed ranks at stages 0-3, and 2 and 3
    with the optimizer offloaded, give the plain PyTorch loop's parameters and dequantized states bit for
    bit; DeepSpeed's per-parameter state API reads and writes each group's own states."""
    import json

    from helpers.ds_launch import SCRIPTS, run_checked

    offload = {"offload_optimizer": {"device": "cpu"}}
    plan = [{"name": f"muon_s{s}", "optimizer": "Muon8bitBlock", "stage": s, "steps": 6, "lr": 0.01, "api": s > 0}
            for s in (0, 1, 2, 3)]
    plan += [{"name": f"muon_s{s}_off", "optimizer": "Muon8bitBlock", "stage": s, "steps": 6, "lr": 0.01,
              "zero": offload} for s in (2, 3)]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    for d in ("plain", "w2"):
        (tmp_path / d).mkdir()
    run_checked([sys.executable, str(SCRIPTS / "invariance.py"), "--plain", "--plan", str(tmp_path / "plan.json"),
                 "--out", str(tmp_path / "plain")], tmp_path / "plain.log", 300)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "0",
           str(SCRIPTS / "invariance.py"), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "w2")]
    run_checked(cmd, tmp_path / "w2.log", 900, result=tmp_path / "w2" / f"{plan[-1]['name']}.pt")
    for job in plan:
        a = torch.load(tmp_path / "plain" / f"{job['name']}.pt", weights_only=False)
        b = torch.load(tmp_path / "w2" / f"{job['name']}.pt", weights_only=False)
        for n in a["params"]:
            assert torch.equal(a["params"][n].float(), b["params"][n].float()), (job["name"], n)
            for k, v in a["state"][n].items():
                assert torch.equal(v.reshape(-1).float(), b["state"][n][k].reshape(-1).float()), (job["name"], n, k)
        if job.get("api"):  # DeepSpeed's per-parameter state API on the rule of each parameter's group
            api = b["api"]
            assert all("no_such_state" in m for m in api["bad_name"]), api["bad_name"]
            assert api["set_get_w4"] == 0.0 and api["set_get_norm"] == 0.0, api


def test_compiled_codec_gives_the_reference_bits():
    """impl="auto" (de)quantizes the momentum and the direction in the compiled kernels; "reference"
    in functional.py: the same parameters and codes, step for step."""
    from ds_q8 import ops

    runs, kernel_calls = [], []
    for impl in ("reference", "auto"):
        params = _params()
        opt = ds_q8.Muon8bitBlock(params, impl=impl, **dict(KW, block_size=BLOCK, min_8bit_size=0))
        before = ops.CALLS[("cpu", "quantize")]
        for s in range(4):
            for p, g in zip(params, _grads(s)):
                p.grad = g.clone()
            opt.step()
        kernel_calls.append(ops.CALLS[("cpu", "quantize")] - before)
        runs.append((params, opt))
    # each path really ran: the reference never calls the compiled quantize, auto always does
    assert kernel_calls[0] == 0 and kernel_calls[1] > 0, kernel_calls
    (pa, oa), (pb, ob) = runs
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        for k in oa.state[a]:
            assert torch.equal(oa.state[a][k], ob.state[b][k]), k




@pytest.mark.multirank
@pytest.mark.slow
def test_gpt_job_at_one_and_two_ranks_ends_bit_identical(tmp_path):
    """The GPT job (launch/train_gpt.py, ds_configs/tiny_cpu_muon8bit.json: ZeRO-2, no clipping) with the
    same global batch, 1 rank x 2 accumulation steps against 2 ranks x 1, batches drawn by their index in
    the run (--world_invariant_data): the final parameters in the two checkpoints are the same bits."""
    from helpers.ds_launch import REPO, free_port, run_checked

    train = REPO / "launch" / "train_gpt.py"
    args = ["--deepspeed_config", str(REPO / "ds_configs" / "tiny_cpu_muon8bit.json"), "--max_steps", "4",
            "--micro_batch", "4", "--context", "64", "--eval_interval", "0", "--eval_batches", "2", "--save_interval",
            "0", "--world_invariant_data", "--no_progress", "--overwrite"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_checked([sys.executable, str(train), *args, "--grad_accum", "2", "--save_dir", str(one),
                 "--master_port", str(free_port())], tmp_path / "one.log", 300)
    run_checked([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "0",
                 str(train), *args, "--grad_accum", "1", "--save_dir", str(two)], tmp_path / "two.log", 600,
                result=two / "summary.json")
    a = torch.load(one / "step4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    b = torch.load(two / "step4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max().item())
