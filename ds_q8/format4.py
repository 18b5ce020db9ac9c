"""Adam's two moments in 4 bits each: the format, written in plain PyTorch (the specification).

Not an optimizer option yet: this module fixes the format that ``docs/four-bit.md`` chose from
measurement, so that kernels can be written against it and tested for identical codes, as the 8-bit
kernels are against ``functional.py``.

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
* **Packing**: two codes a byte, the element at an even offset from the start of what is packed in the
  low nibble; an odd count ends with a high nibble of 0. The offset counts from the first element a
  rank holds, so a partition edge never splits a byte between two ranks: ranks hold the same codes,
  packed from their own edge.

Bytes per parameter and state: half a byte of code, plus 2 (first moment) or 4 (second moment) bytes a
block: 1.094 for both at blocks of 64 (the 8-bit state: 2.062).
"""
from __future__ import annotations

import math
from typing import NamedTuple

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


class Adam4(NamedTuple):
    """One parameter's (or one rank's slice's) 4-bit Adam state: packed codes and per-block maxima."""
    m_codes: torch.Tensor  # uint8, ceil(n / 2)
    m_absmax: torch.Tensor  # bfloat16, one per block
    v_codes: torch.Tensor  # uint8, ceil(n / 2)
    v_max: torch.Tensor  # float32, one per block
    numel: int


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (uint8, flat) two a byte: even offsets in the low nibble."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    pairs = c.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` codes of :func:`pack`'s bytes."""
    p = packed.reshape(-1)
    return torch.stack([p & 0x0F, p >> 4], dim=1).reshape(-1)[:numel]


def encode(m: torch.Tensor, v: torch.Tensor, block_size: int = BLOCK_SIZE) -> Adam4:
    """The 4-bit state of float32 moments ``m`` and ``v`` (same shape, ``v >= 0``, finite)."""
    m = m.reshape(-1).to(torch.float32)
    v = v.reshape(-1).to(torch.float32)
    n = m.numel()
    if v.numel() != n:
        raise ValueError(f"m and v must have as many elements, got {n} and {v.numel()}")
    v_map, m_map = V_MAP.to(v.device), M_MAP.to(m.device)
    v_max = F.block_max(v, block_size)
    v_idx = F.quantize_with_absmax(v, v_max, v_map, block_size, mid=V_MIDPOINTS.to(v.device))
    root = F.dequantize_flat(v_idx, v_max, v_map, block_size).sqrt()
    r = torch.where(root > 0, m / root, torch.zeros_like(m))
    m_absmax = F.block_absmax(r, block_size)
    m_idx = F.quantize_with_absmax(r, m_absmax, m_map, block_size, mid=M_MIDPOINTS.to(m.device))
    return Adam4(pack(m_idx), m_absmax, pack(v_idx), v_max, n)


def decode(state: Adam4, block_size: int = BLOCK_SIZE):
    """``(m, v)`` as float32, flat, as the step reads them."""
    n = state.numel
    v_hat = F.dequantize_flat(unpack(state.v_codes, n), state.v_max, V_MAP.to(state.v_codes.device), block_size)
    r_hat = F.dequantize_flat(unpack(state.m_codes, n), state.m_absmax, M_MAP.to(state.m_codes.device), block_size)
    return r_hat * v_hat.sqrt(), v_hat


def state_bytes_per_param(numel: int, block_size: int = BLOCK_SIZE) -> float:
    """Bytes of both states per element of a parameter of ``numel`` elements."""
    blocks = F.num_blocks(numel, block_size)
    return (2 * math.ceil(numel / 2) + blocks * (2 + 4)) / numel


__all__ = ["BLOCK_SIZE", "root_geometric_map", "root_midpoints", "V_MAP", "V_MIDPOINTS", "M_MAP", "M_MIDPOINTS", "Adam4", "pack", "unpack", "encode",
           "decode", "state_bytes_per_param"]
