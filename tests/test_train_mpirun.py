"""Two CPU ranks with ZeRO-2, started three ways by the launch/ scripts: mpiexec directly (DeepSpeed finds
rank and size through mpi4py), the deepspeed launcher on one machine, and the deepspeed launcher with a
hostfile and its MPICH backend. The same job must give the same losses whichever way it is started."""
from __future__ import annotations

import math
import shutil

import pytest

from helpers.train import LAUNCH, metrics, run, summary

pytestmark = pytest.mark.multirank

ARGS = ["--max_steps", "3", "--eval_interval", "0", "--micro_batch", "4", "--context", "64", "--eval_batches", "2",
        "--stable_embedding", "--no_progress", "--seed", "5"]


def _mpi_available() -> bool:
    if shutil.which("mpiexec") is None or shutil.which("mpirun") is None:
        return False
    try:
        from mpi4py import MPI  # noqa: F401  (needs libmpi at run time, not only the wheel)
    except (ImportError, RuntimeError, OSError):
        return False
    return True


needs_mpi = pytest.mark.skipif(not _mpi_available(),
                               reason="needs mpiexec/mpirun and a working mpi4py (pip install mpich mpi4py)")


@pytest.fixture(scope="module")
def mpirun_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("mpirun")
    # one thread per rank: two ranks share the CPU cores
    run([LAUNCH / "run_mpirun.sh", "--save_dir", d, *ARGS], threads=1, timeout=300,
        extra_env={"NP": "2", "MASTER_PORT": "29617"})
    return d


@needs_mpi
def test_mpirun_two_ranks_zero2(mpirun_run):
    s = summary(mpirun_run)
    assert s["world_size"] == 2 and s["optimizer"] == "Adam8bitBlock"
    # ZeRO-2 split the optimizer state: rank 0 holds half of it
    assert s["optimizer_state_bytes_rank0"] == pytest.approx(s["optimizer_state_bytes"] / 2, rel=0.01)
    for rank in (0, 1):
        assert (mpirun_run / "step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
    rows = metrics(mpirun_run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows) and math.isfinite(rows[-1]["eval_loss"])
    # tokens per step count both ranks: 2 ranks x 4 sequences x 64 tokens
    assert rows[-1]["tokens_per_s"] * rows[-1]["step_time_s"] == pytest.approx(512)


@needs_mpi
@pytest.mark.parametrize("script, extra_env", [
    ("run_single_node.sh", {"NUM_GPUS": "2", "MASTER_PORT": "29619"}),
    ("run_multi_node.sh", {"LAUNCHER": "mpich", "MASTER_PORT": "29621", "MASTER_ADDR": "127.0.0.1"}),
])
def test_deepspeed_launcher_matches_mpirun(script, extra_env, mpirun_run, tmp_path):
    if script == "run_multi_node.sh":
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("# this machine, two ranks\nlocalhost slots=2\n")
        extra_env = dict(extra_env, HOSTFILE=str(hostfile))
    d = tmp_path / "run"
    run([LAUNCH / script, "--save_dir", d, *ARGS], threads=1, timeout=300, extra_env=extra_env)
    assert summary(d)["world_size"] == 2
    assert [r["loss"] for r in metrics(d)] == [r["loss"] for r in metrics(mpirun_run)]


def test_launch_scripts_reject_bad_settings(tmp_path):
    cases = [("run_single_node.sh", {"NUM_GPUS": "0"}, "NUM_GPUS"),
             ("run_mpirun.sh", {"NP": "two"}, "NP"),
             ("run_multi_node.sh", {"LAUNCHER": "slurmish"}, "LAUNCHER"),
             ("run_multi_node.sh", {"HOSTFILE": str(tmp_path / "none")}, "HOSTFILE")]
    for script, extra_env, field in cases:
        proc = run([LAUNCH / script], check=False, extra_env=extra_env, timeout=60)
        assert proc.returncode == 2 and field in proc.stderr, (script, proc.stderr)
