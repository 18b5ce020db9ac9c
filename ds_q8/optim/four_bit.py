"""Storage of 4-bit state (``optim_bits=4``): Adam's two moments in ``format4.py``'s format, read and
written piece by piece over a :class:`~ds_q8.optim.layout.StateLayout` whose ``state_bits`` is 4.

State 0 (``exp_avg``) is stored as ``m / sqrt(v)`` on the first-moment map with bfloat16 block maxima,
state 1 (``exp_avg_sq``) on the zero-free second-moment map with float32 block maxima; both are packed
two codes a byte by the element's index in its parameter (``format4.pack``), and a nibble that no
element of this tensor fills is 0. The functions here take a
:class:`~ds_q8.optim.qstate.QuantizedState` and touch only its storage; where a block is cut by a
partition edge, its maxima come in agreed (``agreed_write``: two all-reduce MAX, the second moment's
first, because the first moment is stored against the decoded second).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import format4 as Q4
from .. import functional as F
from .layout import Piece, StateLayout

M, V = 0, 1  # the states' positions: exp_avg, exp_avg_sq


class Span(NamedTuple):
    """Where a range of a quantized piece keeps its state: elements ``[start, end)`` of the tensor,
    from index ``first`` of their parameter; bytes ``[b0, b1)`` of the codes; block maxima
    ``[a0, a1)``; blocks of ``bs`` elements (a shared piece: its own length, one maximum)."""
    start: int
    end: int
    first: int
    b0: int
    b1: int
    a0: int
    a1: int
    bs: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def span(layout: StateLayout, piece: Piece, start: Optional[int] = None, end: Optional[int] = None) -> Span:
    """The :class:`Span` of ``piece`` (or of its range ``[start, end)``, which starts a block)."""
    start = piece.start if start is None else start
    end = piece.end if end is None else end
    p0 = layout.piece_param_start(piece)
    first = p0 + start - piece.start
    b0 = piece.codes_start + first // 2 - p0 // 2
    b1 = b0 + Q4.packed_bytes(first, end - start)
    if piece.slot >= 0:
        return Span(start, end, first, b0, b1, piece.absmax_start, piece.absmax_start + 1, max(1, piece.numel))
    _, _, bs = layout.segment_blocks(piece.segment)
    a0 = piece.absmax_start + (start - piece.start) // bs
    a1 = piece.absmax_start + (end - piece.start + bs - 1) // bs
    return Span(start, end, first, b0, b1, a0, a1, bs)


def spans(layout: StateLayout, piece: Piece, chunk: int) -> List[Span]:
    """A piece in ranges of at most about ``chunk`` elements that start blocks (a shared piece: one)."""
    if piece.slot >= 0:
        return [span(layout, piece)]
    _, _, bs = layout.segment_blocks(piece.segment)
    step = max(bs, chunk // bs * bs)
    return [span(layout, piece, s, min(piece.end, s + step)) for s in range(piece.start, piece.end, step)]


def read(qs, sp: Span) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)``, float32, of a span, as the step reads them."""
    codes, absmax = qs.codes(), qs.absmax()
    n = sp.numel
    v = Q4.decode_v(Q4.unpack(codes[V][sp.b0:sp.b1], n, sp.first), absmax[V][sp.a0:sp.a1], sp.bs)
    m = Q4.decode_m(Q4.unpack(codes[M][sp.b0:sp.b1], n, sp.first), absmax[M][sp.a0:sp.a1], v, sp.bs)
    return m, v


def encode_v(v: torch.Tensor, sp: Span, v_max: Optional[torch.Tensor] = None):
    """``(codes, v_max, v_hat)`` of a span's new second moment (``v_max`` agreed where given)."""
    codes, v_max = Q4.encode_v(v, sp.bs, v_max)
    return codes, v_max, Q4.decode_v(codes, v_max, sp.bs)


def store(qs, sp: Span, v_codes: torch.Tensor, v_max: torch.Tensor, m: torch.Tensor, v_hat: torch.Tensor,
          m_absmax: Optional[torch.Tensor] = None) -> None:
    """Write a span: the second moment's codes and maxima, and the first moment coded against ``v_hat``
    (its maximum agreed where ``m_absmax`` is given)."""
    m_codes, m_absmax = Q4.encode_m(m, v_hat, sp.bs, m_absmax)
    codes, absmax = qs.codes(), qs.absmax()
    codes[V][sp.b0:sp.b1] = Q4.pack(v_codes, sp.first)
    codes[M][sp.b0:sp.b1] = Q4.pack(m_codes, sp.first)
    absmax[V][sp.a0:sp.a1] = v_max
    absmax[M][sp.a0:sp.a1] = m_absmax


