"""Dispatch from the optimizers to the compiled kernels.

CPU tensors go to the C++ op, CUDA tensors to the CUDA op. Each op is loaded (prebuilt, or
JIT-compiled and cached by torch) on first use. When an op cannot be loaded, the step falls back
to the pure-PyTorch reference, which gives the same result more slowly, and one warning says why.

Environment:
  DS_Q8_KERNELS=0        always use the reference (no warning)
  DS_Q8_CPU_ISA=NAME     force the CPU instruction set: avx512, avx2 or scalar
  DS_Q8_FAST_SEARCH=0    AVX-512: find nearest codes with the lookup table instead of the
                         segment search (csrc/cpu/q8_fastmap.h); same codes, slower
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Dict, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import functional as F

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

_modules: Dict[str, object] = {}
_PREBUILT = {"cpu": "_q8_cpu", "cuda": "_q8_cuda"}  # the op builders' names, as setup.py prebuilds them
_lookups = WeakIdKeyDictionary()  # map tensor -> {id(module): (map version, lookup table)}
_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernels_enabled() -> bool:
    return os.environ.get("DS_Q8_KERNELS", "1").strip().lower() not in ("0", "false", "off", "reference")


def load_op(kind: str):
    """The compiled module for ``kind`` ("cpu" or "cuda"), or None (with one warning) if it cannot load."""
    if kind in _modules:
        return _modules[kind]
    module = None
    try:
        module = importlib.import_module(f"ds_q8.{_PREBUILT[kind]}")  # built by setup.py: no DeepSpeed needed
    except ImportError:
        pass
    try:
        if module is None:
            try:
                from .op_builder import ALL_BUILDERS  # DeepSpeed's OpBuilder compiles the ops
            except ImportError as exc:
                raise RuntimeError(f"DeepSpeed, whose op builder compiles them, cannot be imported ({exc}); "
                                   "pip install deepspeed (or ds_q8[train])") from None
            builder = ALL_BUILDERS[kind]()
            if not builder.is_compatible():
                raise RuntimeError(builder.error_log)
            module = builder.load()
    except Exception as exc:  # a failed build must not stop training: the reference is exact
        reason = " ".join(str(exc).split())[:500]
        _warn_once(f"load-{kind}", f"ds_q8: the {kind.upper()} kernels are unavailable ({reason}); using the "
                                   "pure-PyTorch reference step (same results, slower)")
    _modules[kind] = module
    return module


def cpu_isa(module) -> str:
    """The CPU instruction set to use: DS_Q8_CPU_ISA if set, else the best one supported."""
    supported = list(module.supported_isas())
    wanted = os.environ.get("DS_Q8_CPU_ISA", "").strip().lower()
    if not wanted:
        return supported[0]
    if wanted not in supported:
        raise ValueError(f"DS_Q8_CPU_ISA must be one of {supported} on this CPU, got {wanted!r}")
    return wanted


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
    if not kernels_enabled() or t.device.type not in ("cpu", "cuda"):
        return None
    return load_op(t.device.type)


def _call(module, name, t, *args):
    if t.device.type == "cpu":
        return getattr(module, name)(cpu_isa(module), *args)
    return getattr(module, name)(*args)


def _kernel_maps(optimizer, group, device, module):
    """The maps and their lookup tables for a kernel call, or None (one warning) when a map has none."""
    maps = optimizer._maps(group, device)
    try:
        return maps, [_lookup(m, module) for m in maps]
    except ValueError as exc:  # a map too dense for the one-comparison table
        _warn_once(f"map-{group['quantization']}", f"ds_q8: no fused kernel for this map ({exc}); using the "
                                                   "reference step")
        return None


def fused_step(optimizer, p, grad, codes, absmax, group, hyper) -> bool:
    """Run the 8-bit step of one tensor (or piece) in a compiled kernel; False means "use the reference".

    ``codes``/``absmax`` are its state's codes and block maxima, one per state; its first element
    starts a block.
    """
    return not fused_step_many(optimizer, [(p, grad, tuple(codes), tuple(absmax), None)], group, hyper)


def fused_step_many(optimizer, items, group, hyper) -> list:
    """The 8-bit step of many tensors that share ``group`` and ``hyper``, in one kernel call.

    ``items`` are ``(param, grad, codes, absmax, rounding)``: a tensor or a piece of one (a view) whose
    first element starts a block, its gradient, its states' codes and block maxima, and None or
    ``(key, index of its first element in its parameter)`` for stochastic rounding. They are batched
    by device and dtypes; each batch is one call (on CPU one parallel loop over all its blocks).
    Returns the items it did not step, which the caller steps with the reference.
    """
    rule = getattr(optimizer, "update_rule", "")
    if not rule or group["block_size"] is None or not kernels_enabled():
        return list(items)
    batches: Dict[tuple, list] = {}
    rest = []
    for item in items:  # cheap attribute reads only: this loop runs once per tensor per step
        p, grad = item[0], item[1]
        pd, gd, cuda = p.dtype, grad.dtype, p.is_cuda
        if (pd not in _SUPPORTED or (gd is not pd and gd is not torch.float32) or not p.is_contiguous()
                or grad.is_cuda is not cuda or (not cuda and not p.is_cpu)):
            rest.append(item)
            continue
        key = (p.get_device() if cuda else -1, pd, gd)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = []
        batch.append(item)
    for batch in batches.values():
        device = batch[0][0].device
        module = load_op(device.type)
        if module is None:
            rest.extend(batch)
            continue
        if rule not in module.rules():
            _warn_once(f"rule-{rule}", f"ds_q8: no fused kernel for update rule '{rule}'; using the reference step")
            rest.extend(batch)
            continue
        maps = _kernel_maps(optimizer, group, device, module)
        if maps is None:
            rest.extend(batch)
            continue
        # the kernel writes each param's memory in place, as p.data would
        params = [it[0] for it in batch]
        grads = [g if g.is_contiguous() else g.contiguous() for g in (it[1] for it in batch)]
        keys, index = _rounding_lists(batch, 4)
        _call(module, "step_many", params[0], rule, params, grads, [it[2] for it in batch], [it[3] for it in batch],
              maps[0], maps[1], group["block_size"], dict(hyper), keys, index)
    return rest


def _rounding_lists(items, at: int):
    """The kernels' sr_keys and sr_index lists for a batch: empty when no item asks for stochastic
    rounding (an item that does not, in a batch that does, is a float32 tensor: unaffected)."""
    if all(it[at] is None for it in items):
        return [], []
    return ([it[at][0] if it[at] is not None else 0 for it in items],
            [it[at][1] if it[at] is not None else 0 for it in items])


def fused_step_fp32_many(optimizer, items, group, hyper) -> list:
    """The same fused step for tensors whose state is float32 (``optim_bits=32`` or below
    ``min_8bit_size``): ``items`` are ``(param, grad, states, rounding)``, batched like :func:`fused_step_many`
    (by device and dtypes; on CUDA one launch per list of tensors). Returns the items it did not step."""
    rule = getattr(optimizer, "update_rule", "")
    if not rule or not kernels_enabled():
        return list(items)
    batches: Dict[tuple, tuple] = {}
    rest = []
    for item in items:
        p, grad, states, _ = item
        pd, gd, cuda = p.dtype, grad.dtype, p.is_cuda
        if ((not cuda and not p.is_cpu) or grad.is_cuda is not cuda or pd not in _SUPPORTED
                or (gd is not pd and gd is not torch.float32) or not p.is_contiguous()
                or not all(s.is_contiguous() and (s.device == p.device if cuda else s.is_cpu) for s in states)):
            rest.append(item)
            continue
        key = (p.get_device() if cuda else -1, pd, gd)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = ([], [], [], [])
        batch[0].append(p)
        batch[1].append(grad if grad.is_contiguous() else grad.contiguous())
        batch[2].append(states)
        batch[3].append(item)
    for params, grads, states, batch_items in batches.values():
        module = load_op(params[0].device.type)
        if module is None or rule not in module.rules():
            rest.extend(batch_items)
            continue
        keys, index = _rounding_lists(batch_items, 3)
        _call(module, "step_fp32_many", params[0], rule, params, grads, states, dict(hyper), keys, index)
    return rest


def cpu_all_finite(tensors) -> Optional[bool]:
    """Whether CPU tensors hold only finite values, in one compiled read; None where it does not apply.

    None (the caller then asks torch) for an empty list, kernels switched off or unavailable, or
    any tensor that is not a contiguous float32/float16/bfloat16 CPU tensor.
    """
    if not tensors or not kernels_enabled():
        return None
    module = load_op("cpu")
    if module is None:
        return None
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
        module.dequantize_into(cpu_isa(module), flat_codes, flat_absmax, code, block_size, out.view(-1))
        return out
    values = _call(module, "dequantize", codes, flat_codes, flat_absmax, code, block_size, dtype).view(codes.shape)
    return values if out is None else out.copy_(values)


__all__ = ["fused_step", "fused_step_many", "fused_step_fp32_many", "cpu_all_finite", "quantize_blockwise", "dequantize_blockwise", "load_op", "kernels_enabled"]
