"""The 256-entry maps of ds_q8's 8-bit state: the dynamic tree maps of the paper, the "dynamic6" variant,
the small-float ("minifloat") maps of the default and linear maps for ablations; which of them a state
takes (:func:`state_map`), and which are coded from a float's bits instead of a table (:func:`codec_of`).
``functional.py`` says how a map codes a block."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

_map_cache: dict = {}


def create_dynamic_map(signed: bool = True, bits: int = 8) -> torch.Tensor:
    """The ``2**bits`` sorted float32 values of the dynamic tree map (256 for the 8-bit state).

    Each non-zero entry is ``10**e * f`` for a decimal exponent ``e`` in ``-(bits-2)..0`` and a
    linear fraction ``f`` in (0.1, 1): the more leading zero bits an index has, the smaller the
    exponent and the fewer bits remain for the fraction. Decade ``d`` below the top holds
    ``2**(bits - 2 - d)`` entries of each sign in the signed map, and twice that in the unsigned map,
    whose sign bit serves as one more fraction bit (:func:`tree_map`). Both maps contain 0 and 1.0.
    The signed 8-bit map holds 127 negative values, 0 and 128 positive values.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    key = ("dynamic", bool(signed), bits)
    if key not in _map_cache:
        _map_cache[key] = tree_map([2 ** (bits - 2 - d + (0 if signed else 1)) for d in range(bits - 1)], signed)
    return _map_cache[key].clone()


def tree_map(counts, signed: bool = True) -> torch.Tensor:
    """A sorted float32 map of the dynamic tree's structure with ``counts[d]`` entries in decade ``d``
    (``d = 0`` the top): the midpoints of ``counts[d] + 1`` evenly spaced points in [0.1, 1], times
    ``10**-d``, mirrored to negative values when ``signed``; plus 0 and 1.0. Entries are computed in
    float64 and rounded once to float32."""
    if not all(isinstance(k, int) and k >= 1 for k in counts):
        raise ValueError(f"counts must be integers >= 1 (entries per decade), got {list(counts)}")
    values = [0.0, 1.0]
    for d, k in enumerate(counts):
        scale = 10.0 ** (-d)
        for j in range(k):
            lo = 0.1 + 0.9 * j / k
            hi = 0.1 + 0.9 * (j + 1) / k
            v = scale * (lo + hi) / 2.0
            values += [v, -v] if signed else [v]
    return torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)


_device_maps: dict = {}


def state_map(kind: str, signed: bool, device) -> torch.Tensor:
    """The map of a state: ``kind`` "dynamic", "dynamic6", "minifloat" or "linear", signed or not, one tensor
    per device.

    The same tensor every time, so that the kernels' lookup tables, which are cached per map
    tensor, are built once."""
    key = (kind, bool(signed), str(device))
    m = _device_maps.get(key)
    if m is None:
        if kind == "linear":
            base = create_linear_map(signed)
        elif kind == "minifloat":
            base = create_minifloat_map(signed)
        elif kind == "dynamic6" and signed:
            base = create_dynamic6_map()
        else:  # "dynamic", and "dynamic6"'s unsigned map
            base = create_dynamic_map(signed)
        m = _device_maps[key] = base.to(device)
        _CANONICAL[id(m)] = (m, minifloat_codec(signed) if kind == "minifloat" else None)
    return m


#: the signed "dynamic6" map's positive entries per decade, from [0.1, 1] down to [1e-6, 1e-5]
DYNAMIC6_COUNTS = (72, 32, 14, 6, 2, 1)


def create_dynamic6_map() -> torch.Tensor:
    """The signed map of ``quantization="dynamic6"``: the dynamic tree map's structure over six decades
    instead of seven (:func:`tree_map` of :data:`DYNAMIC6_COUNTS`): 72 of the 127 positive entries in the
    top decade (the dynamic map: 64), 32 in the next, then 14, 6, 2, 1. Its smallest magnitude is 5.5e-6
    of the block maximum (the dynamic map: 5.5e-7). Within a 64-element block a first moment rarely sits
    that far below the block's largest; the entries given up there make the step between neighbouring
    entries from 0.1 to 1 of the maximum, where most first moments lie, 11% smaller. Measured, GPT-2's
    updates stay closer to 32-bit's (docs/history.md, "Requantization over 25 steps, and a map for the
    first moment")."""
    key = ("dynamic6", True, 8)
    if key not in _map_cache:
        _map_cache[key] = tree_map(DYNAMIC6_COUNTS, True)
    return _map_cache[key].clone()


