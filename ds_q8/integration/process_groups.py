"""A process group that a training job ends with must be free to end with it.

``torch.distributed.nn.functional`` binds ``group.WORLD`` into the default arguments of its collectives
(``broadcast(tensor, src, group=group.WORLD)`` and the others) when it is first imported. Torch imports
it lazily, through ``torch._dynamo``, the first time an optimizer is constructed. Where that happens
after the default group exists (DeepSpeed builds the optimizer of a JSON config after
``init_distributed``), ten references to the world group are held by those functions for the rest of
the interpreter's life: ``destroy_process_group()`` cannot release it, and its native threads (Gloo's
``pt_gloo_runloop`` workers and ``gloo_tcp_loop``, the TCPStore's ``pt_tcpstore_uv``) still run while
the interpreter finalizes and the C++ runtime destroys its static objects at exit. A thread still
running then is what "terminate called without an active exception" (exit status -6) reports, the abort
a CPU job using DeepSpeed was seen to end with after every line of it had run.

``import ds_q8`` imports that module first, while no group exists, so its defaults bind to None.
"""
from __future__ import annotations


def bind_collective_defaults_early() -> bool:
    """Import ``torch.distributed.nn`` now if no default process group exists yet; True if it was
    imported here (False: already imported, no ``torch.distributed``, or a group exists already)."""
    import sys

    if "torch.distributed.nn" in sys.modules:
        return False
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    import torch.distributed.nn  # noqa: F401  (the import is the point)

    return True


__all__ = ["bind_collective_defaults_early"]
