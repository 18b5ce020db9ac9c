"""One optimizer step as a function, the way torch's ``adam()`` is one: ``step(rule, work, skip)``.

``work`` lists :class:`TensorStep` s, one per optimized tensor: its parameter (or ZeRO partition),
gradient, :class:`~ds_q8.optim.qstate.QuantizedState`, group, step scalars and rounding. Each tensor is
cut into *pieces* by its layout (``layout.py``) and each piece takes one of three paths, side by side
below; all three write the bits the reference writes, so a parameter's codes, block maxima and values
do not depend on the path or on where ZeRO cut it:

  * 8-bit pieces made of whole blocks: the fused kernels (:func:`fused_step_many`), every piece that
    shares a group and step scalars in one call; the pure-PyTorch reference
    (:func:`reference_step_8bit`) takes what no kernel can;
  * fp32 pieces: the fused fp32-state kernel (:func:`fused_step_fp32_many`), or
    :func:`reference_step_32bit`;
  * shared pieces, the local parts of blocks that a partition edge cuts: one batched reference pass
    (:func:`_update_shared`) whose block maxima are agreed across ranks with one all-reduce MAX per
    process group and call, and only then quantized.

A whole-matrix rule (Muon, ``rule.is_matrix``) takes the same three paths for its element-wise part,
which updates the states and writes each matrix's direction into an fp32 scratch instead of the
parameter; then :func:`_matrix_pass` forms each matrix whole (a ZeRO partition's matrices that
partition edges cut, from the slices every rank holds: :func:`_exchange`), maps it (Newton-Schulz)
and steps the local slice of the parameter by the result.

Which path a group takes is its ``impl`` option, decided here (:func:`kernel_rule`) and nowhere else:

  ``"auto"`` (default)  the kernels; where an op cannot be loaded (one warning says why) or a tensor has
                        no kernel, the reference, which gives the same bits, slower
  ``"kernel"``          the kernels or an error: a failed build raises with the build's message, and so
                        does a tensor that no kernel takes
  ``"reference"``       the pure-PyTorch reference only (the kernels are not even loaded)
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import functional as F
from .. import ops
from . import rounding, telemetry
from . import qstate
from .checks import IMPLS
from .layout import segment_block_size
from .qstate import QuantizedState, codes_key, fp32_key
from .rules import Rule

#: ``(key, index of the item's first element in its parameter)``: an item's stochastic rounding
Rounding = Tuple[int, int]


class Item8(NamedTuple):
    """An 8-bit piece for the kernels: it starts a block of its parameter. ``correction``: the piece's
    correction bytes (a bf16 parameter with ``correction_byte=True``), else None."""
    param: torch.Tensor
    grad: torch.Tensor
    codes: Tuple[torch.Tensor, ...]
    absmax: Tuple[torch.Tensor, ...]
    rounding: Optional[Rounding]
    correction: Optional[torch.Tensor] = None


class Item32(NamedTuple):
    """An fp32-state piece; ``rounding`` only for stochastic writes of 16-bit parameters."""
    param: torch.Tensor
    grad: torch.Tensor
    states: Tuple[torch.Tensor, ...]
    rounding: Optional[Rounding]
    correction: Optional[torch.Tensor] = None


class TensorStep(NamedTuple):
    """One optimized tensor's part of a step.

    ``hyper`` are the step scalars; ``segment_hyper`` (whole-parameter rules) one set per segment
    (:func:`segment_hypers`); ``sr_step`` (:func:`rounding.step_key`) asks for random bits, None for
    none; ``sums`` takes telemetry's requantization error (None: not measured)."""
    param: torch.Tensor
    grad: torch.Tensor
    state: QuantizedState
    group: dict
    hyper: Dict[str, float]
    segment_hyper: Optional[list] = None
    sr_step: Optional[int] = None
    sums: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------- options of a group
def group_impl(group: dict) -> str:
    """A group's ``impl`` (groups saved before the option existed are ``"auto"``)."""
    return group.get("impl", "auto")


