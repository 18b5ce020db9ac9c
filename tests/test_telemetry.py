"""Quantization telemetry (ds_q8/optim/telemetry.py): off by default, the same numbers from the kernels
as from the reference and under any ZeRO partitioning, and it sees what it is for."""
import pytest
import torch

import ds_q8
from ds_q8 import ops

from helpers.isa import ISAS, isa  # noqa: F401  (isa: a fixture)
from helpers.layout import KW, SIZES, grads_for, run_plain, run_sharded


def _trained(impl, steps=4, every=2, bits=8):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(300, 40)),
              torch.nn.Parameter(torch.randn(10))]  # the last one keeps fp32 state
    opt = ds_q8.AdamW8bitBlock(params, lr=1e-2, impl=impl, block_size=256 if bits == 8 else 64, optim_bits=bits)
    if every:
        opt.track_quantization(every)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * torch.logspace(-4, 0, p.numel()).view(p.shape)
        opt.step()
    return opt


def test_off_by_default_it_keeps_nothing_and_reports_only_what_the_codes_hold():
    opt = _trained("auto", every=0)
    assert opt._telemetry is None
    r = opt.quantization_report()
    assert r["measured_step"] is None and len(r["params"]) == 2  # the fp32-state tensor has no codes
    for state in ("exp_avg", "exp_avg_sq"):
        assert r["states"][state]["rel_error"] is None
        assert 0.0 <= r["states"][state]["at_zero"] < 0.05 and 0.0 < r["states"][state]["at_extreme"] < 0.05


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_kernels_measure_what_the_reference_measures(isa):
    calls = sum(n for (k, name), n in ops.CALLS.items() if name == "step_many")
    kernel, reference = _trained("kernel"), _trained("reference")
    assert sum(n for (k, name), n in ops.CALLS.items() if name == "step_many") > calls
    a, b = kernel.quantization_report(), reference.quantization_report()
    assert a["measured_step"] == b["measured_step"] == 4
    for state in ("exp_avg", "exp_avg_sq"):
        assert a["states"][state]["at_zero"] == b["states"][state]["at_zero"]
        assert a["states"][state]["rel_error"] == pytest.approx(b["states"][state]["rel_error"], rel=1e-9)
        assert a["states"][state]["zeroed"] == b["states"][state]["zeroed"]
        assert 1e-4 < a["states"][state]["rel_error"] < 0.05
    for pa, pb in zip(a["params"], b["params"]):
        assert pa["param"] == pb["param"]
        assert pa["exp_avg_sq"]["rel_error"] == pytest.approx(pb["exp_avg_sq"]["rel_error"], rel=1e-9)


def test_every_n_steps_only_and_it_can_be_stopped():
    opt = _trained("auto", steps=5, every=2)
    assert opt.quantization_report()["measured_step"] == 4
    opt.track_quantization(None)
    assert opt.quantization_report()["states"]["exp_avg"]["rel_error"] is None
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        opt.track_quantization(-1)


