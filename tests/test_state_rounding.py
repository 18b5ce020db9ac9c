"""Requantization of the states: every state guided by its old code by default
(``state_rounding="guided"``), every state stochastically, the unsigned ones only, or none on request;
right on average where it must be, the same bits in every kernel as in the reference, and parameter
writes untouched by it.

Rounded to nearest, an exponential average that moves by less than half a code per step loses the
move: Adam's second moment (beta2 = 0.999, 0.1% per step) then lags its fp32 value, and the steps grow;
its first moment lags a gradient that grows by a few percent a step. Guided rounding rounds
stochastically while a value stays next to its old code, and to the nearer entry beyond.
"""
import math

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import maps
from ds_q8.optim import rounding
from ds_q8.optim.group_options import OPTIONS

from helpers.averages import average_against_fp32, held_maximum
from helpers.compare import assert_same_run, run_both
from helpers.isa import ISAS, isa  # noqa: F401  (isa: a fixture)
from helpers.optimizer_cases import kernel_cases

RULES = kernel_cases()


def _bits(key: int, n: int) -> torch.Tensor:
    return rounding.random_bits(key, torch.arange(n))


@pytest.mark.parametrize("signed", [False, True])
def test_stochastic_quantization_is_right_on_average(signed):
    code = F.create_dynamic_map(signed)
    g = torch.Generator().manual_seed(3)
    y = torch.rand(512, generator=g) ** 3  # every decade of the map, values between entries
    if signed:
        y = y * torch.where(torch.rand(512, generator=g) < 0.5, -1.0, 1.0)
    y[0] = 1.0  # a block maximum
    if not signed:  # below the smallest positive entry the zero point rounds up (its own test)
        y = torch.where(y < float(code[1]), torch.full_like(y, float(code[1])), y)
    draws = 2000
    total = torch.zeros(y.numel(), dtype=torch.float64)
    for d in range(draws):
        total += code[F.quantize_scaled(y, code, _bits(d * 7919 + 1, y.numel())).long()].double()
    mean = total / draws
    idx = F.quantize_scaled(y, code)
    gap = (code[(idx.long() + 1).clamp(max=255)] - code[(idx.long() - 1).clamp(min=0)]).double()
    err = (mean - y.double()).abs()
    # one of the two entries around y at each draw: the mean's standard error is at most gap / (2 sqrt(n))
    assert bool((err <= 4.0 * gap / (2 * math.sqrt(draws)) + 1e-12).all()), float((err / gap).max())
    nearest_err = (code[idx.long()].double() - y.double()).abs()
    assert float(err.mean()) < float(nearest_err.mean()) / 5


def test_stochastic_quantization_keeps_entries_zeros_and_the_zero_point():
    for signed in (False, True):
        code = F.create_dynamic_map(signed)
        on_entries = code.clone()
        assert torch.equal(F.quantize_scaled(on_entries, code, _bits(5, 256)).long(), torch.arange(256))
    code = F.create_dynamic_map(False)
    y = torch.cat([torch.tensor([0.0, -0.0]), torch.logspace(-40, -6.6, 200)])
    for key in range(50):
        q = F.quantize_scaled(y, code, _bits(key, y.numel()))
        assert q[:2].tolist() == [0, 0] and bool((q[2:] >= 1).all())
    assert int(F.quantize_scaled(torch.tensor([float("nan")]), code, _bits(1, 1))) == 255


@pytest.mark.parametrize("growth", [1.0, -0.5])
def test_second_moment_tracks_its_fp32_value_unless_rounded_to_nearest(growth):
    """A slowly growing (or shrinking) gradient scale in a block whose maximum moves slowly: v's
    increments are below half a code per step. To nearest they are lost; stochastically v follows its
    fp32 value, and guided by its old code (the default for unsigned states) too (guided by its update it
    does not: ``studies/tests/test_rule_study.py``)."""
    steps, g_scale = 300, torch.linspace(0.05, 0.3, 2048)
    ratio = average_against_fp32(False, 0.999, (held_maximum((g_scale * (1 + growth * t / steps)) ** 2)
                                                  for t in range(steps)))
    assert abs(ratio["stochastic"] - 1.0) < 0.02, ratio
    assert abs(ratio["guided_code"] - 1.0) < 0.02, ratio
    assert abs(ratio["nearest"] - 1.0) > 0.1, ratio  # the bias the stochastic rounding removes


