"""The compiled CPU kernels against the pure-PyTorch reference: identical bits, every path.

The CPU op is JIT-compiled once per session (torch caches it under TORCH_EXTENSIONS_DIR).
Every instruction set this CPU supports is exercised (``ops.use_cpu_isa``), and every comparison runs
the kernel side with ``impl="kernel"`` (an error instead of a silent fallback) and checks
``ops.CALLS``, so a test cannot pass by comparing the reference with itself.
"""
import dataclasses
import inspect
import math
import os
import warnings

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import ops
from ds_q8.optim import rules
from ds_q8.op_builder import Q8CPUBuilder

from helpers.compare import (DTYPES, RULES, assert_quantization_matches, assert_same_bits, assert_same_run,
                             extreme_gradients, run_both)
from helpers.isa import ISAS, isa  # noqa: F401 (isa is a fixture)


@pytest.fixture(scope="module")
def cpu_op():
    module = Q8CPUBuilder().load()
    assert "scalar" in module.supported_isas()
    return module


# ---------------------------------------------------------------------------- fused step

@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_step_bit_identical(isa, rule, dtype):
    cls, kw = RULES[rule]
    # 3 full blocks + a partial one of 7 elements (not a multiple of any vector width)
    kernel, reference = run_both(cls, kw, 3 * 256 + 7, DTYPES[dtype], steps=4, block_size=256)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("n,block_size", [(64, 64), (65, 64), (5000, 2048), (4096 * 2 + 33, 4096), (1, 128)])
def test_step_shapes_and_block_sizes(isa, n, block_size):
    kernel, reference = run_both(ds_q8.AdamW8bitBlock, {}, n, torch.float32, steps=3, block_size=block_size)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_step_fp32_grads_for_low_precision_params(isa, dtype):
    kernel, reference = run_both(ds_q8.Adam8bitBlock, {}, 1000, DTYPES[dtype], steps=3, block_size=128,
                                 grad_dtype=torch.float32)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", ["adamw", "momentum", "rmsprop_momentum", "lion"])
@pytest.mark.parametrize("quantization", ["linear", "dynamic6", "minifloat"])
@pytest.mark.parametrize("state_rounding", ["guided", "stochastic", "nearest"])
def test_step_other_maps(isa, rule, quantization, state_rounding):
    cls, kw = RULES[rule]
    kernel, reference = run_both(cls, dict(kw, state_rounding=state_rounding), 700, torch.float32, steps=3,
                                 block_size=128, quantization=quantization)
    assert_same_run(kernel, reference)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("state_rounding", ["guided", "stochastic", "nearest"])
def test_step_extreme_gradients(isa, state_rounding):
    """extreme_gradients(), each way of requantizing: non-finite blocks take the exact path."""
    grads = extreme_gradients()
    for cls, kw in (RULES["adam"], RULES["momentum"]):
        kw = {**kw, "state_rounding": state_rounding}
        if "nonfinite" in inspect.signature(cls).parameters:
            kw = {**kw, "nonfinite": "off"}  # let NaN/Inf reach the kernels instead of skipping the step
        kernel, reference = run_both(cls, kw, grads[0].numel(), torch.float32, steps=3, block_size=64, grads=grads)
        assert_same_run(kernel, reference)


def unsigned_rules():
    return [name for name, (cls, _) in RULES.items() if False in cls.rule.state_signed]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rule", unsigned_rules())
@pytest.mark.parametrize("n,block_size", [(4 * 256, 256), (2 * 128 + 37, 128)])
def test_step_keeps_small_second_moments_positive(isa, rule, n, block_size):
    """A fused q/k/v projection in miniature: in every block a few elements get gradients 1e4 times
    larger than the rest, so the others' squared gradients sit near 1e-8 of the block maximum, below
    half of the unsigned map's smallest entry. Kernels and reference store them as code 1 or more,
    never as 0, with the same bits."""
    cls, kw = RULES[rule]
    gen = torch.Generator().manual_seed(n)
    grads = []
    for s in range(4):
        g = torch.randn(n, generator=gen) * 1e-4
        g[::97] *= 1e4
        grads.append(g)
    kernel, reference = run_both(cls, kw, n, torch.float32, steps=4, block_size=block_size, grads=grads)
    assert_same_run(kernel, reference)
    pk, ok = kernel
    state = ok.state[pk]
    for i, signed in enumerate(ok.rule_of(pk).state_signed, start=1):
        if not signed:
            assert int((state[f"state{i}"] == 0).sum()) == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["dynamic", "dynamic6", "minifloat", "linear"])
