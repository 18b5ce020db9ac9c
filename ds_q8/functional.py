"""The 8-bit format of ds_q8 (block-wise codes on 256-entry maps), written in plain PyTorch.

This module is the specification: every fast kernel must produce exactly the codes that
these functions produce (``format4.py`` is the 4-bit format's).

Format
------
A state tensor is flattened and cut into blocks of ``block_size`` elements (64 by default; the last
block may be shorter). Each block is scaled by its own absolute maximum (``absmax``, stored as
bfloat16, rounded up), and every scaled value, which lies in [-1, 1], is stored as the uint8 index of
the nearest entry of a 256-entry map (``code``).

Why 64-element blocks with bfloat16 maxima: a block is coded against its largest element, so a block
that spans two parts of a fused projection (GPT-2's ``c_attn`` holds query, key and value columns side
by side; the query and key gradients are about 100x smaller than the value gradients) codes the small
part's moments with a few codes near 0. 64 divides every width and head size that real models use
(GPT-2 768-1600, heads of 64 or 128), so no block mixes two parts; a float32 maximum per 64 elements
would cost 0.0625 bytes per element and state, a bfloat16 one costs half (Adam: 2.0625 B/param).

Exact rounding rule (kernels reproduce it bit for bit):

* ``block_size=None`` means one block spanning the whole tensor (tensor-wise quantization, kept
  for the paper's ablation); see :func:`resolve_block_size`.
* ``x`` is converted to float32 first.
* ``m = max(|x|)`` over block ``b`` (float32, NaN if the block holds one), stored as
  ``absmax[b] = bf16_up(m)``: the smallest bfloat16 at or above ``m`` (on the bit pattern: add
  0xFFFF, keep the top 16 bits), so that every scaled value stays within [-1, 1]; NaN stays NaN and a
  finite maximum above the largest bfloat16 saturates to it. ``A = float32(absmax[b])``, exact.
* ``scale = 1.0f / A`` (float32 division); a block whose absmax is 0 uses ``scale = 0``.
* ``y = x * scale`` (one float32 multiply).
* ``index = #{ i : mid[i] < y }`` where ``mid[i] = (code[i] + code[i + 1]) * 0.5f`` in float32;
  a value exactly on a midpoint goes to the lower entry.
* The zero point: in a map whose smallest entry is 0 (the unsigned maps, for states that are never
  negative: second moments, Adagrad's sum) ``mid[0] = 0``. Code 0 then holds exact zeros only, and
  every positive value takes at least code 1, the smallest positive entry (3.25e-7 of the block
  maximum in the dynamic map). Rounded to nearest, a second moment below half of that would be
  stored as 0: its history wiped at every step, the element would step as if its gradient had just
  appeared, several times too far. Rounded up, it is at most the smallest entry: that element's step
  can only shrink. Signed maps have no zero point: rounded to nearest, a first moment below half of
  the smallest entry of its sign becomes 0, which makes its step shorter.

Stochastic requantization (every state with ``state_rounding="stochastic"``;
the second moments only with ``"stochastic_unsigned"``): with 32
random bits ``r`` per element, the value goes to one of the two entries around it, the upper one with
probability equal to how far toward it the value lies, so that the stored state is right on average.
From the nearest index ``n`` above: ``lo, hi = (n, n + 1)`` if ``y >= code[n]`` else ``(n - 1, n)``
(clamped to [0, 255]); ``u = (r >> 8) * 2**-24``; the index is ``hi`` when
``u * (code[hi] - code[lo]) < y - code[lo]`` (float32), else ``lo``; then the zero point of unsigned
maps applies (a positive value takes at least code 1) and NaN takes 255. A value on an entry stays there.

Guided requantization (``state_rounding="guided"``, the default) takes the stochastic choice (the same
random bits) while the value stays next to its old code, and the nearer of the two entries around it
elsewhere. ``lo, hi`` as above, ``gap = code[hi] - code[lo]``, ``above = y - code[lo]``; the nearer entry
is ``hi`` when ``gap * 0.5 < above``. Every state is guided by its old code: stochastic where the code
before the step is ``lo`` or ``hi``, the nearer entry elsewhere. Then the zero point and NaN as above.
Why: rounded to nearest, an exponential average that moves by less than half a code a step stalls;
rounded stochastically, every element pays fresh noise every step. Guided by its old code, a value
pays it only in the two intervals next to its old entry, where nearest could stall it, and is right
on average there; beyond them it has moved by more than a code and takes the nearer entry, whose
error averages out over an interval. (Rules that no option selects, such as guidance by the update,
are studied through ``ds_q8.optim.path_reference.set_requantize_rule``.)

Dequantization is ``code[index] * A`` in float32, then a cast to the requested dtype.

The minifloat codec
-------------------
The two maps of ``quantization="minifloat"`` (sign + E3M4, and E4M4: :data:`MINIFLOAT_BITS`) are small
floats, coded from a float's bits rather than by the rules above (:class:`MinifloatCodec`; the kernels'
``q8_minifloat.h``). Taken with its top binade at [1, 2) (exponent bias ``B`` = 7 or 15), magnitude code ``c``
is the float ``u(c)`` whose bits are ``(c << 19) + ((127 - B) << 23)``, or ``c * 2**(-3 - B)`` when ``c < 16``
(the subnormals); the largest is ``T = 1.9375``. Its map entry is ``u(c) * float32(1 / T)`` (float32, one
rounding), so dequantization stays ``code[index] * A``.

* ``z = x * s`` with ``s = T / A`` (float32 division; 0 where ``A`` is not positive).
* The fixed point of ``a = |z|``: its bits less ``(127 - B) << 23`` from ``2**(1 - B)`` up, else the bits of
  ``a + 2**(1 - B)`` (float32: the addition rounds ``a`` to the subnormals' grid, to nearest even) less those
  of ``2**(1 - B)``. It is the code ``lo = fixed >> 19`` below ``a`` and 19 bits of the way to the next.
* Rounding adds to it and keeps the top: ``mag = (fixed + add) >> 19`` with ``add = 2**18 - 1`` to nearest (a
  value on a midpoint goes down), ``add = r >> 13`` stochastically (``r`` the element's 32 random bits:
  up with probability the fraction), and, guided, the random bits where the old code is ``lo`` or ``lo + 1``
  (of ``z``'s sign) and ``2**18 - 1`` elsewhere.
* Signed: ``127 + mag``, or ``127 - mag`` for negative ``z``, clamped to [0, 255] (only a positive value within
  a rounding of the largest can reach entry 255). Unsigned: ``min(mag, 255)``, 0 for a negative value, at
  least 1 for a positive one (the zero point). NaN: 255.

The random bits of state ``k`` are ``ds_q8.optim.rounding.state_bits``: ``(key + index) * STATE_MULS[k]``,
a Weyl sequence over a block's elements.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

MIN_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 4096
DEFAULT_BLOCK_SIZE = 64
#: the dtype block maxima are stored in (see the module doc)
ABSMAX_DTYPE = torch.bfloat16
#: parameters smaller than this keep fp32 state by default (the optimizers' ``min_8bit_size``)
DEFAULT_MIN_8BIT_SIZE = 4096
#: states an optimizer may keep (the kernels' limit as well: csrc/includes/q8_common.h)
MAX_STATES = 3

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the minifloat codec's fixed point: a value's code, then 19 bits of the way to the next one
FRACTION_BITS = 19
FRACTION_MASK = (1 << FRACTION_BITS) - 1
FRACTION_HALF = 1 << (FRACTION_BITS - 1)

from .maps import (DYNAMIC6_COUNTS, MINIFLOAT_BITS, MinifloatCodec, codec_of, create_dynamic6_map,  # noqa: F401
                   create_dynamic_map, create_linear_map, create_minifloat_map, minifloat_codec, minifloat_magnitudes,
                   minifloat_map, minifloat_units, mirrored_map, state_map, tree_map)


def check_block_size(block_size, name: str = "block_size") -> int:
    """Validate a block size; returns it as an int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(
            f"{name} must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(
            f"{name} must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}"
        )
    return block_size