@pytest.mark.parametrize("growth", [1.02, 0.98, 1.05])
def test_first_moment_follows_a_changing_gradient_unless_rounded_to_nearest(growth):
    """A gradient that grows (or shrinks) by 2% or 5% a step, as the weights that leave a plateau see
    theirs grow, in a block whose maximum stays put: with beta1 = 0.9 the first moment's increments stay
    below half a code. To nearest it stalls behind its fp32 value (measured 0.96 growing 2%, 1.46
    shrinking: those weights leave the plateau later); stochastically it follows it (0.998, 0.999, 1.000),
    and guided by its old code (the default) too (0.998, 0.999, 1.000); guided by its update it runs
    ahead of it (``studies/tests/test_rule_study.py``)."""
    g0 = torch.linspace(0.01, 0.2, 2048) * torch.where(torch.arange(2048) % 2 == 0, 1.0, -1.0)
    ratio = average_against_fp32(True, 0.9, (held_maximum(g0 * growth ** t) for t in range(60)))
    assert abs(ratio["stochastic"] - 1.0) < 0.01, ratio
    assert abs(ratio["guided_code"] - 1.0) < 0.01, ratio
    if growth == 1.02:
        assert abs(ratio["nearest"] - 1.0) > 0.03, ratio  # the lag the stochastic rounding removes


@pytest.mark.parametrize("growth", [1.02, 0.98, 1.05])
def test_first_moment_follows_a_changing_gradient_on_the_default_maps(growth):
    """The same on the default (minifloat) map, where the default rule must hold too: guided by its old
    code the first moment follows its fp32 value (measured 1.000, 0.999, 0.998), and rounded to nearest
    it lags (0.985 growing 2%, 1.074 shrinking 2%: less than on the dynamic map, whose steps are coarser
    under a tenth of the block's maximum)."""
    g0 = torch.linspace(0.01, 0.2, 2048) * torch.where(torch.arange(2048) % 2 == 0, 1.0, -1.0)
    ratio = average_against_fp32(True, 0.9, (held_maximum(g0 * growth ** t) for t in range(60)),
                                  OPTIONS["quantization"])
    assert abs(ratio["stochastic"] - 1.0) < 0.01, ratio
    assert abs(ratio["guided_code"] - 1.0) < 0.01, ratio
    if growth != 1.05:
        assert (ratio["nearest"] - 1.0) * math.copysign(1.0, 1.0 - growth) > 0.01, ratio


@pytest.mark.parametrize("quantization,kept", [("minifloat", 1.0), ("dynamic6", 0.94)])
def test_a_negative_block_maximum_is_kept_where_the_map_holds_minus_one(quantization, kept):
    """A first moment that is its 64-element block's largest magnitude and negative, under a constant
    gradient, guided by its old code: the scaled value is -1 (or within a bfloat16 rounding of it). The
    minifloat map holds -1.0 and keeps it; dynamic6's most negative entry is -0.99375 (the dynamic map's
    -0.99297: 1.0 has no mirror in either), so each step stores the maximum 0.6% short and its moment
    settles 6% under its fp32 value (measured 0.943-0.947). The minifloat map's one zero gives way to an
    entry above 1.0, so all of E3M4's magnitudes stay; rescaling them to put 1.0 there instead would leave
    -0.96875 and 24% (0.76)."""
    code = F.state_map(quantization, True, "cpu")
    n, ratios = 64, []
    for second in (0.5, 0.8, 0.95):  # the block's other moments reach this far under the maximum
        g = torch.linspace(-second, second, n)
        g[0] = -1.0
        avg32, stored = torch.zeros(n), torch.zeros(n)
        old = F.quantize_scaled(stored, code).long()
        for t in range(100):
            avg32 = 0.9 * avg32 + 0.1 * g
            a = 0.9 * stored + 0.1 * g
            absmax = F.block_absmax(a, n)
            old = F.quantize_with_absmax(a, absmax, code, n, _bits(rounding.step_key(0, t + 1), n), old=old).long()
            stored = F.dequantize_flat(old.to(torch.uint8), absmax, code, n)
        ratios.append(float(stored[0] / avg32[0]))
    assert all(abs(r - kept) < 0.01 for r in ratios), ratios


