"""Many parameters in one kernel call (``step_many``): same bits as the reference, one call per batch.

The optimizers batch 8-bit parameters that share a group and a step count (hence every
hyperparameter) and a device and dtypes, and hand each batch to one kernel call; on CPU that is one
parallel loop over the blocks of all of them.
"""
import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8.optim import step as S
from ds_q8.op_builder import Q8CPUBuilder

from helpers.compare import RULES, assert_same_bits, assert_same_param, kernel_calls, reference_step, spy_calls
from helpers.isa import ISAS, isa  # noqa: F401 (isa is a fixture)


SIZES = [0, 1, 63, 64, 2048, 2049, 5000, 3 * 2048 + 7]


@pytest.fixture(scope="module")
def cpu_op():
    return Q8CPUBuilder().load()


def make_params(device, seed=0, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES * 2):
        dtype = dtypes[i % len(dtypes)]
        out.append(torch.nn.Parameter(torch.randn(n, generator=gen).to(device=device, dtype=dtype)))
    return out


def run_pair(cls, kw, device="cpu", steps=4):
    pk, pr = make_params(device), make_params(device)
    common = dict(block_size=2048, min_8bit_size=0, **kw)
    ok, orf = cls(pk, impl="kernel", **common), cls(pr, impl="reference", **common)
    calls = kernel_calls(device)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        for i, (a, b) in enumerate(zip(pk, pr)):
            if s == 0 and i % 5 == 0:  # these start a step later: another step count, another batch
                a.grad = b.grad = None
                continue
            g = (torch.randn(a.numel(), generator=gen) * 10.0 ** (s % 3 - 1)).to(device=device, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        ok.step()
        orf.step()
    assert kernel_calls(device) >= calls + steps, "the kernel did not run"
    return (pk, ok), (pr, orf)


def assert_same(kernel, reference):
    (pk, ok), (pr, orf) = kernel, reference
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_param(a, ok, b, orf, f"param {i}")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", ["adamw", "momentum", "lion", "rmsprop_momentum"])
def test_many_params_bit_identical_to_reference(isa, rule):
    cls, kw = RULES[rule]
    assert_same(*run_pair(cls, kw))


def test_one_call_per_batch(monkeypatch):
    calls = spy_calls(monkeypatch)
    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(50)]
    params += [torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16)) for _ in range(7)]
    opt = ds_q8.AdamW8bitBlock(params, lr=1e-3, min_8bit_size=0, block_size=128)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted(calls) == [("step_many", 7), ("step_many", 50)]


def test_whole_parameter_rules_take_one_call_per_parameter(monkeypatch):
    # each parameter has its own trust ratio, hence its own step scalars and its own kernel call
    calls = spy_calls(monkeypatch)
    params = [torch.nn.Parameter(torch.randn(300)) for _ in range(3)]
    opt = ds_q8.LAMB8bitBlock(params, lr=1e-3, min_8bit_size=0, block_size=128)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == [("step_many", 1)] * 3


def test_noncontiguous_and_32bit_params_go_their_own_way(monkeypatch):
    calls = spy_calls(monkeypatch)
    base = torch.randn(64, 64)
    strided = torch.nn.Parameter(base.t())  # not contiguous: the reference steps it
    small = torch.nn.Parameter(torch.randn(10))  # below min_8bit_size: 32-bit state
    plain = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.AdamW8bitBlock([strided, small, plain], lr=1e-3, min_8bit_size=4096, block_size=128)
    ref = ds_q8.AdamW8bitBlock([torch.nn.Parameter(strided.detach().clone()),
                                torch.nn.Parameter(small.detach().clone()),
                                torch.nn.Parameter(plain.detach().clone())],
                               lr=1e-3, min_8bit_size=4096, block_size=128)
    for p, q in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    reference_step(ref)
    assert ("step_many", 1) in calls
    for p, q in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert_same_bits(p.data, q.data, "param")


def step_many_args(cpu_op, n_tensors, bad=None):
    code = [F.create_dynamic_map(True), F.create_dynamic_map(False)]
    lookups = [cpu_op.build_lookup(c) for c in code]
    params = [torch.randn(256) for _ in range(n_tensors)]
    grads = [torch.randn(256) for _ in range(n_tensors)]
    states = [[torch.full((256,), 127, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)]
              for _ in range(n_tensors)]
    absmax = [[torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)] for _ in range(n_tensors)]
    hyper = dict(beta1=0.9, one_minus_beta1=0.1, beta2=0.999, one_minus_beta2=0.001, eps=1e-8, weight_decay=0.0,
                 decay_factor=1.0, step_size=1e-3, bias_correction2_sqrt=0.03)
    return params, grads, states, absmax, code, lookups, hyper


@pytest.mark.parametrize("bad", ["state size", "param dtype", "grad size", "list length"])
def test_step_many_checks_everything_before_writing(cpu_op, bad):
    params, grads, states, absmax, code, lookups, hyper = step_many_args(cpu_op, 3)
    if bad == "state size":
        states[2][1] = torch.zeros(255, dtype=torch.uint8)
    elif bad == "param dtype":
        params[2] = params[2].to(torch.bfloat16)
        grads[2] = grads[2].to(torch.bfloat16)
    elif bad == "grad size":
        grads[1] = torch.randn(200)
    else:
        grads = grads[:2]
    before = [p.clone() for p in params]
    codes_before = [[s.clone() for s in st] for st in states]
    with pytest.raises(ValueError):
        cpu_op.step_many(cpu_op.supported_isas()[0], "adamw", params, grads, states, absmax, code, lookups, 128,
                         hyper, [], [])
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for st, sb in zip(states, codes_before):
        for s, b in zip(st, sb):
            if s.shape == b.shape:
                assert torch.equal(s, b)


