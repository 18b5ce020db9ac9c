"""The kernel path: pieces batched by device and dtypes into one call of the compiled CPU or CUDA op
each (``ops.py`` loads them); what no kernel takes goes back to the caller for the reference, or,
under ``impl="kernel"``, raises. :class:`KernelCall` is the one builder of the ops' step arguments
(``step_many``, ``step_fp32_many``, the CPU op's ``PreparedStep``): this path and the cached step plan
(``plan.py``) both call through it."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import ops
from .group_options import group_impl, maps_of, stochastic_params, rounding_modes
from .pieces import Item8, Item32
from .rules import Rule

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _no_kernel(items, strict: bool, why: str) -> list:
    """Items that no kernel takes: back to the caller (reference step), or an error under impl='kernel'."""
    if strict and items:
        raise ValueError(f"impl='kernel': {why}; use impl='auto' to step such tensors with the reference")
    return list(items)


def unsupported(p: torch.Tensor, grad: torch.Tensor, states=()) -> Optional[str]:
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
    if rule.kernel is None:
        _no_kernel(items, strict, f"update rule {rule.name!r} has no fused kernel")
    return rule.kernel, strict


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


def batch_key(p: torch.Tensor, grad: torch.Tensor) -> tuple:
    """What the tensors of one kernel call share: the device and the parameter and gradient dtypes."""
    return p.get_device() if p.is_cuda else -1, p.dtype, grad.dtype


class KernelCall:
    """One call of a compiled step over a batch of tensors that share a group, a device and dtypes:
    the op, its rule and maps, and the arguments that do not change from step to step. ``absmax`` None:
    float32 states (``step_fp32_many``); else 8-bit codes and their block maxima (``step_many``).
    ``keyed``: whether any tensor of the batch takes random bits (its rounding key), which decides the
    stochastic rounding flags of parameters and states (``group_options``)."""

    __slots__ = ("module", "name", "fp32", "params", "states", "absmax", "maps", "block_size", "stoch_params",
                 "rounding_modes", "corrections", "cuda")

    def __init__(self, module, name: str, rule: Rule, group: dict, params: list, states: list, absmax, maps,
                 keyed: bool, corrections: list):
        self.module, self.name, self.fp32 = module, name, absmax is None
        self.params, self.states, self.absmax, self.maps = params, states, absmax, maps
        self.block_size = group["block_size"]
        # the random bits serve 16-bit parameter writes and the stochastically requantized states
        self.stoch_params = keyed and stochastic_params(group, params[0].dtype)
        self.rounding_modes = [keyed and on for on in rounding_modes(group, rule.state_signed)]
        self.corrections = corrections
        self.cuda = params[0].is_cuda

    def run(self, grads: list, hyper, keys: list, index: list, skip=None, error_sums=()) -> None:
        """One step of the batch: ``keys`` and ``index`` the kernels' sr_keys and sr_index (empty: no
        random bits), ``skip`` a CUDA step's device flag, ``error_sums`` telemetry's per-tensor sums."""
        h = ops.kernel_hyper(self.module, self.name, hyper)
        skip = skip if self.cuda else None
        if self.fp32:
            ops.call(self.module, "step_fp32_many", self.params[0], self.name, self.params, grads, self.states, h,
                     keys, index, corrections=self.corrections, skip=skip)
            return
        ops.call(self.module, "step_many", self.params[0], self.name, self.params, grads, self.states, self.absmax,
                 self.maps[0], self.maps[1], self.block_size, h, keys, index, stochastic_params=self.stoch_params,
                 rounding_modes=self.rounding_modes, error_sums=list(error_sums), corrections=self.corrections,
                 skip=skip)

    def prepared(self, group_bits: list, param_bits: list):
        """The CPU op's prepared form of this call (its tensors converted and checked once; a run then
        takes the gradients, the step scalars and the step's key part), or None where the op has none.
        ``group_bits`` and ``param_bits``: each tensor's rounding key parts (empty lists: no keys)."""
        prepare = getattr(self.module, "PreparedStep", None)
        if prepare is None or self.cuda:
            return None
        return prepare(self.name, self.params, list(self.states), self.absmax or [],
                       [] if self.fp32 else list(self.maps[0]), [] if self.fp32 else list(self.maps[1]),
                       self.block_size or 0, group_bits, param_bits, stochastic_params=self.stoch_params,
                       rounding_modes=[] if self.fp32 else self.rounding_modes, corrections=self.corrections)


def kernel_call(rule: Rule, group: dict, name: str, strict: bool, batch: list, params: list, states: list, absmax,
                keyed: bool, corrections: list) -> Optional[KernelCall]:
    """The :class:`KernelCall` of a batch, or None where its device's op lacks the rule or a map lacks a
    lookup table (then the batch goes to the reference; under ``impl="kernel"`` it raises)."""
    device = params[0].device
    module = _module_with_rule(device, name, strict, batch)
    if module is None:
        return None
    maps = None if absmax is None else _kernel_maps(rule, group, device, module, strict)
    if absmax is not None and maps is None:
        return None
    return KernelCall(module, name, rule, group, params, states, absmax, maps, keyed, corrections)


def _batches(items, strict: bool, rest: list, states_of=None) -> Dict[tuple, list]:
    """Items grouped by device and dtypes (one kernel call each); those no kernel takes go to ``rest``."""
    batches: Dict[tuple, list] = {}
    for item in items:
        p, grad = item.param, item.grad
        why = unsupported(p, grad, states_of(item) if states_of else ())
        if why is None and states_of and not all(s.device == p.device for s in states_of(item)):
            why = f"the float32 states of a parameter on {p.device} must be on its device"
        if why is not None:
            rest.extend(_no_kernel([item], strict, why))
            continue
        batches.setdefault(batch_key(p, grad), []).append(item)
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
        keys, index = _rounding_lists(batch)
        # the kernel writes each param's memory in place, as p.data would
        call = kernel_call(rule, group, name, strict, batch, [it.param for it in batch], [it.codes for it in batch],
                           [it.absmax for it in batch], bool(keys), _corrections(batch))
        if call is None:
            rest.extend(batch)
            continue
        grads = [g if g.is_contiguous() else g.contiguous() for g in (it.grad for it in batch)]
        call.run(grads, hyper, keys, index, skip, [sums_of[id(it)] for it in batch] if sums_of else ())
    return rest


def fused_step_fp32_many(rule: Rule, items: List[Item32], group: dict, hyper, skip=None) -> list:
    """The same fused step for pieces whose state is float32 (``optim_bits=32`` or below
    ``min_8bit_size``), batched like :func:`fused_step_many`. Returns the items it did not step."""
    name, strict = kernel_rule(rule, group, items)
    if name is None:
        return list(items)
    rest: list = []
    for batch in _batches(items, strict, rest, states_of=lambda it: it.states).values():
        keys, index = _rounding_lists(batch)
        call = kernel_call(rule, group, name, strict, batch, [it.param for it in batch], [it.states for it in batch],
                           None, bool(keys), _corrections(batch))
        if call is None:
            rest.extend(batch)
            continue
        call.run([it.grad if it.grad.is_contiguous() else it.grad.contiguous() for it in batch], hyper, keys, index,
                 skip)
    return rest


__all__ = ["kernel_rule", "fused_step_many", "fused_step_fp32_many", "KernelCall", "kernel_call", "batch_key",
           "unsupported"]
