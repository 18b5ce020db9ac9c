"""The quantized state of one optimized tensor: an ordinary parameter, or a ZeRO slice of many.

A :class:`QuantizedState` owns what the optimizer keeps for one tensor: its
:class:`~ds_q8.optim.layout.StateLayout` (which slices of which parameters it holds, 8-bit or fp32
per parameter, blocks aligned to parameter starts), and per state the uint8 codes, the block maxima
(bfloat16, rounded up: ``functional.py``) and the float32 values of the fp32 segments. Everything else reads and writes state through
it: the step (the views it hands the kernels), ``state_dict``/``load_state_dict``, universal
checkpoints, DeepSpeed's per-parameter state API, telemetry and the memory figures.

Storage stays in the optimizer's ``state[tensor]`` dict, so that torch's ``state_dict`` and pickling
see plain tensors, under these keys (``i`` counts states from 1):

  * ``state{i}``: codes of the 8-bit segments, packed in tensor order (shaped like the tensor when
    one 8-bit segment covers all of it);
  * ``absmax{i}``: their block maxima (bfloat16), each segment's blocks in order (a block that a
    partition edge cuts is stored by every rank that holds part of it, and agreed on across them);
  * ``state{i}_fp32``: values of the fp32 segments, packed in tensor order;
  * ``step``: the step count (a float tensor, as torch keeps it).

The key names are written here and nowhere else.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import format4
from .. import functional as F
from . import four_bit
from .layout import StateLayout

# Elements dequantized at a time by the readers and the reference: bounds their fp32 temporaries.
CHUNK = 1 << 20
#: bytes of one stored block maximum
ABSMAX_BYTES = torch.tensor([], dtype=F.ABSMAX_DTYPE).element_size()


def codes_key(i: int) -> str:
    """Key of state ``i``'s codes (``i`` from 0)."""
    return f"state{i + 1}"


def absmax_key(i: int) -> str:
    return f"absmax{i + 1}"


def fp32_key(i: int) -> str:
    return f"state{i + 1}_fp32"


#: key of a bf16 tensor's correction bytes (``correction_byte=True``): int8, one per element of the
#: optimized tensor (a ZeRO partition's, padding included), saved and partitioned like the parameter
CORRECTION_KEY = "correction"


def absmax_dtypes(layout: StateLayout, num_states: int) -> tuple:
    """Each state's block-maximum dtype: bfloat16, except a 4-bit second moment's float32 (``format4.py``)."""
    return codec_for(layout.state_bits).absmax_dtypes(num_states)


def storage_keys(num_states: int) -> frozenset:
    """Every key a state entry of ``num_states`` states may hold."""
    keys = {"step", CORRECTION_KEY}
    for i in range(num_states):
        keys |= {codes_key(i), absmax_key(i), fp32_key(i)}
    return frozenset(keys)


def is_8bit(entry: dict) -> bool:
    """Whether a state entry holds codes."""
    s = entry.get(codes_key(0))
    return s is not None and s.dtype == torch.uint8


def has_storage(entry: dict) -> bool:
    """Whether a state entry has been created (holds codes or fp32 values)."""
    return "step" in entry and any(k.startswith("state") for k in entry)


class EightBit:
    """8-bit codes: one byte an element, each state on its own map (``quantization``, signed or not)
    against bfloat16 block maxima. The coding half of :class:`QuantizedState` for ``state_bits=8``;
    the fp32 segments are the state's own."""

    @staticmethod
    def absmax_dtypes(num_states: int) -> tuple:
        return (F.ABSMAX_DTYPE,) * num_states

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


class FourBit:
    """4-bit codes (``optim_bits=4``): Adam's two moments in ``format4.py``'s format, two codes a byte;
    ``four_bit.py`` does the work. The coding half of :class:`QuantizedState` for ``state_bits=4``."""

    @staticmethod
    def absmax_dtypes(num_states: int) -> tuple:
        return format4.ABSMAX_DTYPES

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


