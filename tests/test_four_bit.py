"""``optim_bits=4``: Adam's two moments in one byte per parameter (``ds_q8/format4.py``).

The step writes exactly the codes and maxima of the format's specification after each fp32 update;
ZeRO partitions (ranks simulated by threads, ``helpers/layout.py``) step to the bits of whole
parameters, whatever block or byte an edge cuts; the state saves, loads and converts; bad settings
name the field; the memory estimate is what the live state holds.
"""
import pytest
import torch

import ds_q8
from ds_q8 import format4
from ds_q8.memory import estimate_state_bytes
from ds_q8.optim import rules
from ds_q8.optim.state_io import STATE_DICT_MARKER

from helpers.layout import SIZES, run_plain, run_sharded

KW = dict(block_size=64, min_8bit_size=60, optim_bits=4)


def _grads(step, n):
    g = torch.Generator().manual_seed(step)
    scale = torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)]  # scales spread inside blocks
    return torch.randn(n, generator=g) * scale


@pytest.mark.parametrize("cls,n", [(ds_q8.AdamW8bitBlock, 64 * 5 + 37), (ds_q8.Adam8bitBlock, 64 * 3)])
def test_the_step_writes_the_specifications_codes(cls, n):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    opt = cls([p], lr=1e-2, weight_decay=0.1, **KW)
    rule = rules.ADAMW if cls is ds_q8.AdamW8bitBlock else rules.ADAM
    p_ref, m, v = p.detach().clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 8):
        g = _grads(step, n)
        if step == 4:
            g[64:128] = 0  # a silent block keeps the first moment it had, coded against its own v
        p.grad = g.clone()
        opt.step()
        rule.update(p_ref, g.clone(), [m, v], opt._hyper(opt.param_groups[0], step))
        state = format4.encode(m, v)
        m, v = format4.decode(state)
        st = opt.state[p]
        assert torch.equal(p.detach(), p_ref), f"step {step}: parameter"
        assert torch.equal(st["state1"], state.m_codes) and torch.equal(st["state2"], state.v_codes), f"step {step}"
        assert torch.equal(st["absmax1"], state.m_absmax) and torch.equal(st["absmax2"], state.v_max)
    dq = opt.dequantized_state(p)
    assert torch.equal(dq["exp_avg"], m) and torch.equal(dq["exp_avg_sq"], v)
    assert st["state1"].numel() == (n + 1) // 2 and st["absmax2"].dtype == torch.float32


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_partitions_step_like_whole_parameters(world, stage):
    """Edges fall inside blocks and between the two elements of a byte: the same bits as whole
    parameters, with two all-reduce MAX a step for the cut blocks."""
    kw = dict(KW, lr=1e-2)
    bits = [8, 8, 8, 32, 8, 8, 8, 8]  # parameter 3 marked 32-bit
    params, ref = run_plain(ds_q8.AdamW8bitBlock, SIZES, 4, kw, bits)
    got, states, opts, flats, shared = run_sharded(ds_q8.AdamW8bitBlock, SIZES, world, stage, 4, kw, bits)
    for i, (p, q) in enumerate(zip(params, got)):
        assert torch.equal(p.detach(), q), f"parameter {i} differs"
        want = ref.dequantized_state(p)
        for k in want:
            assert torch.equal(want[k], states[i][k]), f"parameter {i} state {k} differs"
    # the codes themselves, parameter by parameter, as a universal checkpoint assembles them
    whole = {}
    for opt, flat in zip(opts, flats):
        qs = opt.quantized_state(flat)
        assert qs.layout.state_bits == 4
        for si, seg, first, codes, absmax, _ in qs.segment_params():
            if seg.eight_bit:
                w = whole.setdefault(seg.param_index, [torch.zeros(seg.param_numel, dtype=torch.uint8) for _ in range(2)])
                for i in range(2):
                    w[i][seg.param_start:seg.param_end] = codes[i]
    for i, (p, b) in enumerate(zip(params, bits)):
        if i in whole:
            st = ref.state[p]
            assert torch.equal(whole[i][0], format4.unpack(st["state1"], p.numel()))
            assert torch.equal(whole[i][1], format4.unpack(st["state2"], p.numel()))
    if world > 1:
        assert any(o.tensors.layouts[f].shared8 for o, f in zip(opts, flats))
        assert shared["calls"][0] >= 8  # two agreements a step


