"""``correction_byte=True``: a bf16 parameter and an int8 of its rounding residue, read and written as
one 24-bit value (fp32 with the low 8 mantissa bits zero).

* the format (``rounding.split_bf16`` / ``join_bf16``): every 24-bit value survives a split exactly,
  a split is to nearest (at most half a 24-bit unit away), Inf/NaN/zeros/extremes behave;
* every CPU kernel (each instruction set, every rule, 8-bit and fp32 states, bf16 and fp32
  gradients) writes the parameters and bytes the reference writes, bit for bit (the CUDA kernels:
  ``test_cuda_sim.py::test_correction_bytes``);
* what it buys: updates far below half a bf16 unit add up, deterministically, as in an fp32 master;
* options, checkpoints (save, resume bit for bit, load without bytes, drop stale bytes) and the
  bindings' checks.

ZeRO stages, world sizes and universal checkpoints: ``test_zero_invariance.py``.
"""
import pytest
import torch

import ds_q8
from ds_q8 import ops
from ds_q8.optim.rounding import join_bf16, split_bf16

from helpers.optimizer_cases import kernel_cases


@pytest.fixture(scope="module")
def cpu_op():
    module = ops.load_op("cpu")
    if module is None:
        pytest.skip("the CPU op could not be built")
    return module

RULES = kernel_cases()
ISAS = ["avx512", "avx2", "scalar"]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32 if x.element_size() == 4 else torch.int16 if x.element_size() == 2
                               else torch.int8)


# ---------------------------------------------------------------------------- the format
def test_a_24_bit_value_survives_a_split_exactly():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 8)
    x24 = (_bits(x) & ~0xFF).view(torch.float32)  # 24-bit values: low 8 mantissa bits zero
    b, c = split_bf16(x24)
    assert torch.equal(_bits(join_bf16(b, c)), _bits(x24))


def test_a_split_is_to_nearest_and_its_bf16_is_within_one_unit():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=gen) * torch.exp(torch.randn(200_000, generator=gen) * 4)
    b, c = split_bf16(x)
    y = join_bf16(b, c)
    ulp24 = (_bits(x.abs()) & 0x7F800000).view(torch.float32) * 2.0 ** -15  # one 24-bit unit at x
    assert bool(((y - x).abs() <= ulp24 / 2).all())
    assert int(c.min()) >= -128 and int(c.max()) <= 127 and int((c != 0).sum()) > 190_000
    nearest = x.to(torch.bfloat16)  # torch rounds to nearest even in one step; the split rounds twice
    assert int((_bits(b) != _bits(nearest)).sum()) < 1000  # near ties only: about 1 in 512
    assert bool(((b.float() - nearest.float()).abs() <= (nearest.float().abs() * 2.0 ** -7)).all())


def test_special_values_keep_a_zero_byte():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38,
                      1e-40, -1e-40, torch.finfo(torch.float32).max])
    b, c = split_bf16(x)
    y = join_bf16(b, c)
    assert torch.equal(_bits(y[:2]), _bits(x[:2]))  # signed zeros stay
    assert y[2] == float("inf") and y[3] == -float("inf") and bool(torch.isnan(y[4]))
    assert c[2:5].tolist() == [0, 0, 0] and bool(torch.isinf(b[9].float()))  # beyond bf16: Inf, as rounding says
    assert float(y[5]) == pytest.approx(3.3895e38, rel=2 ** -15) and float(y[7]) == pytest.approx(1e-40, rel=1e-2)


def test_small_updates_add_up_where_bf16_alone_loses_them():
    """1000 steps of about +1e-4 on 1.0: half a bf16 unit there is 0.0039, so rounding to nearest keeps
    1.0; the 24-bit value (unit 2^-15 = 3.05e-5) loses at most half a unit per step, and with updates
    that vary, as an optimizer's do, much less."""
    gen = torch.Generator().manual_seed(0)
    steps = (1e-4 * (1 + torch.rand(1000, generator=gen))).tolist()
    fp32, bf16 = torch.ones(1), torch.ones(1, dtype=torch.bfloat16)
    b, c = split_bf16(torch.ones(1))
    for u in steps:
        fp32 += u
        bf16 = (bf16.float() + u).to(torch.bfloat16)
        b, c = split_bf16(join_bf16(b, c) + u)
    assert float(bf16) == 1.0
    err = abs(float(join_bf16(b, c)) - float(fp32))
    assert err < 1000 * 2.0 ** -16 and err < 0.02 * (float(fp32) - 1.0), err


# ---------------------------------------------------------------------------- kernels = reference
def _run(cls, kw, impl, dtype, grad_dtype, min_8bit_size, steps=3, sizes=(3000, 513, 64, 7)):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    for p in params:
        p.grad_dtype = grad_dtype
    opt = cls(params, impl=impl, correction_byte=True, block_size=256, min_8bit_size=min_8bit_size, **kw)
    for s in range(steps):
        for i, p in enumerate(params):
            p.grad = (torch.randn(p.numel(), generator=gen) * 10.0 ** ((s + i) % 3 - 1)).to(grad_dtype)
        opt.step()
    return params, opt


