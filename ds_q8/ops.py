"""Dispatch from the optimizers to the compiled kernels.

CPU tensors go to the C++ op, CUDA tensors to the CUDA op. Each op is loaded (prebuilt, or
JIT-compiled and cached by torch) on first use. Which path a group's step takes is its ``impl``
option, decided here and nowhere else:

  ``"auto"`` (default)  the kernels; where an op cannot be loaded (one warning says why) or a tensor
                        has no kernel, the pure-PyTorch reference, which gives the same bits, slower
  ``"kernel"``          the kernels or an error: a failed build raises with the build's message,
                        and so does a tensor that no kernel takes
  ``"reference"``       the pure-PyTorch reference only (the kernels are not even loaded)

The CPU instruction set is the best one the CPU supports, chosen once when the op loads;
:func:`use_cpu_isa` selects another one for a block of code (tests and benchmarks).
:data:`CALLS` counts kernel calls by ``(device type, entry)``, so a caller can tell that a kernel ran.

Parameters that ZeRO cuts inside a block always take a batched reference pass for that block
(``optim/stepping.py``): its maximum is agreed across ranks before it is quantized.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import warnings
from typing import Dict, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import functional as F

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
from .optim.checks import IMPLS

_modules: Dict[str, object] = {}
_errors: Dict[str, str] = {}  # kind -> why its op could not be loaded
_PREBUILT = {"cpu": "_q8_cpu", "cuda": "_q8_cuda"}  # the op builders' names, as setup.py prebuilds them
_lookups = WeakIdKeyDictionary()  # map tensor -> {id(module): (map version, lookup table)}
_warned: set = set()
_isa: Dict[str, str] = {}  # "chosen": the CPU instruction set in use

#: kernel calls so far, by ``(device type, entry)``, e.g. ``("cpu", "step_many")``
CALLS: collections.Counter = collections.Counter()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def group_impl(group: dict) -> str:
    """A group's ``impl`` (groups saved before the option existed are ``"auto"``)."""
    return group.get("impl", "auto")


def load_op(kind: str, required: bool = False):
    """The compiled module for ``kind`` ("cpu" or "cuda"), or None (with one warning) if it cannot load.

    ``required=True`` raises ``RuntimeError`` with the reason instead.
    """
    if kind not in _modules:
        _modules[kind] = _load(kind)
    module = _modules[kind]
    if module is None:
        if required:
            raise RuntimeError(f"ds_q8: impl='kernel' needs the {kind.upper()} kernels, which cannot be loaded: "
                               f"{_errors[kind]}")
        _warn_once(f"load-{kind}", f"ds_q8: the {kind.upper()} kernels are unavailable ({_errors[kind]}); using the "
                                   "pure-PyTorch reference step (same results, slower)")
    return module


def _load(kind: str):
    try:
        return importlib.import_module(f"ds_q8.{_PREBUILT[kind]}")  # built by setup.py: no DeepSpeed needed
    except ImportError:
        pass
    try:
        try:
            from .op_builder import ALL_BUILDERS  # DeepSpeed's OpBuilder compiles the ops
        except ImportError as exc:
            raise RuntimeError(f"DeepSpeed, whose op builder compiles them, cannot be imported ({exc}); "
                               "pip install deepspeed (or ds_q8[train])") from None
        builder = ALL_BUILDERS[kind]()
        if not builder.is_compatible():
            raise RuntimeError(builder.error_log)
        return builder.load()
    except Exception as exc:  # a failed build must not stop training under impl="auto": the reference is exact
        _errors[kind] = " ".join(str(exc).split())[:2000]
        return None


def cpu_isa(module=None) -> str:
    """The CPU instruction set in use: the best one this CPU supports, chosen when the op loads."""
    if "chosen" not in _isa:
        module = module if module is not None else load_op("cpu", required=True)
        _isa["chosen"] = list(module.supported_isas())[0]
    return _isa["chosen"]


