"""A step's plan, built once and reused while nothing it depends on changes.

With hundreds of parameters the host's share of a step is per-tensor Python: each tensor's state is
looked up and checked, its rounding key hashed, its step count read back, its pieces sorted into
kernel calls. None of it changes from one step to the next in ordinary training, so after a step
that took the general path (``step.tensor_steps`` and ``step.step``), :meth:`StepPlan.build` keeps
what that step found: per group, its rule and kernel calls, each call's tensors, states, maps and
flags. Later steps reuse it: per tensor they only fetch the gradient and check that the tensor's
state entry is the one the plan holds (the same dict, holding the same tensors); per group they
compute the step scalars once; the rounding keys of all tensors come from one vectorized hash, and
the step counts of all tensors live in one tensor (each entry's ``"step"`` is a view of one element
of it) so they advance with one add and are read with one ``tolist``.

The plan takes what the common case is: element-wise rules on ordinary parameters whose state is
whole 8-bit or whole fp32 tensors, every one stepped by a kernel. ZeRO partitions (a few large
tensors, where per-tensor cost does not matter), 4-bit state, whole-parameter rules (LAMB, LARS,
Muon), telemetry and anything the reference steps take the general path every step. It writes
exactly the kernel calls the general path writes, so the bits are the same.

Anything that changes what the plan holds makes :meth:`StepPlan.gradients` answer None, and the step
takes the general path and builds a new plan: another set of parameters or gradients, a changed
group option (``OPTIONS``; the step scalars are read every step), another rule, a replaced state
entry or state tensor, step counts that differ within a group, telemetry. ``add_param_group``,
``load_state_dict`` and ``register_layout`` drop the plan.
"""
from __future__ import annotations

from operator import is_
from typing import List, Optional

import torch

from .. import ops
from .group_options import OPTIONS, group_impl, stochastic_params
from .path_kernel import KernelCall, batch_key, kernel_call, kernel_rule, unsupported
from .state_keys import CORRECTION_KEY, codes_key, fp32_key
from .rounding import sr_key, step_key

_M32 = 0xFFFFFFFF

#: the group options a plan depends on (the others are step scalars, read every step)
_PLANNED_OPTIONS = tuple(k for k in OPTIONS if k != "nonfinite")
_STRIDED = torch.strided


def _options(group: dict) -> tuple:
    return tuple(group.get(k) for k in _PLANNED_OPTIONS)


class _Call:
    """One kernel call of a planned step: its :class:`path_kernel.KernelCall` (the tensors and the arguments
    that stay the same), whose tensors take a rounding key, and, where the op has one, its prepared form."""

    __slots__ = ("call", "index", "keyed", "any_key", "group_bits", "param_bits", "zeros", "prepared")

    def __init__(self, call: KernelCall, index: List[int], steps, keyed: List[bool]):
        self.call, self.index, self.keyed = call, index, keyed
        qss = [t.state for t in steps]
        self.group_bits = [qs.layout.group_index & _M32 for qs in qss]
        self.param_bits = [qs.layout.segments[0].param_index & _M32 for qs in qss]
        self.zeros = [0] * len(steps)
        self.any_key = any(self.keyed)
        # where the op has a prepared call (the CPU op), it converts and checks the call's tensors once,
        # here, and a run takes only the gradients
        self.prepared = None
        if all(self.keyed) == self.any_key:
            self.prepared = call.prepared(self.group_bits if self.any_key else [],
                                          self.param_bits if self.any_key else [])

    def keys(self, step_part: int) -> list:
        """Each tensor's rounding key at this step (``rounding.sr_key``), 0 where it takes none."""
        if not self.any_key:
            return []
        return [sr_key(step_part, g, p) if on else 0 for g, p, on in zip(self.group_bits, self.param_bits, self.keyed)]

    def run(self, hyper: dict, step_part: int, grads: list, skip) -> None:
        gs = [grads[i] for i in self.index]
        call = self.call
        if self.prepared is not None:
            h = ops.kernel_hyper(call.module, call.name, hyper)
            ops.call(call.module, "run_prepared", call.params[0], self.prepared, gs, h, step_part)
            return
        keys = self.keys(step_part)
        call.run(gs, hyper, keys, self.zeros if keys else [], skip)


class _GroupPlan:
    """A group's part of the plan: its tensors are the plan's ``start:stop`` (none: ``start == stop``)."""

    __slots__ = ("group", "group_rule", "options", "params", "start", "stop", "calls")

    def __init__(self, group: dict, rule):
        self.group, self.group_rule, self.start, self.stop = group, rule, 0, 0
        self.options = _options(group)
        self.params = list(group["params"])
        self.calls: List[_Call] = []


