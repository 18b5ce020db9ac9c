"""GPT-2 1.5B readiness on CPU: the gpt2-xl config, at full width 1600 but 2 layers, takes real ZeRO-2 + bf16
steps with Adam8bitBlock. The vocabulary is the byte-level default (256), so the model has 62M parameters;
the 1.5B parameter count itself is checked on the meta device (test_train_cli.py)."""
from __future__ import annotations

import math

import pytest
from helpers.train import CONFIGS, metrics, summary, train

pytestmark = pytest.mark.slow


def test_gpt2_xl_reduced_depth_zero2_bf16_steps(tmp_path):
    train(tmp_path, "--deepspeed_config", CONFIGS / "gpt2_xl_8bit_zero2.json", "--model", "gpt2-xl",
          "--n_layer", "2", "--context", "64", "--micro_batch", "1", "--grad_accum", "1", "--max_steps", "2",
          "--eval_batches", "1", "--save_interval", "0", timeout=600)
    s = summary(tmp_path)
    assert s["model"] == "gpt2-xl" and s["optimizer"] == "Adam8bitBlock" and s["world_size"] == 1
    # 2 blocks of width 1600 (12 * 1600^2 + 13 * 1600 each) + 64 positions + 256 tokens + final LayerNorm
    assert s["n_params"] == 2 * (12 * 1600 ** 2 + 13 * 1600) + (64 + 256) * 1600 + 2 * 1600
    # uint8 moments for the blocks, fp32 moments only for the 1.6M embedding parameters
    assert s["optimizer_state_bytes"] / s["n_params"] < 2.3
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows) and math.isfinite(s["final_eval_loss"])
    assert (tmp_path / "step2" / "complete.json").is_file()


def test_offload_config_keeps_8bit_state_on_the_cpu(tmp_path):
    # the ZeRO-Offload variant of the 1.5B config, on the tiny model: the optimizer built from the JSON
    # type runs on the offloaded fp32 partition and keeps uint8 state
    train(tmp_path, "--deepspeed_config", CONFIGS / "gpt2_xl_8bit_zero2_offload.json", "--context", "64",
          "--micro_batch", "4", "--grad_accum", "1", "--max_steps", "2", "--eval_batches", "1",
          "--save_interval", "0", timeout=300)
    s = summary(tmp_path)
    assert s["optimizer"] == "Adam8bitBlock"
    assert s["optimizer_state_bytes"] / s["n_params"] < 3.0
    assert math.isfinite(s["final_eval_loss"])
