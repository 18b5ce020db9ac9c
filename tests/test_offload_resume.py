"""The shipped ZeRO-Offload config (``ds_configs/decoder_7b_8bit_bf16master_zero2_offload.json``: bf16 masters,
AdamW8bitBlock, optimizer state and step on the CPU) at small size through ``launch/train_gpt.py``: a run
SIGKILLed inside an optimizer step (after the first parameter group was stepped, before the second)
resumes from its last complete checkpoint and ends with the losses and weights of a run that was never
interrupted; DeepSpeed's own ``zero_to_fp32.py``, copied beside the checkpoints, converts them. At two
ranks and ZeRO-3 the trainer's summary reports each rank's host bytes, and ``ds_q8.memory.predict_offload`` predicts
them to the byte for the parameter groups the trainer makes (32-bit embeddings included).

The kill comes from ``DS_Q8_FAULT=kill:mid_step:STEP`` (tests/ds_scripts/faults.py through faulty_train.py).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.train import CONFIGS, LAUNCH, REPO, env, metrics, run, summary, train

import checkpointing

from helpers.ds_launch import free_port

pytestmark = pytest.mark.slow

FAULTY_TRAIN = Path(__file__).resolve().parent / "ds_scripts" / "faulty_train.py"
CONFIG = ["--deepspeed_config", CONFIGS / "decoder_7b_8bit_bf16master_zero2_offload.json"]
SMALL = [*CONFIG, "--micro_batch", "4", "--grad_accum", "2", "--context", "64", "--eval_batches", "2", "--lr", "3e-3"]
STEPS = ["--max_steps", "6", "--eval_interval", "3", "--save_interval", "2", "--seed", "5"]
MODEL_FILE = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload_full")
    train(d, *SMALL, *STEPS)
    return d


def _weights(save_dir, step=6):
    return torch.load(save_dir / f"step{step}" / MODEL_FILE, map_location="cpu", weights_only=False)["module"]


def test_the_config_offloads_8bit_state_and_steps_bf16_masters(full):
    s = summary(full)
    assert s["optimizer"] == "AdamW8bitBlock" and s["optimizer_state_bytes"] > 0
    keep = [r for r in metrics(full) if "loss" in r]
    assert len(keep) == 6 and keep[-1]["loss"] < keep[0]["loss"]
    assert all(v.dtype == torch.bfloat16 for v in _weights(full).values() if v.is_floating_point())


def test_killed_mid_step_resumes_with_the_same_losses(full, tmp_path):
    proc = subprocess.run([sys.executable, str(FAULTY_TRAIN), "--save_dir", str(tmp_path), "--no_progress", *SMALL,
                           *STEPS], cwd=REPO, env=env(2, {"DS_Q8_FAULT": "kill:mid_step:5"}), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]  # died inside step 5
    assert checkpointing.latest_complete(str(tmp_path)) == ("step4", 4)
    train(tmp_path, *SMALL, *STEPS, "--resume")
    assert summary(tmp_path)["start_step"] == 4
    keep = ("step", "loss", "lr", "eval_loss")
    assert [{k: r.get(k) for k in keep} for r in metrics(tmp_path)] == \
           [{k: r.get(k) for k in keep} for r in metrics(full)]
    a, b = _weights(full), _weights(tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_deepspeeds_zero_to_fp32_script_converts_the_checkpoint(full, tmp_path):
    script = full / "zero_to_fp32.py"
    assert script.is_file()  # DeepSpeed copies it beside the checkpoints
    proc = subprocess.run([sys.executable, str(script), str(full), str(tmp_path), "--tag", "step6"], cwd=REPO,
                          env=env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("pytorch_model*.bin"))
    assert len(files) == 1, sorted(p.name for p in tmp_path.iterdir())
    converted = torch.load(files[0], map_location="cpu", weights_only=False)
    model = _weights(full)
    assert set(converted) <= set(model) and len(converted) > 0
    for name, value in converted.items():
        # the bf16 masters, as fp32: the parameters the run ended with
        assert value.dtype == torch.float32 and torch.equal(value, model[name].float()), name


def test_two_ranks_at_zero3_report_the_predicted_host_bytes(tmp_path):
    """ZeRO-3 with every parameter partitioned (``stage3_param_persistence_threshold`` 0), so that each forward
    gathers parameters from both ranks: the final evaluation's three batches are split 2 + 1, and the rank
    without a third batch still joins its gathers."""
    from ds_q8.memory.predict_offload import predict_host_states

    cfg = json.loads((CONFIGS / "decoder_7b_8bit_bf16master_zero2_offload.json").read_text())
    cfg["zero_optimization"].update(stage=3, stage3_param_persistence_threshold=0)
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(cfg))
    save = tmp_path / "run"
    run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", free_port(),
         LAUNCH / "train_gpt.py", "--save_dir", save, "--no_progress", "--deepspeed_config", path, "--micro_batch", "2",
         "--grad_accum", "2", "--context", "32", "--eval_batches", "3", "--max_steps", "2", "--eval_interval", "0",
         "--save_interval", "0"], timeout=600, threads=1)
    s = summary(save)
    assert s["world_size"] == 2 and s["optimizer"] == "AdamW8bitBlock"
    for rank, measured in enumerate(s["host_states"]):
        measured = dict(measured)
        total = measured.pop("total")
        assert sum(measured.values()) == total
        assert measured == predict_host_states(s["param_group_sizes"], "q8_bf16", 3, 2, rank=rank,
                                               group_bits=s["param_group_bits"], gradient_accumulation_steps=2)
