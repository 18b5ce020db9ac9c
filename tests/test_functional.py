"""The number format: map construction, block-wise quantization, error bounds, bad input."""
import numpy as np
import pytest
import torch

from ds_q8 import functional as F


def independent_dynamic_map(signed: bool) -> np.ndarray:
    """The dynamic tree map built the way the method describes it, with numpy, independently."""
    vals = [0.0, 1.0]
    for i in range(7):
        k = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        edges = np.linspace(0.1, 1.0, k)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        vals += list(mids)
        if signed:
            vals += list(-mids)
    return np.sort(np.array(vals))


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_matches_construction(signed):
    m = F.create_dynamic_map(signed)
    assert m.dtype == torch.float32 and m.shape == (256,)
    ref = independent_dynamic_map(signed)
    np.testing.assert_allclose(m.double().numpy(), ref, rtol=1e-6, atol=0)
    assert bool((m[1:] > m[:-1]).all()), "map must be strictly increasing"
    assert 0.0 in m.tolist() and 1.0 in m.tolist()


def test_dynamic_map_shape_of_values():
    signed = F.create_dynamic_map(True)
    assert int((signed < 0).sum()) == 127 and int((signed > 0).sum()) == 128
    unsigned = F.create_dynamic_map(False)
    assert float(unsigned.min()) == 0.0 and int((unsigned > 0).sum()) == 255
    # smallest non-zero magnitudes sit at 1e-6 scale, the largest exponent step reaches 1
    assert 1e-7 < float(signed[signed > 0].min()) < 1e-6
    # unsigned map resolves small values more finely: it spends the sign bit on the fraction
    assert float(unsigned[1]) < float(signed[signed > 0].min())


def test_dynamic6_map_is_the_tree_over_six_decades():
    m = F.create_dynamic6_map()
    assert m.dtype == torch.float32 and m.shape == (256,)
    assert bool((m[1:] > m[:-1]).all()), "map must be strictly increasing"
    assert float(m[127]) == 0.0 and float(m[255]) == 1.0
    assert torch.equal(m[:127], -m[128:255].flip(0)), "negative entries mirror the positive ones (1.0 has none)"
    # decade d holds the midpoints of DYNAMIC6_COUNTS[d] + 1 evenly spaced points in [0.1, 1], times 10^-d
    ref = [1.0]
    for d, k in enumerate(F.DYNAMIC6_COUNTS):
        edges = np.linspace(0.1, 1.0, k + 1)
        ref += list((edges[:-1] + edges[1:]) / 2 * 10.0 ** -d)
    np.testing.assert_allclose(m[m > 0].double().numpy(), np.sort(ref), rtol=1e-6, atol=0)
    assert sum(F.DYNAMIC6_COUNTS) == 127 and F.DYNAMIC6_COUNTS[0] > 64  # finer than the dynamic map's top decade
    # "dynamic6" changes the signed map only: second moments keep the dynamic map
    assert torch.equal(F.state_map("dynamic6", False, "cpu"), F.create_dynamic_map(False))
    assert torch.equal(F.state_map("dynamic6", True, "cpu"), m)