def test_quantize_keeps_positive_values_off_code_zero(cpu_op, isa, kind):
    code = F.state_map(kind, False, "cpu")
    tiny = torch.cat([torch.tensor([1e-45, 1e-40, 1.2e-38]), torch.logspace(-37, -6.5, 123)])
    # whole blocks of 64 (the segment search of AVX-512) and a last block of 57 (the lookup table)
    body = torch.cat([tiny, torch.zeros(1), -torch.zeros(1)])
    x = torch.cat([torch.ones(1), body, torch.ones(1), tiny[:56]])
    codes, absmax = cpu_op.quantize(isa, x, code, cpu_op.build_lookup(code), 64)
    assert_same_bits(codes, F.quantize_with_absmax(x, F.block_absmax(x, 64), code, 64), "codes")
    positive = x > 0
    assert int((codes[positive] == 0).sum()) == 0 and int(codes[~positive].max()) == 0


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_lion_sign_of_zero(isa):
    """Lion's sign treats +0 and -0 (and tiny values whose interpolation underflows) as torch.sign does."""
    n, bs = 4 * 64, 64
    g = torch.randn(n)
    g[0:64] = 0.0
    g[64:128] = -0.0
    g[128:192] = torch.tensor([1e-45, -1e-45, 0.0, -0.0] * 16)
    grads = [g, -g, torch.where(torch.arange(n) % 2 == 0, -0.0, 0.0), g]
    kernel, reference = run_both(ds_q8.Lion8bitBlock, dict(lr=1e-3), n, torch.float32, steps=4, block_size=bs,
                                 grads=grads)
    assert_same_run(kernel, reference)


def test_limits_are_shared_with_python(cpu_op):
    """Block-size bounds and the number of states: one value in C++ (q8_common.h), the same in Python."""
    assert cpu_op.limits() == {"min_block_size": F.MIN_BLOCK_SIZE, "max_block_size": F.MAX_BLOCK_SIZE,
                               "max_states": F.MAX_STATES}
    assert all(r.num_states <= F.MAX_STATES for r in vars(rules).values() if isinstance(r, rules.Rule))


def test_every_python_rule_has_its_functor(cpu_op):
    """The rules of ds_q8/optim/rules.py and the kernels' Q8_RULES are the same set, and each functor's
    kSigned says which states are signed as the Rule's state_signed does (the CUDA step specializes on it)."""
    kernel_rules = {r.kernel: r for r in vars(rules).values() if isinstance(r, rules.Rule) and r.has_kernel}
    assert set(cpu_op.rules()) == set(kernel_rules)
    assert cpu_op.state_signs() == {name: list(r.state_signed) for name, r in kernel_rules.items()}


@pytest.mark.parametrize("rule", list(RULES))
def test_step_is_the_kernel_path(monkeypatch, cpu_op, rule):
    """The optimizers really reach the compiled step (not the reference) for 8-bit CPU state."""
    calls = []
    real = ops.call

    def spy(module, name, *args, **kw):
        calls.append(name)
        return real(module, name, *args, **kw)

    monkeypatch.setattr(ops, "call", spy)
    cls, kw = RULES[rule]
    p = torch.nn.Parameter(torch.randn(5000))
    opt = cls([p], **kw)
    p.grad = torch.randn(5000)
    opt.step()
    assert calls == ["step_many"]


# ---------------------------------------------------------------------------- non-finite check

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_finite_matches_torch(cpu_op, dtype):
    """The compiled check of the nonfinite="skip" policy agrees with torch.isfinite(...).all()."""
    dt = DTYPES[dtype]
    big = torch.finfo(dt).max
    clean = [torch.randn(n).to(dt) for n in (1, 65536, 65536 * 3 + 17)]
    clean[2][:5] = torch.tensor([big, -big, 0.0, -0.0, torch.finfo(dt).tiny / 4])
    assert ops.cpu_all_finite(clean) is True
    for value in (float("nan"), float("inf"), float("-inf")):
        for t, where in ((0, 0), (1, 65535), (2, 65536), (2, 65536 * 3 + 16)):
            bad = [c.clone() for c in clean]
            bad[t][where] = value
            assert ops.cpu_all_finite(bad) is False, (value, t, where)
            assert not all(bool(torch.isfinite(b).all()) for b in bad)


