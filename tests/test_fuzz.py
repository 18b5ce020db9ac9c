"""Property tests: finite input never yields NaN/Inf codes, absmax or parameters."""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_q8 import functional as F

from helpers.optimizer_cases import kernel_cases

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, max_len=5000):
    """Finite tensors of awkward shapes and magnitudes: empty, 1 element, subnormals, near the dtype's max,
    single huge outliers, all-zero blocks, partial blocks."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.one_of(st.just(0), st.just(1), st.integers(2, max_len)))
    kind = draw(st.sampled_from(["normal", "subnormal", "huge", "outlier", "zeros", "mixed"]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float32)
    if kind == "subnormal":
        x = x * info.smallest_normal * 0.5
    elif kind == "huge":
        x = x.clamp(-1, 1) * info.max * 0.999
    elif kind == "outlier" and n:
        x[int(torch.randint(0, n, (1,), generator=g))] = info.max * 0.9
    elif kind == "zeros":
        x.zero_()
    elif kind == "mixed" and n:
        x[: n // 2] = 0.0
    x = x.to(dtype)
    assert torch.isfinite(x).all()
    return x


block_sizes = st.sampled_from([64, 128, 256, 1024, 2048, 4096])


@SETTINGS
@given(x=tensors(), bs=block_sizes, signed=st.booleans())
def test_quantize_roundtrip_is_finite_and_bounded(x, bs, signed):
    code = F.create_dynamic_map(signed)
    codes, absmax = F.quantize_blockwise(x, code, bs)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.numel() == F.num_blocks(x.numel(), bs)
    assert torch.isfinite(absmax).all()
    back = F.dequantize_blockwise(codes, absmax, code, bs)
    assert torch.isfinite(back).all()
    if x.numel():
        xf = x.float()
        if not signed:
            xf = xf.clamp(min=0)  # negative values on the unsigned map go to 0
        am = absmax.repeat_interleave(bs)[: x.numel()].double()
        err = (back.double() - xf.double()).abs()
        bound = F.quantization_error_bound(code)[codes.reshape(-1).long()] * am
        slack = 4 * torch.finfo(torch.float32).eps * am + 1e-30
        # a maximum above the largest bfloat16 is stored as that value: values beyond it lose the excess
        saturated = (xf.abs().double() - float(torch.finfo(torch.bfloat16).max)).clamp(min=0)
        assert bool((err <= bound + slack + saturated).all())
        # all-zero blocks come back exactly zero
        zero_blocks = absmax == 0
        if zero_blocks.any():
            assert torch.equal(back.reshape(-1)[zero_blocks.repeat_interleave(bs)[: x.numel()]].float(),
                               torch.zeros(int(zero_blocks.repeat_interleave(bs)[: x.numel()].sum())))


# Adam's L2 decay is left out: on weights near float32's max, (wd * p)**2 overflows in fp32 math
# itself (torch.optim.Adam gives inf there too), which is no property of the 8-bit format.
# without Adam's L2 decay, which adds weight_decay * p to gradients that are bounded to keep grad**2 finite
OPTIMIZERS = [(cls, {**kw, "weight_decay": 0.0} if name == "adam" else kw)
              for name, (cls, kw) in kernel_cases().items() if name in ("adam", "adamw", "nesterov")]


@SETTINGS
@given(x=tensors(max_len=3000), which=st.integers(0, len(OPTIMIZERS) - 1), bs=block_sizes,
       steps=st.integers(1, 3), seed=st.integers(0, 1000))
def test_optimizer_steps_stay_finite(x, which, bs, steps, seed):
    cls, kw = OPTIMIZERS[which]
    # gradients of the same awkward magnitudes, kept finite when squared in fp32 by Adam
    p = torch.nn.Parameter(x.clone())
    opt = cls([p], block_size=bs, min_8bit_size=0, **kw)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grad = torch.randn(x.shape, generator=g) * (1e-3 if x.numel() == 0 else float(x.float().abs().max()) + 1e-30)
        grad = grad.clamp(-1e18, 1e18)  # grad**2 must fit fp32 for any optimizer, 8-bit or not
        p.grad = grad.to(x.dtype)
        if not torch.isfinite(p.grad).all():
            return
        opt.step()
    st_ = opt.state[p]
    if not st_:
        return
    # SGD's step scales with the gradient: from a 16-bit weight near its dtype's largest value it carries the
    # weight past it, to inf, as torch.optim.SGD does (-65440 in fp16, gradient 43279: -inf in both); the
    # states below must stay finite all the same
    near_max = x.numel() and float(x.float().abs().max()) > 0.5 * float(torch.finfo(x.dtype).max)
    if not (kw.get("momentum") and x.dtype != torch.float32 and near_max):
        assert torch.isfinite(p.detach().float()).all()
    for key, value in st_.items():
        if torch.is_tensor(value) and value.dtype != torch.uint8:
            assert torch.isfinite(value).all(), key
    for value in opt.dequantized_state(p).values():
        assert torch.isfinite(value).all()
