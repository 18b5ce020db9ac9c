"""Adam's two moments in 4 bits each: the format, written in plain PyTorch (the specification).

The format that ``docs/four-bit.md`` chose from measurement, which ``optim_bits=4`` stores (the
reference step, ``optim/path_four.py``, is written with these functions): kernels are tested against
it for identical codes, as the 8-bit kernels are against ``functional.py``.

Format
------
Both states of a parameter are cut into the 8-bit layout's blocks (``BLOCK_SIZE`` elements of the
flattened parameter; the last block may be shorter). Per block:

* **Second moment** ``v``: ``vmax = max(v)`` over the block, kept in float32 (a bfloat16 maximum could
  not move by the 0.1% a step that beta2 = 0.999 moves it, and 4-bit codes cannot either: see the doc).
  ``y = v * (1.0f / vmax)`` (``scale = 0`` for a block of zeros); the code is the number of entries of
  ``V_MIDPOINTS`` below ``y`` (a value on a midpoint goes to the lower entry). ``V_MAP`` holds 16
  values of ``sqrt(v / vmax)`` geometric from 0.05 to 1 (squared): the same relative step for every
  element, and no 0. A midpoint is where ``1/sqrt`` lies halfway between its two neighbours, so
  rounding leaves the update's size, not v, unbiased. Decoded: ``V_MAP[code] * vmax``.
* **First moment** ``m``, stored as ``r = m / sqrt(v_hat)`` with ``v_hat`` the second moment as it
  decodes (computed first), and ``r = 0`` where ``v_hat`` is 0 (every gradient was 0). Adam steps by
  this ratio, so every element's error scales with its own update, not with its block's largest first
  moment. ``absmax = bf16_up(max |r|)`` (``functional.stored_absmax``), ``y = r * (1.0f / absmax)``,
  the code the number of ``M_MIDPOINTS`` below ``y``. ``M_MAP`` is ``k / 7`` for ``k`` in -7..7: even
  levels with 0, so that an element without gradients keeps a first moment of exactly 0 (code 15 is
  never written). Decoded: ``M_MAP[code] * absmax * sqrt(v_hat)``.
* **Packing**: two codes a byte, by the element's index in its *parameter*: elements ``2j`` and
  ``2j + 1`` share byte ``j``, ``2j`` in the low nibble. A slice that starts at an odd index or ends
  before one has a nibble of 0 where the element it does not hold would be. So where a nibble lies
  never depends on where a partition edge falls: two ranks that split a byte each hold it with their
  own half, and their two bytes OR'ed are the unsharded byte.

Square roots are correctly rounded (``mathops.sqrt_rn``), as every kernel takes them.

Bytes per parameter and state: half a byte of code, plus 2 (first moment) or 4 (second moment) bytes a
block: 1.094 for both at blocks of 64 (the 8-bit state: 2.062).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import functional as F

BLOCK_SIZE = 64
#: sqrt(v / vmax) of the smallest entry of V_MAP
V_LOW = 0.05


def root_geometric_map(low: float) -> torch.Tensor:
    """16 float32 values of v, ascending, whose square roots run geometrically from ``low`` to 1."""
    roots = low ** (torch.arange(15, -1, -1, dtype=torch.float64) / 15)
    return (roots * roots).to(torch.float32)


def root_midpoints(v_map: torch.Tensor) -> torch.Tensor:
    """Decision boundaries of a second-moment map: where ``1/sqrt`` lies halfway between neighbours."""
    inv = v_map.double().rsqrt()
    return (4.0 / (inv[:-1] + inv[1:]) ** 2).to(torch.float32)


#: second moment: 16 float32 values, ascending, the largest 1.0
V_MAP = root_geometric_map(V_LOW)
V_MIDPOINTS = root_midpoints(V_MAP)
#: first moment (as m / sqrt(v)): 15 float32 values k / 7, ascending
M_MAP = (torch.arange(-7, 8, dtype=torch.float64) / 7).to(torch.float32)
M_MIDPOINTS = F.midpoints(M_MAP)
#: dtype of each block's maximum: the first moment's (bfloat16, rounded up) and the second's (float32)
ABSMAX_DTYPES = (F.ABSMAX_DTYPE, torch.float32)


class Adam4(NamedTuple):
    """One parameter's (or one rank's slice's) 4-bit Adam state: packed codes and per-block maxima."""
    m_codes: torch.Tensor  # uint8, ceil(n / 2)
    m_absmax: torch.Tensor  # bfloat16, one per block
    v_codes: torch.Tensor  # uint8, ceil(n / 2)
    v_max: torch.Tensor  # float32, one per block
    numel: int


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (``optim/mathops.py`` explains why not torch's)."""
    return x.double().sqrt_().to(torch.float32)


def packed_bytes(first: int, numel: int) -> int:
    """Bytes that hold the codes of ``numel`` elements from index ``first`` of their parameter."""
    return 0 if numel <= 0 else (first + numel + 1) // 2 - first // 2


def pack(codes: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Codes 0..15 (uint8, flat) of elements from index ``first`` of their parameter, two a byte
    (module doc); the nibbles of elements outside the slice are 0."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() == 0:
        return c
    lead, tail = first % 2, (first + c.numel()) % 2
    if lead or tail:
        c = torch.cat([c.new_zeros(lead), c, c.new_zeros(tail)])
    pairs = c.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: torch.Tensor, numel: int, first: int = 0) -> torch.Tensor:
    """The ``numel`` codes of :func:`pack`'s bytes (elements from index ``first`` of their parameter)."""
    p = packed.reshape(-1)
    lead = first % 2
    return torch.stack([p & 0x0F, p >> 4], dim=1).reshape(-1)[lead:lead + numel]


def encode_v(v: torch.Tensor, block_size: int, v_max: Optional[torch.Tensor] = None):
    """``(codes, v_max)`` of a second moment (flat float32, ``v >= 0``): ``v_max`` float32 per block,
    the blocks' maxima unless given (a block that a partition edge cuts: agreed across ranks)."""
    if v_max is None:
        v_max = F.block_max(v, block_size)
    return F.quantize_with_absmax(v, v_max, V_MAP.to(v.device), block_size, mid=V_MIDPOINTS.to(v.device)), v_max


def decode_v(codes: torch.Tensor, v_max: torch.Tensor, block_size: int) -> torch.Tensor:
    """The second moment (float32) of unpacked codes and their blocks' maxima."""
    return F.dequantize_flat(codes, v_max, V_MAP.to(codes.device), block_size)


def ratio(m: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """What the first moment is stored as: ``m / sqrt(v_hat)``, 0 where ``v_hat`` is 0."""
    root = sqrt_rn(v_hat)
    return torch.where(root > 0, m / root, torch.zeros_like(m))


def encode_m(m: torch.Tensor, v_hat: torch.Tensor, block_size: int, absmax: Optional[torch.Tensor] = None):
    """``(codes, absmax)`` of a first moment against its decoded second moment ``v_hat``; ``absmax``
    (bfloat16 per block) from the blocks unless given (stored form of an agreed maximum)."""
    r = ratio(m, v_hat)
    if absmax is None:
        absmax = F.block_absmax(r, block_size)
    return F.quantize_with_absmax(r, absmax, M_MAP.to(m.device), block_size, mid=M_MIDPOINTS.to(m.device)), absmax


def decode_m(codes: torch.Tensor, absmax: torch.Tensor, v_hat: torch.Tensor, block_size: int) -> torch.Tensor:
    """The first moment (float32) of unpacked codes, their blocks' maxima and the decoded ``v_hat``."""
    return F.dequantize_flat(codes, absmax, M_MAP.to(codes.device), block_size) * sqrt_rn(v_hat)


def encode(m: torch.Tensor, v: torch.Tensor, block_size: int = BLOCK_SIZE) -> Adam4:
    """The 4-bit state of float32 moments ``m`` and ``v`` (same shape, ``v >= 0``, finite) of a whole
    parameter."""
    m = m.reshape(-1).to(torch.float32)
    v = v.reshape(-1).to(torch.float32)
    n = m.numel()
    if v.numel() != n:
        raise ValueError(f"m and v must have as many elements, got {n} and {v.numel()}")
    v_idx, v_max = encode_v(v, block_size)
    m_idx, m_absmax = encode_m(m, decode_v(v_idx, v_max, block_size), block_size)
    return Adam4(pack(m_idx), m_absmax, pack(v_idx), v_max, n)


def decode(state: Adam4, block_size: int = BLOCK_SIZE):
    """``(m, v)`` as float32, flat, as the step reads them."""
    n = state.numel
    v_hat = decode_v(unpack(state.v_codes, n), state.v_max, block_size)
    return decode_m(unpack(state.m_codes, n), state.m_absmax, v_hat, block_size), v_hat


def state_bytes_per_param(numel: int, block_size: int = BLOCK_SIZE) -> float:
    """Bytes of both states per element of a parameter of ``numel`` elements."""
    blocks = F.num_blocks(numel, block_size)
    return (2 * math.ceil(numel / 2) + blocks * (2 + 4)) / numel


__all__ = ["BLOCK_SIZE", "root_geometric_map", "root_midpoints", "V_MAP", "V_MIDPOINTS", "M_MAP", "M_MIDPOINTS", "Adam4", "packed_bytes", "pack", "unpack",
           "encode_v", "decode_v", "ratio", "encode_m", "decode_m", "encode", "decode", "state_bytes_per_param"]