class QuantizedState:
    """One tensor's state (see the module doc). ``signed`` gives each state's map; ``quantization``
    is the group's map kind ("dynamic" or "linear")."""

    def __init__(self, entry: dict, layout: StateLayout, signed: Sequence[bool], quantization: str):
        self.entry = entry
        self.layout = layout
        self.signed = tuple(signed)
        self.quantization = quantization
        self._views = None
        #: how the quantized segments are coded: :class:`EightBit` or :class:`FourBit`
        self.codec = codec_for(layout.state_bits)
        k = len(self.signed)
        self._keys = {key: tuple(key(i) for i in range(k)) for key in (codes_key, absmax_key, fp32_key)}

    @property
    def num_states(self) -> int:
        return len(self.signed)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, entry: dict, layout: StateLayout, signed: Sequence[bool], quantization: str, device,
               initial: Optional[Sequence[float]] = None) -> "QuantizedState":
        """Fill ``entry`` with fresh state: every state ``initial[i]`` (default 0), step 0.

        A constant is coded as quantizing a block of it codes it (its maximum rounded up to bfloat16,
        the nearest code of the constant scaled by it), so that the step sees what it would write."""
        qs = cls(entry, layout, signed, quantization)
        entry.clear()
        _, fp32_shape = layout.state_shapes()
        entry["step"] = torch.tensor(0.0)
        qs.codec.create(qs, device, initial)
        if layout.has32:
            for i in range(qs.num_states):
                value = 0.0 if initial is None else float(initial[i])
                entry[fp32_key(i)] = torch.full(fp32_shape, value, dtype=torch.float32, device=device)
        return qs

    # ------------------------------------------------------------------ storage
    def stored(self, key) -> Tuple[torch.Tensor, ...]:
        """Each state's stored tensor under ``key`` (:func:`codes_key`, :func:`absmax_key` or
        :func:`fp32_key`), in its stored shape."""
        entry = self.entry
        return tuple(entry[k] for k in self._keys[key])

    def codes(self) -> List[torch.Tensor]:
        """Flat views of each state's packed codes."""
        return [self.entry[k].view(-1) for k in self._keys[codes_key]]

    def absmax(self) -> List[torch.Tensor]:
        return [self.entry[k] for k in self._keys[absmax_key]]

    def fp32(self) -> List[torch.Tensor]:
        """Flat views of each state's fp32 values."""
        return [self.entry[k].view(-1) for k in self._keys[fp32_key]]

    def maps(self, device) -> List[torch.Tensor]:
        return [F.state_map(self.quantization, s, device) for s in self.signed]

    def nbytes(self) -> Dict[str, int]:
        """Bytes held, by kind: ``codes``, ``absmax`` and ``fp32``."""
        out = {"codes": 0, "absmax": 0, "fp32": 0}
        for i in range(self.num_states):
            for kind, key in (("codes", codes_key(i)), ("absmax", absmax_key(i)), ("fp32", fp32_key(i))):
                t = self.entry.get(key)
                if torch.is_tensor(t):
                    out[kind] += t.numel() * t.element_size()
        return out

    @staticmethod
    def bytes_for(layout: StateLayout, num_states: int) -> Dict[str, int]:
        """The bytes :meth:`create` allocates for ``layout`` (no step counter), by kind."""
        absmax = sum(dtype.itemsize for dtype in absmax_dtypes(layout, num_states))
        return {"codes": num_states * layout.num_codes,
                "absmax": absmax * layout.num_blocks,
                "fp32": 4 * num_states * layout.num_fp32}

    # ------------------------------------------------------------------ views for the step
    def piece_views(self) -> list:
        """``(piece, codes views, absmax views)`` of every whole-block 8-bit piece, made once per storage."""
        tensors = tuple(self.entry[k(i)] for k in (codes_key, absmax_key) for i in range(self.num_states))
        if self._views is not None and all(a is b for a, b in zip(self._views[0], tensors)):
            return self._views[1]
        k = self.num_states
        codes = [t.view(-1) for t in tensors[:k]]
        absmax = tensors[k:]
        views = [(piece, tuple(c[piece.codes_start:piece.codes_start + piece.numel] for c in codes),
                  tuple(a[piece.absmax_start:piece.absmax_start + piece.absmax_count] for a in absmax))
                 for piece in self.layout.pieces8]
        self._views = (tensors, views)
        return views

    def fp32_piece_views(self) -> list:
        """``(piece, fp32 views)`` of every fp32 piece."""
        f32 = self.fp32()
        return [(piece, tuple(f[piece.codes_start:piece.codes_start + piece.numel] for f in f32))
                for piece in self.layout.pieces32]

    # ------------------------------------------------------------------ reading
    def segment_values(self, si: int) -> Iterator[Tuple[int, int, List[torch.Tensor]]]:
        """``(start, end, [fp32 values per state])`` over segment ``si``, chunk by chunk, in tensor order."""
        layout = self.layout
        seg = layout.segments[si]
        if not seg.eight_bit:
            f32 = self.fp32()
            base = layout.segment_codes[si] - seg.start
            for s in range(seg.start, seg.end, CHUNK):
                e = min(seg.end, s + CHUNK)
                yield s, e, [f[base + s:base + e] for f in f32]
            return
        yield from self.codec.segment_values(self, si)

    def segment_codes(self, si: int) -> List[torch.Tensor]:
        """Each state's codes over quantized segment ``si``, one uint8 an element (8-bit: views; 4-bit:
        unpacked), indices into :meth:`code_maps`."""
        return self.codec.segment_codes(self, si)

    def code_maps(self, device) -> List[torch.Tensor]:
        """The map each state's codes index (:meth:`segment_codes`)."""
        return self.codec.code_maps(self, device)

    def read(self, device=None) -> List[torch.Tensor]:
        """Each state's fp32 values over the whole tensor, flat (padding reads as zero)."""
        if device is None:
            t = self.entry.get(codes_key(0), self.entry.get(fp32_key(0)))
            device = t.device if torch.is_tensor(t) else "cpu"
        out = [torch.zeros(self.layout.numel, dtype=torch.float32, device=device) for _ in range(self.num_states)]
        for si in range(len(self.layout.segments)):
            for s, e, values in self.segment_values(si):
                for o, v in zip(out, values):
                    o[s:e] = v
        return out

    def read_segment(self, si: int, i: int) -> torch.Tensor:
        """State ``i``'s fp32 values over segment ``si``."""
        parts = [values[i] for _, _, values in self.segment_values(si)]
        return torch.cat(parts) if parts else torch.zeros(0)

    # ------------------------------------------------------------------ writing
    def write(self, values: List[torch.Tensor], shared_absmax: Optional[Dict[int, List[float]]] = None,
              quantize=None) -> None:
        """Set every state from flat fp32 ``values`` (tensor-long, one per state), requantizing.

        On a sharded tensor the maxima of blocks cut by partition edges are agreed across ranks with
        one all-reduce (every rank must call this then), unless ``shared_absmax`` gives them
        (slot -> one value per state). ``quantize(x, map, block_size) -> (codes, absmax)`` may do
        the whole blocks (the compiled kernels: the same codes)."""
        layout = self.layout
        if layout.has32:
            f32 = self.fp32()
            for piece in layout.pieces32:
                for f, v in zip(f32, values):
                    f[piece.codes_start:piece.codes_start + piece.numel] = v[piece.start:piece.end]
        if not layout.has8 and not layout.sharded:
            return
        self.codec.write_values(self, values, shared_absmax, quantize)

    def write_segment(self, si: int, i: int, param_values: torch.Tensor) -> None:
        """Set state ``i`` of segment ``si`` from its whole parameter's fp32 values (requantizing).

        A block cut by a partition edge takes its maximum from the whole parameter, so every rank that
        holds part of it writes the same maximum without communicating."""
        layout = self.layout
        seg = layout.segments[si]
        v = param_values.reshape(-1)
        if not seg.eight_bit:
            base = layout.segment_codes[si]
            self.fp32()[i][base:base + seg.numel] = v[seg.param_start:seg.param_end]
            return
        self.codec.write_segment(self, si, i, v)

    # ------------------------------------------------------------------ whole parameters (universal checkpoints)
    def segment_params(self) -> Iterator[tuple]:
        """Per non-empty segment: ``(segment, codes per state, absmax per state, fp32 per state)``, each
        the segment's slice of storage (codes and block maxima for 8-bit segments, else None; fp32
        values for fp32 segments, else None), with the segment's first block in its parameter and
        block count available from the layout. What a whole-parameter checkpoint is assembled from."""
        layout = self.layout
        for si, seg in enumerate(layout.segments):
            if seg.numel == 0:
                continue
            c0 = layout.segment_codes[si]
            if seg.eight_bit:
                first, nb, _ = layout.segment_blocks(si)
                a0 = layout.segment_absmax[si]
                codes = self.codec.segment_codes(self, si)
                yield si, seg, first, codes, [a[a0:a0 + nb] for a in self.absmax()], None
            else:
                yield si, seg, 0, None, None, [f[c0:c0 + seg.numel] for f in self.fp32()]

    def restore_params(self, saved: Dict[str, dict]) -> None:
        """Set every segment from its whole parameter's saved state, code for code.

        ``saved`` maps parameter names to ``{"numel", "codes", "absmax"}`` (8-bit) or ``{"values"}``
        (fp32), one tensor per state, as a universal checkpoint holds them."""
        layout = self.layout
        for si, seg, first, codes, absmax, f32 in self.segment_params():
            entry = saved[seg.name]
            if seg.eight_bit:
                if int(entry["numel"]) != seg.param_numel:
                    raise ValueError(f"universal checkpoint holds {entry['numel']} elements for {seg.name}, "
                                     f"the parameter has {seg.param_numel}")
                _, nb, _ = layout.segment_blocks(si)
                self.codec.restore_codes(self, si, codes, entry["codes"])
                for i in range(self.num_states):
                    absmax[i].copy_(entry["absmax"][i][first:first + nb])
            else:
                for i in range(self.num_states):
                    f32[i].copy_(entry["values"][i][seg.param_start:seg.param_end])
        self._views = None

    # ------------------------------------------------------------------ saved entries
    def check_saved(self, st: dict, what: str, owner: str) -> None:
        """Raise ValueError unless the saved entry ``st`` fits this state's storage (keys, sizes,
        dtypes, finite values); ``what`` names the tensor, ``owner`` the optimizer class."""
        layout = self.layout
        codes_shape, fp32_shape = layout.state_shapes()
        corr = st.get(CORRECTION_KEY)
        if corr is not None and (not torch.is_tensor(corr) or corr.dtype != torch.int8 or corr.numel() != layout.numel):
            got = f"{corr.numel()} elements of {corr.dtype}" if torch.is_tensor(corr) else type(corr).__name__
            raise ValueError(f"checkpoint {CORRECTION_KEY} of {what} has {got}; the tensor needs {layout.numel} of "
                             "torch.int8: the checkpoint belongs to another model or partitioning")
        absmax_dtype = absmax_dtypes(layout, self.num_states)
        for i in range(self.num_states):
            for key, want, dtype in ((codes_key(i), codes_shape if layout.has8 else None, torch.uint8),
                                     (absmax_key(i), (layout.num_blocks,) if layout.has8 else None, absmax_dtype[i]),
                                     (fp32_key(i), fp32_shape if layout.has32 else None, torch.float32)):
                v = st.get(key)
                if want is None:
                    if v is not None:
                        raise ValueError(f"checkpoint has {key}, which this tensor's layout has no place for")
                    continue
                if not torch.is_tensor(v):
                    raise ValueError(f"checkpoint state for {what} lacks {key}: not a {owner} checkpoint")
                if v.dtype != dtype or v.numel() != _numel(want):
                    raise ValueError(f"checkpoint {key} has {v.numel()} elements of {v.dtype}; this tensor's layout "
                                     f"needs {_numel(want)} of {dtype}: the checkpoint belongs to another model or "
                                     "partitioning")
                if key.startswith("absmax") and not bool((torch.isfinite(v) & (v >= 0)).all()):
                    raise ValueError(f"checkpoint {key} holds NaN, Inf or negative block maxima: "
                                     "the checkpoint is corrupted")
                if key.endswith("_fp32") and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"checkpoint {key} contains NaN or Inf")

    @classmethod
    def of_saved(cls, st: dict, desc: dict, signed: Sequence[bool], quantization: str) -> "QuantizedState":
        """A saved entry with its saved layout description, read offline (on the CPU, no ranks)."""
        entry = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
        return cls(entry, StateLayout.from_description(desc), signed, quantization)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["CORRECTION_KEY", "QuantizedState", "EightBit", "FourBit", "codec_for", "codes_key", "absmax_key", "fp32_key", "storage_keys", "is_8bit", "has_storage",
           "CHUNK"]
