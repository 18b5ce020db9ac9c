"""How the quantized segments of a tensor's state are coded, one codec per state width: :class:`EightBit`
(a byte an element, each state on its own 256-entry map against bfloat16 block maxima) and
:class:`FourBit` (``optim_bits=4``: Adam's two moments in ``format4.py``'s format, two codes a byte).
:class:`~ds_q8.optim.qstate.QuantizedState` hands its quantized segments to the codec of its layout's
``state_bits`` (:func:`codec_for`); the memory estimate and the checkpoint code ask the same codec for
the bytes and dtypes a state takes. The fp32 segments are the state's own. The codecs work on a
``QuantizedState``'s storage and import nothing of ``qstate.py`` (their annotations name it)."""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from .. import format4
from .. import functional as F
from . import four_bit
from .layout import StateLayout
from .state_keys import CHUNK, absmax_key, codes_key


class _Codec:
    """What every codec answers the same way from its own format."""

    def state_bytes(self, numel: int, num_states: int, block_size: int) -> int:
        """Bytes of one tensor's quantized states over ``numel`` elements: codes and block maxima (the
        memory estimate's figure; :meth:`QuantizedState.bytes_for` gives a live layout's)."""
        dtypes = self.absmax_dtypes(num_states)
        maxima = sum(dtype.itemsize for dtype in dtypes)
        return len(dtypes) * self.code_bytes(numel) + maxima * F.num_blocks(numel, block_size)