def test_minifloat_maps_are_small_floats_with_every_code_finite():
    """Signed: sign + E3M4, unsigned: E4M4; each entry (1 + f/16) 2^e, or f/16 * 2 for e = 0, times float32(1 /
    the largest), one float32 product; 16 entries a binade. The signed map has one zero (+0.0, entry 127), is
    symmetric about it, and ends with the format's next value above its largest (where the second zero
    would be)."""
    for signed, (e_bits, m_bits) in ((True, (3, 4)), (False, (4, 4))):
        m = F.create_minifloat_map(signed)
        assert m.dtype == torch.float32 and m.shape == (256,) and F.MINIFLOAT_BITS[signed] == (e_bits, m_bits)
        assert torch.equal(F.state_map("minifloat", signed, "cpu"), m)
        mags = []
        for e in range(2 ** e_bits):
            for f in range(16):
                mags.append(f / 16 * 2 if e == 0 else (1 + f / 16) * 2.0 ** e)
        inv = np.float32(1.0 / max(mags))
        mags = np.array(mags + ([2.0 ** (2 ** e_bits)] if signed else []), dtype=np.float32) * inv
        ref = np.concatenate([-mags[1:128][::-1], mags]) if signed else mags
        np.testing.assert_array_equal(m.numpy(), ref)
        assert not bool(torch.signbit(m).logical_and(m == 0).any()), "no -0.0 entry"
        assert bool((m[1:] > m[:-1]).all())
        pos = m[(m > 0) & (m <= 1)].double()
        normal = pos[pos >= 2 / ((2 - 1 / 16) * 2.0 ** (2 ** e_bits - 1)) * (1 - 1e-6)]
        assert float((normal[1:] / normal[:-1] - 1).max()) <= 1 / 16 + 1e-7  # 16 entries a binade
    s = F.create_minifloat_map(True)
    assert float(s[127]) == 0.0 and torch.equal(s[:127], -s[128:255].flip(0)) and float(s[254]) == 1.0
    assert float(s[255]) == pytest.approx(32 / 31) and float(s[128]) == pytest.approx(5.04e-4, rel=1e-3)
    with pytest.raises(ValueError, match="exponent \\+ mantissa bits = 7"):
        F.minifloat_map(4, 4, True)
    with pytest.raises(ValueError, match="128 ascending magnitudes"):
        F.mirrored_map(torch.linspace(0, 1, 127, dtype=torch.float64))


@pytest.mark.parametrize("signed", [True, False])
def test_minifloat_codes_are_their_float_bits(signed):
    """The codec of the minifloat maps (module doc, "The minifloat codec"): every code's value from its bits is
    its map entry; every entry, times the largest value, codes back to itself (the signed map's entry above 1.0
    too); the fixed point's two forms meet at the subnormals' end; the maps are known by value as well as by
    identity, and the other maps have no codec."""
    codec = F.minifloat_codec(signed)
    code = F.create_minifloat_map(signed)
    c = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(F.minifloat_values(c, codec).view(torch.int32), code.view(torch.int32))
    assert torch.equal(F.minifloat_codes(code * codec.top, codec), c)
    limit = 2.0 ** (1 - codec.bias)
    edge = torch.tensor([limit], dtype=torch.float32)
    below = torch.nextafter(edge, torch.zeros(1))
    assert F.minifloat_codes(torch.cat([below, edge]), codec).tolist() == ([127 + 16, 127 + 16] if signed else [16, 16])
    assert F.codec_of(F.state_map("minifloat", signed, "cpu")) == codec == F.codec_of(code.clone())
    for other in (F.create_dynamic_map(signed), F.create_linear_map(signed), F.create_dynamic6_map()):
        assert F.codec_of(other) is None