@pytest.fixture
def isa(request, cpu_op):
    if request.param not in cpu_op.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    with ops.use_cpu_isa(request.param):
        yield request.param


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("states", ["8-bit", "fp32"])
def test_kernels_write_what_the_reference_writes(isa, rule, states):
    cls, kw = RULES[rule]
    grad_dtype = torch.float32 if rule in ("adamw", "lion") else torch.bfloat16
    mb = 0 if states == "8-bit" else 10 ** 9
    (pk, ok), (pr, orf) = (_run(cls, kw, impl, torch.bfloat16, grad_dtype, mb) for impl in ("kernel", "reference"))
    for a, b in zip(pk, pr):
        assert torch.equal(_bits(a.data), _bits(b.data)), f"{rule} {states} param of {a.numel()}"
        sa, sb = ok.state[a], orf.state[b]
        assert sa.keys() == sb.keys() and "correction" in sa
        for key in sa:
            if torch.is_tensor(sa[key]):
                assert torch.equal(_bits(sa[key]) if sa[key].is_floating_point() else sa[key],
                                   _bits(sb[key]) if sb[key].is_floating_point() else sb[key]), (rule, key)
    assert bool(ok.state[pk[0]]["correction"].any())


def test_bytes_only_for_bf16_parameters():
    p32 = torch.nn.Parameter(torch.randn(300))
    p16 = torch.nn.Parameter(torch.randn(300).half())
    opt = ds_q8.AdamW8bitBlock([p32, p16], lr=1e-3, correction_byte=True, min_8bit_size=0)
    for p in (p32, p16):
        p.grad = torch.randn_like(p)
    opt.step()
    assert "correction" not in opt.state[p32] and "correction" not in opt.state[p16]


