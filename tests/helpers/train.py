"""Paths and a subprocess runner for the launch/ scripts, shared by the training tests. Importing it puts
launch/ on sys.path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
CONFIGS = REPO / "ds_configs"

if str(LAUNCH) not in sys.path:
    sys.path.insert(0, str(LAUNCH))


def env(threads: int = 2, extra: dict = None) -> dict:
    e = dict(os.environ)
    e.update(extra or {})
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(LAUNCH)] + [p for p in [e.get("PYTHONPATH")] if p])
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def run(cmd, timeout: int = 300, threads: int = 2, check: bool = True, extra_env: dict = None
        ) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env(threads, extra_env), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-4000:]}")
    return proc


def train(save_dir, *extra, timeout: int = 300, launcher=(), threads: int = 2, check: bool = True):
    cmd = list(launcher) + [sys.executable, LAUNCH / "train_gpt.py", "--save_dir", save_dir, "--no_progress",
                            *extra]
    return run(cmd, timeout=timeout, threads=threads, check=check)


def metrics(save_dir) -> list:
    path = Path(save_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def summary(save_dir) -> dict:
    return json.loads((Path(save_dir) / "summary.json").read_text())