class EightBit(_Codec):
    """8-bit codes: one byte an element, each state on its own map (``quantization``, signed or not)
    against bfloat16 block maxima. The coding half of :class:`QuantizedState` for ``state_bits=8``;
    the fp32 segments are the state's own."""

    @staticmethod
    def absmax_dtypes(num_states: int) -> tuple:
        return (F.ABSMAX_DTYPE,) * num_states

    @staticmethod
    def code_bytes(numel: int) -> int:
        """Bytes of one state's codes over ``numel`` elements."""
        return numel

    @staticmethod
    def code_maps(qs: "QuantizedState", device) -> List[torch.Tensor]:
        """The values each state's codes stand for (times the block's maximum)."""
        return qs.maps(device)

    @staticmethod
    def create(qs: "QuantizedState", device, initial: Optional[Sequence[float]]) -> None:
        """Codes and maxima of each state's constant ``initial[i]`` (default 0), coded as quantizing a
        block of it codes it (its maximum rounded up to bfloat16, the nearest code of the constant
        scaled by it), so that the step sees what it would write."""
        layout, entry = qs.layout, qs.entry
        if not layout.has8:
            return
        codes_shape, _ = layout.state_shapes()
        for i, sgn in enumerate(qs.signed):
            m = F.state_map(qs.quantization, sgn, "cpu")
            x = torch.tensor([0.0 if initial is None else float(initial[i])], dtype=torch.float32)
            am = F.block_absmax(x, 1)
            index = int(F.quantize_with_absmax(x, am, m, 1)[0])
            entry[codes_key(i)] = torch.full(codes_shape, index, dtype=torch.uint8, device=device)
            entry[absmax_key(i)] = am.to(device).expand(layout.num_blocks).clone()

    @staticmethod
    def _dequantize_piece(codes, absmax, maps, bs: int, piece, start: int, end: int) -> List[torch.Tensor]:
        off = start - piece.start
        c0 = piece.codes_start + off
        if piece.slot >= 0:  # part of one shared block
            return [m[c[c0:c0 + end - start].long()] * a[piece.absmax_start].to(torch.float32)
                    for c, a, m in zip(codes, absmax, maps)]
        b0 = piece.absmax_start + off // bs
        b1 = piece.absmax_start + (end - piece.start + bs - 1) // bs
        return [F.dequantize_flat(c[c0:c0 + end - start], a[b0:b1], m, bs) for c, a, m in zip(codes, absmax, maps)]

    def segment_values(self, qs: "QuantizedState", si: int) -> Iterator[Tuple[int, int, List[torch.Tensor]]]:
        """``(start, end, [fp32 values per state])`` over 8-bit segment ``si``, chunk by chunk."""
        layout = qs.layout
        codes, absmax = qs.codes(), qs.absmax()
        maps = qs.maps(codes[0].device)
        _, _, bs = layout.segment_blocks(si)
        for piece in layout.pieces_of(si):
            if piece.slot >= 0:
                yield piece.start, piece.end, self._dequantize_piece(codes, absmax, maps, bs, piece, piece.start,
                                                                     piece.end)
                continue
            chunk = max(bs, CHUNK // bs * bs)
            for s in range(piece.start, piece.end, chunk):
                e = min(piece.end, s + chunk)
                yield s, e, self._dequantize_piece(codes, absmax, maps, bs, piece, s, e)

    @staticmethod
    def write_values(qs: "QuantizedState", values: List[torch.Tensor], shared_absmax, quantize) -> None:
        """The quantized half of :meth:`QuantizedState.write`."""
        layout, k = qs.layout, qs.num_states
        device = values[0].device if values else "cpu"
        maps = qs.maps(device)
        codes, absmax = qs.codes(), qs.absmax()
        for piece in layout.pieces8:
            _, _, bs = layout.segment_blocks(piece.segment)
            for c, a, m, v in zip(codes, absmax, maps, values):
                x = v[piece.start:piece.end]
                if quantize is not None:
                    cs = slice(piece.codes_start, piece.codes_start + piece.numel)
                    c[cs], a[piece.absmax_start:piece.absmax_start + piece.absmax_count] = quantize(x, m, bs)
                    continue
                am = F.block_absmax(x, bs)
                a[piece.absmax_start:piece.absmax_start + piece.absmax_count] = am
                c[piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(x, am, m, bs)
        if not layout.sharded:
            return
        if shared_absmax is None:
            vec = torch.zeros(layout.num_slots * k, dtype=torch.float32, device=device)
            for piece in layout.shared8:
                for i, v in enumerate(values):
                    local = v[piece.start:piece.end].abs().max() if piece.numel else torch.zeros(())
                    vec[i * layout.num_slots + piece.slot] = local
            layout.comm.all_reduce_max(vec)
            agreed = {s: [float(vec[i * layout.num_slots + s]) for i in range(k)] for s in range(layout.num_slots)}
        else:
            agreed = shared_absmax
        for piece in layout.shared8:
            for i, (c, a, m, v) in enumerate(zip(codes, absmax, maps, values)):
                am = F.stored_absmax(torch.tensor([agreed[piece.slot][i]], dtype=torch.float32, device=device))
                a[piece.absmax_start:piece.absmax_start + 1] = am
                c[piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(
                    v[piece.start:piece.end], am, m, piece.numel)

    @staticmethod
    def write_segment(qs: "QuantizedState", si: int, i: int, v: torch.Tensor) -> None:
        """The quantized half of :meth:`QuantizedState.write_segment`."""
        layout = qs.layout
        seg = layout.segments[si]
        codes, absmax = qs.codes()[i], qs.absmax()[i]
        m = qs.maps(codes.device)[i]
        _, _, bs = layout.segment_blocks(si)
        for piece in layout.pieces_of(si):
            x = v[seg.param_start + piece.start - seg.start:seg.param_start + piece.end - seg.start]
            if piece.slot >= 0:
                block = (seg.param_start + piece.start - seg.start) // bs
                am = F.stored_absmax(v[block * bs:min((block + 1) * bs, seg.param_numel)].abs().amax().reshape(1))
                piece_bs = piece.numel
            else:
                am, piece_bs = F.block_absmax(x, bs), bs
            absmax[piece.absmax_start:piece.absmax_start + am.numel()] = am
            codes[piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(x, am, m, piece_bs)

    @staticmethod
    def segment_codes(qs: "QuantizedState", si: int) -> List[torch.Tensor]:
        """Each state's codes over 8-bit segment ``si``, one uint8 an element (views)."""
        c0, n = qs.layout.segment_codes[si], qs.layout.segments[si].numel
        return [c[c0:c0 + n] for c in qs.codes()]

    @staticmethod
    def restore_codes(qs: "QuantizedState", si: int, codes: List[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
        """Set segment ``si``'s codes (``codes``: :meth:`segment_codes`) from its whole parameter's."""
        seg = qs.layout.segments[si]
        for c, whole in zip(codes, saved):
            c.copy_(whole[seg.param_start:seg.param_end])


class FourBit(_Codec):
    """4-bit codes (``optim_bits=4``): Adam's two moments in ``format4.py``'s format, two codes a byte;
    ``four_bit.py`` does the work. The coding half of :class:`QuantizedState` for ``state_bits=4``."""

    @staticmethod
    def absmax_dtypes(num_states: int) -> tuple:
        return format4.ABSMAX_DTYPES

    @staticmethod
    def code_bytes(numel: int) -> int:
        """Bytes of one state's codes over ``numel`` elements of a parameter, from its start."""
        return format4.packed_bytes(0, numel)

    @staticmethod
    def code_maps(qs: "QuantizedState", device) -> List[torch.Tensor]:
        """``format4``'s maps: the first moment's (of ``m / sqrt(v)``), the second moment's."""
        return [format4.M_MAP.to(device), format4.V_MAP.to(device)]

    @staticmethod
    def create(qs: "QuantizedState", device, initial: Optional[Sequence[float]]) -> None:
        """Both moments 0 (the first moment's code of 0, the second's code 0, maxima 0)."""
        if initial is not None and any(float(x) != 0.0 for x in initial):
            raise ValueError("4-bit state starts at zero")
        layout, entry = qs.layout, qs.entry
        if not layout.has8:
            return
        for i, dtype in enumerate(format4.ABSMAX_DTYPES):
            entry[codes_key(i)] = torch.zeros(layout.num_codes, dtype=torch.uint8, device=device)
            entry[absmax_key(i)] = torch.zeros(layout.num_blocks, dtype=dtype, device=device)
        four_bit.zero_first_moment(qs)

    @staticmethod
    def segment_values(qs: "QuantizedState", si: int) -> Iterator[Tuple[int, int, List[torch.Tensor]]]:
        layout = qs.layout
        for piece in layout.pieces_of(si):
            for sp in four_bit.spans(layout, piece, CHUNK):
                yield sp.start, sp.end, list(four_bit.read(qs, sp))

    @staticmethod
    def write_values(qs: "QuantizedState", values: List[torch.Tensor], shared_absmax, quantize) -> None:
        four_bit.write_values(qs, values, shared_absmax)

    @staticmethod
    def write_segment(qs: "QuantizedState", si: int, i: int, v: torch.Tensor) -> None:
        """One moment of a segment: the other read and both written again (the first moment is stored
        against the second), so a block that a partition edge cuts is refused."""
        layout = qs.layout
        seg = layout.segments[si]
        if any(piece.slot >= 0 for piece in layout.pieces_of(si)):
            raise ValueError(f"4-bit state of {seg.name or 'a parameter'} cannot be set one state at a time "
                             "where a partition edge cuts a block (its first moment is stored against the "
                             "second, over the whole block); set both with load_dequantized_state on every rank")
        for piece in layout.pieces_of(si):
            sp = four_bit.span(layout, piece)
            values = list(four_bit.read(qs, sp))
            values[i] = v[seg.param_start + sp.start - seg.start:seg.param_start + sp.end - seg.start]
            four_bit.write(qs, sp, *values)

    @staticmethod
    def segment_codes(qs: "QuantizedState", si: int) -> List[torch.Tensor]:
        return four_bit.unpacked_codes(qs, si)

    @staticmethod
    def restore_codes(qs: "QuantizedState", si: int, codes: List[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
        four_bit.restore_codes(qs, si, saved)


_CODECS = {8: EightBit(), 4: FourBit()}


def codec_for(state_bits: int):
    """The codec of a layout's ``state_bits`` (8 or 4)."""
    return _CODECS[state_bits]


def absmax_dtypes(layout: StateLayout, num_states: int) -> tuple:
    """Each state's block-maximum dtype: bfloat16, except a 4-bit second moment's float32 (``format4.py``)."""
    return codec_for(layout.state_bits).absmax_dtypes(num_states)


__all__ = ["EightBit", "FourBit", "codec_for", "absmax_dtypes"]