def test_state_dict_round_trip_and_refusals():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 33))
    opt = ds_q8.AdamW8bitBlock([p], lr=1e-3, **KW)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd[STATE_DICT_MARKER]["layouts"][0]["state_bits"] == 4
    q = torch.nn.Parameter(p.detach().clone())
    again = ds_q8.AdamW8bitBlock([q], lr=1e-3, **KW)
    again.load_state_dict(sd)
    for k, t in opt.state[p].items():
        assert torch.equal(again.state[q][k], t)
    p.grad = q.grad = torch.randn_like(p)
    opt.step()
    again.step()
    assert torch.equal(p, q)
    eight = ds_q8.AdamW8bitBlock([torch.nn.Parameter(p.detach().clone())], lr=1e-3, block_size=64, min_8bit_size=60)
    with pytest.raises(ValueError):
        eight.load_state_dict(sd)  # 4-bit state into an 8-bit optimizer: refused, nothing changed
    assert not eight.state
    ref = ds_q8.AdamW8bitBlock.export_fp32_state_dict(opt.state_dict())
    assert torch.equal(ref["state"][0]["exp_avg_sq"].reshape(p.shape), opt.dequantized_state(p)["exp_avg_sq"])


def test_settings_that_cannot_hold_4_bits_name_the_field():
    p = [torch.nn.Parameter(torch.zeros(8))]
    with pytest.raises(ValueError, match="optim_bits=4 stores Adam's two moments.*'lion'"):
        ds_q8.Lion8bitBlock(p, optim_bits=4)
    with pytest.raises(ValueError, match="quantization must stay 'minifloat' \\(the default\\), 'dynamic6' or 'dynamic', got 'linear'"):
        ds_q8.AdamW8bitBlock(p, optim_bits=4, quantization="linear")
    with pytest.raises(ValueError, match="optim_bits must be 4, 8 or 32, got 2"):
        ds_q8.AdamW8bitBlock(p, optim_bits=2)


@pytest.mark.parametrize("world,stage", [(1, 0), (3, 2), (3, 3)])
def test_the_memory_estimate_is_what_the_state_holds(world, stage):
    sizes = [1000, 40, 4096 + 3, 77 * 51]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    if stage == 0:
        opt = ds_q8.AdamW8bitBlock(params, lr=1e-3, **KW)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        held = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
        assert held == estimate_state_bytes([sizes], 0, 1, "AdamW8bitBlock", bits=4, min_8bit_size=60)
        return
    _, _, opts, flats, _ = run_sharded(ds_q8.AdamW8bitBlock, sizes, world, stage, 1, dict(KW, lr=1e-3))
    for r, (opt, flat) in enumerate(zip(opts, flats)):
        held = sum(t.numel() * t.element_size() for k, t in opt.state[flat].items() if k != "step")
        assert held == estimate_state_bytes([sizes], stage, world, "AdamW8bitBlock", bits=4, min_8bit_size=60, rank=r)


def test_about_one_byte_per_parameter():
    n = 4096 * 1024
    p = torch.nn.Parameter(torch.zeros(n))
    opt = ds_q8.AdamW8bitBlock([p], lr=1e-3, optim_bits=4)
    p.grad = torch.ones_like(p)
    opt.step()
    held = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
    assert held / n == pytest.approx(format4.state_bytes_per_param(n)) and held / n < 1.1


# ---------------------------------------------------------------------------- the compiled CPU kernel
from ds_q8 import ops  # noqa: E402

from helpers.isa import ISAS, isa  # noqa: E402,F401,F811  (builds the CPU op; isa is a fixture)