@contextlib.contextmanager
def use_cpu_isa(name: str):
    """Run the CPU kernels with instruction set ``name`` (avx512, avx2 or scalar) inside the block."""
    supported = list(load_op("cpu", required=True).supported_isas())
    if name not in supported:
        raise ValueError(f"name must be one of the instruction sets this CPU supports, {supported}, got {name!r}")
    saved = cpu_isa()
    _isa["chosen"] = name
    try:
        yield name
    finally:
        _isa["chosen"] = saved


def _lookup(code: torch.Tensor, module) -> torch.Tensor:
    """The nearest-code table of a map, built once per map tensor and per module and dropped with the
    map (the cache holds the map weakly; an in-place change of the map rebuilds it)."""
    per_map = _lookups.get(code)
    if per_map is None:
        per_map = _lookups[code] = {}
    hit = per_map.get(id(module))
    if hit is None or hit[0] != code._version:
        table = module.build_lookup(code.detach().to("cpu", torch.float32).contiguous()).to(code.device)
        hit = per_map[id(module)] = (code._version, table)
    return hit[1]


def _default_map(device) -> torch.Tensor:
    """The signed dynamic map on ``device``: the optimizers' cached one, so its table is built once."""
    from .optim.base import get_map  # the optimizers import this module

    return get_map("dynamic", True, device)


def _op_for(t: torch.Tensor):
    if t.device.type not in ("cpu", "cuda"):
        return None
    return load_op(t.device.type)


def _call(module, name, t, *args, skip=None, **kwargs):
    """``module.<name>(*args, **kwargs)``, counted; CPU entry points take the instruction set first, CUDA
    step entry points an optional device skip flag."""
    kind = t.device.type
    CALLS[(kind, name)] += 1
    if kind == "cpu":
        return getattr(module, name)(cpu_isa(module), *args, **kwargs)
    if skip is not None:
        return getattr(module, name)(*args, skip=skip, **kwargs)
    return getattr(module, name)(*args, **kwargs)


def _kernel_maps(optimizer, group, device, module, strict):
    """The maps and their lookup tables for a kernel call, or None (one warning) when a map has none."""
    maps = optimizer._maps(group, device)
    try:
        return maps, [_lookup(m, module) for m in maps]
    except ValueError as exc:  # a map too dense for the one-comparison table
        if strict:
            raise ValueError(f"impl='kernel': no fused kernel for quantization={group['quantization']!r} ({exc})") \
                from None
        _warn_once(f"map-{group['quantization']}", f"ds_q8: no fused kernel for this map ({exc}); using the "
                                                   "reference step")
        return None


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


def _kernel_rule(optimizer, group, items):
    """``(rule, strict)`` for a batch of items, or ``(None, strict)`` when they all go to the reference."""
    impl = group_impl(group)
    strict = impl == "kernel"
    if impl == "reference" or not items:
        return None, strict
    rule = getattr(optimizer, "update_rule", "")
    if not rule:
        _no_kernel(items, strict, f"{type(optimizer).__name__} has no fused kernel")
    return rule or None, strict


def fused_step(optimizer, p, grad, codes, absmax, group, hyper) -> bool:
    """Run the 8-bit step of one tensor (or piece) in a compiled kernel; False means "use the reference".

    ``codes``/``absmax`` are its state's codes and block maxima, one per state; its first element
    starts a block.
    """
    return not fused_step_many(optimizer, [(p, grad, tuple(codes), tuple(absmax), None)], group, hyper)


