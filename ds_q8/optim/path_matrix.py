"""The whole-matrix path (Muon): each matrix's direction formed whole from the slices every rank holds
(in fp32, or 8-bit block-wise: a quarter of the bytes), mapped (Newton-Schulz) and applied to the local
slice of the parameter, the same bits at every world size."""
from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Tuple

import torch

from .. import functional as F
from . import rounding
from .group_options import correction_of, stochastic_params
from .layout import segment_block_size
from .pieces import TensorStep
from .qstate import QuantizedState
from .rules import MUON, Rule

from .path_reference import block_codec, read_param, write_param

def _param_shape(layout, seg) -> tuple:
    if layout.param_shapes is not None:
        return layout.param_shapes[seg.param_index]
    if seg.numel == seg.param_numel == layout.numel:
        return layout.shape
    raise RuntimeError("a whole-matrix rule (Muon) needs the shapes of the parameters that a flat partition holds "
                       "slices of; DeepSpeed's ZeRO stages 1-3 and bf16 optimizer give them (import ds_q8 before "
                       "deepspeed.initialize)")


def matrix_pass(rule: Rule, t: TensorStep, held: List[torch.Tensor]) -> None:
    """Map each matrix's whole direction and step this tensor's slice of it (``held``: the tensor's
    flat direction scratch, the only reference to it, so that it can be freed here).

    The matrix is mapped whole, in fp32, one at a time (its temporaries are freed before the next),
    by every rank that holds a slice of it, from the same bits: each rank steps its slice by the
    same result, so the parameters do not depend on where partition edges fall. With 8-bit
    directions the fp32 scratch is freed once quantized, and each matrix is dequantized in turn."""
    layout, group, h = t.state.layout, t.group, t.hyper
    pf = layout.param_views(t.param)
    corr = correction_of(t)
    d = held.pop()
    if h.get("direction_bits", 32.0) == 8.0:
        whole = _directions_8bit(layout, group, d)
        del d
    else:
        cut = exchange(layout, d)
        whole = {si: cut.get(seg.param_index, d[seg.start:seg.end]) for si, seg in enumerate(layout.segments)
                 if seg.numel}
    for si, seg in enumerate(layout.segments):
        if seg.numel == 0:
            continue
        shape = _param_shape(layout, seg)
        full = whole.pop(si)
        full = full() if callable(full) else full
        o = rule.matrix(full.view(shape), h).reshape(-1)[seg.param_start:seg.param_end]
        dst = pf[seg.start:seg.end]
        c = None if corr is None else corr[seg.start:seg.end]
        if dst.dtype == torch.float32:
            rule.apply(dst, o, h)
        else:
            p32 = read_param(dst, c)
            rule.apply(p32, o, h)
            sr = None
            if t.sr_step is not None and stochastic_params(group, dst.dtype):
                sr = (rounding.sr_key(t.sr_step, layout.group_index, seg.param_index), seg.param_start)
            write_param(dst, p32, sr, correction=c)
        del o, full


#: per layout, kept with the step rather than on the layout (which is geometry): the agreed cut
#: parameters (:func:`split_params`), and the payload bytes each tensor sent into whole-matrix
#: exchanges (:func:`exchanged_bytes`, a measurement)
_SPLIT_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_EXCHANGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def exchanged_bytes(layout) -> int:
    """Payload bytes this tensor's matrices sent into whole-matrix exchanges so far."""
    return _EXCHANGED.get(layout, 0)


def _count_exchange(layout, buf: torch.Tensor) -> None:
    _EXCHANGED[layout] = _EXCHANGED.get(layout, 0) + buf.numel() * buf.element_size()


def split_params(layout) -> Dict[int, Tuple[int, bool]]:
    """The parameters of a sharded tensor that partition edges cut, every rank's view the same:
    ``{param_index: (numel, 8-bit state)}``, in index order. Agreed once per layout with two
    all-reduces (which ranks hold partial slices; the parameters' sizes and kinds) and kept."""
    cached = _SPLIT_PARAMS.get(layout)
    if cached is not None:
        return cached
    partial = torch.zeros(layout.num_params, dtype=torch.float32)
    known = torch.zeros(2 * layout.num_params, dtype=torch.float32)  # sizes, then 8-bit flags
    for seg in layout.segments:
        if 0 < seg.numel < seg.param_numel:
            partial[seg.param_index] = 1.0
        known[seg.param_index] = float(seg.param_numel)
        if seg.eight_bit:
            known[layout.num_params + seg.param_index] = 1.0
    layout.comm.all_reduce_sum(partial)
    layout.comm.all_reduce_max(known)
    out = {i: (int(known[i]), bool(known[layout.num_params + i] > 0)) for i in range(layout.num_params)
           if float(partial[i]) > 0}
    _SPLIT_PARAMS[layout] = out
    return out