def resolve_block_size(block_size: Optional[int], numel: int) -> int:
    """The block length used for a tensor of ``numel`` elements; ``None`` means one block for all of it.

    The single block is never shorter than 1 so that empty tensors still have one absmax entry.
    """
    if block_size is None:
        return max(1, numel)
    return check_block_size(block_size)


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def _check_code(code: Optional[torch.Tensor], device) -> torch.Tensor:
    if code is None:
        code = create_dynamic_map(signed=True)
    if code.dtype != torch.float32 or code.numel() != 256:
        raise ValueError(f"code must be a float32 tensor of 256 sorted values, got {code.dtype} with {code.numel()}")
    return code.to(device)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """Decision boundaries between neighbouring map entries, float32 (255 values): their midpoints,
    except that a map whose smallest entry is 0 has its first boundary at 0 (the zero point, see the
    module doc)."""
    mid = (code[:-1] + code[1:]) * 0.5
    if code.numel():  # as tensor operations: no host sync for a map on a GPU
        mid[0] = torch.where(code[0] == 0, torch.zeros_like(mid[0]), mid[0])
    return mid


def stored_absmax(m: torch.Tensor) -> torch.Tensor:
    """Block maxima (non-negative float32, or NaN) as stored: bfloat16, each the smallest bfloat16 at
    or above its value (``bf16_up`` in the module doc). Monotone, so the stored maximum of several
    partial maxima is the maximum of their stored forms."""
    u = m.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    r = (u + 0xFFFF) >> 16
    r = torch.where(u > 0x7F800000, torch.full_like(r, 0x7FC0), r)  # NaN
    r = torch.where((r == 0x7F80) & (u < 0x7F800000), torch.full_like(r, 0x7F7F), r)  # saturate, finite
    return (r << 16).to(torch.int32).view(torch.float32).to(ABSMAX_DTYPE).view(m.shape)


