"""One optimizer step as a function, the way torch's ``adam()`` is one: ``step(rule, work, skip)``.

``work`` lists :class:`~ds_q8.optim.pieces.TensorStep` s, one per optimized tensor: its parameter (or
ZeRO partition), gradient, :class:`~ds_q8.optim.qstate.QuantizedState`, group, step scalars and
rounding. This module is the entry point and its plan: each tensor is cut into *pieces* by its layout
(``layout.py``) and each piece takes one of three paths, each in a module of its own; all three write
the bits the reference writes, so a parameter's codes, block maxima and values do not depend on the
path or on where ZeRO cut it:

  * ``path_kernel.py``: 8-bit pieces made of whole blocks and fp32-state pieces, in the fused kernels,
    every piece that shares a group and step scalars in one call;
  * ``path_reference.py``: the pure-PyTorch reference, which takes what no kernel can, and the
    parameter reads and writes every path shares;
  * ``path_shared.py``: the local parts of blocks that a partition edge cuts, one batched reference
    pass whose block maxima are agreed across ranks with one all-reduce MAX per process group and call
    (:class:`_Plan` runs it), and only then quantized.

A whole-matrix rule (Muon, ``rule.is_matrix``) takes the same three paths for its element-wise part,
which updates the states and writes each matrix's direction into an fp32 scratch instead of the
parameter; then ``path_matrix.py`` forms each matrix whole (a ZeRO partition's matrices that partition
edges cut, from the slices every rank holds), maps it (Newton-Schulz) and steps the local slice of the
parameter by the result. How a group's options are read (``impl``, rounding, maps) is
``group_options.py``.

Which path a group takes is its ``impl`` option, decided in one place (``path_kernel.kernel_rule``):

  ``"auto"`` (default)  the kernels; where an op cannot be loaded (one warning says why) or a tensor has
                        no kernel, the reference, which gives the same bits, slower
  ``"kernel"``          the kernels or an error: a failed build raises with the build's message, and so
                        does a tensor that no kernel takes
  ``"reference"``       the pure-PyTorch reference only (the kernels are not even loaded)
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from . import nonfinite as NF
from . import rounding
from .group_options import IMPLS
from .group_options import (corrected, correction_of, group_impl, maps_of, stochastic_params,  # noqa: F401
                            rounding_modes)
from .path_kernel import fused_step_fp32_many, fused_step_many, kernel_rule  # noqa: F401
from .path_four import step_four
from .path_matrix import matrix_pass
from .path_reference import (block_codec, read_param, reference_step_32bit, reference_step_8bit,  # noqa: F401
                             write_param)
from .path_shared import update_shared
from .pieces import Item8, Item32, Rounding, TensorStep  # noqa: F401
from .plan import StepPlan
from .state_keys import CORRECTION_KEY, codes_key, fp32_key
from .rules import Rule


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
    maxima are exactly those of every other rule; then each matrix's pass (``path_matrix.matrix_pass``)."""
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
        # the scratch goes with its tensor: matrix_pass frees it as soon as it has what it needs
        held, directions[i] = [directions[i].view(-1)], None
        matrix_pass(rule, t, held)


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
        self.four: list = []  # 4-bit tensors: (TensorStep, step scalars, parameter rounding keys, correction)
        self.copied: list = []  # (strided parameter, the contiguous copy stepped in its place)

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
        if layout.state_bits == 4:  # its quantized pieces take path_four, cut blocks included
            if not t.param.is_contiguous():  # a transposed view, say: stepped in a copy, written back after
                flat = t.param.detach().contiguous()
                self.copied.append((t.param, flat))
                t = t._replace(param=flat)
            if layout.has8 or layout.sharded:
                self.four.append((t, h, keys32, corr))
            if layout.has32:
                self._add_pieces(t, h, seg_hyper, keys, keys32, corr, quantized=False)
            return
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

    def _add_pieces(self, t: TensorStep, h, seg_hyper, keys, keys32, corr, quantized: bool = True) -> None:
        layout, group = t.state.layout, t.group
        sizes, at8, at32, _ = layout.splits()
        pv = layout.param_views(t.param).split(sizes)
        gv = t.grad.view(-1).split(sizes)
        cv = (None,) * len(sizes) if corr is None else corr.split(sizes)

        def rounding_of(piece, which=keys):
            return None if which is None else (which[piece.segment], layout.piece_param_start(piece))

        if layout.has8 and quantized:
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
        if self.four and not self._skipped():
            step_four(rule, self.four)
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
        for param, flat in self.copied:
            param.detach().copy_(flat)

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
                    pending.append(update_shared(self.rule, t, h, None, base, keys))
                else:  # per-parameter step scalars: one batch per parameter
                    by_hyper: Dict[int, tuple] = {}
                    for j, piece in enumerate(layout.shared8):
                        hp = seg_hyper[piece.segment]
                        by_hyper.setdefault(id(hp), (hp, []))[1].append(j)
                    for hp, which in by_hyper.values():
                        pending.append(update_shared(self.rule, t, hp, which, base, keys))
            base += layout.num_slots * k
        vec = torch.zeros(total, dtype=torch.float32, device=device if device is not None else "cpu")
        for slots, maxima, _ in pending:
            vec[slots] = maxima
        comm.all_reduce_max(vec)
        for slots, _, finish in pending:
            finish(vec[slots])