def test_states_are_guided_by_their_old_code_unless_the_group_asks_otherwise():
    """The default: every state guided by its old code (3)."""
    p = torch.nn.Parameter(torch.zeros(8))
    for cls, kw in ((ds_q8.AdamW8bitBlock, {}), (ds_q8.RMSprop8bitBlock, dict(momentum=0.9)),
                    (ds_q8.Momentum8bitBlock, dict(momentum=0.9)), (ds_q8.Lion8bitBlock, {}),
                    (ds_q8.Adagrad8bitBlock, {}), (ds_q8.AdEMAMix8bitBlock, {})):
        opt = cls([p], **kw)
        signed = opt.rule_for(opt.param_groups[0]).state_signed
        assert opt.rounding_modes(opt.param_groups[0]) == (3,) * len(signed)
        opt = cls([p], state_rounding="stochastic", **kw)
        assert opt.rounding_modes(opt.param_groups[0]) == (1,) * len(signed)
        opt = cls([p], state_rounding="stochastic_unsigned", **kw)
        assert opt.rounding_modes(opt.param_groups[0]) == tuple(not s for s in signed)
        opt = cls([p], state_rounding="nearest", **kw)
        assert not any(opt.rounding_modes(opt.param_groups[0]))
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        ds_q8.AdamW8bitBlock([p], state_rounding="up")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", ["adamw", "rmsprop", "adagrad", "lamb"])
@pytest.mark.parametrize("n,block_size", [(3 * 256 + 7, 256), (2 * 64, 64), (5000, 2048)])
def test_stochastic_state_rounding_kernels_match_the_reference(isa, rule, n, block_size):
    cls, kw = RULES[rule]
    kernel, reference = run_both(cls, kw, n, torch.float32, steps=4, block_size=block_size)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", ["nearest", "stochastic_unsigned", "stochastic"])