#: the minifloat maps' exponent and mantissa bits: sign + E3M4 for signed states, E4M4 for unsigned ones
MINIFLOAT_BITS = {True: (3, 4), False: (4, 4)}


def minifloat_units(exp_bits: int, man_bits: int) -> torch.Tensor:
    """The ``2**(E + M)`` values of a small float format in which every code is finite, ascending, exact in
    float64: exponent field ``e`` and mantissa field ``f`` stand for ``(1 + f / 2**M) * 2**e``, and for
    ``(f / 2**M) * 2`` when ``e = 0`` (subnormals, 0 among them). The largest is ``(2 - 2**-M) * 2**(2**E - 1)``:
    248 for E3M4, 63488 for E4M4. Code ``c`` (``e = c >> M``) is the float whose bits are ``(c << (23 - M))
    + (127 << 23)`` when ``e >= 1``, and ``c * 2**(1 - M)`` when ``e = 0``."""
    f = torch.arange(2 ** man_bits, dtype=torch.float64) / 2 ** man_bits
    return torch.cat([f * 2.0] + [(1.0 + f) * 2.0 ** e for e in range(1, 2 ** exp_bits)])


def minifloat_magnitudes(exp_bits: int, man_bits: int) -> torch.Tensor:
    """:func:`minifloat_units` over the largest (the largest 1.0), in float64."""
    units = minifloat_units(exp_bits, man_bits)
    return units / units[-1]


def mirrored_map(mags: torch.Tensor) -> torch.Tensor:
    """A signed map from 128 ascending magnitudes, the first 0 and the last 1: the negatives from -1 up,
    one zero (entry 127, +0.0), the positives up to 1.0 (entry 254), and entry 255 one top spacing above
    1.0. Scaled values of a finite block are at most 1 (block maxima are stored rounded up), so entry
    255 is never coded; it is there so that the map is symmetric about entry 127 with every entry
    distinct, as the dynamic maps are, which is what the kernels' fast searches ask of a signed map."""
    if not (mags.numel() == 128 and float(mags[0]) == 0.0 and float(mags[-1]) == 1.0
            and bool((mags[1:] > mags[:-1]).all())):
        raise ValueError("a mirrored map needs 128 ascending magnitudes from 0 to 1")
    top = (2.0 * mags[-1] - mags[-2]).reshape(1)
    return (torch.cat([-mags.flip(0), mags[1:], top]) + 0.0).to(torch.float32)  # + 0.0: -0.0 becomes +0.0


def minifloat_map(exp_bits: int, man_bits: int, signed: bool) -> torch.Tensor:
    """The sorted float32 map of the small float format of :func:`minifloat_units`: each value times
    ``float32(1 / T)`` in float32, ``T`` the largest value, so that entries end at 1.0 and each is one
    rounding of its exact value (what the kernels compute from a code's bits). Unsigned: the ``2**(E + M)``
    values; signed: a sign bit and ``2**(E + M) = 128`` magnitudes, the negatives from -1 up, one zero
    (entry 127), the positives up to 1.0 (entry 254) and entry 255 the next value of the format above the
    largest, ``2**(2**E) / T`` (where a sign-magnitude format's second zero would be): the map is then
    symmetric about entry 127, every entry distinct."""
    if not (isinstance(exp_bits, int) and isinstance(man_bits, int) and exp_bits >= 1 and man_bits >= 0
            and exp_bits + man_bits == (7 if signed else 8)):
        raise ValueError(f"a {'signed' if signed else 'unsigned'} 8-bit minifloat map needs exponent + mantissa "
                         f"bits = {7 if signed else 8}, got E{exp_bits}M{man_bits}")
    key = ("minifloat", bool(signed), exp_bits, man_bits)
    if key not in _map_cache:
        units = minifloat_units(exp_bits, man_bits)
        inv_top = torch.tensor(1.0 / float(units[-1]), dtype=torch.float32)
        if signed:
            units = torch.cat([units, torch.tensor([2.0 ** (2 ** exp_bits)], dtype=torch.float64)])
        vals = units.to(torch.float32) * inv_top
        _map_cache[key] = torch.cat([-vals[1:128].flip(0), vals]) if signed else vals
    return _map_cache[key].clone()