def fused_step_many(optimizer, items, group, hyper, skip=None, error_sums=None) -> list:
    """The 8-bit step of many tensors that share ``group`` and ``hyper``, in one kernel call.

    ``items`` are ``(param, grad, codes, absmax, rounding)``: a tensor or a piece of one (a view) whose
    first element starts a block, its gradient, its states' codes and block maxima, and None or
    ``(key, index of its first element in its parameter)``: the random bits of stochastic rounding, of
    16-bit parameter writes (``optimizer.stochastic_params``) and of states (``optimizer.stochastic_states``). They are batched
    by device and dtypes; each batch is one call (on CPU one parallel loop over all its blocks).
    Returns the items it did not step, which the caller steps with the reference (``impl="auto"``
    only: under ``impl="kernel"`` an item without a kernel raises). ``skip`` is a CUDA step's device
    skip flag (``optim/nonfinite.py``), which the CUDA kernels read. ``error_sums`` (telemetry, one
    float64 ``(states, 2)`` tensor per item) take each item's requantization error and magnitude.
    """
    rule, strict = _kernel_rule(optimizer, group, items)
    if rule is None:
        return list(items)
    if group["block_size"] is None:
        return _no_kernel(items, strict, "block_size=None (one block per tensor) has no kernel")
    batches: Dict[tuple, list] = {}
    rest = []
    sums_of = {id(it): s for it, s in zip(items, error_sums)} if error_sums is not None else {}
    for item in items:
        p, grad = item[0], item[1]
        why = _unsupported(p, grad)
        if why is not None:
            rest.extend(_no_kernel([item], strict, why))
            continue
        key = (p.get_device() if p.is_cuda else -1, p.dtype, grad.dtype)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = []
        batch.append(item)
    for batch in batches.values():
        device = batch[0][0].device
        module = load_op(device.type, required=strict)
        if module is None:
            rest.extend(batch)
            continue
        if rule not in module.rules():
            if not strict:
                _warn_once(f"rule-{rule}", f"ds_q8: no fused kernel for update rule '{rule}'; using the reference step")
            rest.extend(_no_kernel(batch, strict, f"no fused kernel for update rule {rule!r}"))
            continue
        maps = _kernel_maps(optimizer, group, device, module, strict)
        if maps is None:
            rest.extend(batch)
            continue
        # the kernel writes each param's memory in place, as p.data would
        params = [it[0] for it in batch]
        grads = [g if g.is_contiguous() else g.contiguous() for g in (it[1] for it in batch)]
        keys, index = _rounding_lists(batch, 4)
        # the random bits serve 16-bit parameter writes and the stochastically requantized states
        stochastic_params = bool(keys) and optimizer.stochastic_params(group, params[0])
        stochastic_states = [bool(keys) and on for on in optimizer.stochastic_states(group)]
        sums = [sums_of[id(it)] for it in batch] if sums_of else []
        _call(module, "step_many", params[0], rule, params, grads, [it[2] for it in batch], [it[3] for it in batch],
              maps[0], maps[1], group["block_size"], dict(hyper), keys, index, stochastic_params=stochastic_params,
              stochastic_states=stochastic_states, error_sums=sums, skip=skip if device.type == "cuda" else None)
    return rest


def _rounding_lists(items, at: int):
    """The kernels' sr_keys and sr_index lists for a batch: empty when no item asks for stochastic
    rounding (an item that does not, in a batch that does, is a float32 tensor: unaffected)."""
    if all(it[at] is None for it in items):
        return [], []
    return ([it[at][0] if it[at] is not None else 0 for it in items],
            [it[at][1] if it[at] is not None else 0 for it in items])


def fused_step_fp32_many(optimizer, items, group, hyper, skip=None) -> list:
    """The same fused step for tensors whose state is float32 (``optim_bits=32`` or below
    ``min_8bit_size``): ``items`` are ``(param, grad, states, rounding)``, batched like :func:`fused_step_many`
    (by device and dtypes; on CUDA one launch per list of tensors). Returns the items it did not step."""
    rule, strict = _kernel_rule(optimizer, group, items)
    if rule is None:
        return list(items)
    batches: Dict[tuple, tuple] = {}
    rest = []
    for item in items:
        p, grad, states, _ = item
        why = _unsupported(p, grad, states)
        if why is None and not all(s.device == p.device for s in states):
            why = f"the float32 states of a parameter on {p.device} must be on its device"
        if why is not None:
            rest.extend(_no_kernel([item], strict, why))
            continue
        key = (p.get_device() if p.is_cuda else -1, p.dtype, grad.dtype)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = ([], [], [], [])
        batch[0].append(p)
        batch[1].append(grad if grad.is_contiguous() else grad.contiguous())
        batch[2].append(states)
        batch[3].append(item)
    for params, grads, states, batch_items in batches.values():
        device = params[0].device
        module = load_op(device.type, required=strict)
        if module is None or rule not in module.rules():
            rest.extend(_no_kernel(batch_items, strict, f"no fused kernel for update rule {rule!r}")
                        if module is not None else batch_items)
            continue
        keys, index = _rounding_lists(batch_items, 3)
        _call(module, "step_fp32_many", params[0], rule, params, grads, states, dict(hyper), keys, index,
              skip=skip if device.type == "cuda" else None)
    return rest


