"""Start torch.distributed for any of the ways the trainer can be launched.

* ``deepspeed`` launcher / torchrun: RANK, WORLD_SIZE, MASTER_* are already set.
* ``mpirun`` / ``mpiexec``: DeepSpeed reads rank and size from MPI through mpi4py.
* plain ``python``: one rank; the variables are filled in here so that DeepSpeed does not go
  looking for an MPI job that does not exist.
"""
from __future__ import annotations

import datetime
import os
import socket

#: seconds a collective waits for the other ranks; see ``--dist_timeout`` in train_gpt.py
DEFAULT_TIMEOUT_S = 600

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_mpi() -> bool:
    return "RANK" not in os.environ and any(v in os.environ for v in _MPI_RANK_VARS)


def init(master_port: int = None, timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    import deepspeed

    if "RANK" not in os.environ and not launched_by_mpi():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(master_port or _free_port()))
    # MPI discovery overwrites MASTER_PORT with this port; keep one a launcher exported
    port = master_port or int(os.environ.get("MASTER_PORT", 29500))
    # gloo applies the process group's timeout to every collective: a rank that died or hangs
    # makes the others fail after timeout_s instead of waiting forever
    timeout = datetime.timedelta(seconds=timeout_s)
    # ...but only the default group gets it: the groups DeepSpeed makes later (ZeRO's data-parallel
    # group, where gradients are reduced) take torch's default of 30 minutes. Seen: a host lost
    # during backward left the survivor waiting there long after timeout_s. Make it their default.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    deepspeed.init_distributed(distributed_port=port, timeout=timeout)


def hostnames() -> list:
    """Every rank's hostname, in rank order (one entry without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [socket.gethostname()]
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names


# what gloo says when a peer process died (connection closed/reset) or stopped answering (timeout)
_PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Connection refused",
                 "No route to host", "Broken pipe")


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank or its host went away."""
    import torch.distributed as dist

    return isinstance(e, (RuntimeError, dist.DistError)) and any(s in str(e) for s in _PEER_FAILURE)


def peer_failure_message(e: BaseException, timeout_s: int) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"rank {os.environ.get('RANK', '?')} on host {socket.gethostname()}: lost contact with the other ranks "
            f"({first.strip()}). Another rank, its host or the network to it is gone; a rank waits at most "
            f"--dist_timeout={timeout_s} s in a collective")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def release_shm_buffer() -> None:
    """Remove this rank's /dev/shm all-reduce buffer (66 MiB) that DeepSpeed's CPU backend creates
    and never unlinks. Call once no rank will communicate again: the name goes, open mappings stay."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    try:
        os.unlink(name)
    except OSError:
        pass  # not created (GPU backends, ranks on several hosts) or already gone


def shutdown() -> None:
    # With gloo, a rank that exits while others still tear down can abort; meet first.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        release_shm_buffer()
        dist.destroy_process_group()