def test_a_second_moment_at_code_zero_shows():
    p = torch.nn.Parameter(torch.randn(4096))
    opt = ds_q8.AdamW8bitBlock([p], lr=1e-3)
    g = torch.randn(4096)
    g[2048:] = 0.0  # half the elements never see a gradient: their second moment is exactly zero
    p.grad = g
    opt.step()
    assert opt.quantization_report()["states"]["exp_avg_sq"]["at_zero"] == pytest.approx(0.5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world,stage", [(3, 2), (2, 3)])
def test_zero_partitions_add_up_to_the_whole_parameters(world, stage, bits):
    """Each rank measures its slices, blocks cut by partition edges included: per parameter the ranks'
    sums are the unsharded optimizer's."""
    kw = dict(KW, lr=1e-2, optim_bits=bits)
    cls = ds_q8.Adam8bitBlock
    params, plain = run_plain(cls, SIZES, 0, kw)
    plain.track_quantization(1)
    for s in range(3):
        for p, g in zip(params, grads_for(s, SIZES)):
            p.grad = g.clone()
        plain.step()
    _, _, opts, flats, _ = run_sharded(cls, SIZES, world, stage, 3, kw, setup=lambda o: o.track_quantization(1))
    want = {}
    for p in params:
        if p in plain._telemetry.sums:
            layout = plain.layout_of(p)
            want[layout.segments[0].param_index] = plain._telemetry.sums[p][0]
    got = {}
    for opt, flat in zip(opts, flats):
        sums = opt._telemetry.sums[flat]
        for si, seg in enumerate(opt.layout_of(flat).segments):
            if seg.eight_bit:
                got[seg.param_index] = got.get(seg.param_index, 0) + sums[si]
    assert want.keys() == got.keys() and len(want) >= 4
    for i in want:
        assert torch.allclose(got[i], want[i], rtol=1e-9, atol=0), i


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("quantization,within", [("minifloat", 1e-3), ("dynamic6", 0.0)])
def test_first_moments_lost_to_a_mixed_block_show(impl, quantization, within):
    """A block that spans a part with far smaller gradients (as 2048-element blocks span the query and
    value columns of GPT-2's c_attn) codes the small part's first moments against the large part's
    maximum: below half the signed map's smallest entry (2.5e-4 of it on minifloat, 2.8e-6 on dynamic6)
    they are stored as zero, and ``zeroed`` counts them. With blocks inside each part (the boundary at a
    multiple of 64) nothing is lost on dynamic6; on minifloat the few Gaussian values that far under
    their block's largest are (measured 2 of 4096)."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(4096, generator=g)
    grad[:1024] *= 1e-8  # a small part of 1024 elements, then a large one
    report = {}
    for bs in (2048, 64):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = ds_q8.AdamW8bitBlock([p], lr=1e-3, block_size=bs, impl=impl, quantization=quantization)
        opt.track_quantization(1)
        p.grad = grad.clone()
        opt.step()
        report[bs] = opt.quantization_report()["states"]
    assert report[2048]["exp_avg"]["zeroed"] > 0.2  # most of the small part: 1024 of 4096 elements is 0.25
    assert report[64]["exp_avg"]["zeroed"] <= within
    assert report[64]["exp_avg_sq"]["zeroed"] == report[2048]["exp_avg_sq"]["zeroed"] == 0.0  # the zero point


def test_the_report_covers_every_group_rule_muon_momentum_included():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(128, 64))
    b = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.Muon8bitBlock([w, b], block_size=64, min_8bit_size=100)
    opt.track_quantization(1)
    w.grad, b.grad = torch.randn(128, 64), torch.randn(5000)
    opt.step()
    r = opt.quantization_report()
    assert set(r["states"]) == {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    assert r["states"]["momentum_buffer"]["rel_error"] is not None
    names = {(e["numel"], tuple(k for k in e if isinstance(e[k], dict))) for e in r["params"]}
    assert names == {(128 * 64, ("momentum_buffer",)), (5000, ("exp_avg", "exp_avg_sq"))}


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_four_bit_state_is_reported_and_measured_without_changing_the_step(impl):
    """optim_bits=4: both moments are in the report, at the 4-bit maps' zero and ends, and the measured
    error is what requantizing Adam's fp32 moments lost (computed here from the state before the step).
    Measuring routes a step through the reference, which the kernels equal bit for bit: tracking changes
    no bit of the run."""
    tracked, untracked = _trained(impl, every=1, bits=4), _trained(impl, every=0, bits=4)
    for a, b in zip(tracked.param_groups[0]["params"], untracked.param_groups[0]["params"]):
        assert torch.equal(a, b)
    r = tracked.quantization_report()
    assert set(r["states"]) == {"exp_avg", "exp_avg_sq"} and len(r["params"]) == 2
    assert r["states"]["exp_avg_sq"]["at_zero"] == 0.0  # the 4-bit second moment's map has no zero
    for name in ("exp_avg", "exp_avg_sq"):
        assert 0.0 < r["states"][name]["at_extreme"] < 0.2
        assert 0.005 < r["states"][name]["rel_error"] < 0.3  # 4 bits: coarser than 8 (below 0.05 there)

    # one more measured step, its error computed by hand from the state it starts from
    params = [p for p in tracked.param_groups[0]["params"] if p.numel() >= 4096]
    before = [tracked.quantized_state(p, create=False).read() for p in params]
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(p.shape, generator=g) for p in tracked.param_groups[0]["params"]]
    for p, gr in zip(tracked.param_groups[0]["params"], grads):
        p.grad = gr
    tracked.step()
    after = [tracked.quantized_state(p, create=False).read() for p in params]
    r = tracked.quantization_report()
    grads = [gr.reshape(-1) for p, gr in zip(tracked.param_groups[0]["params"], grads) if p.numel() >= 4096]
    for k, (name, beta) in enumerate((("exp_avg", 0.9), ("exp_avg_sq", 0.999))):
        x = [beta * b[k] + (1 - beta) * (gr if k == 0 else gr * gr) for b, gr in zip(before, grads)]
        err = sum(float((a[k].double() - xi.double()).abs().sum()) for a, xi in zip(after, x))
        mag = sum(float(xi.double().abs().sum()) for xi in x)
        assert r["states"][name]["rel_error"] == pytest.approx(err / mag, rel=1e-5), name