def cpu_all_finite(tensors) -> Optional[bool]:
    """Whether CPU tensors hold only finite values, in one compiled read; None where it does not apply.

    None (the caller then asks torch) for an empty list, kernels unavailable, or
    any tensor that is not a contiguous float32/float16/bfloat16 CPU tensor.
    """
    if not tensors:
        return None
    module = load_op("cpu")
    if module is None:
        return None
    CALLS[("cpu", "all_finite_or_unknown")] += 1
    answer = module.all_finite_or_unknown(tensors if isinstance(tensors, (list, tuple)) else list(tensors))
    return None if answer < 0 else bool(answer)


def quantize_blockwise(x: torch.Tensor, code: Optional[torch.Tensor] = None,
                       block_size: Optional[int] = F.DEFAULT_BLOCK_SIZE):
    """:func:`ds_q8.functional.quantize_blockwise` in a compiled kernel (same checks, same codes).

    ``block_size=None`` (one block per tensor), tensors on other devices, and kernels that cannot be
    loaded use the reference.
    """
    module = _op_for(x) if block_size is not None else None
    if module is None:
        return F.quantize_blockwise(x, code, block_size)
    F.check_block_size(block_size)
    if x.dtype not in _SUPPORTED:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    code = F._check_code(_default_map(x.device) if code is None else code, x.device)
    flat = x.detach().reshape(-1).contiguous()
    codes, absmax = _call(module, "quantize", x, flat, code, _lookup(code, module), block_size)
    # a block's absmax is NaN or Inf exactly when the block holds one: a check on 1/block_size of the data
    if absmax.numel() and not bool(torch.isfinite(absmax).all()):
        raise ValueError("quantize_blockwise: x contains NaN or Inf; only finite values can be quantized")
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: Optional[torch.Tensor] = None,
                         block_size: Optional[int] = F.DEFAULT_BLOCK_SIZE, dtype: Optional[torch.dtype] = None,
                         out: Optional[torch.Tensor] = None):
    """:func:`ds_q8.functional.dequantize_blockwise` in a compiled kernel (same checks, same values).

    With ``out=`` a CPU kernel writes straight into it (no temporary); a fresh output mostly costs
    the first touch of its pages.
    """
    module = _op_for(codes) if block_size is not None else None
    if module is None or codes.dtype != torch.uint8 or (dtype is not None and dtype not in _SUPPORTED):
        return F.dequantize_blockwise(codes, absmax, code, block_size, dtype, out=out)
    if out is not None:
        dtype = F.check_dequantize_out(out, codes, dtype)
    dtype = torch.float32 if dtype is None else dtype
    F.check_block_size(block_size)
    code = F._check_code(code, codes.device)
    flat_codes, flat_absmax = codes.reshape(-1).contiguous(), absmax.reshape(-1).contiguous()
    if out is not None and codes.device.type == "cpu":
        CALLS[("cpu", "dequantize_into")] += 1
        module.dequantize_into(cpu_isa(module), flat_codes, flat_absmax, code, block_size, out.view(-1))
        return out
    values = _call(module, "dequantize", codes, flat_codes, flat_absmax, code, block_size, dtype).view(codes.shape)
    return values if out is None else out.copy_(values)


__all__ = ["fused_step", "fused_step_many", "fused_step_fp32_many", "cpu_all_finite", "quantize_blockwise",
           "dequantize_blockwise", "load_op", "cpu_isa", "use_cpu_isa", "group_impl", "IMPLS", "CALLS"]
