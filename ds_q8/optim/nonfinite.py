"""What a step does when a gradient holds NaN or Inf.

A non-finite value that reached the 8-bit state would make its block's absmax non-finite and
every code of that block meaningless, for good. So the step checks the gradients first:

* ``"skip"`` (default): the whole step is skipped on every rank, parameters and state are left
  untouched, and ``optimizer.skipped_steps`` counts it (one warning per 100 skips).
* ``"raise"``: a ``FloatingPointError`` before anything changes.
* ``"off"``: no check (saves one read of the gradients: on CPU a compiled pass, elsewhere torch's
  ``isfinite``); use it only where something upstream already skips such steps, e.g. DeepSpeed's
  fp16 loss scaler.

The check needs no read of its own where the step is given the gradients' global norm: DeepSpeed's
(``integration/grad_norm.py``) or the caller's, ``step(grad_norm=...)`` (what
``torch.nn.utils.clip_grad_norm_`` returned). A norm is finite exactly when every element is (one that
overflows float32 also counts as non-finite, as in DeepSpeed's own check). A given norm must cover every
rank's gradients (DDP's gradients are the same on every rank; FSDP's ``clip_grad_norm_`` returns the global
norm): the ranks do not ask each other then.

On CUDA with ``"skip"`` the decision stays on the device: :func:`device_flag` is one int32 that the
kernels read (non-zero: they write nothing), so the step queues its work without waiting for the
GPU. The host learns of a skip at the next ``step()`` or ``state_dict()`` (see :class:`PendingSkips`),
which then takes back the step counts that the skipped step had advanced.
"""
from __future__ import annotations

import math
import warnings
from typing import List

import torch

from .. import ops
from .group_options import group_impl

MODES = ("skip", "raise", "off")


def check_mode(value) -> str:
    if value not in MODES:
        raise ValueError(f"nonfinite must be one of {MODES}, got {value!r}")
    return value


def check_norm(value):
    """``step(grad_norm=...)``: None, a real number or a one-element floating-point tensor, else an error."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.is_floating_point():
            return value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise TypeError(f"step(grad_norm=...) takes the gradients' global norm: a number or a one-element floating-point "
                    f"tensor (what torch.nn.utils.clip_grad_norm_ returns) or None, got {_describe(value)}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


def _any_nonfinite(grads: List[torch.Tensor], use_kernel: bool) -> torch.Tensor:
    """Whether this rank's gradients hold a NaN or Inf (a bool tensor: no sync on a GPU)."""
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


def report_skip(optimizer, stacklevel: int = 3) -> None:
    optimizer.skipped_steps += 1
    if optimizer.skipped_steps % 100 == 1:
        warnings.warn(
            f"{optimizer.__class__.__name__}: non-finite gradient, step skipped "
            f"({optimizer.skipped_steps} skipped so far; parameters and state unchanged)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def device_flag(grads: List[torch.Tensor], norm=None) -> torch.Tensor:
    """One int32 on the gradients' device: 1 when a gradient on any rank holds a NaN or Inf.

    ``norm`` is a global gradient norm already computed for this step (DeepSpeed's, for clipping),
    which answers it without reading the gradients; otherwise one fused read takes each gradient's
    L2 norm (a NaN or Inf makes it non-finite; so does a gradient whose norm overflows float32, as
    for DeepSpeed's own check). No host synchronisation either way.
    """
    device = grads[0].device
    if norm is not None:
        norm = torch.as_tensor(norm, device=device)
        bad = torch.logical_not(torch.isfinite(norm)).any()
    else:
        bad = torch.logical_not(torch.isfinite(torch.stack(torch._foreach_norm(grads)))).any()
    flag = bad.to(torch.int32).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1 and norm is None:  # a norm is global already
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag


class PendingSkips:
    """Device-side skip decisions the host has not read yet: each step's flag, copied to pinned host
    memory behind an event, with the step counters that step advanced."""

    def __init__(self):
        self.entries = []

    def add(self, flag: torch.Tensor, counters: list) -> None:
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)  # on the current stream of the flag's device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flag.device))  # that stream, even when another device is current
        self.entries.append((host, event, counters))

    def settle(self, optimizer) -> None:
        """Read the decisions (each event finished long ago unless called right after the step) and
        undo what a skipped step counted."""
        entries, self.entries = self.entries, []
        for host, event, counters in entries:
            event.synchronize()
            if int(host[0]):
                for state in counters:
                    state["step"] -= 1
                report_skip(optimizer)


def skip_on_device(optimizer, work) -> bool:
    """Whether this step's non-finite decision can stay on the device: ``"skip"`` mode, every
    gradient a CUDA tensor, and some group using kernels."""
    return (optimizer.nonfinite == "skip" and bool(work) and all(p.grad.is_cuda for _, p in work)
            and any(group_impl(g) != "reference" for g in optimizer.param_groups))


def decide(optimizer, work):
    """This step's non-finite decision: ``(go, flag)``. ``go`` False: skip the step (counted and
    reported here) or raise (``"raise"``). ``flag``: on CUDA, the decision as a device tensor that the
    kernels read, with no host synchronisation (None elsewhere)."""
    if optimizer.nonfinite == "off":
        return True, None
    norm = getattr(optimizer, "_given_norm", None)  # step(grad_norm=...)
    source = optimizer.grad_norm_source
    if norm is None and source is not None:
        norm = source()  # DeepSpeed's global norm for this step, if any
    if skip_on_device(optimizer, work):
        optimizer.nonfinite_checks["norm" if norm is not None else "device"] += 1
        return True, device_flag([p.grad for _, p in work], norm)
    # a norm is finite exactly when every gradient element is, on every rank; otherwise read them all
    optimizer.nonfinite_checks["norm" if norm is not None else "pass"] += 1
    if norm is not None:
        finite = math.isfinite(float(norm))
    else:
        finite = grads_all_finite([p.grad for _, p in work],
                                  any(group_impl(g) != "reference" for g in optimizer.param_groups))
    if finite:
        return True, None
    if optimizer.nonfinite == "raise":
        raise FloatingPointError(f"{type(optimizer).__name__}: a gradient contains NaN or Inf; nothing was updated "
                                 "(nonfinite='raise'; use 'skip' to skip such steps)")
    report_skip(optimizer, stacklevel=4)  # the warning points at the caller of step()
    return False, None