def write(qs, sp: Span, m: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize a span of whole blocks from its own values."""
    v_codes, v_max, v_hat = encode_v(v, sp)
    store(qs, sp, v_codes, v_max, m, v_hat)


def quantized_pieces(layout: StateLayout) -> List[Piece]:
    """The quantized pieces (whole blocks and shared parts), in tensor order."""
    return sorted(layout.pieces8 + layout.shared8, key=lambda p: p.start)


def zero_first_moment(qs) -> None:
    """Code every first moment as 0 in fresh storage (code 7 of ``format4.M_MAP``; nibbles outside the
    tensor stay 0); the second moment's code 0 and maxima 0 need nothing."""
    layout = qs.layout
    zero_m = int(torch.searchsorted(Q4.M_MIDPOINTS, torch.zeros(1))[0])
    codes = qs.codes()
    for piece in quantized_pieces(layout):
        sp = span(layout, piece)
        codes[M][sp.b0:sp.b1] = Q4.pack(torch.full((sp.numel,), zero_m, dtype=torch.uint8), sp.first).to(codes[M].device)


def agreed_write(items: Sequence[tuple], comm, num_slots: Sequence[int]) -> None:
    """Quantize the shared spans of several tensors whose blocks partition edges cut, agreeing on each
    block's maxima across ranks: ``items`` are ``(qs, span, slot base, m, v)``, ``num_slots`` the slots
    each tensor reserves (the same on every rank). Two all-reduce MAX: the second moment's maxima, then
    (the second moment decoded with them) the first moment's, as ``m / sqrt(v)``."""
    total = sum(num_slots)
    device = items[0][3].device if items else "cpu"
    vec = torch.zeros(total, dtype=torch.float32, device=device)
    for qs, sp, slot, m, v in items:
        vec[slot:slot + 1] = v.abs().amax().reshape(1) if sp.numel else 0.0
    if comm is not None:
        comm.all_reduce_max(vec)
    coded = []
    for qs, sp, slot, m, v in items:
        v_codes, v_max, v_hat = encode_v(v, sp, vec[slot:slot + 1].clone())
        coded.append((v_codes, v_max, v_hat))
    rvec = torch.zeros(total, dtype=torch.float32, device=device)
    for (qs, sp, slot, m, v), (_, _, v_hat) in zip(items, coded):
        r = Q4.ratio(m, v_hat)
        rvec[slot:slot + 1] = r.abs().amax().reshape(1) if sp.numel else 0.0
    if comm is not None:
        comm.all_reduce_max(rvec)
    for (qs, sp, slot, m, v), (v_codes, v_max, v_hat) in zip(items, coded):
        store(qs, sp, v_codes, v_max, m, v_hat, F.stored_absmax(rvec[slot:slot + 1]))


def write_values(qs, values: List[torch.Tensor], shared: Optional[Dict[int, Tuple[float, float]]] = None) -> None:
    """Set both moments from tensor-long fp32 values (``QuantizedState.write``): the whole blocks from
    their own values; the cut blocks with maxima agreed across ranks (every rank calls this then), or
    from ``shared`` (slot -> (first moment's maximum of ``m / sqrt(v)``, second moment's maximum))."""
    layout = qs.layout
    m_all, v_all = values[M], values[V]
    for piece in layout.pieces8:
        sp = span(layout, piece)
        write(qs, sp, m_all[sp.start:sp.end], v_all[sp.start:sp.end])
    if not layout.sharded:
        return
    items = [(qs, span(layout, piece), piece.slot, m_all[piece.start:piece.end], v_all[piece.start:piece.end])
             for piece in layout.shared8]
    if shared is None:
        agreed_write(items, layout.comm, [layout.num_slots])
        return
    for _, sp, slot, m, v in items:
        r_max, v_max = shared[slot]
        v_codes, vm, v_hat = encode_v(v, sp, torch.tensor([v_max], dtype=torch.float32, device=v.device))
        store(qs, sp, v_codes, vm, m, v_hat, F.stored_absmax(torch.tensor([r_max], dtype=torch.float32,
                                                                          device=v.device)))


def whole_blocks_of(seg, bs: int, param_values: Sequence[torch.Tensor], block: int):
    """A cut block's maxima from its whole parameter's values: (max of ``m / sqrt(v)``, max of v)."""
    lo, hi = block * bs, min((block + 1) * bs, seg.param_numel)
    m, v = (t[lo:hi] for t in param_values)
    v_codes, v_max = Q4.encode_v(v, hi - lo, v.abs().amax().reshape(1))
    v_hat = Q4.decode_v(v_codes, v_max, hi - lo)
    return float(Q4.ratio(m, v_hat).abs().amax()), float(v_max[0])


def unpacked_codes(qs, si: int) -> List[torch.Tensor]:
    """Each state's codes over segment ``si``, one uint8 an element (what universal checkpoints hold)."""
    layout = qs.layout
    seg = layout.segments[si]
    c0 = layout.segment_codes[si]
    nb = layout.segment_code_count(seg)
    return [Q4.unpack(c[c0:c0 + nb], seg.numel, seg.param_start) for c in qs.codes()]


def restore_codes(qs, si: int, codes: Sequence[torch.Tensor]) -> None:
    """Set segment ``si``'s packed codes from its whole parameter's per-element codes."""
    layout = qs.layout
    seg = layout.segments[si]
    c0 = layout.segment_codes[si]
    nb = layout.segment_code_count(seg)
    for c, whole in zip(qs.codes(), codes):
        c[c0:c0 + nb] = Q4.pack(whole[seg.param_start:seg.param_end], seg.param_start).to(c.device)


__all__ = ["Span", "span", "spans", "read", "encode_v", "store", "write", "quantized_pieces", "zero_first_moment", "agreed_write",
           "write_values", "whole_blocks_of", "unpacked_codes", "restore_codes"]
