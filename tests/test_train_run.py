"""Real training runs of the tiny model on CPU: determinism, resume, refusal to clobber, comparison report."""
from __future__ import annotations

import json
import math
import sys

import pytest

from helpers.train import LAUNCH, metrics, run, summary, train

pytestmark = pytest.mark.slow

# short sequences keep each run to a few seconds of compute; the rest is process start-up
SMALL = ["--micro_batch", "4", "--context", "64", "--eval_batches", "2"]
STEPS = ["--max_steps", "6", "--eval_interval", "3", "--save_interval", "3", "--seed", "11"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    proc = train(d, *SMALL, *STEPS, "--tensorboard", "--quant_report_interval", "2")
    return d, proc


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("cut")
    train(d, *SMALL, *STEPS, "--stop_at", "4")
    return d


def test_metrics_and_summary_are_written(uninterrupted):
    d, proc = uninterrupted
    rows = metrics(d)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    for r in rows:
        assert {"loss", "lr", "tokens_per_s", "step_time_s"} <= set(r) and math.isfinite(r["loss"])
    assert rows[-1]["loss"] < rows[0]["loss"]
    # the 8-bit state's telemetry every 2 steps (it changes nothing: the run without it has the same losses)
    assert [r["step"] for r in rows if "quant_exp_avg_sq_rel_error" in r] == [2, 4, 6]
    for r in rows[1::2]:
        assert 0 < r["quant_exp_avg_sq_rel_error"] < 0.05 and 0 <= r["quant_exp_avg_sq_at_zero"] < 0.05
        assert 0 < r["quant_exp_avg_at_extreme"] < 0.05
    s = summary(d)
    assert s["optimizer"] == "Adam8bitBlock" and s["world_size"] == 1 and s["steps"] == 6
    assert s["final_eval_loss"] == rows[-1]["eval_loss"]
    # 8-bit state: ~2 bytes per parameter, plus fp32 state for the embeddings; 32-bit Adam would be 8
    assert 2.0 < s["optimizer_state_bytes"] / s["n_params"] < 3.5
    for step in (3, 6):
        assert (d / f"step{step}" / "complete.json").is_file()
    # tensorboard is optional: without the package the run says so and carries on
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "tensorboard package is not installed" in proc.stderr
    else:
        assert (d / "tensorboard").is_dir()


def test_same_seed_gives_the_same_losses(uninterrupted, interrupted):
    full, cut = metrics(uninterrupted[0]), metrics(interrupted)
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    for a, b in zip(full, cut):
        assert a["loss"] == b["loss"] and a["lr"] == b["lr"] and a.get("eval_loss") == b.get("eval_loss")


def test_resume_reproduces_the_uninterrupted_run(uninterrupted, interrupted):
    # a checkpoint some rank never finished must be skipped: the run continues from step 4
    (interrupted / "step5").mkdir()
    (interrupted / "latest").write_text("step5")
    train(interrupted, *SMALL, *STEPS, "--resume")
    full, resumed = metrics(uninterrupted[0]), metrics(interrupted)
    assert summary(interrupted)["start_step"] == 4
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, resumed):
        assert (a["step"], a["loss"], a["lr"], a.get("eval_loss")) == (b["step"], b["loss"], b["lr"],
                                                                        b.get("eval_loss"))


def test_an_earlier_run_is_not_overwritten_silently(uninterrupted):
    proc = train(uninterrupted[0], *SMALL, *STEPS, check=False)
    assert proc.returncode != 0
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr


def test_comparison_report_and_plot(tmp_path):
    out = tmp_path / "cmp"
    run([sys.executable, LAUNCH / "compare.py", "--save_dir", out, "--max_steps", "4",
         "--runs", "32bit", "8bit", "8bit_bf16", "--",
         "--eval_interval", "2", "--no_progress", *SMALL], timeout=400)
    text = (out / "report.md").read_text()
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "| optimizer | Adam | Adam8bitBlock | Adam8bitBlock |" in text
    assert "| eval loss vs 32-bit | +0.00% |" in text and "8-bit, bf16 masters, stochastic rounding" in text
    assert "final eval perplexity" in text and "![train and eval loss](loss.png)" in text
    # what each run ran, and where: the plan chosen before the first run from the probe of this CPU
    plan = json.loads((out / "plan.json").read_text())
    assert plan["steps"] == 4 and plan["compute"] in ("bf16", "fp32") and plan["cpu"]
    assert f"| compute (forward and backward) | fp32 | fp32 | {plan['compute']} |" in text
    assert "| master weights | fp32 | fp32 | bf16 |" in text and "| steps | 4 | 4 | 4 |" in text
    assert f"Measured on {plan['cpu']} (" in text
    s8, s32 = summary(out / "8bit"), summary(out / "32bit")
    assert s8["n_params"] == s32["n_params"]
    assert s8["optimizer_state_bytes"] < 0.5 * s32["optimizer_state_bytes"]
    # both runs saw the same batches from the same start: the first losses agree (lr is tiny at step 1)
    assert metrics(out / "8bit")[0]["loss"] == metrics(out / "32bit")[0]["loss"]


def test_comparison_holds_muon8bit_against_deepspeeds_muon(tmp_path):
    out = tmp_path / "cmp"
    run([sys.executable, LAUNCH / "compare.py", "--save_dir", out, "--max_steps", "3", "--runs", "32bit", "muon",
         "muon8bit", "--", "--eval_interval", "0", "--no_progress", *SMALL], timeout=600)
    text = (out / "report.md").read_text()
    assert "| optimizer | Adam | MuonWithAuxAdam | Muon8bitBlock |" in text
    assert "| eval loss vs DeepSpeed Muon |  | +0.00% |" in text
    ds, ours = summary(out / "muon"), summary(out / "muon8bit")
    # the same tags: DeepSpeed's for "Muon", ds_q8's copy of them for Muon8bitBlock
    assert ds["muon_params"] == ours["muon_params"] > 0.9 * ds["n_params"]
    assert ds["muon_momentum_bytes"] == 4 * ds["muon_params"] and ds["muon_staging_bytes"] == 4 * ds["muon_params"]
    # one byte a value, plus one bfloat16 maximum for every 64 values
    assert 1.0 < ours["muon_momentum_bytes_8bit"] / ours["muon_momentum_elements_8bit"] <= 1.0 + 2 / 64 + 1e-3
    assert ours["muon_staging_bytes"] == 0
    assert "Muon momentum per Muon parameter (bytes) |  | 4.000 |" in text
    assert "Muon8bitBlock, 8-bit momentum against DeepSpeed Muon, fp32 momentum: eval loss" in text
    # the same batches from the same start: the first losses agree
    assert metrics(out / "muon")[0]["loss"] == metrics(out / "muon8bit")[0]["loss"]