def test_all_finite_leaves_other_tensors_to_torch(cpu_op, monkeypatch):
    assert ops.cpu_all_finite([]) is None
    assert ops.cpu_all_finite([torch.randn(8, 8).t()]) is None  # not contiguous
    assert ops.cpu_all_finite([torch.randn(8, dtype=torch.float64)]) is None
    # one unsuitable tensor among good ones (even after a NaN) leaves the whole answer to torch
    assert ops.cpu_all_finite([torch.tensor([float("nan")]), torch.randn(8, 8).t()]) is None
    assert ops.cpu_all_finite([torch.randn(8), torch.randn(8, device="meta")]) is None
    # the strict binding keeps refusing such tensors with a message
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        cpu_op.all_finite([torch.randn(8, 8).t()])


# ---------------------------------------------------------------------------- (de)quantization

def special_values(code):
    """Scaled values on, just below and just above every midpoint, plus zeros and extremes."""
    mid = F.midpoints(code)
    below = torch.nextafter(mid, torch.full_like(mid, -math.inf))
    above = torch.nextafter(mid, torch.full_like(mid, math.inf))
    extra = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, -1e-38, 0.9999999, -0.9999999])
    return torch.cat([mid, below, above, code, extra]).clamp(-1, 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,signed", [("dynamic", True), ("dynamic", False), ("dynamic6", True), ("minifloat", True),
                                         ("minifloat", False), ("linear", True),
                                         ("linear", False)])
def test_lookup_exact_on_midpoints(cpu_op, isa, kind, signed):
    code = F.state_map(kind, signed, "cpu")
    y = special_values(code)
    # blocks of 64 whose absmax is exactly 1, so the scaled value is the value itself
    nb = (y.numel() + 62) // 63
    body = torch.zeros(nb * 63)
    body[: y.numel()] = y
    x = torch.cat([torch.ones(nb, 1), body.view(nb, 63)], dim=1).view(-1)
    codes, absmax = cpu_op.quantize(isa, x, code, cpu_op.build_lookup(code), 64)
    expect = F.quantize_with_absmax(x, F.block_absmax(x, 64), code, 64)
    assert torch.equal(absmax, torch.ones(nb))
    assert_same_bits(codes, expect, "codes")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n,block_size", [(4096 * 3 + 100, 2048), (64 * 5 + 1, 64), (3, 256)])
def test_quantize_dequantize_match_reference(isa, dtype, n, block_size):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * torch.logspace(-8, 3, n)).to(DTYPES[dtype])
    x[:block_size] = 0  # an all-zero block
    for signed in (True, False):
        assert_quantization_matches(x if signed else x.abs(), F.create_dynamic_map(signed), block_size)


