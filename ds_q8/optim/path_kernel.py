"""The kernel path: pieces batched by device and dtypes into one call of the compiled CPU or CUDA op
each (``ops.py`` loads them); what no kernel takes goes back to the caller for the reference, or,
under ``impl="kernel"``, raises."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import ops
from .group_options import group_impl, maps_of, stochastic_params, stochastic_states
from .pieces import Item8, Item32
from .rules import Rule

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
                 [it.absmax for it in batch], maps[0], maps[1], group["block_size"], ops.kernel_hyper(module, name, hyper), keys, index,
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
                 [it.states for it in batch], ops.kernel_hyper(module, name, hyper), keys, index, corrections=_corrections(batch),
                 skip=skip if device.type == "cuda" else None)
    return rest


__all__ = ["kernel_rule", "fused_step_many", "fused_step_fp32_many"]