def test_step_many_missing_hyperparameter_writes_nothing(cpu_op):
    params, grads, states, absmax, code, lookups, hyper = step_many_args(cpu_op, 2)
    del hyper["eps"]
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match="needs hyperparameter 'eps'"):
        cpu_op.step_many("scalar", "adamw", params, grads, states, absmax, code, lookups, 128, hyper, [], [])
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("extra", ["lr_", "betas", "weight_decay_"])
def test_step_many_unknown_hyperparameter_is_refused_and_writes_nothing(cpu_op, extra):
    """A setting the rule does not read (a misspelt or misplaced name) is an error naming it, not ignored."""
    params, grads, states, absmax, code, lookups, hyper = step_many_args(cpu_op, 2)
    hyper[extra] = 0.5
    before = [p.clone() for p in params]
    for call in ("step_many", "step_fp32_many"):
        with pytest.raises(ValueError, match=f"update rule 'adamw' has no hyperparameter '{extra}'; it reads .*'eps'"):
            if call == "step_many":
                cpu_op.step_many("scalar", "adamw", params, grads, states, absmax, code, lookups, 128, hyper, [], [])
            else:
                fp32 = [[torch.zeros_like(p), torch.zeros_like(p)] for p in params]
                cpu_op.step_fp32_many("scalar", "adamw", params, grads, fp32, hyper, [], [])
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_step_many_equals_one_call_per_tensor(cpu_op):
    args = step_many_args(cpu_op, 5)
    params, grads, states, absmax, code, lookups, hyper = args
    singles = [p.clone() for p in params], [[s.clone() for s in st] for st in states], \
        [[a.clone() for a in am] for am in absmax]
    isa = cpu_op.supported_isas()[0]
    cpu_op.step_many(isa, "adamw", params, grads, states, absmax, code, lookups, 128, hyper, [], [])
    for p, g, st, am in zip(singles[0], grads, singles[1], singles[2]):
        cpu_op.step(isa, "adamw", p, g, st, am, code, lookups, 128, hyper, [], [])
    for i in range(5):
        assert torch.equal(params[i], singles[0][i])
        for k in range(2):
            assert torch.equal(states[i][k], singles[1][i][k])
            assert torch.equal(absmax[i][k], singles[2][i][k])


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["adamw", "momentum"])
def test_cuda_many_params_bit_identical_to_reference(rule):
    cls, kw = RULES[rule]
    assert_same(*run_pair(cls, kw, device="cuda"))


# ---------------------------------------------------------------------------- float32 states

def run_pair_32bit(cls, kw, steps=3):
    pk, pr = make_params("cpu"), make_params("cpu")
    common = dict(optim_bits=32, **kw)
    ok, orf = cls(pk, impl="kernel", **common), cls(pr, impl="reference", **common)
    gen = torch.Generator().manual_seed(2)
    for s in range(steps):
        for a, b in zip(pk, pr):
            g = (torch.randn(a.numel(), generator=gen) * 10.0 ** (s % 3 - 1)).to(a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        ok.step()
        orf.step()
    return (pk, ok), (pr, orf)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", [r for r in RULES if not RULES[r][0].rule.needs_norms])
def test_32bit_state_fused_step_bit_identical_to_reference(isa, rule, monkeypatch):
    calls = []
    real = S.fused_step_fp32_many

    def spy(opt, items, group, h, **kw):
        rest = real(opt, items, group, h, **kw)
        calls.append(len(items) - len(rest))
        return rest

    monkeypatch.setattr(S, "fused_step_fp32_many", spy)
    cls, kw = RULES[rule]
    (pk, ok), (pr, orf) = run_pair_32bit(cls, kw)
    assert sum(calls) > 0  # the kernel really stepped them
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_bits(a.data, b.data, f"param {i}")
        for key, value in ok.state[a].items():
            if torch.is_tensor(value):
                assert value.dtype == torch.float32
                assert_same_bits(value, orf.state[b][key], f"param {i} {key}")


def test_state_count_must_match_the_rule(cpu_op):
    p, g = torch.randn(64), torch.randn(64)
    hyper = dict(beta1=0.9, one_minus_beta1=0.1, beta2=0.999, one_minus_beta2=0.001, eps=1e-8, weight_decay=0.0,
                 decay_factor=1.0, step_size=1e-3, bias_correction2_sqrt=0.03)
    with pytest.raises(ValueError, match="different number of states"):
        cpu_op.step_fp32_many("scalar", "adamw", [p], [g], [[torch.zeros(64)]], hyper, [], [])
    before = p.clone()
    with pytest.raises(ValueError, match="float32 state must have"):
        cpu_op.step_fp32_many("scalar", "adamw", [p], [g], [[torch.zeros(64), torch.zeros(63)]], hyper, [], [])
    assert torch.equal(p, before)
