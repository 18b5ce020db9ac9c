"""A NaN or Inf gradient never reaches the 8-bit state."""
import copy

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8 import ops


def setup(nonfinite="skip", impl="auto"):
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    opt = ds_q8.Adam8bitBlock(model.parameters(), lr=1e-2, block_size=256, nonfinite=nonfinite, impl=impl)
    for _ in range(3):
        model(torch.randn(8, 100)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def poison(model, value):
    model(torch.randn(8, 100)).pow(2).mean().backward()
    model.weight.grad[3, 7] = value


@pytest.fixture(params=["kernel", "reference"])
def check_path(request):
    """CPU gradients are checked by the compiled op when kernels are on, by torch otherwise."""
    return request.param


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_skip_leaves_params_and_state_untouched(value, check_path):
    model, opt = setup("skip", impl=check_path)
    before_m, before_o = snapshot(model, opt)
    poison(model, value)
    reads = ops.CALLS[("cpu", "all_finite_or_unknown")]
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.step()
    # the compiled read of the gradients ran exactly when kernels are in use
    assert (ops.CALLS[("cpu", "all_finite_or_unknown")] == reads + 1) == (check_path == "kernel")
    after_m, after_o = snapshot(model, opt)
    for k in before_m:
        assert torch.equal(before_m[k], after_m[k])
    for pid, st in before_o["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after_o["state"][pid][key])), key
    assert opt.skipped_steps == 1
    # the next finite step proceeds normally, from step 4
    opt.zero_grad()
    model(torch.randn(8, 100)).pow(2).mean().backward()
    opt.step()
    assert opt.state[model.weight]["step"] == 4
    assert torch.isfinite(opt.state[model.weight]["absmax1"]).all()


def test_raise_changes_nothing():
    model, opt = setup("raise")
    before_m, _ = snapshot(model, opt)
    poison(model, float("nan"))
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(before_m[k], v)
    assert opt.state[model.weight]["step"] == 3


def test_off_does_not_check():
    model, opt = setup("off")
    poison(model, float("nan"))
    opt.step()
    assert opt.skipped_steps == 0 and opt.state[model.weight]["step"] == 4


def test_bad_mode():
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('skip', 'raise', 'off'\), got 'ignore'"):
        ds_q8.AdamW8bitBlock([nn.Parameter(torch.zeros(3))], nonfinite="ignore")


@pytest.mark.parametrize("norm", [torch.tensor(float("nan")), float("inf"), torch.tensor([float("-inf")])])
def test_an_engine_norm_that_is_not_finite_skips_without_reading_gradients(norm):
    model, opt = setup("skip")
    before_m, _ = snapshot(model, opt)
    opt.grad_norm_source = lambda: norm
    model(torch.randn(8, 100)).pow(2).mean().backward()  # finite gradients: only the norm says skip
    reads = ops.CALLS[("cpu", "all_finite_or_unknown")]
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.step()
    assert ops.CALLS[("cpu", "all_finite_or_unknown")] == reads
    assert opt.nonfinite_checks["norm"] == 1 and opt.skipped_steps == 1
    after_m, _ = snapshot(model, opt)
    assert all(torch.equal(before_m[k], after_m[k]) for k in before_m)


def test_a_finite_engine_norm_replaces_the_read():
    model, opt = setup("skip")
    opt.grad_norm_source = lambda: torch.tensor(3.0)
    model(torch.randn(8, 100)).pow(2).mean().backward()
    def steps():  # kernel steps, lists or the prepared calls of a step that reuses its plan (optim/plan.py)
        return sum(ops.CALLS[("cpu", name)] for name in ("step_many", "step_fp32_many", "run_prepared"))

    reads, before = ops.CALLS[("cpu", "all_finite_or_unknown")], steps()
    opt.step()
    # one call for the weight's 8-bit state, one for the bias's fp32 state
    assert ops.CALLS[("cpu", "all_finite_or_unknown")] == reads and steps() == before + 2
    assert opt.state[model.weight]["step"] == 4
    # a source with nothing to say (no norm this step) falls back to reading the gradients
    opt.grad_norm_source = lambda: None
    opt.step()
    assert ops.CALLS[("cpu", "all_finite_or_unknown")] == reads + 1


def test_a_norm_given_to_step_answers_the_check():
    """step(grad_norm=...): the norm a caller already computed (clip_grad_norm_'s) replaces the read."""
    model, opt = setup("skip")
    model(torch.randn(8, 100)).pow(2).mean().backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    reads = ops.CALLS[("cpu", "all_finite_or_unknown")]
    opt.step(grad_norm=norm)
    assert ops.CALLS[("cpu", "all_finite_or_unknown")] == reads
    assert opt.nonfinite_checks["norm"] == 1 and opt.state[model.weight]["step"] == 4
    # the same bits as a step that reads the gradients
    twin_model, twin = setup("skip")
    twin_model(torch.randn(8, 100)).pow(2).mean().backward()
    nn.utils.clip_grad_norm_(twin_model.parameters(), 1.0)
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert twin.nonfinite_checks["pass"] == 4
    # the norm belongs to that step only: the next one reads the gradients again
    reads = ops.CALLS[("cpu", "all_finite_or_unknown")]
    opt.step()
    assert ops.CALLS[("cpu", "all_finite_or_unknown")] == reads + 1


@pytest.mark.parametrize("norm", [float("nan"), torch.tensor(float("inf")), torch.tensor([float("-inf")])])
def test_a_given_norm_that_is_not_finite_skips_the_step(norm):
    model, opt = setup("skip")
    before_m, before_o = snapshot(model, opt)
    model(torch.randn(8, 100)).pow(2).mean().backward()
    with pytest.warns(RuntimeWarning, match="non-finite gradient, step skipped"):
        opt.step(grad_norm=norm)
    after_m, after_o = snapshot(model, opt)
    assert all(torch.equal(before_m[k], after_m[k]) for k in before_m)
    assert opt.skipped_steps == 1 and opt.state[model.weight]["step"] == 3


@pytest.mark.parametrize("norm", ["1.0", True, torch.ones(2), torch.tensor(1), [1.0]])
def test_a_given_norm_of_the_wrong_kind_is_refused_before_anything_changes(norm):
    model, opt = setup("skip")
    before_m, _ = snapshot(model, opt)
    model(torch.randn(8, 100)).pow(2).mean().backward()
    with pytest.raises(TypeError, match=r"step\(grad_norm=...\) takes the gradients' global norm"):
        opt.step(grad_norm=norm)
    assert all(torch.equal(before_m[k], v) for k, v in model.state_dict().items())
    assert opt.state[model.weight]["step"] == 3
    opt.step()  # and the optimizer steps on as before
    assert opt.state[model.weight]["step"] == 4