class StepPlan:
    """What a step of the same parameters does again (see the module's docstring)."""

    def __init__(self, work, entries, groups, flat: torch.Tensor):
        self.work = work  # [(group, tensor)]: what NF.decide reads
        self.tensors = [p for _, p in work]
        self.entries = entries
        self.values = [tuple(e.values()) for e in entries]
        self.groups: List[_GroupPlan] = groups
        planned = {id(p) for p in self.tensors}
        self.idle = [p for gp in groups for p in gp.params if id(p) not in planned]
        self.flat = flat  # every planned tensor's step count; each entry's "step" is a view of one element
        self._counts: Optional[list] = None

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, opt, work, by_rule) -> Optional["StepPlan"]:
        """The plan of a step that just took the general path over ``work`` (``tensor_steps``'s
        ``by_rule``), or None where some tensor is not of the kind a plan takes."""
        if not work or opt._telemetry is not None:
            return None
        step_of = {}
        for rule, steps in by_rule.values():
            if rule.is_matrix or rule.needs_norms or rule.kernel is None:
                return None
            for t in steps:
                step_of[id(t.param)] = (rule, t)
        # every group, also one without a gradient now: a gradient that appears there changes the plan
        groups = [_GroupPlan(group, opt.rule_for(group)) for group in opt.param_groups]
        at = {id(gp.group): gp for gp in groups}
        entries = []
        for i, (group, p) in enumerate(work):
            t = step_of.get(id(p), (None, None))[1]
            gp = at.get(id(group))
            if t is None or gp is None or not cls._plannable(t):
                return None
            if gp.stop == 0:
                gp.start = i
            elif gp.stop != i:  # the work of a group is one run
                return None
            gp.stop = i + 1
            entries.append(t.state.entry)
        for gp in groups:
            if gp.stop > gp.start and not cls._add_calls(gp, [step_of[id(p)][1] for _, p in work[gp.start:gp.stop]]):
                return None
        # the step counts as one tensor: each entry's "step" is a view of its element
        flat = torch.tensor([float(e["step"]) for e in entries])
        for i, e in enumerate(entries):
            e["step"] = flat[i]
        return cls(work, entries, groups, flat)

    @staticmethod
    def _plannable(t) -> bool:
        layout = t.state.layout
        return (t.segment_hyper is None and t.sums is None and not layout.sharded and layout.state_bits == 8
                and (layout.whole8 or layout.whole32) and group_impl(t.group) != "reference"
                and t.group["block_size"] is not None and t.param.is_contiguous() and t.grad.is_contiguous()
                and unsupported(t.param, t.grad) is None)

    @staticmethod
    def _add_calls(gp: _GroupPlan, steps) -> bool:
        """The group's kernel calls, batched as ``path_kernel`` batches them; False where one has no kernel."""
        name, strict = kernel_rule(gp.group_rule, gp.group, steps)
        if name is None:
            return False
        batches = {}
        for j, t in enumerate(steps):
            fp32 = t.state.layout.whole32
            states = t.state.stored(fp32_key) if fp32 else ()
            if fp32 and (not all(s.is_contiguous() and s.device == t.param.device for s in states)):
                return False
            batches.setdefault((fp32,) + batch_key(t.param, t.grad), []).append(j)
        for (fp32, *_), index in batches.items():
            steps_in = [steps[j] for j in index]
            qss = [t.state for t in steps_in]
            corrections = [qs.entry[CORRECTION_KEY].view(-1) for qs in qss] \
                if any(CORRECTION_KEY in qs.entry for qs in qss) else []
            # whose rounding key the kernel gets (the general path's Item8 / Item32 rounding)
            keyed = [t.sr_step is not None and (not fp32 or stochastic_params(gp.group, t.param.dtype))
                     for t in steps_in]
            call = kernel_call(gp.group_rule, gp.group, name, strict, steps_in, [t.param for t in steps_in],
                               [qs.stored(fp32_key if fp32 else codes_key) for qs in qss],
                               None if fp32 else [tuple(qs.absmax()) for qs in qss], any(keyed), corrections)
            if call is None:
                return False
            gp.calls.append(_Call(call, [gp.start + j for j in index], steps_in, keyed))
        return True

    # ------------------------------------------------------------------ each step
    def gradients(self, opt) -> Optional[list]:
        """Every planned tensor's gradient, or None when the plan no longer holds (then the step takes
        the general path)."""
        groups = opt.param_groups
        if opt._telemetry is not None or len(groups) != len(self.groups) \
                or not all(map(is_, groups, (gp.group for gp in self.groups))):
            return None
        for gp in self.groups:
            group = gp.group
            params = group["params"]
            if (len(params) != len(gp.params) or not all(map(is_, params, gp.params))
                    or _options(group) != gp.options or opt.rule_for(group) is not gp.group_rule):
                return None
        for p in self.idle:
            if p.grad is not None:
                return None
        grads = [p.grad for p in self.tensors]
        state_get = opt.state.get
        for p, g, entry, values in zip(self.tensors, grads, self.entries, self.values):
            if (g is None or g.layout is not _STRIDED or not g.is_contiguous() or state_get(p) is not entry
                    or len(entry) != len(values) or not all(map(is_, entry.values(), values))):
                return None
        counts = self.flat.tolist()
        for gp in self.groups:
            if gp.stop > gp.start and counts[gp.start:gp.stop].count(counts[gp.start]) != gp.stop - gp.start:
                return None
        self._counts = counts
        return grads

    def run(self, opt, grads: list, skip) -> list:
        """Step every planned tensor (after :meth:`gradients`); the state entries whose counts advanced."""
        counts, self._counts = self._counts, None
        self.flat.add_(1)
        for gp in self.groups:
            if not gp.calls:
                continue
            count = int(counts[gp.start]) + 1
            hyper = opt._hyper(gp.group, count)
            part = step_key(gp.group.get("sr_seed", 0), count)
            for call in gp.calls:
                call.run(hyper, part, grads, skip)
        return self.entries


__all__ = ["StepPlan"]
