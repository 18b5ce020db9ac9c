"""Where each element of an optimized tensor comes from, and how its state is stored.

An optimizer steps *tensors*: an ordinary parameter, or under ZeRO a flat partition that holds
slices of many parameters. A :class:`StateLayout` describes one such tensor as *segments*: the
range ``[start, start + numel)`` of the tensor holds elements ``[param_start, param_start + numel)``
of original parameter ``param_index`` (of ``param_numel`` elements). Whether a segment keeps 8-bit
or fp32 state is decided per original parameter, never from the tensor's size.

Quantization blocks belong to parameters, not to tensors: block ``k`` of a parameter covers its
elements ``[k * block_size, (k + 1) * block_size)`` wherever a partition edge falls. A block that
a partition edge cuts is *shared*: two (or more) ranks hold parts of it, each keeps a copy of its
absmax, and the ranks agree on that absmax through one all-reduce MAX per step (the layout's
``comm``). Each parameter's codes and block maxima are therefore those the unsharded optimizer
holds, at any world size.

State storage of a tensor, per state ``i`` (from 1), as ``qstate.py`` keeps it:
  * ``state{i}``: uint8 codes of the 8-bit segments, packed in tensor order (shaped like the
    tensor when one 8-bit segment covers all of it);
  * ``absmax{i}``: bfloat16 block maxima of those segments, each segment's blocks in order
    (a shared block is stored by every rank that holds part of it);
  * ``state{i}_fp32``: float32 values of the fp32 segments, packed in tensor order (shaped like
    the tensor when one fp32 segment covers all of it).
Padding (elements no segment covers, e.g. the end of ZeRO's last partition) has no state.

With ``state_bits=4`` (``optim_bits=4``, Adam's two moments in ``format4.py``'s format) a segment's codes
are packed two a byte by the element's index in its parameter (``format4.pack``), so ``state{i}``
holds bytes and every offset into it (``segment_codes``, a piece's ``codes_start``) counts bytes; each
segment's bytes start a byte of their own. ``absmax1`` is bfloat16 (the first moment's), ``absmax2``
float32 (the second moment's maxima).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch


class Segment(NamedTuple):
    """``numel`` elements at ``start`` of the tensor are elements ``param_start..`` of one parameter."""
    start: int
    numel: int
    param_index: int
    param_start: int
    param_numel: int
    eight_bit: bool
    name: Optional[str] = None

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def param_end(self) -> int:
        return self.param_start + self.numel


class Piece(NamedTuple):
    """A range of the tensor stepped as one unit, with where its state lives.

    8-bit pieces: ``codes_start`` indexes the packed codes, ``absmax_start``/``absmax_count``
    the block maxima; the piece starts on a block boundary of its parameter, so a kernel that
    starts a block at the piece's first element reproduces the parameter's blocks. A *shared*
    piece is the local part of one block that other ranks also hold; ``slot`` is that block's
    position in the all-reduce vector. fp32 pieces: ``codes_start`` indexes the packed fp32 values.
    """
    start: int
    end: int
    codes_start: int
    absmax_start: int
    absmax_count: int
    segment: int
    slot: int = -1

    @property
    def numel(self) -> int:
        return self.end - self.start


class Comm:
    """What a sharded layout needs from its process group: element-wise MAX and SUM across ranks.

    ``ds_q8.integration.zero_layout`` supplies one backed by ``torch.distributed``; anything with
    these two methods (acting in place) will do.
    """

    def all_reduce_max(self, t: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def all_reduce_sum(self, t: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def segment_block_size(block_size: Optional[int], param_numel: int) -> int:
    """The block length of a parameter's state: ``block_size``, or the whole parameter when None."""
    return max(1, param_numel) if block_size is None else block_size


def shared_blocks(segments: Sequence[Segment], block_size: Optional[int]) -> List[Tuple[int, int]]:
    """``(param_index, block)`` of every block that this tensor holds only part of (8-bit segments)."""
    out = []
    for seg in segments:
        if not seg.eight_bit or seg.numel == 0:
            continue
        bs = segment_block_size(block_size, seg.param_numel)
        first, last = seg.param_start // bs, (seg.param_end - 1) // bs
        for b in sorted({first, last}):
            lo, hi = b * bs, min((b + 1) * bs, seg.param_numel)
            if seg.param_start > lo or seg.param_end < hi:
                out.append((seg.param_index, b))
    return out