# ---------------------------------------------------------------------------- what it buys
def test_a_low_learning_rate_tracks_fp32_masters():
    """Adam at lr 1e-4 on weights of about 1: each update is a fortieth of half a bf16 unit. bf16
    written to nearest stands still; stochastic rounding is right on average but noisy; the 24-bit
    master (unit 2^-15 at 1) follows the fp32 master closely and the same way every run."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16)
    grads = [torch.randn(4096, generator=gen) for _ in range(200)]

    def train(dtype, **opts):
        p = torch.nn.Parameter(w0.to(dtype).clone())
        opt = ds_q8.Adam8bitBlock([p], lr=1e-4, min_8bit_size=0, **opts)
        for g in grads:
            p.grad = (g + 0.5).to(dtype)
            opt.step()
        return opt, p

    _, fp32 = train(torch.float32)
    opt_c, corrected = train(torch.bfloat16, correction_byte=True)
    _, nearest = train(torch.bfloat16, stochastic_rounding=False)
    _, stochastic = train(torch.bfloat16)
    moved = (fp32.detach() - w0.float()).abs().mean()
    value = join_bf16(corrected.detach(), opt_c.state[corrected]["correction"])
    err = {name: float((x - fp32.detach()).abs().mean() / moved)
           for name, x in (("correction", value), ("nearest", nearest.detach().float()),
                           ("stochastic", stochastic.detach().float()))}
    assert err["nearest"] > 0.9  # stood still
    assert err["correction"] < 0.03 and err["correction"] < err["stochastic"] / 10, err  # measured 0.011 vs 0.64
    assert torch.equal(_bits(train(torch.bfloat16, correction_byte=True)[1].detach()), _bits(corrected.detach()))


# ---------------------------------------------------------------------------- options and checkpoints
@pytest.mark.parametrize("bad,message", [(dict(correction_byte="yes"), "correction_byte must be true or false"),
                                         (dict(correction_byte=True, stochastic_rounding=True),
                                          "cannot be combined with stochastic_rounding=true")])
def test_bad_options_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ds_q8.AdamW8bitBlock([torch.nn.Parameter(torch.zeros(4))], **bad)


def _stepped(n_steps, opt=None, params=None, correction=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if params is None:
        params = [torch.nn.Parameter(torch.randn(700, generator=gen).to(torch.bfloat16)),
                  torch.nn.Parameter(torch.randn(30, generator=gen).to(torch.bfloat16))]
    if opt is None:
        opt = ds_q8.AdamW8bitBlock(params, lr=1e-3, correction_byte=correction, block_size=64, min_8bit_size=100)
    for s in range(n_steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i)).to(p.dtype)
        opt.step()
    return params, opt


def test_resume_from_a_state_dict_is_bit_identical():
    full, full_opt = _stepped(6)
    half, half_opt = _stepped(3)
    sd = half_opt.state_dict()
    assert all(st["correction"].dtype == torch.int8 for st in sd["state"].values())
    params = [torch.nn.Parameter(p.detach().clone()) for p in half]
    opt = ds_q8.AdamW8bitBlock(params, lr=1e-3, correction_byte=True, block_size=64, min_8bit_size=100)
    opt.load_state_dict(sd)
    gen_steps = range(3, 6)
    for s in gen_steps:
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i)).to(p.dtype)
        opt.step()
    for a, b in zip(params, full):
        assert torch.equal(_bits(a.data), _bits(b.data))
        assert torch.equal(opt.state[a]["correction"], full_opt.state[b]["correction"])


def test_turning_the_option_on_and_off_between_runs():
    """As every hyperparameter, the option comes with a loaded state_dict's groups; switched on for a
    run that saved none, the bytes start at zero (the masters are exactly the bf16 values); switched
    off, stale bytes are dropped rather than saved again."""
    params, plain = _stepped(2, correction=False)
    sd = plain.state_dict()
    assert all("correction" not in st for st in sd["state"].values())
    opt = ds_q8.AdamW8bitBlock(params, lr=1e-3, correction_byte=True, block_size=64, min_8bit_size=100)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["correction_byte"] is False
    opt.param_groups[0]["correction_byte"] = True
    before = [p.detach().clone() for p in params]
    _stepped(1, opt, params)
    assert all(opt.state[p]["correction"].dtype == torch.int8 for p in params)
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    opt2 = ds_q8.AdamW8bitBlock(params, lr=1e-3, block_size=64, min_8bit_size=100)
    opt2.load_state_dict(opt.state_dict())
    assert all("correction" in opt2.state[p] for p in params)
    opt2.param_groups[0]["correction_byte"] = False
    _stepped(1, opt2, params)
    assert all("correction" not in opt2.state[p] for p in params)


def test_a_damaged_byte_tensor_is_refused_before_anything_changes():
    params, opt = _stepped(2)
    sd = opt.state_dict()
    first = next(iter(sd["state"]))
    sd["state"][first]["correction"] = sd["state"][first]["correction"][:-1].clone()
    fresh_params, fresh = _stepped(1)
    before = {k: v.clone() for k, v in fresh.state[fresh_params[0]].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match="correction"):
        fresh.load_state_dict(sd)
    for k, v in before.items():
        assert torch.equal(fresh.state[fresh_params[0]][k], v)


def test_the_bindings_check_the_bytes(cpu_op):
    p = torch.zeros(256, dtype=torch.bfloat16)
    g = torch.zeros(256, dtype=torch.bfloat16)
    states = [torch.zeros(256), torch.zeros(256)]
    hyper = dict(ds_q8.AdamW8bitBlock([torch.nn.Parameter(p.clone())])._hyper(
        ds_q8.AdamW8bitBlock([torch.nn.Parameter(p.clone())]).param_groups[0], 1))
    isa = cpu_op.supported_isas()[-1]
    with pytest.raises(ValueError, match="corrections\\[0\\] must be a contiguous int8"):
        cpu_op.step_fp32_many(isa, "adamw", [p], [g], [states], hyper, [], [],
                              corrections=[torch.zeros(255, dtype=torch.int8)])
    with pytest.raises(ValueError, match="need bfloat16 params"):
        cpu_op.step_fp32_many(isa, "adamw", [p.float()], [g.float()], [states], hyper, [], [],
                              corrections=[torch.zeros(256, dtype=torch.int8)])
    with pytest.raises(ValueError, match="replace stochastic rounding"):
        cpu_op.step_fp32_many(isa, "adamw", [p], [g], [states], hyper, [7], [0],
                              corrections=[torch.zeros(256, dtype=torch.int8)])


def test_muon_matrices_and_their_auxiliary_adamw_keep_bytes():
    """Muon8bitBlock: the matrices are stepped by the whole-matrix pass, the vectors by AdamW; with
    the option both read and write 24-bit masters, the kernels as the reference."""
    def run(impl):
        gen = torch.Generator().manual_seed(3)
        mats = [torch.nn.Parameter(torch.randn(64, 96, generator=gen).to(torch.bfloat16)) for _ in range(2)]
        vecs = [torch.nn.Parameter(torch.randn(96, generator=gen).to(torch.bfloat16))]
        opt = ds_q8.Muon8bitBlock([dict(params=mats, use_muon=True, lr=0.01), dict(params=vecs, use_muon=False,
                                                                                    lr=1e-3)],
                                  correction_byte=True, impl=impl, min_8bit_size=0)
        for s in range(3):
            for i, p in enumerate(mats + vecs):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i)).to(p.dtype)
            opt.step()
        return mats + vecs, opt

    (pk, ok), (pr, orf) = run("auto"), run("reference")
    for a, b in zip(pk, pr):
        assert torch.equal(_bits(a.data), _bits(b.data))
        assert torch.equal(ok.state[a]["correction"], orf.state[b]["correction"])
        assert bool(ok.state[a]["correction"].any())
