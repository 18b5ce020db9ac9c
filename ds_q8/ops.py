"""The compiled kernels: loading them, and the calls every caller shares.

CPU tensors go to the C++ op, CUDA tensors to the CUDA op. Each op is loaded (prebuilt, or
JIT-compiled and cached by torch) on first use. Which path a step takes (kernels or the pure-PyTorch
reference, the ``impl`` option) is decided in ``optim/path_kernel.py``, which calls the step entry points
through :func:`call`; this module also offers block-wise (de)quantization in a kernel and the finite
check of the gradients.

The CPU instruction set is the best one the CPU supports, chosen once when the op loads;
:func:`use_cpu_isa` selects another one for a block of code (tests and benchmarks).
:data:`CALLS` counts kernel calls by ``(device type, entry)``, so a caller can tell that a kernel ran.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import os
import warnings
from typing import Dict, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import functional as F

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

_modules: Dict[str, object] = {}
_errors: Dict[str, str] = {}  # kind -> why its op could not be loaded
_PREBUILT = {"cpu": "_q8_cpu", "cuda": "_q8_cuda"}  # the op builders' names, as setup.py prebuilds them
_lookups = WeakIdKeyDictionary()  # map tensor -> {id(module): (map version, lookup table)}
_warned: set = set()
_isa: Dict[str, str] = {}  # "chosen": the CPU instruction set in use

#: kernel calls so far, by ``(device type, entry)``, e.g. ``("cpu", "step_many")``
CALLS: collections.Counter = collections.Counter()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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
        warn_once(f"load-{kind}", f"ds_q8: the {kind.upper()} kernels are unavailable ({_errors[kind]}); using the "
                                   "pure-PyTorch reference step (same results, slower)")
    return module


def _load(kind: str):
    # DS_Q8_EMULATE_AVX512=1 (op_builder/cpu.py: tests of the AVX-512 kernels on any CPU) skips the prebuilt CPU op
    emulated = kind == "cpu" and os.environ.get("DS_Q8_EMULATE_AVX512", "0") not in ("", "0")
    try:
        if not emulated:
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


def lookup_table(code: torch.Tensor, module) -> torch.Tensor:
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
    return F.state_map("dynamic", True, device)


def _op_for(t: torch.Tensor):
    if t.device.type not in ("cpu", "cuda"):
        return None
    return load_op(t.device.type)


_settings: Dict[int, dict] = {}  # id(op module) -> {rule: the hyperparameters its kernels take}


def kernel_hyper(module, rule: str, hyper) -> dict:
    """The step scalars of ``hyper`` that rule ``rule``'s kernels take (the op names them: a rule's
    dict also carries what only the reference or the norm pass reads). A name the kernels need and
    ``hyper`` lacks stays missing, so the op refuses the call and names it."""
    names = _settings.get(id(module))
    if names is None:
        names = _settings[id(module)] = module.rule_settings()
    return {k: hyper[k] for k in names.get(rule, ()) if k in hyper}


def call(module, name, t, *args, skip=None, **kwargs):
    """``module.<name>(*args, **kwargs)``, counted; CPU entry points take the instruction set first, CUDA
    step entry points an optional device skip flag."""
    kind = t.device.type
    CALLS[(kind, name)] += 1
    if kind == "cpu":
        return getattr(module, name)(cpu_isa(module), *args, **kwargs)
    if skip is not None:
        return getattr(module, name)(*args, skip=skip, **kwargs)
    return getattr(module, name)(*args, **kwargs)


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
    codes, absmax = call(module, "quantize", x, flat, code, lookup_table(code, module), block_size)
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
    values = call(module, "dequantize", codes, flat_codes, flat_absmax, code, block_size, dtype).view(codes.shape)
    return values if out is None else out.copy_(values)


__all__ = ["cpu_all_finite", "quantize_blockwise", "dequantize_blockwise", "load_op", "cpu_isa", "use_cpu_isa",
           "lookup_table", "call", "warn_once", "CALLS"]
