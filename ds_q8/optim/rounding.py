"""Stochastic rounding of 16-bit parameter writes and of state requantization: the random bits the
kernels reproduce.

With bf16 (or fp16) master weights an update smaller than half a unit in the last place rounds
away, every step, and training stalls. Written with stochastic rounding, a value takes the 16-bit
neighbour above it with probability equal to how far it lies toward that neighbour: right on
average, so small updates accumulate.

The random bits of an element are ``(key ^ index) * DRAW_MUL`` modulo 2^32, of which every use takes
the top bits: ``index`` is the element's position in its original parameter (below 2^32) and ``key``
folds in the seed, the step count and the parameter's identity (its group and its position among the
group's trainable parameters) through ``mix32``, the murmur3 finalizer, so the bits do not depend on
how ZeRO partitioned the parameter, and a resumed run draws what the uninterrupted one would. A key
is uniform and drawn afresh every step, so ``key ^ index`` is too, and multiplying by an odd number
permutes the 32-bit values: each element's bits are uniform and independent from step to step, which
is all that rounding that is right on average needs. Within one step the elements' draws lie on a
lattice (a shifted golden-ratio sequence over ``index``), spread more evenly than independent draws.
One multiplication per element instead of the finalizer's two and three shifts is what it saves.

The requantization of state ``k`` draws with its own key, :func:`state_key` of the parameter's, and its
own multiplier: ``(key_k + index) * STATE_MULS[k]`` (:func:`state_bits`). Over consecutive elements these
bits are a Weyl sequence (each the one before plus the multiplier), which a kernel computes with one
addition per element, and which spreads the draws of a block evenly; a fresh key each step makes every
element's draw uniform and independent from step to step, and the states' different multipliers keep
the draws of one element's states apart. (``ds_q8.functional.quantize_with_absmax`` says how the bits
pick a code.) The C++ and CUDA kernels implement the same functions in ``csrc/includes/q8_common.h``
(``q8_sr_bits``, ``q8_*_from_float_sr``, ``q8_state_key``, ``q8_state_bits``).
"""
from __future__ import annotations

from typing import Union

import torch

_M32 = 0xFFFFFFFF


def mix32(h: int) -> int:
    """The murmur3 32-bit finalizer on a Python int."""
    h &= _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def step_key(seed: int, step: int) -> int:
    """The part of the key shared by every parameter at one step."""
    return mix32(mix32(seed) ^ (step & _M32))


def sr_key(step_part: int, group_index: int, param_index: int) -> int:
    """The key of one parameter's random bits at one step (``step_part`` from :func:`step_key`)."""
    return mix32(mix32(step_part ^ (group_index & _M32)) ^ (param_index & _M32))


def state_key(key: int, state: int) -> int:
    """The key of the random bits that requantize state ``state`` (0 or 1) of the parameter whose key is
    ``key`` (:func:`sr_key`): drawn apart from the parameter's own bits and from the other state's."""
    return mix32(key ^ ((0x9E3779B9 * (state + 1)) & _M32))


#: the multiplier of an element's random bits: 2^32 / the golden ratio, rounded to odd
DRAW_MUL = 0x9E3779B9
#: the multipliers of the states' random bits: 2^32 times the fractional parts of the golden ratio, of the
#: square root of 2 and of the square root of 3, rounded to odd
STATE_MULS = (0x9E3779B9, 0x6A09E667, 0xBB67AE85)


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for int64 tensors holding 32-bit values, without int64 overflow."""
    lo, hi = a & 0xFFFF, a >> 16
    return (lo * b + (((hi * b) & 0xFFFF) << 16)) & _M32


def mix32_t(h: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on an int64 tensor of 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(key: Union[int, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element (int64 tensor): ``(key ^ index) * DRAW_MUL`` modulo 2^32, to be read
    from the top (module doc)."""
    k = key if isinstance(key, int) else key.to(torch.int64)
    return _mul32((index.to(torch.int64) & _M32) ^ k, DRAW_MUL)


def state_bits(key: Union[int, torch.Tensor], index: torch.Tensor, state: int) -> torch.Tensor:
    """32 random bits per element (int64 tensor) for requantizing state ``state``: ``(key + index) *
    STATE_MULS[state]`` modulo 2^32, ``key`` the state's (:func:`state_key`; or one per element), to be read from
    the top (module doc)."""
    k = key if isinstance(key, int) else key.to(torch.int64)
    return _mul32(((index.to(torch.int64) & _M32) + k) & _M32, STATE_MULS[state])


