"""A step's plan (``optim/plan.py``): reused while it holds, dropped when anything it holds changes,
and the same bits as the general path every time.

Each test runs one optimizer twice over the same parameters and gradients: once as users do (the
plan is built after the first step and reused), once forced onto the general path every step.
"""
import io

import pytest
import torch

import ds_q8
from ds_q8 import ops
from ds_q8.optim.plan import StepPlan

from helpers.compare import assert_same_bits, spy_calls
from helpers.isa import ISAS, isa  # noqa: F401 (isa is a fixture)

# 8-bit state (fp32, bf16 and fp16 parameters, a partial last block), fp32 state (below min_8bit_size)
SHAPES = [((64, 80), torch.float32), (5000, torch.float32), (300, torch.float32), (4096, torch.bfloat16),
          (2049, torch.float16), (3000, torch.bfloat16), (100, torch.bfloat16)]


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape, dtype in SHAPES]


def make_opt(ps, cls=ds_q8.AdamW8bitBlock, **kw):
    # two groups: the second keeps correction bytes for its bf16 parameters and rounds states to nearest
    groups = [dict(params=ps[:5]), dict(params=ps[5:], correction_byte=True, state_rounding="nearest", lr=3e-3)]
    return cls(groups, lr=1e-3, min_8bit_size=1000, block_size=256, **kw)


def set_grads(ps, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 2)).to(p.dtype)


def assert_same_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert sorted(sa[i]) == sorted(sb[i]), f"entry {i}"
        for key, value in sa[i].items():
            if torch.is_tensor(value):
                assert_same_bits(value.reshape(-1), sb[i][key].reshape(-1), f"entry {i} {key}")


def assert_same(planned, general):
    (pp, op), (pg, og) = planned, general
    for i, (a, b) in enumerate(zip(pp, pg)):
        assert_same_bits(a.data, b.data, f"param {i}")
    assert_same_state(op, og)


def step_both(planned, general, step, change=None):
    """One step of each, after ``change(opt, params)`` on both; whether the planned one reused its plan."""
    (pp, op), (pg, og) = planned, general
    set_grads(pp, step)
    set_grads(pg, step)
    if change is not None:
        change(op, pp)
        change(og, pg)
    before = op._plan
    op.step()
    og._plan = None  # the general path every step
    og.step()
    return before is not None and op._plan is before


@pytest.mark.parametrize("cls,kw", [(ds_q8.AdamW8bitBlock, dict(weight_decay=0.1)),
                                    (ds_q8.Lion8bitBlock, {}), (ds_q8.Momentum8bitBlock, {}),
                                    (ds_q8.AdEMAMix8bitBlock, {})])
@pytest.mark.parametrize("isa", ISAS, indirect=True)  # the prepared call on every instruction set
def test_planned_steps_equal_the_general_path(cls, kw, isa):
    pp, pg = make_params(), make_params()
    op, og = make_opt(pp, cls, **kw), make_opt(pg, cls, **kw)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (op, og)]
    reused = []
    for step in range(6):
        reused.append(step_both((pp, op), (pg, og), step))
        for s in sched:
            s.step()  # the learning rate changes every step: a step scalar, read every step, not a change of plan
    assert reused == [False] + [True] * 5
    assert_same((pp, op), (pg, og))
    assert [int(op.state[p]["step"]) for p in pp] == [6] * len(pp)


def _grad_gone(opt, ps):
    ps[1].grad = None


def _option(opt, ps):
    opt.param_groups[0]["state_rounding"] = "stochastic_unsigned"


def _rule_setting(opt, ps):
    opt.param_groups[1]["correction_byte"] = False


def _state_tensor(opt, ps):
    entry = opt.state[ps[0]]
    key = next(k for k, v in entry.items() if torch.is_tensor(v) and v.dtype == torch.uint8)
    entry[key] = entry[key].clone()  # the same codes in a new tensor: the plan must step the new one


def _step_count(opt, ps):
    opt.state[ps[3]]["step"] = torch.tensor(7.0)  # one count apart from its group's: its own step scalars


def _new_group(opt, ps):
    if not hasattr(opt, "_extra"):
        opt._extra = torch.nn.Parameter(torch.ones(3000))
        opt.add_param_group(dict(params=[opt._extra]))
    opt._extra.grad = torch.full((3000,), 0.01)


def _telemetry(opt, ps):
    opt.track_quantization(1)


def _reload(opt, ps):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=False))


CHANGES = dict(grad_gone=_grad_gone, option=_option, rule_setting=_rule_setting, state_tensor=_state_tensor,
               step_count=_step_count, new_group=_new_group, telemetry=_telemetry, reload=_reload)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_drops_the_plan_and_the_bits_stay_the_same(change):
    pp, pg = make_params(), make_params()
    planned, general = (pp, make_opt(pp)), (pg, make_opt(pg))
    assert [step_both(planned, general, s) for s in range(2)] == [False, True]
    assert not step_both(planned, general, 2, CHANGES[change])
    assert_same(planned, general)
    for s in range(3, 5):
        step_both(planned, general, s)
    assert_same(planned, general)