def corrected(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` keeps a correction byte (``correction_byte=True``, bf16 only):
    then it is written to nearest as a 24-bit value (``rounding.split_bf16``), never stochastically."""
    return dtype == torch.bfloat16 and bool(group.get("correction_byte", False))


def correction_of(t: "TensorStep") -> Optional[torch.Tensor]:
    """The flat correction bytes of a tensor step, or None."""
    if not corrected(t.group, t.param.dtype):
        return None
    c = t.state.entry.get(qstate.CORRECTION_KEY)
    if c is None:
        raise RuntimeError("correction_byte=True but the tensor's state has no correction bytes")
    return c.view(-1)


def stochastic_params(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` is written with stochastic rounding (on by default for 16-bit,
    off where a correction byte keeps what rounding drops)."""
    if dtype not in (torch.bfloat16, torch.float16) or corrected(group, dtype):
        return False
    choice = group.get("stochastic_rounding")
    return True if choice is None else bool(choice)


def stochastic_states(group: dict, signed: Sequence[bool]) -> tuple:
    """Which states are requantized with stochastic rounding: the unsigned ones (second moments,
    Adagrad's sum) unless the group asks for ``state_rounding="nearest"``.

    Rounded to nearest, an exponential average that moves by less than half a code per step (a
    second moment with beta2=0.999 moves by 0.1%) loses those moves: it lags its fp32 value, by half
    on a GPT-2 attention matrix after 300 steps, and the steps grow by as much as 1.6x. Rounded
    stochastically it is right on average."""
    if group.get("state_rounding", "stochastic") != "stochastic":
        return (False,) * len(signed)
    return tuple(not s for s in signed)


def maps_of(rule: Rule, group: dict, device) -> List[torch.Tensor]:
    return [F.state_map(group["quantization"], s, device) for s in rule.state_signed]


# ---------------------------------------------------------------------------- the entry point
def step(rule: Rule, work: Sequence[TensorStep], skip: Optional[torch.Tensor] = None) -> None:
    """Step every tensor of ``work`` by ``rule``. ``skip`` is a CUDA step's device flag
    (``optim/nonfinite.py``): non-zero, nothing may be written; the kernels read it on the device."""
    if rule.is_matrix:
        _matrix_step(rule, work, skip)
        return
    plan = _Plan(rule, skip)
    for t in work:
        plan.add(t)
    plan.run()


# ---------------------------------------------------------------------------- whole-matrix rules
def _matrix_step(rule: Rule, work: Sequence[TensorStep], skip: Optional[torch.Tensor]) -> None:
    """A whole-matrix rule's step: the element-wise part through the three paths above, with an fp32
    direction scratch in place of each parameter, so that states, shared blocks and their agreed
    maxima are exactly those of every other rule; then each matrix's pass (:func:`_matrix_pass`)."""
    plan = _Plan(rule, skip)
    directions = []
    for t in work:
        d = torch.zeros(t.param.shape, dtype=torch.float32, device=t.param.device)
        plan.add(t._replace(param=d))
        directions.append(d)
    plan.run()
    skipped = plan._skipped()
    del plan  # its items hold the scratches
    if skipped:
        return
    for i, t in enumerate(work):
        # the scratch goes with its tensor: _matrix_pass frees it as soon as it has what it needs
        held, directions[i] = [directions[i].view(-1)], None
        _matrix_pass(rule, t, held)


def _param_shape(layout, seg) -> tuple:
    if layout.param_shapes is not None:
        return layout.param_shapes[seg.param_index]
    if seg.numel == seg.param_numel == layout.numel:
        return layout.shape
    raise RuntimeError("a whole-matrix rule (Muon) needs the shapes of the parameters that a flat partition holds "
                       "slices of; DeepSpeed's ZeRO stages 1-3 and bf16 optimizer give them (import ds_q8 before "
                       "deepspeed.initialize)")


def _matrix_pass(rule: Rule, t: TensorStep, held: List[torch.Tensor]) -> None:
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
        cut = _exchange(layout, d)
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


def split_params(layout) -> Dict[int, Tuple[int, bool]]:
    """The parameters of a sharded tensor that partition edges cut, every rank's view the same:
    ``{param_index: (numel, 8-bit state)}``, in index order. Agreed once per layout with two
    all-reduces (which ranks hold partial slices; the parameters' sizes and kinds) and kept."""
    cached = layout.__dict__.get("_split_params")
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
    layout.__dict__["_split_params"] = out
    return out


def _exchange(layout, d: torch.Tensor) -> Dict[int, torch.Tensor]:
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
    layout.exchanged_bytes += buf.numel() * buf.element_size()
    return {pi: buf[offsets[pi]:offsets[pi] + cut[pi][0]] for pi in sorted(held)}


#: the direction's codec follows the group's impl, as for a rule without a fused kernel
MATRIX_CODEC_RULE = Rule("", ("direction",), (True,), None)


def _directions_8bit(layout, group: dict, d: torch.Tensor) -> Dict[int, torch.Tensor]:
    """``direction_bits=8`` (the default): each matrix's direction quantized 8-bit block-wise in its own
    blocks (signed map, to nearest; the maxima of blocks that partition edges cut agreed across ranks,
    as for the states), and dequantized whole. A cut matrix travels as its codes and block maxima:
    one all-reduce MAX over the codes of only the cut matrices (each code written by one rank, zeros
    elsewhere) and one over their maxima, a quarter of the fp32 bytes. The values are the same bits
    wherever the edges fall. Returns ``{segment index: flat whole direction of its parameter}``."""
    qd = QuantizedState.create({}, layout, (True,), group["quantization"], d.device)
    codec = block_codec(MATRIX_CODEC_RULE, group)
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
            layout.exchanged_bytes += buf.numel() * buf.element_size()
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


def segment_hypers(rule: Rule, t: TensorStep) -> list:
    """First pass of a whole-parameter rule: each segment's step scalars; no state changes.

    Squares are summed in float64 per parameter over its segments, chunk by chunk (the chunks
    dequantize the same codes the update pass will), and across ranks for a sharded partition."""
    qs, layout, h = t.state, t.state.layout, t.hyper
    k = rule.num_states
    pf, gf = layout.param_views(t.param), t.grad.reshape(-1)
    sums: Optional[torch.Tensor] = None
    for si, seg in enumerate(layout.segments):
        for s, e, values in qs.segment_values(si):
            terms = rule.norm_terms(pf[s:e].to(torch.float32), gf[s:e].to(torch.float32),
                                    [v.clone() for v in values], h)
            if sums is None:
                sums = torch.zeros(layout.num_params, len(terms), dtype=torch.float64)
            for j, term in enumerate(terms):
                sums[seg.param_index, j] += float(torch.linalg.vector_norm(term, dtype=torch.float64) ** 2)
    if sums is None:  # no segment here (or an empty parameter): the norms are 0
        probe = rule.norm_terms(torch.zeros(0), torch.zeros(0), [torch.zeros(0) for _ in range(k)], h)
        sums = torch.zeros(layout.num_params, len(probe), dtype=torch.float64)
    if layout.sharded:
        layout.comm.all_reduce_sum(sums)
    norms = sums.sqrt().tolist()
    by_param: Dict[int, Dict[str, float]] = {}
    out = []
    for seg in layout.segments:
        hp = by_param.get(seg.param_index)
        if hp is None:
            hp = by_param[seg.param_index] = rule.norm_hyper(h, norms[seg.param_index])
        out.append(hp)
    return out


class _Plan:
    """The pieces of one step, sorted by path and batched by group and step scalars, then run."""

    def __init__(self, rule: Rule, skip: Optional[torch.Tensor]):
        self.rule = rule
        self.skip = skip  # CUDA: one int32 on the device, non-zero when the step must write nothing
        self.sums_of: Dict[int, torch.Tensor] = {}  # telemetry: id(8-bit item) -> its (states, 3) error sums
        self._skip_read: Optional[bool] = None
        self.eight: Dict[tuple, tuple] = {}
        self.fp32: Dict[tuple, tuple] = {}
        self.shared: Dict[int, tuple] = {}  # id(comm) -> (comm, [TensorStep with its keys])

    def _bucket(self, table, group, h):
        key = (id(group), id(h))
        entry = table.get(key)
        if entry is None:
            entry = table[key] = (group, h, [])
        return entry[2]

    def add(self, t: TensorStep) -> None:
        layout, group, h, seg_hyper = t.state.layout, t.group, t.hyper, t.segment_hyper
        if seg_hyper is not None and len(layout.segments) == 1:
            h, seg_hyper = seg_hyper[0], None  # one parameter: one set of scalars
        keys = None
        if t.sr_step is not None:
            keys = [rounding.sr_key(t.sr_step, layout.group_index, seg.param_index) for seg in layout.segments]
        keys32 = keys if stochastic_params(group, t.param.dtype) else None
        qs = t.state
        corr = correction_of(t)
        if seg_hyper is None and layout.whole8:
            item = Item8(t.param, t.grad, qs.stored(codes_key), tuple(qs.absmax()), keys and (keys[0], 0), corr)
            self._bucket(self.eight, group, h).append(item)
            if t.sums is not None:
                self.sums_of[id(item)] = t.sums[0]
        elif seg_hyper is None and layout.whole32:
            self._bucket(self.fp32, group, h).append(
                Item32(t.param, t.grad, qs.stored(fp32_key), keys32 and (keys32[0], 0), corr))
        else:
            self._add_pieces(t, h, seg_hyper, keys, keys32, corr)
        if layout.sharded:
            entry = self.shared.get(id(layout.comm))
            if entry is None:
                entry = self.shared[id(layout.comm)] = (layout.comm, [])
            entry[1].append((t, h, seg_hyper, keys))

    def _add_pieces(self, t: TensorStep, h, seg_hyper, keys, keys32, corr) -> None:
        layout, group = t.state.layout, t.group
        sizes, at8, at32, _ = layout.splits()
        pv = layout.param_views(t.param).split(sizes)
        gv = t.grad.view(-1).split(sizes)
        cv = (None,) * len(sizes) if corr is None else corr.split(sizes)

        def rounding_of(piece, which=keys):
            return None if which is None else (which[piece.segment], layout.piece_param_start(piece))

        if layout.has8:
            for j, (piece, cs, am) in zip(at8, t.state.piece_views()):
                hp = h if seg_hyper is None else seg_hyper[piece.segment]
                item = Item8(pv[j], gv[j], cs, am, rounding_of(piece), cv[j])
                self._bucket(self.eight, group, hp).append(item)
                if t.sums is not None:
                    self.sums_of[id(item)] = t.sums[piece.segment]
        if layout.has32:
            for j, (piece, states) in zip(at32, t.state.fp32_piece_views()):
                hp = h if seg_hyper is None else seg_hyper[piece.segment]
                self._bucket(self.fp32, group, hp).append(
                    Item32(pv[j], gv[j], states, rounding_of(piece, keys32), cv[j]))

    def run(self) -> None:
        rule = self.rule
        # the pieces are disjoint, so the order is free: the shared pieces first, while the caches
        # still hold what their small operations use (after the big kernels they took 2-3x longer)
        if self.shared and not self._skipped():
            for comm, tensors in self.shared.values():
                self._run_shared(comm, tensors)
        for group, h, items in self.eight.values():
            sums = [self.sums_of[id(it)] for it in items] if self.sums_of else None
            rest = fused_step_many(rule, items, group, h, skip=self.skip, error_sums=sums)
            if rest and not self._skipped():
                quant = block_codec(rule, group)
                for item in rest:
                    reference_step_8bit(rule, item, group, h, error_sums=self.sums_of.get(id(item)), codec=quant)
        for group, h, items in self.fp32.values():
            rest = fused_step_fp32_many(rule, items, group, h, skip=self.skip)
            if rest and not self._skipped():
                for item in rest:
                    reference_step_32bit(rule, item, group, h)

    def _skipped(self) -> bool:
        """Whether the step is skipped, for the pure-PyTorch paths, which cannot read a device flag:
        they wait for it once (the kernels never do)."""
        if self.skip is None:
            return False
        if self._skip_read is None:
            self._skip_read = bool(self.skip.item())
        return self._skip_read

    def _run_shared(self, comm, tensors) -> None:
        """Update every shared piece, agree on the block maxima with one all-reduce MAX, quantize.

        Each tensor reserves ``num_slots`` entries per state in the all-reduce vector, also where this
        rank holds no shared piece of it, so that the vector is the same on every rank."""
        k = self.rule.num_states
        total = sum(t.state.layout.num_slots * k for t, *_ in tensors)
        pending, base, device = [], 0, None
        for t, h, seg_hyper, keys in tensors:
            layout = t.state.layout
            if layout.shared8:
                device = t.param.device
                if seg_hyper is None:
                    pending.append(_update_shared(self.rule, t, h, None, base, keys))
                else:  # per-parameter step scalars: one batch per parameter
                    by_hyper: Dict[int, tuple] = {}
                    for j, piece in enumerate(layout.shared8):
                        hp = seg_hyper[piece.segment]
                        by_hyper.setdefault(id(hp), (hp, []))[1].append(j)
                    for hp, which in by_hyper.values():
                        pending.append(_update_shared(self.rule, t, hp, which, base, keys))
            base += layout.num_slots * k
        vec = torch.zeros(total, dtype=torch.float32, device=device if device is not None else "cpu")
        for slots, maxima, _ in pending:
            vec[slots] = maxima
        comm.all_reduce_max(vec)
        for slots, _, finish in pending:
            finish(vec[slots])


# ---------------------------------------------------------------------------- the shared-block path
def _update_shared(rule: Rule, t: TensorStep, h, which, base: int, keys):
    """Update a tensor's shared pieces (all, or those in ``which``) in fp32; returns their slots in
    the all-reduce vector, their local maxima, and the function that quantizes once they are agreed."""
    qs, layout, group, p, sums = t.state, t.state.layout, t.group, t.param, t.sums
    k = rule.num_states
    device = p.device
    maps = maps_of(rule, group, device)
    elem, code_at, absmax_at, owner, slots, in_param = layout.shared_index(device, which)
    codes, absmax = qs.codes(), qs.absmax()
    pf, gf = layout.param_views(p), t.grad.view(-1)
    corr = correction_of(t)
    p32 = read_param(pf.index_select(0, elem), None if corr is None else corr.index_select(0, elem))
    states = [maps[i].index_select(0, codes[i].index_select(0, code_at).long())
              * absmax[i].index_select(0, absmax_at).to(torch.float32).index_select(0, owner) for i in range(k)]
    rule.update(p32, gf.index_select(0, elem).to(torch.float32), states, h)
    element_keys = None  # each element's key is its parameter's
    pieces = layout.shared8 if which is None else [layout.shared8[j] for j in which]
    if keys is not None:
        element_keys = [keys[pc.segment] for pc in pieces]
    if corr is not None:
        b, c = rounding.split_bf16(p32)
        pf.index_copy_(0, elem, b)
        corr.index_copy_(0, elem, c)
    elif element_keys is None or not stochastic_params(group, pf.dtype) or pf.dtype == torch.float32:
        pf.index_copy_(0, elem, p32.to(pf.dtype))
    else:
        piece_keys = torch.tensor(element_keys, dtype=torch.int64, device=device)
        pf.index_copy_(0, elem, rounding.round_stochastic(p32, pf.dtype, piece_keys[owner], in_param))
    state_bits = [None] * k
    if element_keys is not None:
        for i, on in enumerate(stochastic_states(group, rule.state_signed)):
            if on:
                per_piece = torch.tensor([rounding.state_key(key, i) for key in element_keys], dtype=torch.int64,
                                         device=device)
                state_bits[i] = rounding.random_bits(per_piece[owner], in_param)
    n = absmax_at.numel()
    if sums is not None:
        segment_of = torch.tensor([pc.segment for pc in pieces], dtype=torch.int64, device=device)
    maxima = torch.zeros(k, n, dtype=torch.float32, device=device)
    for i in range(k):
        maxima[i].scatter_reduce_(0, owner, states[i].abs(), reduce="amax", include_self=True)
    slot_index = (base + slots + layout.num_slots * torch.arange(k, device=device)[:, None]).reshape(-1)

    def finish(agreed: torch.Tensor) -> None:
        stored = F.stored_absmax(agreed.view(k, n))  # rounding up is monotone: any rank may round
        agreed = stored.to(torch.float32)
        scale = torch.where(agreed > 0, 1.0 / agreed, torch.zeros_like(agreed))
        for i in range(k):
            q = F.quantize_scaled(states[i] * scale[i].index_select(0, owner), maps[i], state_bits[i],
                                  _midpoints(maps[i]))
            codes[i].index_copy_(0, code_at, q)
            absmax[i].index_copy_(0, absmax_at, stored[i])
            if sums is not None:  # telemetry: each element's error goes to its piece's parameter
                back = maps[i][q.long()] * agreed[i].index_select(0, owner)
                seg = segment_of[owner]
                sums[:, i, 0].index_add_(0, seg, (back - states[i]).double().abs())
                sums[:, i, 1].index_add_(0, seg, states[i].double().abs())
                sums[:, i, 2].index_add_(0, seg, ((back == 0) & (states[i] != 0)).double())

    return slot_index, maxima.reshape(-1), finish


_MIDPOINTS: Dict[tuple, tuple] = {}


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    """``F.midpoints`` of a map, computed once per map tensor."""
    key = (code.data_ptr(), str(code.device), code._version)
    hit = _MIDPOINTS.get(key)
    if hit is None:  # the map is kept with its midpoints, so its address cannot be reused
        hit = _MIDPOINTS[key] = (code, F.midpoints(code))
    return hit[1]


# ---------------------------------------------------------------------------- the reference path
def read_param(p: torch.Tensor, correction: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A parameter (or its chunk) as fp32: with its correction bytes, the 24-bit value they make."""
    if correction is None:
        return p.to(torch.float32)
    return rounding.join_bf16(p.reshape(-1), correction.reshape(-1)).view(p.shape)


def write_param(dst: torch.Tensor, p32: torch.Tensor, sr: Optional[Rounding], offset: int = 0,
                correction: Optional[torch.Tensor] = None) -> None:
    """Write fp32 values into a parameter (or its chunk): rounded to nearest, stochastically with
    ``sr = (key, index of dst's first element in its parameter)``, or split into bf16 and its
    ``correction`` bytes."""
    if correction is not None:
        b, c = rounding.split_bf16(p32.reshape(-1))
        dst.copy_(b.view(dst.shape))
        correction.copy_(c.view(correction.shape))
        return
    if sr is None or dst.dtype == torch.float32:
        dst.copy_(p32.view(dst.shape))
        return
    index = torch.arange(sr[1] + offset, sr[1] + offset + p32.numel(), device=p32.device)
    dst.copy_(rounding.round_stochastic(p32.reshape(-1), dst.dtype, sr[0], index).view(dst.shape))


def reference_step_32bit(rule: Rule, item: Item32, group: dict, h) -> None:
    p, grad, states, sr, corr = item
    if p.dtype == torch.float32:
        rule.update(p.data, grad.to(torch.float32), list(states), h)
    else:
        p32 = read_param(p.data, corr)
        rule.update(p32, grad.to(torch.float32), list(states), h)
        write_param(p.data, p32, sr, correction=corr)


class BlockCodec(NamedTuple):
    """Block-wise (de)quantization by the compiled kernels, for a rule that has no fused step
    (Muon's momentum): the same codes and values as functional.py's, which is their specification
    (``tests/test_kernels.py``). ``quantize(x, map, bs) -> (codes, absmax)`` rounds to nearest."""
    quantize: Callable
    dequantize: Callable


def block_codec(rule: Rule, group: dict) -> Optional[BlockCodec]:
    """The compiled codec where ``rule`` has no fused kernel and the group may use kernels
    (``impl`` not ``"reference"``); None: functional.py's."""
    if rule.name or group.get("impl", "auto") == "reference":
        return None
    return BlockCodec(_kernel_quantize, _kernel_dequantize)


def _kernel_quantize(x: torch.Tensor, code: torch.Tensor, bs: int):
    try:
        return ops.quantize_blockwise(x, code, bs)
    except ValueError:  # a non-finite value: the reference maps it as the step's specification says
        am = F.block_absmax(x, bs)
        return F.quantize_with_absmax(x, am, code, bs), am


def _kernel_dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, bs: int) -> torch.Tensor:
    return ops.dequantize_blockwise(codes, absmax, code, bs)


def reference_step_8bit(rule: Rule, item: Item8, group: dict, h, error_sums=None,
                        codec: Optional[BlockCodec] = None) -> None:
    """The specification of the 8-bit step, on a tensor (or piece) whose first element starts a block.

    ``item.rounding`` is None or ``(key, index of p's first element in its parameter)``: the random
    bits of stochastic rounding (``rounding.py``), for 16-bit parameter writes and for the states that
    :func:`stochastic_states` names. ``error_sums`` (telemetry) takes the requantization error.
    ``codec`` (:func:`block_codec`) dequantizes and requantizes (to nearest) in the compiled kernels."""
    p, grad, codes, absmax, sr, corr = item
    bs = F.resolve_block_size(group["block_size"], p.numel())
    maps = maps_of(rule, group, p.device)
    state_keys = [rounding.state_key(sr[0], i) if sr is not None and on else None
                  for i, on in enumerate(stochastic_states(group, rule.state_signed))]
    param_sr = sr if stochastic_params(group, p.dtype) else None
    n = p.numel()
    # a non-contiguous parameter (e.g. a transposed view) is stepped in a flat copy, written back below
    in_place = p.data.is_contiguous()
    pf = p.data.view(-1) if in_place else p.data.reshape(-1).clone()
    gf = grad.reshape(-1)
    flat_codes = [c.view(-1) for c in codes]
    chunk = max(bs, qstate.CHUNK // bs * bs)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        b0, b1 = start // bs, F.num_blocks(end, bs)
        corr_chunk = None if corr is None else corr.view(-1)[start:end]
        p32 = pf[start:end] if p.dtype == torch.float32 else read_param(pf[start:end], corr_chunk)
        g32 = gf[start:end].to(torch.float32)
        dequantize = F.dequantize_flat if codec is None else codec.dequantize
        states = [dequantize(c[start:end], a[b0:b1], m, bs) for c, a, m in zip(flat_codes, absmax, maps)]
        rule.update(p32, g32, states, h)
        for c, a, m, s, key in zip(flat_codes, absmax, maps, states, state_keys):
            if codec is not None and key is None:
                c[start:end], a[b0:b1] = codec.quantize(s, m, bs)
                continue
            new_absmax = F.block_absmax(s, bs)
            a[b0:b1] = new_absmax
            bits = None if key is None else rounding.random_bits(
                key, torch.arange(sr[1] + start, sr[1] + end, device=p.device))
            c[start:end] = F.quantize_with_absmax(s, new_absmax, m, bs, bits)
        if error_sums is not None:
            for i, (c, a, m, s) in enumerate(zip(flat_codes, absmax, maps, states)):
                telemetry.add_error(error_sums, i, F.dequantize_flat(c[start:end], a[b0:b1], m, bs), s)
        if p.dtype != torch.float32:
            write_param(pf[start:end], p32, param_sr, start, correction=corr_chunk)
    if not in_place:
        p.data.copy_(pf.view(p.shape))


# ---------------------------------------------------------------------------- the kernel path
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _no_kernel(items, strict: bool, why: str) -> list:
    """Items that no kernel takes: back to the caller (reference step), or an error under impl='kernel'."""
    if strict and items:
        raise ValueError(f"impl='kernel': {why}; use impl='auto' to step such tensors with the reference")
    return list(items)


def _unsupported(p: torch.Tensor, grad: torch.Tensor, states=()) -> Optional[str]:
    """Why the kernels cannot take this tensor, or None (cheap attribute reads: runs per tensor per step)."""
    pd, gd = p.dtype, grad.dtype
    if pd not in _SUPPORTED or (gd is not pd and gd is not torch.float32):
        return f"no kernel for {pd} parameters with {gd} gradients"
    if p.device.type not in ("cpu", "cuda") or grad.device != p.device:
        return f"no kernel for a parameter on {p.device} with its gradient on {grad.device}"
    if not p.is_contiguous() or not all(s.is_contiguous() for s in states):
        return "the kernels need contiguous parameters and states"
    return None


def kernel_rule(rule: Rule, group: dict, items) -> Tuple[Optional[str], bool]:
    """The one place ``impl`` is decided: ``(kernel name, strict)`` for a batch of items, or
    ``(None, strict)`` when they all go to the reference."""
    impl = group_impl(group)
    strict = impl == "kernel"
    if impl == "reference" or not items:
        return None, strict
    if not rule.name:
        _no_kernel(items, strict, "this update rule has no fused kernel")
    return rule.name or None, strict


def _module_with_rule(device, name: str, strict: bool, batch):
    """The op for ``device`` if it knows rule ``name``; else None (and the batch goes to the reference)."""
    module = ops.load_op(device.type, required=strict)
    if module is None:
        return None
    if name not in module.rules():
        if not strict:
            ops.warn_once(f"rule-{name}", f"ds_q8: no fused kernel for update rule '{name}'; using the reference step")
        _no_kernel(batch, strict, f"no fused kernel for update rule {name!r}")
        return None
    return module


def _kernel_maps(rule: Rule, group: dict, device, module, strict: bool):
    """The maps and their lookup tables for a kernel call, or None (one warning) when a map has none."""
    maps = maps_of(rule, group, device)
    try:
        return maps, [ops.lookup_table(m, module) for m in maps]
    except ValueError as exc:  # a map too dense for the one-comparison table
        if strict:
            raise ValueError(f"impl='kernel': no fused kernel for quantization={group['quantization']!r} ({exc})") \
                from None
        ops.warn_once(f"map-{group['quantization']}", f"ds_q8: no fused kernel for this map ({exc}); using the "
                                                      "reference step")
        return None


def _rounding_lists(items) -> Tuple[list, list]:
    """The kernels' sr_keys and sr_index lists for a batch: empty when no item asks for stochastic
    rounding (an item that does not, in a batch that does, is a float32 tensor: unaffected)."""
    if all(it.rounding is None for it in items):
        return [], []
    return ([it.rounding[0] if it.rounding is not None else 0 for it in items],
            [it.rounding[1] if it.rounding is not None else 0 for it in items])


def _corrections(items) -> list:
    """The kernels' corrections list for a batch: empty, or every item's bytes (a batch shares its
    group and parameter dtype, which decide whether there are any)."""
    if all(it.correction is None for it in items):
        return []
    if any(it.correction is None for it in items):
        raise RuntimeError("a kernel batch mixes parameters with and without correction bytes")
    return [it.correction for it in items]


def _batches(items, strict: bool, rest: list, states_of=None) -> Dict[tuple, list]:
    """Items grouped by device and dtypes (one kernel call each); those no kernel takes go to ``rest``."""
    batches: Dict[tuple, list] = {}
    for item in items:
        p, grad = item.param, item.grad
        why = _unsupported(p, grad, states_of(item) if states_of else ())
        if why is None and states_of and not all(s.device == p.device for s in states_of(item)):
            why = f"the float32 states of a parameter on {p.device} must be on its device"
        if why is not None:
            rest.extend(_no_kernel([item], strict, why))
            continue
        batches.setdefault((p.get_device() if p.is_cuda else -1, p.dtype, grad.dtype), []).append(item)
    return batches


def fused_step_many(rule: Rule, items: List[Item8], group: dict, hyper, skip=None, error_sums=None) -> list:
    """The 8-bit step of many pieces that share ``group`` and ``hyper``, in one kernel call per device
    and dtypes (on CPU one parallel loop over all their blocks). Returns the items it did not step,
    which the caller steps with the reference (``impl="auto"`` only: under ``impl="kernel"`` an item
    without a kernel raises). ``skip`` is a CUDA step's device flag, read by the CUDA kernels.
    ``error_sums`` (telemetry, one float64 ``(states, 3)`` tensor per item) take each item's
    requantization error, magnitude and count of nonzero values requantized to zero."""
    name, strict = kernel_rule(rule, group, items)
    if name is None:
        return list(items)
    if group["block_size"] is None:
        return _no_kernel(items, strict, "block_size=None (one block per tensor) has no kernel")
    rest: list = []
    sums_of = {id(it): s for it, s in zip(items, error_sums)} if error_sums is not None else {}
    for batch in _batches(items, strict, rest).values():
        device = batch[0].param.device
        module = _module_with_rule(device, name, strict, batch)
        maps = _kernel_maps(rule, group, device, module, strict) if module is not None else None
        if maps is None:
            rest.extend(batch)
            continue
        # the kernel writes each param's memory in place, as p.data would
        params = [it.param for it in batch]
        grads = [g if g.is_contiguous() else g.contiguous() for g in (it.grad for it in batch)]
        keys, index = _rounding_lists(batch)
        # the random bits serve 16-bit parameter writes and the stochastically requantized states
        stoch_params = bool(keys) and stochastic_params(group, params[0].dtype)
        stoch_states = [bool(keys) and on for on in stochastic_states(group, rule.state_signed)]
        sums = [sums_of[id(it)] for it in batch] if sums_of else []
        ops.call(module, "step_many", params[0], name, params, grads, [it.codes for it in batch],
                 [it.absmax for it in batch], maps[0], maps[1], group["block_size"], dict(hyper), keys, index,
                 stochastic_params=stoch_params, stochastic_states=stoch_states, error_sums=sums,
                 corrections=_corrections(batch), skip=skip if device.type == "cuda" else None)
    return rest


def fused_step_fp32_many(rule: Rule, items: List[Item32], group: dict, hyper, skip=None) -> list:
    """The same fused step for pieces whose state is float32 (``optim_bits=32`` or below
    ``min_8bit_size``), batched like :func:`fused_step_many`. Returns the items it did not step."""
    name, strict = kernel_rule(rule, group, items)
    if name is None:
        return list(items)
    rest: list = []
    for batch in _batches(items, strict, rest, states_of=lambda it: it.states).values():
        device = batch[0].param.device
        module = _module_with_rule(device, name, strict, batch)
        if module is None:
            rest.extend(batch)
            continue
        keys, index = _rounding_lists(batch)
        ops.call(module, "step_fp32_many", batch[0].param, name, [it.param for it in batch],
                 [it.grad if it.grad.is_contiguous() else it.grad.contiguous() for it in batch],
                 [it.states for it in batch], dict(hyper), keys, index, corrections=_corrections(batch),
                 skip=skip if device.type == "cuda" else None)
    return rest


__all__ = ["corrected", "correction_of", "read_param", "step", "segment_hypers", "TensorStep", "Item8", "Item32", "IMPLS", "group_impl", "stochastic_params",
           "stochastic_states", "fused_step_many", "fused_step_fp32_many", "reference_step_8bit",
           "reference_step_32bit", "kernel_rule", "write_param"]
