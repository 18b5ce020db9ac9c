"""Stochastic rounding of 16-bit parameter writes: unbiased, reproducible, the same bits in the
compiled kernels as in the PyTorch specification (ds_q8/optim/rounding.py)."""

import pytest
import torch

import ds_q8
from ds_q8.optim import rounding

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ulp_below(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values around |x| (the step between the neighbours of x)."""
    a = x.abs()
    lo = a.to(dtype).to(torch.float32)
    lo = torch.where(lo > a, torch.nextafter(lo.to(dtype), torch.zeros((), dtype=dtype)).to(torch.float32), lo)
    hi = torch.nextafter(lo.to(dtype), torch.full((), float("inf"), dtype=dtype)).to(torch.float32)
    return hi - lo


def test_mix32_matches_its_tensor_version():
    values = torch.tensor([0, 1, 2, 0xFFFFFFFF, 0x12345678, 0x80000000], dtype=torch.int64)
    assert rounding.mix32_t(values).tolist() == [rounding.mix32(int(v)) for v in values]


@pytest.mark.parametrize("name", list(DTYPES))
def test_unbiased_on_average(name):
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, generator=g) * torch.logspace(-6, 3, 256)  # many binades, both signs
    if dtype == torch.float16:
        x = torch.cat([x.clamp(-6e4, 6e4), torch.tensor([3e-6, -1e-7, 65000.0, 6.1e-5])])  # subnormals, the top
    draws = 4000
    index = torch.arange(x.numel())
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for key in range(draws):
        total += rounding.round_stochastic(x, dtype, key * 7919, index).to(torch.float64)
    mean = total / draws
    spread = ulp_below(x, dtype).to(torch.float64)
    # each draw is one of two neighbours a step apart: the mean's standard error is at most step / (2 sqrt(n))
    err = (mean - x.to(torch.float64)).abs() / spread
    assert float(err.max()) < 4.0 / (2 * draws ** 0.5), float(err.max())
    # and every draw is one of the two neighbours
    one = rounding.round_stochastic(x, dtype, 12345, index).to(torch.float32)
    assert bool(((one - x).abs() <= ulp_below(x, dtype) * (1 + 1e-6)).all())


@pytest.mark.parametrize("name", list(DTYPES))
def test_updates_below_half_a_unit_are_not_lost(name):
    dtype = DTYPES[name]
    # 1.0 - 1e-4 rounds back to 1.0 to nearest in both formats: a plain 16-bit write never moves
    x0 = torch.ones(2000, dtype=dtype)
    nearest, stochastic = x0.clone(), x0.clone()
    index = torch.arange(x0.numel())
    for step in range(1, 301):
        nearest = (nearest.float() - 1e-4).to(dtype)
        stochastic = rounding.round_stochastic(stochastic.float() - 1e-4, dtype, rounding.step_key(0, step), index)
    assert bool((nearest == 1.0).all())
    moved = 1.0 - float(stochastic.float().mean())
    assert moved == pytest.approx(300 * 1e-4, rel=0.05)


def exact_write(x: torch.Tensor, dtype, kernels: bool, seed=0):
    """Momentum with lr 1 from p = 0 and grad -x writes x itself: what reaches memory is x rounded."""
    p = torch.nn.Parameter(torch.zeros(x.numel(), dtype=dtype))
    p.grad_dtype = torch.float32
    opt = ds_q8.Momentum8bitBlock([p], lr=1.0, momentum=0.5, optim_bits=32, sr_seed=seed, nonfinite="off",
                                  impl="kernel" if kernels else "reference")
    p.grad = (-x).to(torch.float32)
    opt.step()
    return p.detach()


@pytest.mark.parametrize("name", list(DTYPES))
def test_kernel_and_reference_draw_the_same_bits(name):
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=g) * torch.logspace(-8, 4.6, 5000)
    edges = [0.0, 65504.0, 65519.0, -65500.0, 6e-8, 5.9e-8, 1e-45, float("inf"), 3.4e38, -3.39e38]
    x = torch.cat([x, torch.tensor(edges)])
    if dtype == torch.float16:
        x = torch.where(x.abs() > 7e4, torch.full_like(x, 1.0), x)  # fp16 has no such values to round
    key = rounding.sr_key(rounding.step_key(0, 1), 0, 0)
    want = rounding.round_stochastic(x, dtype, key, torch.arange(x.numel()))
    kernel, reference = exact_write(x, dtype, True), exact_write(x, dtype, False)
    assert torch.equal(reference.view(torch.int16), want.view(torch.int16))
    assert torch.equal(kernel.view(torch.int16), want.view(torch.int16))
    # it is stochastic: some values went up, some down, relative to round-to-nearest
    nearest = x.to(dtype)
    assert 0 < int((kernel != nearest).sum()) < x.numel()


def test_seed_and_switch():
    x = torch.randn(4000) * 1e-3 + 1.0
    a, b = exact_write(x, torch.bfloat16, True, seed=0), exact_write(x, torch.bfloat16, True, seed=0)
    c = exact_write(x, torch.bfloat16, True, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    p = torch.nn.Parameter(torch.zeros(4000, dtype=torch.bfloat16))
    p.grad_dtype = torch.float32
    opt = ds_q8.Momentum8bitBlock([p], lr=1.0, momentum=0.5, optim_bits=32, stochastic_rounding=False)
    p.grad = -x
    opt.step()
    assert torch.equal(p.detach(), x.to(torch.bfloat16))  # switched off: round to nearest


@pytest.mark.parametrize("bad", [dict(stochastic_rounding="yes"), dict(sr_seed=-1), dict(sr_seed=2 ** 32),
                                 dict(sr_seed=1.5)])
def test_bad_settings_name_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        ds_q8.AdamW8bitBlock([torch.nn.Parameter(torch.zeros(4))], **bad)


def test_adam_with_bf16_weights_moves_where_nearest_rounding_stalls():
    """Adam's steps of about lr = 1e-3 are below half a bf16 unit at 1.0 (2^-8): rounded to nearest
    the weights never move; with stochastic rounding they move by lr per step on average."""
    def run(sr):
        p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
        opt = ds_q8.Adam8bitBlock([p], lr=1e-3, stochastic_rounding=sr)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach().float()

    assert bool((run(False) == 1.0).all())
    assert float(1.0 - run(True).mean()) == pytest.approx(50 * 1e-3, rel=0.1)