def create_minifloat_map(signed: bool = True) -> torch.Tensor:
    """The maps of ``quantization="minifloat"``: sign + E3M4 for signed states (first moments), E4M4 for
    unsigned ones (second moments). 16 entries in every binade, from the block's maximum down to 8.1e-3
    of it (signed; then 15 subnormals down to 5.0e-4) or 3.1e-5 (unsigned; down to 2.0e-6): neighbouring
    entries at most 6.25% apart over that range, where "dynamic6"'s are 1.4% apart near the maximum,
    2.5% at half of it, 7.8% a decade below it and 18% two decades below. Adam's update divides each
    first moment by its own scale, so a moment a decade under its block's largest counts as much as the
    largest; over 25 steps of GPT-2 the updates on these maps stay closer to 32-bit's than on "dynamic6"
    (docs/history.md, "Minifloat maps"). Where a state's values sit within a decade of their block's
    maximum, the dynamic maps' top decade is the finer (Adagrad8bitBlock and RMSprop8bitBlock keep
    "dynamic6" by default for that). The kernels code these two maps from a float's bits, without tables
    (:class:`MinifloatCodec`)."""
    return minifloat_map(*MINIFLOAT_BITS[bool(signed)], signed)


class MinifloatCodec(NamedTuple):
    """How a minifloat map of :data:`MINIFLOAT_BITS` is coded from a float's bits (``functional.py``'s module
    doc). The format's values are taken with their top binade at [1, 2): code ``c`` (exponent field ``e = c >>
    4``) is ``(1 + f / 16) * 2**(e - bias)``, or ``f / 16 * 2**(1 - bias)`` when ``e = 0``, the largest ``top =
    1.9375``; a block's values times ``top / absmax`` lie in these units, and a code's entry in the map is its
    value times ``inv_top = float32(1 / top)`` (one float32 product)."""
    signed: bool
    bias: int        # 7 (E3M4) or 15 (E4M4)
    top: float       # 1.9375, the largest value
    inv_top: float   # float32(1 / 1.9375)


def minifloat_codec(signed: bool) -> MinifloatCodec:
    e, m = MINIFLOAT_BITS[bool(signed)]
    top = 2.0 - 2.0 ** -m
    return MinifloatCodec(bool(signed), 2 ** e - 1, top, float(torch.tensor(1.0 / top, dtype=torch.float32)))


_CANONICAL: dict = {}  # id of a state_map tensor -> (the tensor, its codec or None)


def codec_of(code: torch.Tensor) -> Optional[MinifloatCodec]:
    """The codec of a map that is one of the two minifloat maps of :data:`MINIFLOAT_BITS`, else None (a map
    coded through its table). The maps of :func:`state_map` are known by identity; any other tensor is
    compared by value (a device sync for a map on a GPU)."""
    hit = _CANONICAL.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    if code.dtype != torch.float32 or code.numel() != 256:
        return None
    for signed in (True, False):
        if torch.equal(code, create_minifloat_map(signed).to(code.device)):
            return minifloat_codec(signed)
    return None


def create_linear_map(signed: bool = True) -> torch.Tensor:
    """256 evenly spaced float32 values: [-1, 1] when signed, [0, 1] when not (for ablations)."""
    key = ("linear", bool(signed))
    if key not in _map_cache:
        lo = -1.0 if signed else 0.0
        _map_cache[key] = torch.linspace(lo, 1.0, 256, dtype=torch.float64).to(torch.float32)
    return _map_cache[key].clone()