def test_public_functions_use_the_kernels(cpu_op, monkeypatch):
    """ds_q8.(de)quantize_blockwise are the dispatching ones; ds_q8.functional stays the reference."""
    assert ds_q8.quantize_blockwise is ops.quantize_blockwise
    assert ds_q8.dequantize_blockwise is ops.dequantize_blockwise
    calls = []
    for name in ("quantize", "dequantize", "dequantize_into"):
        real = getattr(cpu_op, name)
        monkeypatch.setattr(cpu_op, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x = torch.randn(5000)
    codes, absmax = ds_q8.quantize_blockwise(x)
    ds_q8.dequantize_blockwise(codes, absmax)
    ds_q8.dequantize_blockwise(codes, absmax, out=torch.empty(5000))
    assert calls == ["quantize", "dequantize", "dequantize_into"]
    # one block per tensor is the reference's alone, through the same functions
    c1, a1 = ds_q8.quantize_blockwise(x, block_size=None)
    assert a1.shape == (1,) and torch.equal(c1, F.quantize_blockwise(x, block_size=None)[0])
    assert torch.equal(ds_q8.dequantize_blockwise(c1, a1, block_size=None), F.dequantize_blockwise(c1, a1, block_size=None))


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_dequantize_out_rejects_bad_buffers(cpu_op, impl):
    fn = ops.dequantize_blockwise if impl == "kernel" else F.dequantize_blockwise
    codes, absmax = F.quantize_blockwise(torch.randn(3000))
    cases = [
        (torch.empty(2999), ValueError, "out must have the shape of codes"),
        (torch.empty(3000, dtype=torch.float64), ValueError, "out must be float32, float16 or bfloat16"),
        (torch.empty(6000)[::2], ValueError, "out must be contiguous"),
        (torch.empty(3000).numpy(), TypeError, "out must be a torch.Tensor"),
    ]
    for out, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn(codes, absmax, out=out)
    out = torch.zeros(3000)
    with pytest.raises(ValueError, match="out has dtype torch.float32 but dtype=torch.float16"):
        fn(codes, absmax, dtype=torch.float16, out=out)
    assert torch.count_nonzero(out) == 0  # nothing written by a refused call
    # out= decides the dtype when dtype is not given
    half = torch.empty(3000, dtype=torch.float16)
    assert fn(codes, absmax, out=half) is half
    assert torch.equal(half, F.dequantize_blockwise(codes, absmax, dtype=torch.float16))


def test_quantize_rejects_bad_input(cpu_op):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ops.quantize_blockwise(torch.randn(10), block_size=1000)
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.quantize_blockwise(torch.tensor([1.0, float("nan")]))
    code = F.create_dynamic_map()
    with pytest.raises(ValueError, match="absmax must be 2 bfloat16"):
        cpu_op.dequantize("scalar", torch.zeros(100, dtype=torch.uint8), torch.ones(3), code, 64, torch.float32)
    with pytest.raises(ValueError, match="isa must be one"):
        cpu_op.quantize("sse9", torch.randn(10), code, cpu_op.build_lookup(code), 64)
    with pytest.raises(ValueError, match="code must be sorted"):
        cpu_op.build_lookup(torch.linspace(1, -1, 256))


def test_step_rejects_missing_hyperparameter(cpu_op):
    p, g = torch.randn(64), torch.randn(64)
    code = F.create_dynamic_map()
    lookup = cpu_op.build_lookup(code)
    with pytest.raises(ValueError, match="needs hyperparameter 'lr'"):
        cpu_op.step("scalar", "momentum", p, g, [torch.zeros(64, dtype=torch.uint8)], [torch.zeros(1, dtype=torch.bfloat16)], [code],
                    [lookup], 64, {"momentum": 0.9}, [], [])


# ---------------------------------------------------------------------------- dispatch and fallback

def break_the_build(monkeypatch):
    """Make every op fail to load, as a machine without a compiler would."""
    class Broken:
        def __init__(self):
            self.error_log = "no compiler in this test"

        def is_compatible(self, verbose=False):
            return False

    monkeypatch.setattr("ds_q8.op_builder.ALL_BUILDERS", {"cpu": Broken, "cuda": Broken})
    monkeypatch.setattr(ops, "_modules", {})
    monkeypatch.setattr(ops, "_errors", {})
    monkeypatch.setattr(ops, "_PREBUILT", {"cpu": "_not_prebuilt", "cuda": "_not_prebuilt"})


def test_unavailable_op_warns_once_and_uses_reference(monkeypatch):
    break_the_build(monkeypatch)
    monkeypatch.setattr(ops, "_warned", set())
    p = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.AdamW8bitBlock([p])
    with pytest.warns(RuntimeWarning, match=r"CPU kernels are unavailable \(no compiler in this test\)"):
        for _ in range(3):
            p.grad = torch.randn(5000)
            opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.grad = torch.randn(5000)
        opt.step()
    assert opt.is_8bit_state(opt.state[p])


def test_unknown_rule_falls_back_with_one_warning(cpu_op, monkeypatch):
    class Renamed(ds_q8.Momentum8bitBlock):
        rule = dataclasses.replace(rules.MOMENTUM, name="not_a_kernel_rule")

    monkeypatch.setattr(ops, "_warned", set())
    p = torch.nn.Parameter(torch.randn(5000))
    opt = Renamed([p])
    with pytest.warns(RuntimeWarning, match="no fused kernel for update rule 'not_a_kernel_rule'"):
        p.grad = torch.randn(5000)
        opt.step()


def test_map_without_lookup_table_falls_back(cpu_op, monkeypatch):
    dense = torch.linspace(0.5, 0.51, 256)  # many midpoints per table bucket
    from ds_q8.optim import path_kernel, path_reference

    for path in (path_kernel, path_reference):  # the kernel path, and the reference it falls back to
        monkeypatch.setattr(path, "maps_of", lambda rule, group, device: [dense])
    monkeypatch.setattr(ops, "_warned", set())
    p = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.Momentum8bitBlock([p])
    p.grad = torch.randn(5000)
    with pytest.warns(RuntimeWarning, match="no fused kernel for this map"):
        opt.step()


def test_reference_impl_never_loads_an_op(monkeypatch):
    monkeypatch.setattr(ops, "load_op", lambda *a, **k: pytest.fail("must not load an op"))
    p = torch.nn.Parameter(torch.randn(5000, dtype=torch.bfloat16))
    opt = ds_q8.Adam8bitBlock([p], impl="reference", min_8bit_size=1000)
    q = torch.nn.Parameter(torch.randn(100))  # 32-bit state: the other kernel
    opt.add_param_group({"params": [q], "impl": "reference"})
    p.grad, q.grad = torch.randn(5000, dtype=torch.bfloat16), torch.randn(100)
    opt.step()
    assert opt.state[p]["step"] == 1 and opt.state[q]["step"] == 1


def test_kernel_impl_raises_with_the_build_error(monkeypatch):
    break_the_build(monkeypatch)
    p = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.AdamW8bitBlock([p], impl="kernel")
    p.grad = torch.randn(5000)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"impl='kernel' needs the CPU kernels.*no compiler in this test"), \
            pytest.warns(RuntimeWarning, match="CPU kernels are unavailable"):  # the gradient check's fallback
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("case", ["non-contiguous", "block_size=None", "rule"])
def test_kernel_impl_refuses_what_no_kernel_takes(cpu_op, case):
    cls = ds_q8.Momentum8bitBlock
    if case == "rule":
        class Renamed(ds_q8.Momentum8bitBlock):
            rule = dataclasses.replace(rules.MOMENTUM, name="not_a_kernel_rule")
        cls = Renamed
    p = torch.nn.Parameter(torch.randn(100, 50).t() if case == "non-contiguous" else torch.randn(5000))
    opt = cls([p], impl="kernel", block_size=None if case == "block_size=None" else 2048)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="impl='kernel'"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_unknown_isa_is_an_error(cpu_op):
    with pytest.raises(ValueError, match="name must be one of the instruction sets this CPU supports"):
        with ops.use_cpu_isa("mmx"):
            pass