def _bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


def to_bf16_stochastic(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 with stochastic rounding: the top 16 random bits added below the kept ones.
    Inf and NaN round as to nearest."""
    u = _bits_of(x)
    special = (u & 0x7F800000) == 0x7F800000
    top = ((u + (r >> 16)) >> 16) << 16
    top = torch.where(top >= 1 << 31, top - (1 << 32), top).to(torch.int32)  # back to a signed bit pattern
    out = top.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(special, x.to(torch.bfloat16), out)


def to_fp16_stochastic(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 with stochastic rounding: the neighbours below and above |x| and 24 random
    bits compared with the exact fraction of the step between them. |x| >= 65504, Inf and NaN
    round as to nearest."""
    a = x.abs()
    h = a.to(torch.float16).view(torch.int16).to(torch.int32)
    h = h - (h.to(torch.int16).view(torch.float16).to(torch.float32) > a).to(torch.int32)  # toward zero
    lo = h.to(torch.int16).view(torch.float16).to(torch.float32)
    step = (h + 1).to(torch.int16).view(torch.float16).to(torch.float32) - lo
    frac = (a - lo) / step
    draw = (r >> 8).to(torch.float32) * 5.9604644775390625e-08
    h = h + (draw < frac).to(torch.int32)
    out = h.to(torch.int16).view(torch.float16)
    out = torch.where(torch.signbit(x), -out, out)
    return torch.where(a < 65504.0, out, x.to(torch.float16))


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, key: Union[int, torch.Tensor],
                     index: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` written as ``dtype`` (bf16 or fp16) with stochastic rounding; ``index`` holds
    each element's position in its original parameter, ``key`` the parameter's key (or one per element)."""
    r = random_bits(key, index)
    if dtype == torch.bfloat16:
        return to_bf16_stochastic(x, r)
    if dtype == torch.float16:
        return to_fp16_stochastic(x, r)
    return x.to(dtype)


# ---------------------------------------------------------------------------- the correction byte
# With ``correction_byte=True`` a bf16 parameter keeps, beside its 16 bits, a signed byte of what
# rounding to bf16 dropped: together they are a 24-bit float (fp32 with the low 8 mantissa bits zero),
# so that an update of down to 1/256 of a bf16 unit is kept, deterministically. In bit patterns: the
# 24-bit value's pattern is ``(b << 16) + (c << 8)``, where ``b`` is the bf16 pattern and ``c`` in
# [-128, 127] the byte (``c`` counts toward larger magnitude for either sign, as patterns do). Splitting
# an fp32 value rounds its pattern to a multiple of 2^8 and then to a multiple of 2^16, each half away
# from zero in magnitude, with integer additions: the CPU and CUDA kernels (``q8_bf16_split`` and
# ``q8_bf16_join`` in ``csrc/includes/q8_common.h``) do the same operations. Inf and NaN keep a zero byte.

def split_bf16(x: torch.Tensor):
    """float32 ``x`` as (bfloat16, int8 correction): the 24-bit value nearest ``x``, split."""
    u = _bits_of(x)
    special = (u & 0x7F800000) == 0x7F800000
    r = (u + 0x80) & 0xFFFFFF00  # the 24-bit pattern (a carry into the exponent rounds up a binade)
    b = (r + 0x8000) >> 16
    c = (r - (b << 16)) >> 8  # in [-128, 127]; an arithmetic shift of a signed int64
    b = torch.where(special, x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF, b)
    c = torch.where(special | ((b & 0x7F80) == 0x7F80), torch.zeros_like(c), c)
    b = torch.where(b >= 1 << 15, b - (1 << 16), b).to(torch.int16).view(torch.bfloat16)
    return b, c.to(torch.int8)


def join_bf16(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The float32 value of bfloat16 ``b`` with its int8 correction ``c`` (Inf and NaN as they are)."""
    top = (b.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    special = (top & 0x7F800000) == 0x7F800000
    u = torch.where(special, top, top + (c.to(torch.int64) << 8))
    u = torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32)
    return u.view(torch.float32)


__all__ = ["split_bf16", "join_bf16", "mix32", "step_key", "sr_key", "state_key", "random_bits", "state_bits", "STATE_MULS", "round_stochastic", "to_bf16_stochastic",
           "to_fp16_stochastic"]
