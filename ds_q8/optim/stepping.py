"""One ``step()`` call's work, laid out by :class:`~ds_q8.optim.layout.StateLayout` and then run.

Every optimized tensor contributes *pieces* (see ``layout.py``):
  * 8-bit pieces made of whole blocks go to the fused kernels, all pieces that share a group and
    step scalars in one call (the pure-PyTorch reference takes what no kernel can);
  * fp32 pieces go to the fused fp32-state kernel the same way;
  * shared pieces, the local parts of blocks that a partition edge cuts, are updated in one
    batched reference pass; their block maxima are agreed across ranks with one all-reduce MAX
    per process group and call, and only then quantized.
All three write the bits the reference writes, so a parameter's codes, block maxima and values do
not depend on where ZeRO cut it.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .. import functional as F
from . import rounding
from .layout import StateLayout

# Elements processed per chunk by the reference path: bounds its fp32 temporaries.
REFERENCE_CHUNK = 1 << 20


def state_views(state: dict, k: int, codes: bool):
    """Flat views of a tensor's packed codes and block maxima (``codes``) or fp32 values."""
    if codes:
        return ([state[f"state{i}"].view(-1) for i in range(1, k + 1)],
                [state[f"absmax{i}"] for i in range(1, k + 1)])
    return [state[f"state{i}_fp32"].view(-1) for i in range(1, k + 1)], None


def dequantize_piece(codes: List[torch.Tensor], absmax: List[torch.Tensor], maps, bs: int, piece, start: int,
                     end: int) -> List[torch.Tensor]:
    """fp32 state values of elements ``[start, end)`` of an 8-bit piece (block-aligned within it)."""
    off = start - piece.start
    c0 = piece.codes_start + off
    if piece.slot >= 0:  # part of one shared block
        return [m[c[c0:c0 + end - start].long()] * a[piece.absmax_start] for c, a, m in zip(codes, absmax, maps)]
    b0 = piece.absmax_start + off // bs
    b1 = piece.absmax_start + (end - piece.start + bs - 1) // bs
    return [F.dequantize_flat(c[c0:c0 + end - start], a[b0:b1], m, bs) for c, a, m in zip(codes, absmax, maps)]


