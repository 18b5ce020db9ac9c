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
    deepspeed.init_distributed(distributed_port=port, timeout=datetime.timedelta(seconds=timeout_s))


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