class StateLayout:
    """The segments of one optimized tensor and the storage of their state (see the module doc)."""

    def __init__(self, shape, segments: Sequence[Segment], block_size: Optional[int],
                 comm: Optional[Comm] = None, slots: Optional[Dict[Tuple[int, int], int]] = None,
                 num_slots: int = 0, num_params: Optional[int] = None, group_index: int = 0, param_shapes: Optional[Sequence[tuple]] = None,
                 state_bits: int = 8):
        if state_bits not in (4, 8):
            raise ValueError(f"state_bits must be 4 or 8, got {state_bits!r}")
        #: bits of each quantized state's codes: 8, or 4 (two codes a byte, ``format4.py``)
        self.state_bits = int(state_bits)
        self.shape = tuple(shape)
        self.numel = 1
        for d in self.shape:
            self.numel *= int(d)
        self.segments: Tuple[Segment, ...] = tuple(sorted(segments, key=lambda s: s.start))
        self.block_size = block_size
        self.comm = comm
        self.num_slots = int(num_slots)
        #: that group's index; with each segment's ``param_index`` (its parameter's position among the
        #: group's trainable parameters) it names the parameter in stochastic rounding's random bits
        self.group_index = int(group_index)
        #: how many parameters the tensor was built from (the same on every rank: per-parameter
        #: sums such as LAMB's norms are all-reduced as vectors of this length)
        self.num_params = int(num_params) if num_params is not None else 1 + max(
            (s.param_index for s in self.segments), default=-1)
        #: each original parameter's shape, by ``param_index`` (None: unknown; an ordinary parameter's
        #: is the tensor's). Whole-matrix rules (Muon) need it to see a partition's slices as matrices;
        #: not part of :meth:`describe`, so saved layouts are unchanged.
        self.param_shapes = None if param_shapes is None else tuple(tuple(int(d) for d in s) for s in param_shapes)
        self._check_segments()
        self._cut(block_size, slots)
        #: whether the state has codes (``state{i}``, ``absmax{i}``) and fp32 values (``state{i}_fp32``)
        self.has8 = any(s.eight_bit for s in self.segments)
        self.has32 = any(not s.eight_bit for s in self.segments)
        #: one 8-bit segment covering the whole tensor from its parameter's start: state shaped like the tensor
        self.whole8 = (len(self.segments) == 1 and self.segments[0].eight_bit and self.num_codes == self.numel
                       and not self.shared8 and self.state_bits == 8)
        self.whole32 = len(self.segments) == 1 and not self.segments[0].eight_bit and self.num_fp32 == self.numel

    def _check_segments(self) -> None:
        last_end = 0
        for s in self.segments:
            if s.start < last_end or s.end > self.numel or s.numel < 0:
                raise ValueError(f"segments overlap or leave the tensor of {self.numel} elements: {self.segments}")
            if s.param_start < 0 or s.param_end > s.param_numel:
                raise ValueError(f"segment {s} reaches outside its parameter of {s.param_numel} elements")
            last_end = s.end

    def _cut(self, block_size: Optional[int], slots: Optional[Dict[Tuple[int, int], int]]) -> None:
        """Cut the segments into pieces: whole blocks (``pieces8``), the parts of blocks that partition
        edges cut (``shared8``, each with its slot) and fp32 pieces, with each segment's storage offsets."""
        self.pieces8: List[Piece] = []
        self.shared8: List[Piece] = []
        self.pieces32: List[Piece] = []
        self.segment_codes: List[int] = []   # per segment: offset in the packed codes or fp32 values
        self.segment_absmax: List[int] = []  # per segment: offset of its first block maximum (8-bit)
        n8 = n32 = nb = 0
        for si, seg in enumerate(self.segments):
            if not seg.eight_bit:
                self.segment_codes.append(n32)
                self.segment_absmax.append(-1)
                if seg.numel:
                    self.pieces32.append(Piece(seg.start, seg.end, n32, 0, 0, si))
                n32 += seg.numel
                continue
            self.segment_codes.append(n8)
            self.segment_absmax.append(nb)
            if seg.numel == 0:
                continue
            bs = segment_block_size(block_size, seg.param_numel)
            first, last = seg.param_start // bs, (seg.param_end - 1) // bs
            whole_lo, whole_hi = first, last
            for b in sorted({first, last}):
                lo, hi = b * bs, min((b + 1) * bs, seg.param_numel)
                if seg.param_start <= lo and seg.param_end >= hi:
                    continue
                if slots is None or (seg.param_index, b) not in slots:
                    raise ValueError(f"block {b} of parameter {seg.param_index} is cut by a partition edge, "
                                     "but the layout was given no slot to agree on its absmax across ranks")
                a, z = max(lo, seg.param_start), min(hi, seg.param_end)
                self.shared8.append(Piece(seg.start + a - seg.param_start, seg.start + z - seg.param_start,
                                          n8 + self._code_offset(seg, a), nb + b - first, 1, si,
                                          slots[(seg.param_index, b)]))
                if b == first:
                    whole_lo = first + 1
                if b == last:
                    whole_hi = last - 1
            if whole_lo <= whole_hi:
                a, z = whole_lo * bs, min((whole_hi + 1) * bs, seg.param_numel)
                self.pieces8.append(Piece(seg.start + a - seg.param_start, seg.start + z - seg.param_start,
                                          n8 + self._code_offset(seg, a), nb + whole_lo - first,
                                          whole_hi - whole_lo + 1, si))
            n8 += self.segment_code_count(seg)
            nb += last - first + 1
        self.pieces8.sort(key=lambda p: p.start)
        self.shared8.sort(key=lambda p: p.start)
        self.num_codes, self.num_blocks, self.num_fp32 = n8, nb, n32

    def segment_code_count(self, seg: Segment) -> int:
        """Entries of ``state{i}`` a quantized segment takes: one a code, or bytes of two (4 bits)."""
        if self.state_bits == 8:
            return seg.numel
        return 0 if seg.numel == 0 else (seg.param_end + 1) // 2 - seg.param_start // 2

    def _code_offset(self, seg: Segment, param_index: int) -> int:
        """Offset, within its segment's codes, of the entry that holds element ``param_index``."""
        if self.state_bits == 8:
            return param_index - seg.param_start
        return param_index // 2 - seg.param_start // 2

    def piece_code_count(self, piece: Piece) -> int:
        """Entries of ``state{i}`` a quantized piece's codes take (bytes at 4 bits: both halves of a
        byte at its ends, when the piece holds one)."""
        if self.state_bits == 8:
            return piece.numel
        first = self.piece_param_start(piece)
        return 0 if piece.numel == 0 else (first + piece.numel + 1) // 2 - first // 2

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_parameter(cls, p: torch.Tensor, eight_bit: bool, block_size: Optional[int], name: Optional[str] = None,
                      param_index: int = 0, group_index: int = 0, num_params: Optional[int] = None,
                      state_bits: int = 8) -> "StateLayout":
        """An ordinary parameter: one segment, the whole of it."""
        n = p.numel()
        return cls(p.shape, [Segment(0, n, param_index, 0, n, eight_bit, name)], block_size,
                   num_params=num_params, group_index=group_index, state_bits=state_bits)

    @property
    def sharded(self) -> bool:
        return self.num_slots > 0

    def state_shapes(self) -> Tuple[tuple, tuple]:
        """Shapes of ``state{i}`` (codes) and ``state{i}_fp32`` for this tensor."""
        codes = self.shape if self.whole8 else (self.num_codes,)
        fp32 = self.shape if self.whole32 else (self.num_fp32,)
        return codes, fp32

    def describe(self) -> dict:
        """A plain-data copy (ints, bools, strings) for checkpoints and offline tools."""
        out = {"shape": list(self.shape), "block_size": self.block_size,
               "segments": [list(s) for s in self.segments]}
        if self.state_bits != 8:  # 8-bit layouts are described as they always were
            out["state_bits"] = self.state_bits
        return out

    def same_as(self, desc: dict) -> bool:
        """Whether a saved layout describes the same slices of the same parameters as this one.

        Compared: where each segment lies in the tensor and in its parameter, the parameter's size, the
        8/32-bit choice and, where both sides have one, the parameter's name (not its position, which
        only names it: an optimizer over the same tensors in another order still fits)."""
        if list(desc.get("shape", [])) != list(self.shape) or desc.get("block_size") != self.block_size:
            return False
        if int(desc.get("state_bits", 8)) != self.state_bits:
            return False
        saved = [Segment(*s) for s in desc.get("segments", [])]
        if len(saved) != len(self.segments):
            return False
        for a, b in zip(saved, self.segments):
            if (a.start, a.numel, a.param_start, a.param_numel, bool(a.eight_bit)) != \
                    (b.start, b.numel, b.param_start, b.param_numel, bool(b.eight_bit)):
                return False
            if a.name is not None and b.name is not None and a.name != b.name:
                return False
        return True

    @staticmethod
    def segments_of(desc: dict) -> List[Segment]:
        return [Segment(*s) for s in desc["segments"]]

    @classmethod
    def from_description(cls, desc: dict) -> "StateLayout":
        """A saved layout, for reading a checkpoint offline (no ranks to agree with)."""
        segments = cls.segments_of(desc)
        cut = sorted(set(shared_blocks(segments, desc["block_size"])))
        return cls(desc["shape"], segments, desc["block_size"], slots={b: i for i, b in enumerate(cut)},
                   state_bits=int(desc.get("state_bits", 8)))

    # ------------------------------------------------------------------ per segment
    def segment_blocks(self, si: int) -> Tuple[int, int, int]:
        """(first block, number of blocks, block size) of 8-bit segment ``si`` within its parameter."""
        seg = self.segments[si]
        bs = segment_block_size(self.block_size, seg.param_numel)
        if seg.numel == 0:
            return seg.param_start // bs, 0, bs
        first, last = seg.param_start // bs, (seg.param_end - 1) // bs
        return first, last - first + 1, bs

    def pieces_of(self, si: int) -> List[Piece]:
        """The pieces of segment ``si`` in tensor order."""
        by_segment = self.__dict__.get("_by_segment")
        if by_segment is None:
            by_segment = [[] for _ in self.segments]
            for piece in self.pieces8 + self.shared8 + self.pieces32:
                by_segment[piece.segment].append(piece)
            for lst in by_segment:
                lst.sort(key=lambda p: p.start)
            self._by_segment = by_segment
        return by_segment[si]

    @staticmethod
    def param_views(p: torch.Tensor) -> torch.Tensor:
        """The optimized tensor as a flat view (pieces slice it)."""
        return p.detach().view(-1)

    def splits(self) -> Tuple[List[int], List[int], List[int], List[int]]:
        """Sizes that cut the whole tensor into its pieces and the gaps between them, and where the
        8-bit, fp32 and shared pieces fall in that cut: one ``split`` then gives every piece's view."""
        cached = self.__dict__.get("_splits")
        if cached is not None:
            return cached
        marks = [(p.start, p.end, 0, i) for i, p in enumerate(self.pieces8)]
        marks += [(p.start, p.end, 1, i) for i, p in enumerate(self.pieces32)]
        marks += [(p.start, p.end, 2, i) for i, p in enumerate(self.shared8)]
        sizes, where, pos = [], ([0] * len(self.pieces8), [0] * len(self.pieces32), [0] * len(self.shared8)), 0
        for start, end, kind, i in sorted(marks):
            if start > pos:
                sizes.append(start - pos)
            where[kind][i] = len(sizes)
            sizes.append(end - start)
            pos = end
        if pos < self.numel:
            sizes.append(self.numel - pos)
        self._splits = (sizes,) + where
        return self._splits

    def piece_param_start(self, piece: Piece) -> int:
        """Index, in its original parameter, of a piece's first element."""
        seg = self.segments[piece.segment]
        return seg.param_start + piece.start - seg.start

    def shared_index(self, device, which: Optional[List[int]] = None):
        """Index tensors over the shared pieces (all, or those listed in ``which``): each element's
        position in the tensor and in the packed codes, each piece's absmax position, each element's
        piece (owner), each piece's slot, and each element's index in its original parameter.
        Made once per device for all pieces."""
        key = ("_shared_index", str(device))
        if which is None and key in self.__dict__:
            return self.__dict__[key]
        pieces = self.shared8 if which is None else [self.shared8[j] for j in which]
        elem = torch.cat([torch.arange(p.start, p.end) for p in pieces])
        code_at = torch.cat([torch.arange(p.codes_start, p.codes_start + p.numel) for p in pieces])
        absmax_at = torch.tensor([p.absmax_start for p in pieces], dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor([p.numel for p in pieces]))
        slots = torch.tensor([p.slot for p in pieces], dtype=torch.long)
        in_param = torch.cat([torch.arange(self.piece_param_start(p), self.piece_param_start(p) + p.numel)
                              for p in pieces])
        out = tuple(t.to(device) for t in (elem, code_at, absmax_at, owner, slots, in_param))
        if which is None:
            self.__dict__[key] = out
        return out

    def find_param(self, param_index: int) -> Optional[int]:
        """Index of the segment holding part of parameter ``param_index``, or None."""
        for si, seg in enumerate(self.segments):
            if seg.param_index == param_index and seg.numel > 0:
                return si
        return None


__all__ = ["Segment", "Piece", "Comm", "StateLayout", "shared_blocks", "segment_block_size"]
