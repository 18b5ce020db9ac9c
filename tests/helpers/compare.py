"""Kernel against reference, bit for bit: the comparisons the kernel tests share (they build no op)."""
import torch

from ds_q8 import functional as F
from ds_q8 import ops

from helpers.optimizer_cases import kernel_cases, reference_step  # noqa: F401 (reference_step: for importers)

RULES = kernel_cases()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def bits(t):
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype, what
    if a.is_floating_point():
        same = (bits(a) == bits(b)) | (torch.isnan(a) & torch.isnan(b))
        assert bool(same.all()), f"{what}: {int((~same).sum())} of {a.numel()} differ"
    else:
        assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ"


def kernel_calls(device="cpu") -> int:
    """Kernel calls so far on ``device`` (any entry point)."""
    kind = torch.device(device).type
    return sum(n for (k, _), n in ops.CALLS.items() if k == kind)


def run_both(cls, kw, n, dtype, steps, block_size, grad_dtype=None, quantization="dynamic", grads=None, seed=0,
             device="cpu"):
    """Same optimizer twice, once with kernels, once forced onto the reference; returns both."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    pk, pr = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    if grad_dtype is not None:
        pk.grad_dtype = pr.grad_dtype = grad_dtype  # e.g. fp32 gradients of bf16 params
    common = dict(block_size=block_size, min_8bit_size=0, quantization=quantization, **kw)
    ok, orf = cls([pk], impl="kernel", **common), cls([pr], impl="reference", **common)
    calls = kernel_calls(device)
    for s in range(steps):
        g = grads[s] if grads is not None else torch.randn(n, generator=gen) * 10.0 ** (s % 3 - 1)
        if grads is None and n > block_size and s == 1:
            g[block_size:2 * block_size] = 0  # a block whose state decays to (and stays at) zero
        g = g.to(device=device, dtype=grad_dtype or dtype)
        pk.grad, pr.grad = g.clone(), g.clone()
        ok.step()
        orf.step()
    assert kernel_calls(device) >= calls + steps, "the kernel did not run"
    return (pk, ok), (pr, orf)


def assert_same_param(a, ok, b, orf, label="param"):
    """Parameter ``a`` of optimizer ``ok`` and ``b`` of ``orf``: the same bits, the same state."""
    assert_same_bits(a.data, b.data, label)
    sk, sr = ok.state[a], orf.state[b]
    assert sk.keys() == sr.keys()
    for key in sk:
        if torch.is_tensor(sk[key]):
            assert_same_bits(sk[key], sr[key], f"{label} {key}")
        else:
            assert sk[key] == sr[key], (label, key)


def assert_same_run(kernel, reference):
    (pk, ok), (pr, orf) = kernel, reference
    assert ok.is_8bit_state(ok.state[pk])
    assert_same_param(pk, ok, pr, orf)


def assert_quantization_matches(x, code, block_size):
    """ops.(de)quantize_blockwise give the bits of ds_q8.functional's, for every output dtype."""
    code = code.to(x.device)
    codes, absmax = ops.quantize_blockwise(x, code, block_size)
    ref_codes, ref_absmax = F.quantize_blockwise(x, code, block_size)
    assert_same_bits(codes, ref_codes, "codes")
    assert_same_bits(absmax, ref_absmax, "absmax")
    for out_dtype in DTYPES.values():
        got = ops.dequantize_blockwise(codes, absmax, code, block_size, out_dtype)
        want = F.dequantize_blockwise(ref_codes, ref_absmax, code, block_size, out_dtype)
        assert_same_bits(got, want, f"dequantized {out_dtype}")
        out = torch.full(x.shape, float("nan"), dtype=out_dtype, device=x.device)
        assert ops.dequantize_blockwise(codes, absmax, code, block_size, out=out) is out
        assert_same_bits(out, want, f"dequantized into out= {out_dtype}")


def spy_calls(monkeypatch):
    """The ops.call entry points called from now on: (name, tensors in the call)."""
    calls = []
    real = ops.call

    def spy(module, name, *args, **kw):
        calls.append((name, len(args[2]) if name == "step_many" else 1))  # args: tensor, rule, params
        return real(module, name, *args, **kw)

    monkeypatch.setattr(ops, "call", spy)
    return calls


def extreme_gradients():
    """Tiny, huge, zero and subnormal gradients; an all-zero block; NaN and Inf in one block."""
    n = 6 * 64
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    g[0:64] = 0.0
    g[64:128] *= 1e-30
    g[128:192] = torch.tensor([1e-40, -1e-42, 3e38, -3e38] * 16)
    g[192:256] *= 1e20
    g[256] = float("nan")
    g[257] = float("inf")
    g[320:384] = -0.0
    return [g, g * 0.5, torch.randn(n)]
