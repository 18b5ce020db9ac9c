"""Two ranks started by mpiexec (mpich from pip), discovered by DeepSpeed through mpi4py: ZeRO-2 on CPU."""
from __future__ import annotations

import math
import shutil

import pytest

from train_helpers import metrics, summary, train


def _mpi_available() -> bool:
    if shutil.which("mpiexec") is None:
        return False
    try:
        from mpi4py import MPI  # noqa: F401  (needs libmpi at run time, not only the wheel)
    except (ImportError, RuntimeError, OSError):
        return False
    return True


@pytest.mark.skipif(not _mpi_available(), reason="needs mpiexec and a working mpi4py (pip install mpich mpi4py)")
def test_mpirun_two_ranks_zero2(tmp_path):
    # one thread per rank: two ranks share the CPU cores
    train(tmp_path, "--master_port", "29617", "--max_steps", "3", "--eval_interval", "0", "--micro_batch", "4",
          "--context", "64", "--eval_batches", "2", "--stable_embedding",
          launcher=["mpiexec", "-n", "2"], threads=1, timeout=300)
    s = summary(tmp_path)
    assert s["world_size"] == 2 and s["optimizer"] == "Adam8bitBlock"
    # ZeRO-2 split the optimizer state: rank 0 holds half of it
    assert s["optimizer_state_bytes_rank0"] == pytest.approx(s["optimizer_state_bytes"] / 2, rel=0.01)
    for rank in (0, 1):
        assert (tmp_path / "step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows) and math.isfinite(rows[-1]["eval_loss"])
    # tokens per step count both ranks: 2 ranks x 4 sequences x 64 tokens
    assert rows[-1]["tokens_per_s"] * rows[-1]["step_time_s"] == pytest.approx(512)
