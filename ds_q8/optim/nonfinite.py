"""What a step does when a gradient holds NaN or Inf.

A non-finite value that reached the 8-bit state would make its block's absmax non-finite and
every code of that block meaningless, for good. So the step checks the gradients first:

* ``"skip"`` (default): the whole step is skipped on every rank, parameters and state are left
  untouched, and ``optimizer.skipped_steps`` counts it (one warning per 100 skips).
* ``"raise"``: a ``FloatingPointError`` before anything changes.
* ``"off"``: no check (saves one read of the gradients: on CPU a compiled pass, elsewhere torch's
  ``isfinite``); use it only where something upstream already skips such steps, e.g. DeepSpeed's
  fp16 loss scaler.
"""
from __future__ import annotations

import warnings
from typing import List

import torch

MODES = ("skip", "raise", "off")


def check_mode(value) -> str:
    if value not in MODES:
        raise ValueError(f"nonfinite must be one of {MODES}, got {value!r}")
    return value


def _any_nonfinite(grads: List[torch.Tensor], use_kernel: bool) -> torch.Tensor:
    """Whether this rank's gradients hold a NaN or Inf (a bool tensor: no sync on a GPU)."""
    from .. import ops

    # CPU gradients: one compiled read instead of torch's isfinite (which writes a bool temporary)
    fast = ops.cpu_all_finite(grads) if use_kernel else None
    if fast is not None:
        return torch.tensor(not fast)
    flags = [torch.logical_not(torch.isfinite(g).all()) for g in grads]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


def grads_all_finite(grads: List[torch.Tensor], use_kernel: bool = True) -> bool:
    """True when every gradient on every rank is finite (ranks agree, so all skip or none)."""
    local = _any_nonfinite(grads, use_kernel)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return not bool(local)
    device = local.device
    if torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = local.to(device, torch.float32).reshape(1)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return not bool(flag.item())


def report_skip(optimizer) -> None:
    optimizer.skipped_steps += 1
    if optimizer.skipped_steps % 100 == 1:
        warnings.warn(
            f"{optimizer.__class__.__name__}: non-finite gradient, step skipped "
            f"({optimizer.skipped_steps} skipped so far; parameters and state unchanged)",
            RuntimeWarning,
            stacklevel=3,
        )