def exchange(layout, d: torch.Tensor) -> Dict[int, torch.Tensor]:
    """``direction_bits=32``: the whole fp32 directions of the matrices that partition edges cut,
    assembled from every rank's slices with one all-reduce SUM over a buffer of only those matrices
    (each element written by one rank, zeros elsewhere: the sum is exact). Matrices a rank holds
    whole never travel. Returns ``{param_index: flat whole direction}`` for the cut matrices this
    rank holds part of."""
    if layout.comm is None:  # an ordinary parameter, or a partition of one rank's: nothing is cut
        return {}
    cut = split_params(layout)
    if not cut:
        return {}
    offsets, total = {}, 0
    for pi, (n, _) in cut.items():
        offsets[pi] = total
        total += n
    buf = torch.zeros(total, dtype=torch.float32, device=d.device)
    held = set()
    for seg in layout.segments:
        if seg.numel and seg.param_index in offsets:
            o = offsets[seg.param_index]
            buf[o + seg.param_start:o + seg.param_end] = d[seg.start:seg.end]
            held.add(seg.param_index)
    layout.comm.all_reduce_sum(buf)
    _count_exchange(layout, buf)
    return {pi: buf[offsets[pi]:offsets[pi] + cut[pi][0]] for pi in sorted(held)}




def _directions_8bit(layout, group: dict, d: torch.Tensor) -> Dict[int, torch.Tensor]:
    """``direction_bits=8`` (the default): each matrix's direction quantized 8-bit block-wise in its own
    blocks (signed map, to nearest; the maxima of blocks that partition edges cut agreed across ranks,
    as for the states), and dequantized whole. A cut matrix travels as its codes and block maxima:
    one all-reduce MAX over the codes of only the cut matrices (each code written by one rank, zeros
    elsewhere) and one over their maxima, a quarter of the fp32 bytes. The values are the same bits
    wherever the edges fall. Returns ``{segment index: flat whole direction of its parameter}``."""
    qd = QuantizedState.create({}, layout, (True,), group["quantization"], d.device)
    codec = block_codec(MUON, group)  # the direction's codec follows the group's impl, as Muon's momentum does
    qd.write([d], quantize=None if codec is None else codec.quantize)
    cmap = qd.maps(d.device)[0]
    dequantize = F.dequantize_flat if codec is None else codec.dequantize
    cut = split_params(layout) if layout.comm is not None else {}
    out, held = {}, {}
    for si, seg, first, codes, absmax, f32 in qd.segment_params():
        if seg.param_index in cut:
            held[si] = (seg, first, codes, absmax, f32)
        elif seg.eight_bit:  # dequantized when its turn comes
            out[si] = functools.partial(dequantize, codes[0], absmax[0], cmap, layout.segment_blocks(si)[2])
        else:
            out[si] = f32[0]
    if not cut:
        return out
    sizes = {"codes": 0, "absmax": 0, "fp32": 0}
    offsets = {}
    for pi, (n, eight) in cut.items():
        if eight:
            bs = segment_block_size(layout.block_size, n)
            offsets[pi] = (sizes["codes"], sizes["absmax"], bs)
            sizes["codes"] += n
            sizes["absmax"] += (n + bs - 1) // bs
        else:
            offsets[pi] = (sizes["fp32"], None, None)
            sizes["fp32"] += n
    codes_buf = torch.zeros(sizes["codes"], dtype=torch.uint8, device=d.device)
    absmax_buf = torch.zeros(sizes["absmax"], dtype=torch.float32, device=d.device)
    fp32_buf = torch.zeros(sizes["fp32"], dtype=torch.float32, device=d.device)
    for seg, first, codes, absmax, f32 in held.values():
        o, a, _ = offsets[seg.param_index]
        if seg.eight_bit:
            codes_buf[o + seg.param_start:o + seg.param_end] = codes[0]
            absmax_buf[a + first:a + first + absmax[0].numel()] = absmax[0]
        else:
            fp32_buf[o + seg.param_start:o + seg.param_end] = f32[0]
    for buf, reduce in ((codes_buf, layout.comm.all_reduce_max), (absmax_buf, layout.comm.all_reduce_max),
                        (fp32_buf, layout.comm.all_reduce_sum)):
        if buf.numel():  # every rank agrees which are empty (split_params)
            reduce(buf)
            _count_exchange(layout, buf)
    # the maxima travel as float32 (exact; every backend reduces it) and are stored values again here
    absmax_buf = absmax_buf.to(F.ABSMAX_DTYPE)
    for si, (seg, *_) in held.items():
        n, eight = cut[seg.param_index]
        o, a, bs = offsets[seg.param_index]
        if eight:
            out[si] = functools.partial(dequantize, codes_buf[o:o + n], absmax_buf[a:a + (n + bs - 1) // bs], cmap, bs)
        else:
            out[si] = fp32_buf[o:o + n]
    return out


__all__ = ["matrix_pass", "split_params", "exchange"]