# ---------------------------------------------------------------------------- from an optimizer's groups
def optimizer_step(opt) -> None:
    """One ``step()`` of optimizer ``opt`` (after its closure and ``settle``): the last step's plan where it
    still holds (``plan.py``), else the general path, which leaves a plan for the next step."""
    plan = opt._plan
    grads = plan.gradients(opt) if plan is not None else None
    if grads is not None:
        go, flag = NF.decide(opt, plan.work)
        if go:
            _count_pending(opt, flag, plan.run(opt, grads, flag))
        return
    opt._plan = None
    work = stepped_tensors(opt)
    go, flag = NF.decide(opt, work)
    if not go:
        return
    by_rule, counters = tensor_steps(opt, work)
    for rule, steps in by_rule.values():
        step(rule, steps, skip=flag)
    _count_pending(opt, flag, counters)
    opt._plan = StepPlan.build(opt, work, by_rule)


def _count_pending(opt, flag, counters) -> None:
    """A CUDA step's device skip flag, with the counts it advanced, for ``settle`` to read later."""
    if flag is not None:
        opt._pending_skips.add(flag, counters)


def stepped_tensors(opt) -> list:
    """``(group, parameter)`` of every parameter with a gradient, checked."""
    work = []
    name = type(opt).__name__
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients; use a dense embedding (sparse=False)")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"{name} supports float32/float16/bfloat16 params, got {p.dtype}")
            work.append((group, p))
    return work


def tensor_steps(opt, work):
    """The :class:`TensorStep` of each ``(group, tensor)`` of ``work`` for optimizer ``opt``, grouped by
    rule in the order the groups first use them: ``({id(rule): (rule, steps)}, step counters)``. Each
    tensor's step count is advanced here (a skipped CUDA step takes it back, ``nonfinite.py``), all of
    them at once and only once every tensor's state is ready.

    This runs once per tensor and step, so what depends on the group alone is looked up once per group,
    and what depends on the group and step count alone once per count: with hundreds of tensors it is
    the host's share of a step, which on a GPU comes before the first kernel starts."""
    by_rule: Dict[int, tuple] = {}
    ready = []
    for group, p in work:
        opt._adopt_fp32_state(p, opt.state[p], group=group)
        qs = opt.quantized_state(p, group)
        match_correction(qs.entry, group, p)
        ready.append((group, p, qs))
    counters = [qs.entry for _, _, qs in ready]
    counts = _advance(counters)
    of_group: Dict[int, tuple] = {}  # id(group) -> (rule, any state rounded stochastically)
    of_count: Dict[tuple, tuple] = {}  # (id(group), count) -> (step scalars, rounding key of the step)
    telemetry = opt._telemetry
    for (group, p, qs), count in zip(ready, counts):
        g = of_group.get(id(group))
        if g is None:
            rule = opt.rule_for(group)
            g = of_group[id(group)] = (rule, any(opt.rounding_modes(group)))
        rule, states_random = g
        c = of_count.get((id(group), count))
        if c is None:
            c = of_count[(id(group), count)] = (opt._hyper(group, count),
                                                rounding.step_key(group.get("sr_seed", 0), count))
        h, key = c
        random = opt.stochastic_params(group, p) or (qs.layout.has8 and states_random)
        sums = None if telemetry is None else telemetry.sums_for(p, qs.layout, rule.num_states, count)
        t = TensorStep(p, p.grad, qs, group, h, None, key if random else None, sums)
        if rule.needs_norms:
            t = t._replace(segment_hyper=segment_hypers(rule, t))
        by_rule.setdefault(id(rule), (rule, []))[1].append(t)
    return by_rule, counters


def _advance(entries: Sequence[dict]) -> List[int]:
    """Count one more step in each state entry (one foreach add over their step tensors); their new
    step numbers."""
    steps = []
    for entry in entries:
        step_t = entry["step"]
        if not torch.is_tensor(step_t):  # an int written by a loader
            step_t = entry["step"] = torch.tensor(float(step_t))
        steps.append(step_t)
    if steps:
        torch._foreach_add_(steps, 1)
    return [int(step_t.item()) for step_t in steps]


def match_correction(entry: dict, group: dict, p: torch.Tensor) -> None:
    """Give a bf16 tensor its correction bytes when its group asks for them (zeros: the master is
    exactly the bf16 value, as after a load from a checkpoint without them), and drop bytes that a
    group without the option would leave stale."""
    if corrected(group, p.dtype):
        if CORRECTION_KEY not in entry:
            entry[CORRECTION_KEY] = torch.zeros(p.numel(), dtype=torch.int8, device=p.device)
    else:
        entry.pop(CORRECTION_KEY, None)


__all__ = ["step", "optimizer_step", "stepped_tensors", "tensor_steps", "match_correction", "segment_hypers", "TensorStep", "Item8", "Item32", "Rounding", "IMPLS", "group_impl", "corrected",
           "correction_of", "stochastic_params", "rounding_modes", "maps_of", "fused_step_many",
           "fused_step_fp32_many", "kernel_rule", "reference_step_8bit", "reference_step_32bit", "read_param",
           "write_param", "block_codec"]