def trained(steps: int):
    """Parameters and their optimizer after ``steps`` steps."""
    ps = make_params()
    opt = make_opt(ps)
    for s in range(steps):
        set_grads(ps, s)
        opt.step()
    return ps, opt


def test_the_step_counts_are_views_of_one_tensor_and_save_as_counts():
    ps, opt = trained(3)
    assert isinstance(opt._plan, StepPlan)
    steps = [opt.state[p]["step"] for p in ps]
    assert {t.untyped_storage().data_ptr() for t in steps} == {opt._plan.flat.untyped_storage().data_ptr()}
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert [float(e["step"]) for e in saved["state"].values()] == [3.0] * len(ps)
    # a resumed run continues exactly where the uninterrupted one goes
    qs = make_params()
    resumed = make_opt(qs)
    for q, p in zip(qs, ps):
        q.data.copy_(p.data)
    resumed.load_state_dict(saved)
    for s in range(3, 6):
        for params, o in ((ps, opt), (qs, resumed)):
            set_grads(params, s)
            o.step()
    assert_same((ps, opt), (qs, resumed))


def test_a_skipped_step_counts_nothing_and_keeps_the_plan():
    ps, opt = trained(2)
    plan = opt._plan
    set_grads(ps, 2)
    ps[2].grad[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="step skipped"):
        opt.step()
    assert opt._plan is plan and opt.skipped_steps == 1
    assert [int(opt.state[p]["step"]) for p in ps] == [2] * len(ps)


def test_rules_the_plan_does_not_take_step_as_before():
    # LAMB scales each parameter by its own norm: every step takes the general path
    ps = [torch.nn.Parameter(torch.randn(3000)) for _ in range(3)]
    opt = ds_q8.LAMB8bitBlock(ps, lr=1e-3, min_8bit_size=0)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(3000)
        opt.step()
    assert opt._plan is None
    assert [int(opt.state[p]["step"]) for p in ps] == [2, 2, 2]


def test_many_tensors_per_call_equal_the_general_path():
    # dozens of tensors in each kernel call, in two groups (their rounding keys hash in their group's index)
    def params():
        gen = torch.Generator().manual_seed(3)
        return [torch.nn.Parameter(torch.randn(700 + 37 * i, generator=gen).to((torch.float32, torch.bfloat16)[i % 2]))
                for i in range(40)]

    def opt(ps):
        return ds_q8.AdamW8bitBlock([dict(params=ps[:25]), dict(params=ps[25:], weight_decay=0.0)], lr=1e-3,
                                    min_8bit_size=800, block_size=128)

    pp, pg = params(), params()
    planned, general = (pp, opt(pp)), (pg, opt(pg))
    assert [step_both(planned, general, s) for s in range(4)] == [False, True, True, True]
    assert_same(planned, general)


def test_a_gradient_in_a_group_that_had_none_changes_the_plan():
    pp, pg = make_params(), make_params()
    planned, general = (pp, make_opt(pp)), (pg, make_opt(pg))

    def first_group_only(opt, ps):
        for p in ps[5:]:
            p.grad = None

    assert [step_both(planned, general, s, first_group_only) for s in range(2)] == [False, True]
    assert not step_both(planned, general, 2)  # the second group's gradients are back
    assert_same(planned, general)
    assert [int(planned[1].state[p]["step"]) for p in pp] == [3] * 5 + [1] * 2


def test_a_planned_cpu_step_is_one_prepared_call_per_batch(monkeypatch):
    ps, opt = trained(2)
    calls = spy_calls(monkeypatch)
    set_grads(ps, 2)
    opt.step()
    # group 1: fp32 8-bit, fp32 with fp32 state, bf16 8-bit, fp16 8-bit; group 2: bf16 8-bit, bf16 fp32 state
    assert sorted(name for name, _ in calls) == ["run_prepared"] * 6


def test_a_prepared_step_checks_the_gradients_before_writing():
    ps, opt = trained(2)
    before = [p.detach().clone() for p in ps]
    state = {i: {k: v.clone() for k, v in e.items() if torch.is_tensor(v)} for i, e in enumerate(opt.state.values())}
    gp, call = next((gp, c) for gp in opt._plan.groups for c in gp.calls
                    if c.prepared is not None and len(c.call.params) > 1)
    module = call.call.module
    hyper = ops.kernel_hyper(module, call.call.name, opt._hyper(gp.group, 3))
    good = [p.grad for p in call.call.params]
    for bad, match in ((good[:-1], "one tensor per param"), (good[:-1] + [torch.zeros(3)], "changed since"),
                       (good[:-1] + [good[-1].to(torch.float64)], "one grad dtype")):
        with pytest.raises(ValueError, match=match):
            module.run_prepared(ops.cpu_isa(module), call.prepared, bad, hyper, 0)
    for a, b in zip(ps, before):
        assert_same_bits(a.data, b, "param")
    for i, e in enumerate(opt.state.values()):
        for k, v in state[i].items():
            assert torch.equal(e[k], v), k