def test_other_state_roundings_kernels_match_the_reference(isa, dtype, choice):
    kernel, reference = run_both(ds_q8.AdamW8bitBlock, dict(state_rounding=choice), 3 * 256 + 7, dtype, steps=4,
                                 block_size=256)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_state_rounding_draws_no_parameter_rounding(impl):
    """bf16 parameters with stochastic_rounding=False are written to nearest, also when the states draw
    random bits: after one step (whose update reads no stored state yet) they do not depend on it."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(4096, generator=g).to(torch.bfloat16)
    grad = torch.randn(4096, generator=g).to(torch.bfloat16)
    out = {}
    for rounding_kind in ("stochastic", "nearest"):
        p = torch.nn.Parameter(p0.clone())
        opt = ds_q8.AdamW8bitBlock([p], lr=1e-2, stochastic_rounding=False, state_rounding=rounding_kind,
                                   block_size=256, impl=impl)
        p.grad = grad.clone()
        opt.step()
        out[rounding_kind] = (p.detach().clone(), opt.state[p]["state2"].clone())
    assert torch.equal(out["stochastic"][0], out["nearest"][0])
    assert not torch.equal(out["stochastic"][1], out["nearest"][1])  # the states did round differently


def _edge_values(code: torch.Tensor) -> torch.Tensor:
    """Every entry of a map, the floats just beside each, its midpoints and the floats just beside those,
    the zeros and the smallest subnormals: where a kernel that finds the two entries around a value
    some other way than the reference could pick another pair."""
    mid = (code[:-1] + code[1:]) * 0.5
    tiny = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
    pts = torch.cat([code, mid, torch.tensor([0.0, -0.0, tiny, -tiny])])
    return torch.cat([pts, torch.nextafter(pts, torch.tensor(2.0)), torch.nextafter(pts, torch.tensor(-2.0))])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("quantization", ["dynamic", "dynamic6", "minifloat", "linear"])
def test_stochastic_state_rounding_kernels_match_the_reference_at_the_maps_edges(isa, quantization):
    """Adam with betas (0, 0) stores m = g and v = g^2; a block maximum of 1 makes the scaled values g
    and g^2 themselves, so the first moment lands on the signed map's entries, midpoints and their
    neighbours exactly, and the second moment (g the square roots of the unsigned map's) right beside
    the unsigned map's."""
    block = 256
    signed = _edge_values(F.state_map(quantization, True, "cpu")).clamp(-1.0, 1.0)
    unsigned = _edge_values(F.state_map(quantization, False, "cpu")).clamp(0.0, 1.0).sqrt()
    g = _unit_max_blocks(torch.cat([signed, unsigned, -unsigned]), block)
    kernel, reference = run_both(ds_q8.AdamW8bitBlock, dict(betas=(0.0, 0.0), weight_decay=0.0), g.numel(),
                                 torch.float32, steps=3, block_size=block, quantization=quantization,
                                 grads=[g, g.flip(0), g])
    assert_same_run(kernel, reference)


def _unit_max_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """The values in blocks led by a 1 (each block's maximum), so that they are their own scaled values."""
    per_block = block - 1
    blocks = -(-values.numel() // per_block)
    body = torch.cat([values, torch.zeros(blocks * per_block - values.numel())]).view(blocks, per_block)
    return torch.cat([torch.ones(blocks, 1), body], dim=1).view(-1)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_stochastic_state_rounding_kernels_match_the_reference_on_a_map_without_floor_tables(isa, monkeypatch):
    """A map with two neighbouring floats as entries has a midpoint that is one of them, so the AVX2
    kernel cannot build its floor tables (q8_floormap.h) for it and rounds from the nearest codes, its
    two-pass path. The map goes in where every state's map comes from, for kernel and reference alike."""
    code = F.create_dynamic_map(True)
    k = 143  # 0.00128 between 0.00094 and 0.00184: the entry's table bucket holds no other midpoint
    code[k + 1] = torch.nextafter(code[k], torch.tensor(1.0))
    assert code[k + 1] < code[k + 2]
    monkeypatch.setitem(maps._device_maps, ("dynamic", True, "cpu"), code)
    g = _unit_max_blocks(_edge_values(code).clamp(-1.0, 1.0), 256)
    kernel, reference = run_both(ds_q8.AdamW8bitBlock, dict(betas=(0.0, 0.0), weight_decay=0.0), g.numel(),
                                 torch.float32, steps=3, block_size=256, grads=[g, g.flip(0), g])
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("signed", [True, False])
def test_rounding_guided_by_the_old_code_draws_only_where_the_value_stalls_near_it(signed):
    """The default rule, against its statement: the stochastic code (the same random
    bits) where the code before the step is one of the two entries around the value, the nearer entry
    where the value moved past them; NaN to 255; the unsigned map's zero point."""
    code = F.create_dynamic_map(signed)
    g = torch.Generator().manual_seed(6)
    n = 4096
    y = torch.rand(n, generator=g) ** 3 * (torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) if signed else 1.0)
    near = F.quantize_scaled(y, code).long()
    # the old code: the nearest one, its neighbours, or far away
    shift = torch.randint(-3, 4, (n,), generator=g)
    old = (near + shift).clamp(0, 255)
    bits = _bits(7, n)
    got = F.quantize_scaled(y, code, bits, old=old).long()
    stochastic = F.quantize_scaled(y, code, bits).long()
    up = y >= code[near]
    lo = torch.where(up, near, (near - 1).clamp(min=0))
    hi = torch.where(up, (near + 1).clamp(max=255), near)
    draws = (old == lo) | (old == hi)
    assert bool(draws.any()) and bool((~draws).any())
    assert torch.equal(got[draws], stochastic[draws])
    assert torch.equal(got[~draws], near[~draws])
    special = torch.tensor([float("nan"), 0.0, 1e-30])
    q = F.quantize_scaled(special, code, _bits(1, 3), old=torch.tensor([9, 9, 9])).tolist()
    assert q[0] == 255
    if not signed:
        assert q[1:] == [0, 1]