@pytest.mark.parametrize("signed", [True, False])
def test_minifloat_rounding_against_its_statement(signed):
    """Nearest, stochastic and guided codes of values around the entries, against the rule stated on the
    format's magnitudes: the nearer (a midpoint goes down), the larger with probability the fraction of the
    way to it (19 random bits added below the kept mantissa: up where they reach past the next code), the
    stochastic code next to the old code and the nearest elsewhere; the zero point; NaN to 255."""
    codec = F.minifloat_codec(signed)
    # the format's values with its top binade at [1, 2), exact in float64, ascending from 0
    mags = F.minifloat_units(*F.MINIFLOAT_BITS[signed]) / 2.0 ** codec.bias
    g = torch.Generator().manual_seed(1)
    n = 200000
    start = torch.randint(0, mags.numel() - 1, (n,), generator=g)
    gap = mags[start + 1] - mags[start]
    where = torch.where(torch.rand(n, generator=g) < 0.2, torch.full((n,), 0.5, dtype=torch.float64),
                        torch.rand(n, generator=g, dtype=torch.float64))
    a = (mags[start] + where * gap).to(torch.float32)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) if signed else torch.ones(n)
    z = a * sign
    ad = a.double()
    lo = (torch.searchsorted(mags, ad, right=True) - 1).clamp(max=mags.numel() - 2)
    frac = (ad - mags[lo]) / (mags[lo + 1] - mags[lo])

    def code_of(m, zero_point=True):  # the code of magnitude m of z's sign; the unsigned map's zero point
        if signed:
            return torch.where(sign < 0, 127 - m, 127 + m)
        return torch.where((a > 0) & (m == 0), torch.ones_like(m), m) if zero_point else m

    assert torch.equal(F.minifloat_codes(z, codec).long(), code_of(lo + (frac > 0.5).long()))
    bits = torch.randint(0, 2 ** 32, (n,), generator=g, dtype=torch.int64)
    drawn = (bits >> 13).double() / 2 ** 19
    up = F.minifloat_codes(z, codec, bits).long()
    assert bool(((up == code_of(lo)) | (up == code_of(lo + 1))).all())
    went_up = up == code_of(lo + 1)
    two = code_of(lo) != code_of(lo + 1)  # not the unsigned map's zero point, where both are code 1
    # up where the draw reaches past 1 - fraction (the value's own 19 fraction bits: within 2^-19 of it)
    assert bool((~two | ~went_up | (drawn >= 1 - frac - 2 ** -19)).all())
    assert bool((~two | went_up | (drawn < 1 - frac + 2 ** -19)).all())
    old = torch.where(torch.rand(n, generator=g) < 0.6, code_of(lo + torch.randint(0, 2, (n,), generator=g), False),
                      torch.randint(0, 256, (n,), generator=g))
    guided = F.minifloat_codes(z, codec, bits, old).long()
    next_to = (old == code_of(lo, False)) | (old == code_of(lo + 1, False))
    nearest = code_of(lo + (frac > 0.5).long())
    assert torch.equal(guided[next_to], up[next_to]) and torch.equal(guided[~next_to], nearest[~next_to])
    special = torch.tensor([float("nan"), 1e-30, -1e-30])
    out = F.minifloat_codes(special, codec, bits[:3]).tolist()
    assert out[0] == 255 and out[1] == (127 if signed else 1) and out[2] == (127 if signed else 0)


def test_tree_map_builds_the_dynamic_maps():
    for bits in (4, 8):
        top = 2 ** (bits - 2)
        assert torch.equal(F.tree_map([top >> d for d in range(bits - 1)], True), F.create_dynamic_map(True, bits))
        assert torch.equal(F.tree_map([2 * top >> d for d in range(bits - 1)], False), F.create_dynamic_map(False, bits))
    with pytest.raises(ValueError, match="counts must be integers >= 1"):
        F.tree_map([64, 0])


def test_map_is_returned_as_a_copy():
    a = F.create_dynamic_map()
    a.zero_()
    assert float(F.create_dynamic_map().abs().max()) == 1.0


