"""CUDA steps decide about non-finite gradients on the device: no host synchronisation in a step, and a
skipped step writes nothing and is counted (with its step counts taken back) once the host reads it."""
import contextlib

import pytest
import torch

import ds_q8

pytestmark = pytest.mark.gpu


def setup(n=5000, small=100, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")), torch.nn.Parameter(torch.randn(small, device="cuda"))]
    opt = ds_q8.AdamW8bitBlock(params, lr=1e-2, block_size=256, min_8bit_size=1000, impl="kernel", **kw)
    return params, opt


def set_grads(params, poison=None):
    for p in params:
        p.grad = torch.randn_like(p)
    if poison is not None:
        params[0].grad[17] = poison


def snapshot(params, opt):
    return [p.detach().clone() for p in params], {id(p): {k: (v.clone() if torch.is_tensor(v) else v)
                                                           for k, v in opt.state[p].items()} for p in params}


def test_a_step_does_not_synchronise():
    params, opt = setup()
    set_grads(params)
    opt.step()  # first step: maps, lookup tables and state are made
    set_grads(params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.nonfinite_checks["device"] == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_skipped_step_writes_nothing_and_is_counted_later(value):
    params, opt = setup()
    set_grads(params)
    opt.step()
    before_p, before_s = snapshot(params, opt)
    set_grads(params, poison=value)
    opt.step()
    after_p, after_s = snapshot(params, opt)
    for a, b in zip(before_p, after_p):
        assert torch.equal(a, b)
    for p in params:  # the codes, maxima and fp32 states are untouched (the host's step count is not yet)
        for key, v in before_s[id(p)].items():
            if key != "step":
                assert torch.equal(v, after_s[id(p)][key]), key
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.settle()
    assert opt.skipped_steps == 1
    assert all(int(opt.state[p]["step"]) == 1 for p in params)
    set_grads(params)
    opt.step()
    opt.settle()
    assert opt.skipped_steps == 1 and all(int(opt.state[p]["step"]) == 2 for p in params)


def test_state_dict_settles_first():
    params, opt = setup()
    set_grads(params)
    opt.step()
    set_grads(params, poison=float("nan"))
    opt.step()
    with pytest.warns(RuntimeWarning, match="step skipped"):
        sd = opt.state_dict()
    assert all(int(s["step"]) == 1 for s in sd["state"].values())


def test_skip_matches_the_reference_bit_for_bit():
    params, opt = setup()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = ds_q8.AdamW8bitBlock(ref_params, lr=1e-2, block_size=256, min_8bit_size=1000, impl="reference")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for s in range(5):
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            q.grad = p.grad.clone()
        if s == 2:
            params[0].grad[5] = float("nan")
            ref_params[0].grad[5] = float("nan")
        with pytest.warns(RuntimeWarning) if s == 2 else contextlib.nullcontext():
            opt.step()
            opt.settle()
            ref.step()
    for p, q in zip(params, ref_params):
        assert torch.equal(p.detach(), q.detach())
    assert opt.skipped_steps == ref.skipped_steps == 1

