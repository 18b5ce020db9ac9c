"""When one of two ranks dies or hangs mid-training, the other one ends with an error in bounded time.

* a rank killed outright (SIGKILL, as by the OOM killer): the survivor's next collective fails at
  once with gloo's "Connection closed by peer" / "Connection reset by peer";
* a rank that hangs (SIGSTOP: alive, sockets open, silent): the survivor fails after ``--dist_timeout``
  seconds with gloo's "Timed out waiting ...ms";
* under the ``deepspeed`` launcher and under ``mpiexec`` the launcher notices the dead rank, kills
  the rest and exits non-zero, leaving no process behind.

Faults come from ``DS_Q8_FAULT`` (tests/ds_scripts/faults.py, hooked into the trainer by faulty_train.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.train import REPO, env

from helpers.ds_launch import free_port

pytestmark = pytest.mark.multirank

RUN = ["--no_progress", "--micro_batch", "4", "--context", "64", "--eval_batches", "2", "--max_steps", "40",
       "--eval_interval", "0", "--save_interval", "0"]
# a dead peer is noticed by the next collective (seen: well under a second); the slack covers a
# loaded machine
NOTICE_S = 30


def script(save_dir, *extra):
    return [str(Path(__file__).resolve().parent / "ds_scripts" / "faulty_train.py"), "--save_dir", str(save_dir),
            *RUN, *extra]


def trainer(save_dir, *extra):
    return [sys.executable] + script(save_dir, *extra)


def start_rank(rank, cmd, port, fault=None):
    extra = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if fault:
        extra["DS_Q8_FAULT"] = fault
    return subprocess.Popen(cmd, cwd=REPO, env=env(1, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def is_stopped(pid) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def wait_for(cond, limit_s=None):
    """Wait until ``cond()``; past ``limit_s`` seconds (the behaviour under test), fail. None: no limit but
    the test's own (a rank reaching its fault point takes what the machine gives it)."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while not cond():
        assert deadline is None or time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)
    return time.monotonic()


def processes_mentioning(text) -> list:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def two_plain_ranks(tmp_path, fault, timeout_s):
    """Start ranks 0 and 1 as separate processes (no launcher); rank 1 gets the fault."""
    cmd = trainer(tmp_path / "run", "--dist_timeout", str(timeout_s))
    port = free_port()
    r0, r1 = start_rank(0, cmd, port), start_rank(1, cmd, port, fault)
    return r0, r1


def finish(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_survivor_fails_fast_when_a_rank_is_killed(tmp_path):
    r0, r1 = two_plain_ranks(tmp_path, "kill:step:3:1", 600)
    try:
        died = wait_for(lambda: r1.poll() is not None)
        ended = wait_for(lambda: r0.poll() is not None, NOTICE_S)
        out = r0.stdout.read()
    finally:
        finish(r0, r1)
    assert r1.returncode == -signal.SIGKILL
    assert r0.returncode != 0
    assert "Connection closed by peer" in out or "Connection reset by peer" in out, out[-3000:]
    print(f"survivor exited {ended - died:.2f} s after its peer was killed")


def test_survivor_times_out_when_a_rank_hangs(tmp_path):
    timeout_s = 10
    r0, r1 = two_plain_ranks(tmp_path, "stop:step:3:1", timeout_s)
    try:
        stopped = wait_for(lambda: r1.poll() is None and is_stopped(r1.pid))
        ended = wait_for(lambda: r0.poll() is not None, timeout_s + NOTICE_S)
        out = r0.stdout.read()
    finally:
        finish(r0, r1)
    assert r0.returncode != 0
    assert f"Timed out waiting {timeout_s * 1000}ms" in out, out[-3000:]
    assert ended - stopped >= timeout_s - 1  # the survivor waited for the configured time, not less
    print(f"survivor exited {ended - stopped:.2f} s after its peer stopped (--dist_timeout {timeout_s})")


LAUNCHERS = {  # the deepspeed launcher starts python itself
    "deepspeed": lambda port, args: [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                     "--master_port", str(port)] + args,
    "mpiexec": lambda port, args: ["mpiexec", "-n", "2", "-genv", "DS_Q8_FAULT", "kill:step:3:1",
                                   sys.executable] + args,
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_ends_the_job_when_a_rank_dies(tmp_path, launcher):
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec (pip install mpich mpi4py)")
    port = free_port()
    marker = str(tmp_path / "run")
    cmd = LAUNCHERS[launcher](port, script(marker, "--master_port", str(port)))
    proc = subprocess.run(cmd, cwd=REPO, env=env(1, {"DS_Q8_FAULT": "kill:step:3:1"}), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "peer" in out or "BAD TERMINATION" in out, out[-3000:]
    assert processes_mentioning(marker) == []