def bf16_at_or_above(m: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= each non-negative finite m: torch's nearest rounding, stepped up one
    bfloat16 where that fell below (an independent reading of the stored maxima)."""
    b = m.to(torch.bfloat16)
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(b.float() < m, up, b)


def brute_force_nearest(x: torch.Tensor, code: torch.Tensor, block_size: int):
    """Nearest entry by exhaustive distance, ties to the lower entry (an independent reading of the spec)."""
    flat = x.reshape(-1).float()
    nb = F.num_blocks(flat.numel(), block_size)
    absmax = bf16_at_or_above(torch.stack([flat[b * block_size:(b + 1) * block_size].abs().max() for b in range(nb)]))
    a = absmax.float()
    scale = torch.where(a > 0, 1.0 / a, torch.zeros_like(a))
    y = flat * scale.repeat_interleave(block_size)[: flat.numel()]
    mid = (code[:-1] + code[1:]) * 0.5
    idx = (y[:, None] > mid[None, :]).sum(1)
    if float(code[0]) == 0.0:  # the zero point of unsigned maps: code 0 holds zeros only
        idx = torch.where((y > 0) & (idx == 0), torch.ones_like(idx), idx)
    return idx.to(torch.uint8).view(x.shape), absmax


def tiny_positive_values() -> torch.Tensor:
    """Positive values from the smallest subnormal up to the map's smallest positive entry, each placed
    in a block whose maximum is 1: far below half of that entry, nearest rounding would give code 0."""
    return torch.cat([torch.tensor([1e-45, 1e-40, 1.2e-38]), torch.logspace(-37, -6.5, 300),
                      torch.tensor([1.6e-7, 1.625e-7, 1.63e-7, 3e-7])])


@pytest.mark.parametrize("kind", ["dynamic", "linear"])
def test_unsigned_maps_store_no_positive_value_as_zero(kind):
    code = F.create_dynamic_map(False) if kind == "dynamic" else F.create_linear_map(False)
    tiny = tiny_positive_values()
    x = torch.cat([torch.ones(1), tiny, torch.tensor([0.0, -0.0])])
    codes, absmax = F.quantize_blockwise(x, code, 4096)
    assert float(absmax[0]) == 1.0
    assert bool((codes[1:1 + tiny.numel()] >= 1).all())
    assert codes[-2:].tolist() == [0, 0]  # zeros stay exact zeros
    below = tiny < float(code[1])  # below the smallest positive entry: that entry, nothing larger
    assert bool((codes[1:1 + tiny.numel()][below] == 1).all())
    back = F.dequantize_blockwise(codes, absmax, code, 4096)
    assert bool((back[1:1 + tiny.numel()] > 0).all())
    ref_codes, _ = brute_force_nearest(x, code, 4096)
    assert torch.equal(codes, ref_codes)


def test_signed_maps_round_small_values_to_nearest_including_zero():
    """The first moment keeps nearest rounding: a value below half the smallest entry reads back as 0."""
    code = F.create_dynamic_map(True)
    zero = int(torch.argmin(code.abs()))
    tiny = tiny_positive_values()
    tiny = tiny[tiny < float(code[zero + 1]) / 2]
    x = torch.cat([torch.ones(1), tiny, -tiny])
    codes, _ = F.quantize_blockwise(x, code, 4096)
    assert bool((codes[1:] == zero).all())


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n,bs", [(1, 64), (63, 64), (64, 64), (1000, 256), (5000, 2048), (4097, 4096)])
def test_quantize_matches_exhaustive_search(signed, n, bs):
    g = torch.Generator().manual_seed(n + bs)
    x = torch.randn(n, generator=g) * 3
    if not signed:
        x = x.abs()
    code = F.create_dynamic_map(signed)
    codes, absmax = F.quantize_blockwise(x, code, bs)
    ref_codes, ref_absmax = brute_force_nearest(x, code, bs)
    assert torch.equal(absmax, ref_absmax)
    assert torch.equal(codes, ref_codes)


def test_values_on_map_entries_roundtrip_exactly():
    code = F.create_dynamic_map(True)
    x = code.clone()  # absmax of this block is exactly 1
    codes, absmax = F.quantize_blockwise(x, code, 256)
    assert float(absmax[0]) == 1.0
    assert torch.equal(codes.long(), torch.arange(256))
    assert torch.equal(F.dequantize_blockwise(codes, absmax, code, 256), x)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "uniform"])
def test_roundtrip_error_is_bounded_per_element(signed, dist):
    """|x - deq(q(x))| <= half the gap to the neighbouring entry, times the block's absmax."""
    g = torch.Generator().manual_seed(7)
    n, bs = 3 * 2048 + 123, 2048
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "heavy_tailed":
        x = torch.randn(n, generator=g) ** 3
    else:
        x = torch.rand(n, generator=g) * 2 - 1
    if not signed:
        x = x.abs()
    code = F.create_dynamic_map(signed)
    codes, absmax = F.quantize_blockwise(x, code, bs)
    back = F.dequantize_blockwise(codes, absmax, code, bs)
    bound = F.quantization_error_bound(code)[codes.long()] * absmax.double().repeat_interleave(bs)[:n]
    err = (x.double() - back.double()).abs()
    # one float32 rounding of the scaled value may push it just past a midpoint
    slack = 4 * torch.finfo(torch.float32).eps * absmax.double().repeat_interleave(bs)[:n]
    assert bool((err <= bound + slack).all()), float((err - bound).max())
    # and the error is small on average for these well-behaved inputs
    assert float((err / absmax.double().repeat_interleave(bs)[:n]).mean()) < 0.01


def test_blockwise_beats_tensorwise_with_outliers():
    """The motivation of block-wise scaling: one outlier ruins the resolution of a whole tensor-wide scale."""
    g = torch.Generator().manual_seed(0)
    n = 64 * 2048
    x = torch.randn(n, generator=g) * 1e-3
    x[12345] = 50.0  # a single outlier
    code = F.create_dynamic_map(True)

    codes, absmax = F.quantize_blockwise(x, code, 2048)
    err_block = (F.dequantize_blockwise(codes, absmax, code, 2048) - x).abs().mean()

    # tensor-wise: one scale for everything (block as large as the tensor)
    am = x.abs().max().reshape(1)
    t_codes = F.quantize_with_absmax(x, am, code, n)
    err_tensor = (F.dequantize_flat(t_codes, am, code, n) - x).abs().mean()
    assert float(err_block) * 5 < float(err_tensor), (float(err_block), float(err_tensor))


def test_zero_blocks_give_exact_zeros():
    x = torch.zeros(5000)
    x[4500] = 1.5
    codes, absmax = F.quantize_blockwise(x)
    assert absmax.tolist()[:2] == [0.0, 0.0]
    back = F.dequantize_blockwise(codes, absmax)
    assert torch.equal(back, x)
    assert not torch.isnan(back).any()


def test_empty_tensor():
    codes, absmax = F.quantize_blockwise(torch.empty(0))
    assert codes.shape == (0,) and codes.dtype == torch.uint8 and absmax.numel() == 0
    assert F.dequantize_blockwise(codes, absmax).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_precision_input_and_output(dtype):
    x = torch.randn(3, 1000).to(dtype)
    codes, absmax = F.quantize_blockwise(x, block_size=512)
    assert codes.shape == x.shape and absmax.dtype == torch.bfloat16
    ref_codes, _ = F.quantize_blockwise(x.float(), block_size=512)
    assert torch.equal(codes, ref_codes)
    back = F.dequantize_blockwise(codes, absmax, block_size=512, dtype=dtype)
    assert back.dtype == dtype and back.shape == x.shape
    assert float((back.float() - x.float()).abs().max()) < 0.05 * float(x.float().abs().max())


def test_unsigned_map_on_signed_data_clamps_to_zero_not_nan():
    x = -torch.rand(3000)
    code = F.create_dynamic_map(False)
    codes, absmax = F.quantize_blockwise(x, code)
    assert int(codes.max()) == 0
    assert torch.equal(F.dequantize_blockwise(codes, absmax, code), torch.zeros(3000))


@pytest.mark.parametrize("bs", [0, 32, 100, 1000, 8192, 2048.0, True, "2048"])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match=r"block_size must be a power of two in \[64, 4096\]"):
        F.quantize_blockwise(torch.randn(10), block_size=bs)
    with pytest.raises(ValueError, match="block_size"):
        F.dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(1, dtype=torch.bfloat16), block_size=bs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad):
    x = torch.randn(100)
    x[17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_blockwise(x)


def test_bad_dtypes_and_shapes():
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        F.quantize_blockwise(torch.arange(10))
    with pytest.raises(ValueError, match="codes must be uint8"):
        F.dequantize_blockwise(torch.zeros(10), torch.zeros(1))
    with pytest.raises(ValueError, match="absmax has 2 entries"):
        F.dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="absmax must be bfloat16"):
        F.dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(1))
    with pytest.raises(ValueError, match="256"):
        F.quantize_blockwise(torch.randn(10), code=torch.zeros(10))