def block_max(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block max |x| of a flat float32 tensor, unrounded (float32, one entry per block)."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    a = x.abs()
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    return a.view(nb, block_size).amax(dim=1)


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block maxima of a flat float32 tensor as stored (bfloat16, rounded up; one per block)."""
    return stored_absmax(block_max(x, block_size))


def block_scale(absmax: torch.Tensor, code: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What a block's values are multiplied by before they are coded, from its stored maximum ``A``
    (float32): ``1 / A`` for a map coded through its table, ``T / A`` for a minifloat map (``T`` its
    largest value, :class:`MinifloatCodec`); 0 where ``A`` is not positive (an all-zero block, or NaN)."""
    codec = None if code is None else codec_of(code)
    num = torch.full_like(absmax, 1.0 if codec is None else codec.top)
    # a tensor divided by a tensor: one rounding (a scalar over a tensor is its reciprocal times the scalar)
    return torch.where(absmax > 0, num / absmax, torch.zeros_like(absmax))


def quantize_with_absmax(x: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int,
                         random_bits: Optional[torch.Tensor] = None, mid: Optional[torch.Tensor] = None,
                         old: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes of a flat float32 tensor given its per-block absmax (no validation: internal): to the
    nearest entry, or stochastically with ``random_bits`` (32 per element, int64; see the module doc),
    guided by ``old`` (each code before the step) when it is given.
    ``mid`` replaces :func:`midpoints` of ``code`` as the decision boundaries (``format4.py``'s second moment)."""
    n = x.numel()
    nb = absmax.numel()
    scale = block_scale(absmax.to(torch.float32), None if mid is not None else code)  # format4: the table's rules
    pad = nb * block_size - n
    xs = torch.nn.functional.pad(x, (0, pad)) if pad else x
    y = (xs.view(nb, block_size) * scale[:, None]).reshape(-1)[:n]
    return quantize_scaled(y, code, random_bits, mid, old)


def minifloat_codes(z: torch.Tensor, codec: MinifloatCodec, random_bits: Optional[torch.Tensor] = None,
                    old: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes of values ``z`` in a minifloat map's units (a block's values times ``top / A``), from their
    bits (module doc): to nearest, stochastically with ``random_bits`` (32 per element, int64), or guided by
    ``old``, each element's code before the step."""
    a = z.abs()
    bits = a.view(torch.int32).to(torch.int64)
    # the value as a fixed-point code with 19 fraction bits: the float's own bits from 2^(1 - bias) up, whose
    # exponent and top mantissa bits are the code; below, the mantissa of a + 2^(1 - bias) (the subnormals,
    # evenly spaced: the addition rounds a to the fixed point, to nearest even). NaN: replaced below
    limit = 2.0 ** (1 - codec.bias)  # where the subnormals end: a + limit rounds a to their fixed point
    fixed = torch.where(a < limit, (a + limit).view(torch.int32).to(torch.int64) - ((128 - codec.bias) << 23),
                        bits - ((127 - codec.bias) << 23))
    lo, frac = fixed >> FRACTION_BITS, fixed & FRACTION_MASK
    up = frac > FRACTION_HALF  # the nearer entry; a value on a midpoint goes down
    if random_bits is not None:
        drawn = frac + (random_bits >> (32 - FRACTION_BITS)) > FRACTION_MASK
        if old is not None:  # guided: drawn only where the old code is lo or lo + 1 (of the value's sign)
            offset = old.to(torch.int64) - (127 if codec.signed else 0)
            if codec.signed:
                offset = torch.where(torch.signbit(z), -offset, offset)
            drawn = torch.where((offset == lo) | (offset == lo + 1), drawn, up)
        up = drawn
    mag = lo + up.to(torch.int64)
    if codec.signed:  # a value within a rounding of the top may round up to entry 255 (above 1.0) if positive
        idx = torch.where(torch.signbit(z), 127 - mag, 127 + mag).clamp(0, 255)
    else:
        idx = torch.where(z < 0, torch.zeros_like(mag), mag.clamp(max=255))
        idx = torch.where((z > 0) & (idx == 0), torch.ones_like(idx), idx)  # the zero point
    return torch.where(torch.isnan(z), torch.full_like(idx, 255), idx).to(torch.uint8)


def minifloat_values(codes: torch.Tensor, codec: MinifloatCodec) -> torch.Tensor:
    """The map entries of minifloat codes, computed from their bits as the kernels do (module doc): equal to
    indexing the map (``tests/test_functional.py`` checks every code)."""
    c = codes.to(torch.int64)
    mag = (c - 127).abs() if codec.signed else c
    one = ((mag << 19) + ((127 - codec.bias) << 23)).to(torch.int32).view(torch.float32)
    sub = mag < 16  # exponent field 0: the value is (one - 2^-bias) * 2
    inv = torch.tensor(codec.inv_top, dtype=torch.float32)
    units = torch.where(sub, one - 2.0 ** -codec.bias, one)
    v = units * torch.where(sub, inv * 2.0, inv)
    return torch.where((c < 127) & codec.signed, -v, v)


def quantize_scaled(y: torch.Tensor, code: torch.Tensor, random_bits: Optional[torch.Tensor] = None,
                    mid: Optional[torch.Tensor] = None, old: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes of values already divided by their block's absmax: nearest, or stochastic, or guided by
    ``old``, each element's code before the step (module doc). ``mid`` may give :func:`midpoints` of
    ``code``, computed once. For a minifloat map (:func:`codec_of`) ``y`` is in the map's units (times
    :func:`block_scale`) and the codes come from its bits, unless ``mid`` asks for the table's rules."""
    codec = codec_of(code) if mid is None else None
    if codec is not None:
        return minifloat_codes(y, codec, random_bits, old)
    near = torch.searchsorted(midpoints(code) if mid is None else mid, y, right=False)
    if random_bits is None:
        return near.to(torch.uint8)
    top = code.numel() - 1
    near = near.clamp(max=top)
    up = y >= code[near]
    nb = torch.where(up, near + 1, near - 1).clamp(0, top)
    lo, hi = torch.where(up, near, nb), torch.where(up, nb, near)
    c_lo, c_hi = code[lo], code[hi]
    gap, above = c_hi - c_lo, y - c_lo
    u = (random_bits >> 8).to(torch.float32) * 5.9604644775390625e-08  # 24 bits times 2^-24, exact
    go_up = u * gap < above
    if old is not None:
        go_up = torch.where((old == lo) | (old == hi), go_up, gap * 0.5 < above)
    idx = torch.where(go_up, hi, lo)
    idx = torch.where((code[0] == 0) & (y > 0) & (idx == 0), torch.ones_like(idx), idx)  # the zero point
    idx = torch.where(torch.isnan(y), torch.full_like(idx, top), idx)
    return idx.to(torch.uint8)


def dequantize_flat(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 values of flat codes (no validation: internal). ``absmax`` may be bfloat16 (the
    format) or float32 (the block maxima of checkpoints written before format 3)."""
    n = codes.numel()
    nb = absmax.numel()
    v = code[codes.long()]
    pad = nb * block_size - n
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return (v.view(nb, block_size) * absmax.to(torch.float32)[:, None]).reshape(-1)[:n]


def quantize_blockwise(
    x: torch.Tensor, code: Optional[torch.Tensor] = None, block_size: Optional[int] = DEFAULT_BLOCK_SIZE
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` block-wise: returns (codes uint8 shaped like x, absmax bfloat16 per block).

    ``block_size=None`` quantizes tensor-wise (one absmax). Raises ValueError for non-finite
    input, unsupported dtypes and bad block sizes.
    """
    block_size = resolve_block_size(block_size, x.numel())
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    code = _check_code(code, x.device)
    flat = x.detach().reshape(-1).to(torch.float32)
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise ValueError("quantize_blockwise: x contains NaN or Inf; only finite values can be quantized")
    absmax = block_absmax(flat, block_size)
    codes = quantize_with_absmax(flat, absmax, code, block_size)
    return codes.view(x.shape), absmax


def check_dequantize_out(out: torch.Tensor, codes: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    """Validate ``out=`` of :func:`dequantize_blockwise`; returns the output dtype."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but dtype={dtype} was asked for")
    if out.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if out.shape != codes.shape:
        raise ValueError(f"out must have the shape of codes {tuple(codes.shape)}, got {tuple(out.shape)}")
    if out.device != codes.device:
        raise ValueError(f"out must be on the device of codes ({codes.device}), got {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out.dtype


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: Optional[torch.Tensor] = None,
    block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: a tensor of ``dtype`` shaped like ``codes``.

    ``dtype`` defaults to float32, or to the dtype of ``out`` when ``out`` (a contiguous tensor
    shaped like ``codes``, on its device) is given: the values are written there and it is returned.
    """
    block_size = resolve_block_size(block_size, codes.numel())
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if absmax.dtype != ABSMAX_DTYPE:
        raise ValueError(f"absmax must be bfloat16 (the block maxima quantize_blockwise returns), got {absmax.dtype}")
    expected = num_blocks(codes.numel(), block_size)
    if absmax.numel() != expected:
        raise ValueError(
            f"absmax has {absmax.numel()} entries but {codes.numel()} codes with block_size={block_size} "
            f"need {expected}"
        )
    if out is not None:
        dtype = check_dequantize_out(out, codes, dtype)
    dtype = torch.float32 if dtype is None else dtype
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    code = _check_code(code, codes.device)
    values = dequantize_flat(codes.reshape(-1), absmax.reshape(-1), code, block_size).to(dtype).view(codes.shape)
    if out is None:
        return values
    return out.copy_(values)


def quantization_error_bound(code: torch.Tensor) -> torch.Tensor:
    """Per-entry largest distance from ``code[i]`` of a value in [-1, 1] that rounds to entry ``i``
    (float64, 256 values). Times absmax, it bounds the round-trip error of each element.

    The outer entries also cover the ends of the range: the signed dynamic map has no -1.0, so
    its first entry takes every value down to -1. In a map whose smallest entry is 0 (unsigned)
    code 1 takes every positive value down to 0 (the zero point) and code 0 no positive one.
    """
    c = code.double()
    mid = midpoints(code).double()
    left = torch.cat([(c[:1] + 1.0).clamp(min=0.0), c[1:] - mid])
    right = torch.cat([mid - c[:-1], (1.0 - c[-1:]).clamp(min=0.0)])
    return torch.maximum(left, right)


__all__ = ["create_dynamic_map", "create_linear_map", "quantize_blockwise", "dequantize_blockwise",
           "check_block_size", "resolve_block_size", "num_blocks", "block_absmax", "block_max",
           "stored_absmax", "ABSMAX_DTYPE", "midpoints", "DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_8BIT_SIZE",
           "state_map", "MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE"]
