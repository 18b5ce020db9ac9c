"""launch/compare.py's plan, chosen before the first run: what the bf16 runs compute in (from the probe's
times), how many steps fit the budget, what each run's command and progress bar say, and the report's
statement of it all. The probe and the builds are stubbed: these tests take no time."""
from __future__ import annotations

import time

import pytest

from helpers.train import LAUNCH  # noqa: F401  (puts launch/ on sys.path)

import compare
import cpu_probe

CPU = "Some CPU"


def fake_probe(fp32, bf16, bf16_fp32_compute, onednn_bf16="from the times"):
    if onednn_bf16 == "from the times":
        onednn_bf16 = bf16 < 2 * fp32
    return cpu_probe.Probe(cpu=CPU, capability="AVX2", onednn_bf16=onednn_bf16, threads=2,
                           seconds=dict(fp32=fp32, bf16=bf16, bf16_fp32_compute=bf16_fp32_compute),
                           shape="tiny GPT, 16 x 128 tokens")


@pytest.fixture
def probed(monkeypatch):
    """plan() on a CPU whose probe gives the times set by the returned function."""
    times = {}
    monkeypatch.setattr(compare, "prebuild", lambda: None)
    monkeypatch.setattr(cpu_probe, "measure", lambda *a, **k: fake_probe(**times))
    return times.update


def plan(*argv, start=None):
    args = compare.parse_args(list(argv))
    return args, compare.plan(args, time.time() if start is None else start)


def test_without_native_bf16_the_bf16_runs_compute_in_fp32(probed):
    probed(fp32=0.25, bf16=2.2, bf16_fp32_compute=0.26)  # an AVX2 CPU (AVX2 emulated on a Xeon)
    args, p = plan()
    assert p["compute"] == "fp32" and p["cpu"] == CPU and p["why"].startswith("no native bf16")
    assert p["bf16"] == {r: r in ("bf16_states", "8bit_bf16", "8bit_bf16_nosr", "8bit_bf16_corr", "4bit_bf16")
                         for r in compare.RUNS}
    # nine runs fit the budget at the probe's speed
    assert compare.MIN_STEPS <= p["steps"] <= compare.DEFAULT_STEPS and p["steps"] % 10 == 0
    assert p["expected_s"] <= args.budget_s or p["steps"] == compare.MIN_STEPS
    cmd = compare.train_command(args, "8bit_bf16", p, 3)
    assert cmd[cmd.index("--compute") + 1] == "fp32" and cmd[cmd.index("--max_steps") + 1] == str(p["steps"])
    assert cmd[cmd.index("--label") + 1] == "4/9 8bit_bf16 (bf16 masters, fp32 compute)"
    assert cmd[cmd.index("--eval_interval") + 1] == str(p["steps"] // 10)
    cmd = compare.train_command(args, "32bit", p, 0)
    assert cmd[cmd.index("--label") + 1] == "1/9 32bit (fp32 masters, fp32 compute)"


def test_with_native_bf16_the_bf16_runs_compute_in_bf16(probed):
    probed(fp32=0.17, bf16=0.15, bf16_fp32_compute=0.18)  # the Xeon's AMX
    args, p = plan("--runs", "32bit", "8bit_bf16")
    assert p["compute"] == "bf16" and p["why"].startswith("native bf16")
    cmd = compare.train_command(args, "8bit_bf16", p, 1)
    assert cmd[cmd.index("--compute") + 1] == "bf16"
    # two runs at this speed fit the most steps
    assert p["steps"] == compare.DEFAULT_STEPS


def test_torch_s_answer_outweighs_a_busy_moment(probed):
    """On a shared CPU one busy moment can make bf16 look slower than it is (1.7x, measured so on the Xeon
    with native bf16 while other jobs ran); torch's answer decides, the timing only where torch gives none
    or where bf16 is far slower."""
    probed(fp32=4.3, bf16=3.9, bf16_fp32_compute=2.3, onednn_bf16=True)
    assert plan()[1]["compute"] == "bf16"
    probed(fp32=0.25, bf16=2.2, bf16_fp32_compute=0.26, onednn_bf16=None)
    assert plan()[1]["compute"] == "fp32"
    probed(fp32=0.25, bf16=0.3, bf16_fp32_compute=0.26, onednn_bf16=False)
    assert plan()[1]["compute"] == "fp32"


def test_the_steps_follow_the_budget_and_an_explicit_count_wins(probed):
    probed(fp32=0.4, bf16=4.0, bf16_fp32_compute=0.4)
    _, slow = plan("--budget_s", "60")
    assert slow["steps"] == compare.MIN_STEPS  # not fewer, however short the budget
    _, given = plan("--max_steps", "7", "--compute", "bf16")
    assert given["steps"] == 7 and given["compute"] == "bf16" and given["why"] == "--compute bf16"
    _, late = plan(start=time.time() - 400)  # the builds took 400 s of the 540
    _, early = plan()
    assert late["steps"] < early["steps"]


def test_flags_compare_sets_itself_are_refused_after_the_separator():
    with pytest.raises(SystemExit):
        compare.parse_args(["--", "--compute", "fp32"])


def test_the_report_says_what_each_run_ran_and_where():
    def summary(masters, compute):
        return dict(summary=dict(optimizer="Adam", config="x.json", model="tiny", micro_batch=16, context=128,
                                 n_params=1000, world_size=1, steps=60, compute=compute, masters=masters,
                                 final_eval_loss=2.0, final_eval_ppl=7.4, mean_step_time_s=0.2, tokens_per_s=1e4,
                                 optimizer_state_bytes=8000, peak_rss_bytes_rank0=2 ** 30),
                    metrics=[dict(step=1, loss=3.0, eval_loss=2.0)])
    runs = {"32bit": summary("fp32", "fp32"), "8bit_bf16": summary("bf16", "fp32")}
    p = dict(cpu=CPU, probe=fake_probe(0.25, 2.2, 0.26).describe(), why="bf16 is slow here", steps=60,
             wall_s=301.0, expected_s=290.0)
    text = compare.report(runs, "loss.png", p)
    assert "| model | tiny, 16 x 128 tokens a step | tiny, 16 x 128 tokens a step |" in text
    assert "| steps | 60 | 60 |" in text
    assert "| compute (forward and backward) | fp32 | fp32 |" in text
    assert "| master weights | fp32 | bf16 |" in text
    assert "| optimizer state | fp32 moments | 8-bit moments |" in text
    assert f"Measured on {CPU} (" in text and "Wall time 5 min 01 s (expected 4 min 50 s of training)" in text