def test_isa_is_chosen_once_and_restored(cpu_op):
    best = ops.cpu_isa()
    assert best == cpu_op.supported_isas()[0]
    with ops.use_cpu_isa("scalar"):
        assert ops.cpu_isa() == "scalar"
    assert ops.cpu_isa() == best


# ---------------------------------------------------------------------------- builders

def test_cpu_builder_follows_deepspeed_conventions(tmp_path):
    from deepspeed.ops.op_builder.builder import OpBuilder

    b = Q8CPUBuilder()
    assert isinstance(b, OpBuilder) and b.is_compatible()
    assert b.absolute_name() == "ds_q8._q8_cpu"
    assert all(os.path.isabs(s) and os.path.exists(s) for s in b.sources())
    assert "-ffp-contract=off" in b.cxx_args() and "-fopenmp" in b.cxx_args()
    ext = b.builder()  # what setup.py adds to ext_modules when DS_BUILD_Q8_CPU=1
    assert ext.name == "ds_q8._q8_cpu" and ext.sources == b.sources()


def test_load_prefers_a_prebuilt_module(monkeypatch):
    import importlib
    import types

    from deepspeed.ops.op_builder.builder import OpBuilder

    prebuilt = types.ModuleType("ds_q8._q8_cpu")
    monkeypatch.delitem(OpBuilder._loaded_ops, "_q8_cpu", raising=False)
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: prebuilt if name == "ds_q8._q8_cpu" else pytest.fail(name))
    b = Q8CPUBuilder()
    monkeypatch.setattr(b, "jit_load", lambda verbose=False: pytest.fail("must not JIT-compile"))
    assert b.load() is prebuilt


def test_a_changed_header_changes_the_build_flags(tmp_path, monkeypatch):
    """torch's JIT cache rebuilds on changed sources or flags only: a header edit must reach the flags."""
    import shutil

    from ds_q8.op_builder import common

    copy = tmp_path / "csrc"
    shutil.copytree(common.CSRC, copy)
    monkeypatch.setattr(common, "CSRC", str(copy))
    before = common.headers_define()
    assert before in Q8CPUBuilder().cxx_args()
    with open(copy / "includes" / "q8_common.h", "a") as f:
        f.write("\n// edited\n")
    assert common.headers_define() != before
    edited = common.headers_define()
    with open(copy / "cuda" / "q8_cuda_step.cuh", "a") as f:  # the CUDA step's headers count too
        f.write("\n// edited\n")
    assert common.headers_define() != edited