PARAMS = {  # name -> (parameter dtype, extra options)
    "fp32": (torch.float32, {}),
    "bf16_sr": (torch.bfloat16, {}),
    "bf16_nearest": (torch.bfloat16, {"stochastic_rounding": False}),
    "bf16_correction": (torch.bfloat16, {"correction_byte": True}),
    "fp16": (torch.float16, {}),
}


def _train(impl, dtype, extra, sizes=(64 * 40 + 37, 4096, 130), steps=5, block_size=64, cls=ds_q8.AdamW8bitBlock):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
    opt = cls(params, lr=1e-2, weight_decay=0.1, optim_bits=4, min_8bit_size=100, block_size=block_size,
              impl=impl, **extra)
    for s in range(steps):
        for i, p in enumerate(params):
            g = _grads(100 * s + i, p.numel())
            if s == 2:
                g[:200] = 0  # silent blocks
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("kind", list(PARAMS))
def test_the_cpu_kernel_writes_the_references_bits(isa, kind):
    dtype, extra = PARAMS[kind]
    ref_params, ref = _train("reference", dtype, extra)
    calls = ops.CALLS[("cpu", "step4_many")]
    got_params, got = _train("kernel", dtype, extra)
    assert ops.CALLS[("cpu", "step4_many")] - calls == 5  # one call a step for all three tensors' whole blocks
    for p, q in zip(ref_params, got_params):
        assert torch.equal(p, q)
        for k, t in ref.state[p].items():
            assert torch.equal(got.state[q][k], t), k


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("block_size,cls", [(256, ds_q8.Adam8bitBlock), (4096, ds_q8.AdamW8bitBlock)])
def test_the_cpu_kernel_at_other_block_sizes(isa, block_size, cls):
    ref_params, ref = _train("reference", torch.float32, {}, sizes=(3 * 4096 + 99,), block_size=block_size, cls=cls)
    got_params, got = _train("kernel", torch.float32, {}, sizes=(3 * 4096 + 99,), block_size=block_size, cls=cls)
    assert torch.equal(ref_params[0], got_params[0])
    for k, t in ref.state[ref_params[0]].items():
        assert torch.equal(got.state[got_params[0]][k], t), k


@pytest.mark.parametrize("world,stage", [(3, 2), (4, 3)])
def test_partitions_through_the_kernel(world, stage):
    """Whole blocks in the kernel, cut blocks in the reference: still the bits of whole parameters."""
    kw = dict(KW, lr=1e-2)
    params, ref = run_plain(ds_q8.AdamW8bitBlock, SIZES, 4, dict(kw, impl="reference"))
    calls = ops.CALLS[("cpu", "step4_many")]
    got, states, *_ = run_sharded(ds_q8.AdamW8bitBlock, SIZES, world, stage, 4, kw)
    assert ops.CALLS[("cpu", "step4_many")] > calls
    for i, (p, q) in enumerate(zip(params, got)):
        assert torch.equal(p.detach(), q), f"parameter {i} differs"
        want = ref.dequantized_state(p)
        for k in want:
            assert torch.equal(want[k], states[i][k]), f"parameter {i} state {k} differs"



@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_a_strided_parameter_steps_like_its_contiguous_copy(impl):
    """A transposed view (small, so fp32, and large, so 4-bit) is stepped in a copy and written back: the
    same values and codes as a contiguous parameter holding the same elements."""
    def run(strided):
        torch.manual_seed(0)
        shapes = [(64, 50), (8, 9)]
        values = [torch.randn(*s) for s in shapes]
        params = [torch.nn.Parameter(v.t().contiguous().t() if strided else v.clone()) for v in values]
        opt = ds_q8.AdamW8bitBlock(params, lr=1e-2, optim_bits=4, min_8bit_size=100, impl=impl)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = _grads(10 * step + i, p.numel()).view(p.shape)
            opt.step()
        return params, opt

    want, ref = run(False)
    got, opt = run(True)
    assert not got[0].is_contiguous()
    for p, q in zip(want, got):
        assert torch.equal(p.detach(), q.detach())
        for k, t in ref.state[p].items():
            assert torch.equal(opt.state[q][k], t), k
