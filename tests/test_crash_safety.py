"""The trainer killed with SIGKILL at any moment, including inside a checkpoint write, loses only the
steps since its last complete checkpoint: ``--resume`` continues from there and on CPU ends with
exactly the weights and losses of a run that was never interrupted.

The kills come from ``DS_Q8_FAULT`` (tests/ds_scripts/faults.py, hooked into the trainer by
faulty_train.py: the process SIGKILLs itself at a named point,
e.g. half-way through writing a checkpoint file) and, for a moment no hook chooses, from the test
itself: it kills the process as soon as the new checkpoint folder appears.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.train import LAUNCH, REPO, env, metrics, summary, train

import checkpointing

pytestmark = pytest.mark.slow

FAULTY_TRAIN = Path(__file__).resolve().parent / "ds_scripts" / "faulty_train.py"
SMALL = ["--micro_batch", "4", "--context", "64", "--eval_batches", "2"]
STEPS = ["--max_steps", "6", "--eval_interval", "3", "--save_interval", "2", "--seed", "5"]
MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def killed_run(save_dir, fault):
    proc = subprocess.run([sys.executable, str(FAULTY_TRAIN), "--save_dir", str(save_dir),
                           "--no_progress", *SMALL, *STEPS], cwd=REPO, env=env(2, {"DS_Q8_FAULT": fault}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def final_weights(save_dir):
    sd = torch.load(save_dir / "step6" / MODEL_FILE, map_location="cpu", weights_only=False)
    return sd["module"]


def assert_same_as_uninterrupted(full, resumed):
    keep = ("step", "loss", "lr", "eval_loss")
    assert [{k: r.get(k) for k in keep} for r in metrics(resumed)] == \
           [{k: r.get(k) for k in keep} for r in metrics(full)]
    a, b = final_weights(full), final_weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert summary(resumed)["final_eval_loss"] == summary(full)["final_eval_loss"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    train(d, *SMALL, *STEPS)
    return d


def test_markers_list_flushed_files_with_their_sizes(full):
    for step in (2, 4, 6):
        assert checkpointing.check_complete(full / f"step{step}") is None
    assert not list(full.glob("step*/complete.json.tmp"))


@pytest.mark.parametrize("fault", ["kill:mid_save:4", "kill:save:4"])
def test_kill_inside_a_checkpoint_write_resumes_from_the_previous_one(full, tmp_path, fault):
    killed_run(tmp_path, fault)
    # DeepSpeed already points `latest` at the unfinished checkpoint; the marker is what counts
    assert (tmp_path / "latest").read_text().strip() == "step4" or fault.startswith("kill:mid_save")
    assert not (tmp_path / "step4" / checkpointing.MARKER).exists()
    if fault.startswith("kill:mid_save"):  # the file it was writing is cut short
        sizes = {f.name: f.stat().st_size for f in (tmp_path / "step4").iterdir()}
        assert sizes and min(sizes.values()) < (full / "step4" / MODEL_FILE).stat().st_size
    proc = train(tmp_path, *SMALL, *STEPS, "--resume")
    assert "skipping checkpoint" in proc.stderr and "step4" in proc.stderr
    assert summary(tmp_path)["start_step"] == 2
    assert_same_as_uninterrupted(full, tmp_path)


def test_damaged_file_under_a_marker_falls_back_to_the_previous_checkpoint(full, tmp_path):
    killed_run(tmp_path, "kill:step:5")
    assert checkpointing.latest_complete(str(tmp_path)) == ("step4", 4)
    victim = tmp_path / "step4" / OPTIM_FILE
    victim.write_bytes(victim.read_bytes()[:1000])
    proc = train(tmp_path, *SMALL, *STEPS, "--resume")
    assert f"{OPTIM_FILE} has 1000 bytes" in proc.stderr
    assert summary(tmp_path)["start_step"] == 2
    assert_same_as_uninterrupted(full, tmp_path)


def test_kill_when_the_checkpoint_folder_appears(full, tmp_path):
    proc = subprocess.Popen([sys.executable, str(LAUNCH / "train_gpt.py"), "--save_dir", str(tmp_path),
                             "--no_progress", *SMALL, *STEPS], cwd=REPO, env=env(2),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (tmp_path / "step4").exists():  # as long as the run takes, within the test's own limit
            assert proc.poll() is None, "the run ended before step 4"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    marked = (tmp_path / "step4" / checkpointing.MARKER).exists()
    if marked:  # only ever written after the files: then they must all be there, whole
        assert checkpointing.check_complete(tmp_path / "step4") is None
    train(tmp_path, *SMALL, *STEPS, "--resume")
    assert summary(tmp_path)["start_step"] == (4 if marked else 2)
    assert_same_as_uninterrupted(full, tmp_path)