def piece_chunks(piece, bs: int):
    """``(start, end)`` chunks of a piece, each a whole number of blocks (shared pieces: one chunk)."""
    if piece.slot >= 0:
        yield piece.start, piece.end
        return
    chunk = max(bs, REFERENCE_CHUNK // bs * bs)
    for s in range(piece.start, piece.end, chunk):
        yield s, min(piece.end, s + chunk)


def segment_values(layout: StateLayout, state: dict, si: int, maps, k: int):
    """Yield ``(start, end, [fp32 values per state])`` over segment ``si``, chunk by chunk, in order."""
    seg = layout.segments[si]
    if not seg.eight_bit:
        f32, _ = state_views(state, k, codes=False)
        base = layout.segment_codes[si] - seg.start
        for s in range(seg.start, seg.end, REFERENCE_CHUNK):
            e = min(seg.end, s + REFERENCE_CHUNK)
            yield s, e, [f[base + s:base + e] for f in f32]
        return
    codes, absmax = state_views(state, k, codes=True)
    _, _, bs = layout.segment_blocks(si)
    for piece in layout.pieces_of(si):
        for s, e in piece_chunks(piece, bs):
            yield s, e, dequantize_piece(codes, absmax, maps, bs, piece, s, e)


class StepRunner:
    """Collects the pieces of one ``step()`` call, then runs them (see the module doc)."""

    def __init__(self, opt, skip: Optional[torch.Tensor] = None):
        self.opt = opt
        self.skip = skip  # CUDA: one int32 on the device, non-zero when the step must write nothing
        self.sums_of: Dict[int, torch.Tensor] = {}  # telemetry: id(8-bit item) -> its (states, 2) error sums
        self._skip_read: Optional[bool] = None
        self.k = len(opt.state_signed)
        self.eight: Dict[tuple, tuple] = {}
        self.fp32: Dict[tuple, tuple] = {}
        self.shared: Dict[int, tuple] = {}  # id(comm) -> (comm, [(layout, group, [(hyper, item)])])

    def _bucket(self, table, group, h):
        key = (id(group), id(h))
        entry = table.get(key)
        if entry is None:
            entry = table[key] = (group, h, [])
        return entry[2]

    def add(self, p: torch.Tensor, grad: torch.Tensor, state: dict, layout: StateLayout, group: dict, h,
            seg_hyper: Optional[list] = None, sr_step: Optional[int] = None,
            sums: Optional[torch.Tensor] = None) -> None:
        """Queue tensor ``p``'s step. ``seg_hyper`` gives each segment its own step scalars (LAMB, LARS);
        ``sr_step`` (``rounding.step_key``) asks for random bits: stochastic rounding of 16-bit parameter
        writes (``opt._stochastic``) and of the states that ``opt.stochastic_states`` names.

        Every item ends with its rounding: None, or (key, index of its first element in its parameter).
        fp32-state items carry it only for stochastic parameter writes. ``sums`` (telemetry, a measured
        step) takes the requantization error of each segment and state.
        """
        k = self.k
        if seg_hyper is not None and len(layout.segments) == 1:
            h, seg_hyper = seg_hyper[0], None  # one parameter: one set of scalars
        keys = None
        if sr_step is not None:
            keys = [rounding.sr_key(sr_step, layout.group_index, seg.param_index) for seg in layout.segments]
        keys32 = keys if self.opt.stochastic_params(group, p) else None
        if seg_hyper is None and layout.whole8:
            item = (p, grad, tuple(state[f"state{i}"] for i in range(1, k + 1)),
                    tuple(state[f"absmax{i}"] for i in range(1, k + 1)), keys and (keys[0], 0))
            self._bucket(self.eight, group, h).append(item)
            if sums is not None:
                self.sums_of[id(item)] = sums[0]
        elif seg_hyper is None and layout.whole32:
            self._bucket(self.fp32, group, h).append(
                (p, grad, tuple(state[f"state{i}_fp32"] for i in range(1, k + 1)), keys32 and (keys32[0], 0)))
        else:
            self._add_pieces(p, grad, state, layout, group, h, seg_hyper, keys, keys32, sums)
        if layout.sharded:
            entry = self.shared.get(id(layout.comm))
            if entry is None:
                entry = self.shared[id(layout.comm)] = (layout.comm, [])
            entry[1].append((layout, group, p, grad, state, h, seg_hyper, keys, sums))

    def _add_pieces(self, p, grad, state, layout, group, h, seg_hyper, keys, keys32, sums) -> None:
        sizes, at8, at32, _ = layout.splits()
        pv = layout.param_views(p).split(sizes)
        gv = grad.view(-1).split(sizes)

        def rounding_of(piece, which=keys):
            return None if which is None else (which[piece.segment], layout.piece_param_start(piece))

        if layout.has8:
            views = layout.cached_views(state, self.k)
            for j, (piece, cs, am) in zip(at8, views):
                hp = h if seg_hyper is None else seg_hyper[piece.segment]
                item = (pv[j], gv[j], cs, am, rounding_of(piece))
                self._bucket(self.eight, group, hp).append(item)
                if sums is not None:
                    self.sums_of[id(item)] = sums[piece.segment]
        if layout.has32:
            f32, _ = state_views(state, self.k, codes=False)
            for j, piece in zip(at32, layout.pieces32):
                hp = h if seg_hyper is None else seg_hyper[piece.segment]
                n0 = piece.codes_start
                self._bucket(self.fp32, group, hp).append(
                    (pv[j], gv[j], tuple(f[n0:n0 + piece.numel] for f in f32), rounding_of(piece, keys32)))

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        from .. import ops

        opt = self.opt
        # the pieces are disjoint, so the order is free: the shared pieces first, while the caches
        # still hold what their small operations use (after the big kernels they took 2-3x longer)
        if self.shared and not self._skipped():
            for comm, tensors in self.shared.values():
                self._run_shared(comm, tensors)
        for group, h, items in self.eight.values():
            sums = [self.sums_of[id(it)] for it in items] if self.sums_of else None
            rest = ops.fused_step_many(opt, items, group, h, skip=self.skip, error_sums=sums)
            if rest and not self._skipped():
                for item in rest:
                    opt._reference_step_8bit(*item, group, h, error_sums=self.sums_of.get(id(item)))
        for group, h, items in self.fp32.values():
            rest = ops.fused_step_fp32_many(opt, items, group, h, skip=self.skip)
            if rest and not self._skipped():
                for item in rest:
                    opt._reference_step_32bit(*item, h)

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
        rank holds no shared piece of it, so that the vector is the same on every rank.
        """
        k = self.k
        total = sum(layout.num_slots * k for layout, *_ in tensors)
        pending, base, device = [], 0, None
        for layout, group, p, grad, state, h, seg_hyper, keys, sums in tensors:
            if layout.shared8:
                device = p.device
                if seg_hyper is None:
                    pending.append(self._update_shared(layout, group, p, grad, state, h, None, base, keys, sums))
                else:  # per-parameter step scalars: one batch per parameter
                    by_hyper: Dict[int, tuple] = {}
                    for j, piece in enumerate(layout.shared8):
                        hp = seg_hyper[piece.segment]
                        by_hyper.setdefault(id(hp), (hp, []))[1].append(j)
                    for hp, which in by_hyper.values():
                        pending.append(self._update_shared(layout, group, p, grad, state, hp, which, base, keys,
                                                           sums))
            base += layout.num_slots * k
        vec = torch.zeros(total, dtype=torch.float32, device=device if device is not None else "cpu")
        for slots, maxima, _ in pending:
            vec[slots] = maxima
        comm.all_reduce_max(vec)
        for slots, _, finish in pending:
            finish(vec[slots])

    def _update_shared(self, layout, group, p, grad, state, h, which, base, keys, sums=None):
        """Update a tensor's shared pieces (all, or those in ``which``) in fp32; returns their slots in
        the all-reduce vector, their local maxima, and the function that quantizes once they are agreed."""
        opt, k = self.opt, self.k
        device = p.device
        maps = opt._maps(group, device)
        elem, code_at, absmax_at, owner, slots, in_param = layout.shared_index(device, which)
        codes, absmax = state_views(state, k, codes=True)
        pf, gf = layout.param_views(p), grad.view(-1)
        p32 = pf.index_select(0, elem).to(torch.float32)
        states = [maps[i].index_select(0, codes[i].index_select(0, code_at).long())
                  * absmax[i].index_select(0, absmax_at).index_select(0, owner) for i in range(k)]
        opt._update_fp32(p32, gf.index_select(0, elem).to(torch.float32), states, h)
        element_keys = None  # each element's key is its parameter's
        if keys is not None:
            pieces = layout.shared8 if which is None else [layout.shared8[j] for j in which]
            element_keys = [keys[pc.segment] for pc in pieces]
        if element_keys is None or not opt.stochastic_params(group, p) or pf.dtype == torch.float32:
            pf.index_copy_(0, elem, p32.to(pf.dtype))
        else:
            piece_keys = torch.tensor(element_keys, dtype=torch.int64, device=device)
            pf.index_copy_(0, elem, rounding.round_stochastic(p32, pf.dtype, piece_keys[owner], in_param))
        state_bits = [None] * k
        if element_keys is not None:
            for i, on in enumerate(opt.stochastic_states(group)):
                if on:
                    per_piece = torch.tensor([rounding.state_key(key, i) for key in element_keys], dtype=torch.int64,
                                             device=device)
                    state_bits[i] = rounding.random_bits(per_piece[owner], in_param)
        n = absmax_at.numel()
        if sums is not None:
            pieces = layout.shared8 if which is None else [layout.shared8[j] for j in which]
            segment_of = torch.tensor([pc.segment for pc in pieces], dtype=torch.int64, device=device)
        maxima = torch.zeros(k, n, dtype=torch.float32, device=device)
        for i in range(k):
            maxima[i].scatter_reduce_(0, owner, states[i].abs(), reduce="amax", include_self=True)
        slot_index = (base + slots + layout.num_slots * torch.arange(k, device=device)[:, None]).reshape(-1)

        def finish(agreed: torch.Tensor) -> None:
            agreed = agreed.view(k, n)
            scale = torch.where(agreed > 0, 1.0 / agreed, torch.zeros_like(agreed))
            for i in range(k):
                q = F.quantize_scaled(states[i] * scale[i].index_select(0, owner), maps[i], state_bits[i],
                                      _midpoints(maps[i]))
                codes[i].index_copy_(0, code_at, q)
                absmax[i].index_copy_(0, absmax_at, agreed[i])
                if sums is not None:  # telemetry: each element's error goes to its piece's parameter
                    err = (maps[i][q.long()] * agreed[i].index_select(0, owner) - states[i]).double().abs()
                    seg = segment_of[owner]
                    sums[:, i, 0].index_add_(0, seg, err)
                    sums[:, i, 1].index_add_(0, seg, states[i].double().abs())

        return slot_index, maxima.reshape(-1), finish


_MIDPOINTS: Dict[tuple, tuple] = {}


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    """``F.midpoints`` of a map, computed once per map tensor."""
    key = (code.data_ptr(), str(code.device), code._version)
    hit = _MIDPOINTS.get(key)
    if hit is None:  # the map is kept with its midpoints, so its address cannot be reused
        hit = _MIDPOINTS[key] = (code, F.midpoints(code))
    return hit[1]


