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

The key names are written in ``state_keys.py`` and nowhere else; how the quantized segments are
coded is the codec of the layout's state width (``codecs.py``).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import functional as F
from .codecs import absmax_dtypes, codec_for
from .layout import StateLayout
from .state_keys import CHUNK, CORRECTION_KEY, absmax_key, codes_key, fp32_key

class QuantizedState:
    """One tensor's state (see the module doc). ``signed`` gives each state's map; ``quantization``
    is the group's map kind ("dynamic", "dynamic6", "minifloat" or "linear")."""

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
        absmax = sum(dtype.itemsize for dtype in codec_for(layout.state_bits).absmax_dtypes(num_states))
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


__all__ = ["QuantizedState"]
