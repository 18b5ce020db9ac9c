"""The training stage of the GPU check (gpu_check/gpu_train.sh, gpu_check/gpu_train.py, gpu_check/gpu_train_row.py)
without a GPU: its rows name shipped configs that train alike, its dry run lists every row's launch, it stops
at once without a GPU, a row the budget cannot pay is skipped, and the whole stage runs on DeepSpeed's CPU
accelerator with a tiny GPT-2 through the same launches, giving a table and a JSON with every column."""
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers.train import CONFIGS

GPU_CHECK = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(GPU_CHECK))
import gpu_train  # noqa: E402
import gpu_train_row  # noqa: E402  (it puts launch/ on sys.path for the trainer's modules)

from helpers.ds_launch import extensions_root, free_port


def stage(out, *args, dry_run=False, extra_env=None, timeout=120):
    # WHEELS= : .whl/, when present, holds wheels for the GPU machine's Python, not this one's
    env = dict(os.environ, OUT=str(out), WHEELS="", OMP_NUM_THREADS="1", **(extra_env or {}))
    env.pop("DRY_RUN", None)
    if dry_run:
        env["DRY_RUN"] = "1"
    return subprocess.run(["bash", str(GPU_CHECK / "gpu_train.sh"), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_shell_scripts_parse():
    for name in ("gpu_train.sh", "gpu_env.sh"):
        subprocess.run(["bash", "-n", str(GPU_CHECK / name)], check=True)


def test_rows_use_shipped_configs_that_train_alike():
    xl = json.loads((CONFIGS / "gpt2_xl_8bit_zero2.json").read_text())
    hyper = {k: xl["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")}
    for row in gpu_train.ROWS:
        cfg = json.loads((CONFIGS / row.config).read_text())
        # the same schedule, batch shape and ZeRO stage: only the optimizer and its precision differ
        for key in ("scheduler", "zero_optimization", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping"):
            assert cfg[key] == xl[key], (row.config, key)
        if row.client:
            assert "optimizer" not in cfg and cfg["zero_allow_untested_optimizer"] is True
            assert gpu_train_row.CLIENT_HYPERPARAMETERS == CONFIGS / "gpt2_xl_8bit_zero2.json"
        else:
            assert {k: cfg["optimizer"]["params"][k] for k in hyper} == hyper, row.config
    assert [gpu_train.op_of(r) for r in gpu_train.ROWS] == ["FusedAdam", "ds_q8", "FusedAdam", "ds_q8", "ds_q8",
                                                           "ds_q8", None]
    assert {r.rung for r in gpu_train.ROWS} == {"a", "b", "c", "e", "f", "g", None}
    names = {r.name for r in gpu_train.ROWS}
    assert all(a in names and b in names for a, b, _ in gpu_train.COMPARISONS)


def test_dry_run_lists_every_row_launch(tmp_path):
    out = stage(tmp_path, dry_run=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("dry run: build FusedAdam, ds_q8 side by side (at most 180 s), then 7 rows in ")
    for row in gpu_train.ROWS:
        (line,) = [x for x in lines if x.startswith(f"row {row.name} (")]
        assert "-m deepspeed.launcher.runner --num_gpus 1 " in line and f"ds_configs/{row.config} " in line
        # gpt2-xl at full depth, context 1024, the micro batch from the arithmetic, 3 + 30 steps
        assert "--model gpt2-xl --vocab_size 50257 --context 1024 --micro_batch 16 --warmup 3 --steps 30" in line
        assert "--n_layer" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_train.log"]


def test_gpu_less_run_stops_with_one_line(tmp_path):
    out, ext = tmp_path / "out", tmp_path / "ext"
    run = stage(out, extra_env=dict(CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(ext)))
    lines = [x for x in run.stdout.splitlines() if x.strip()]
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("STOP preflight: no CUDA GPU visible"), lines
    assert not ext.exists(), "the GPU-less run built something"


@pytest.mark.parametrize("argv,message", [(["--rows", "8bit,adamw"], "--rows must name rows among"),
                                          (["--micro_batch", "0"], "--micro_batch must be an integer >= 1, got 0"),
                                          (["--warmup", "0"], "--warmup must be an integer >= 1, got 0"),
                                          (["--row_min_s", "60", "--row_limit_s", "50"],
                                           "--row_limit_s must be at least --row_min_s=60, got 50")])
def test_bad_arguments_are_named(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        gpu_train.main(["--out", str(tmp_path)] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_row_the_budget_cannot_pay_is_skipped_and_listed(tmp_path, capsys):
    args = gpu_train.parse_args(["--out", str(tmp_path), "--budget_s", "30"])  # less than RESERVE_S + a row
    s = gpu_train.Stage(args, tmp_path)
    row = gpu_train.ROWS[1]
    gpu_train.run_row(s, row, 0, 1, {"ds_q8": None})
    assert capsys.readouterr().out.startswith(f"SKIP row {row.name}: ")
    table = (tmp_path / "train_table.md").read_text()
    assert f"| {row.label} | `{row.config}` | SKIP: " in table and "a row needs 40" in table
    assert json.loads((tmp_path / "train.json").read_text())["rows"][0]["status"] == "SKIP"
    gpu_train.run_row(s, gpu_train.ROWS[3], 1, 1, {"ds_q8": "its build exited 1"})
    assert capsys.readouterr().out == "SKIP row 8bit: ds_q8 did not build\n"


def test_cuda_library_headers_only_where_the_toolkit_lacks_them(tmp_path, monkeypatch):
    site, full = tmp_path / "site", tmp_path / "cuda"
    for d in (site / "nvidia" / "cu13" / "include", site / "nvidia" / "nccl" / "include", full / "include"):
        d.mkdir(parents=True)
    (full / "include" / "cusparse.h").write_text("")
    monkeypatch.setattr(sys, "path", [str(site)])
    assert gpu_train.cuda_library_headers(str(full)) == []
    assert gpu_train.cuda_library_headers(str(tmp_path / "nvcc-only")) == [
        str(site / "nvidia" / "cu13" / "include"), str(site / "nvidia" / "nccl" / "include")]


COLUMNS = ("tokens_per_s", "step_ms_median", "peak_allocated_bytes", "peak_reserved_bytes",
           "model_state_bytes_per_param", "loss_last", "tokens_per_s_at_config_accumulation")


def build_first(builds: str, ops=("ds_q8", "FusedAdam", "ShareMemComm")) -> None:
    """Build the stage's ops, side by side as the stage does, limited only by the test's own time: the stage
    gives its builds BUILD_LIMIT_S (the GPU machine's budget), which a slow or busy CPU passes cold (a 2-core AMD
    EPYC beside other jobs: "build FusedAdam (cpu): its build ran past 180 s"). The stage then loads them."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=builds, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    procs = {op: subprocess.Popen([sys.executable, "-c", gpu_train.BUILDS[op], "cpu"], env=env, cwd=gpu_train.REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for op in ops}
    for op, proc in procs.items():
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"build {op}:\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the builds (unlimited, cold: minutes on a busy CPU), then the stage's own 850 s
def test_stage_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    """The same script, launches and rows as on the GPU, on DeepSpeed's CPU accelerator: DeepSpeed's FusedAdam
    (its CPU build), Adam8bitBlock with bf16 masters, and bitsandbytes' AdamW8bit as a client optimizer where
    bitsandbytes is installed (skipped, saying so, where it is not)."""
    rows = ["deepspeed-adam", "8bit-bf16", "bnb-8bit"]
    # the builds (ds_q8's CPU op, DeepSpeed's CPU FusedAdam and shared-memory comm: 110-160 s each here, cold) land
    # where this suite's other tests build theirs, not in the checkout's .ext_cache/ that the GPU machine uses
    builds = extensions_root()
    build_first(builds)
    run = stage(tmp_path, "--cpu", "--model", "tiny", "--vocab_size", "256", "--context", "64", "--micro_batch", "4",
                "--warmup", "2", "--steps", "3", "--rows", ",".join(rows), "--master_port", free_port(),
                "--budget_s", "800", "--row_limit_s", "300", extra_env=dict(TORCH_EXTENSIONS_DIR=builds), timeout=850)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["failed"] == 0 and data["device"].startswith("CPU") and data["commit"] != "unknown"
    assert [r["name"] for r in data["rows"]] == rows
    has_bnb = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True).returncode == 0
    table = (tmp_path / "train_table.md").read_text().splitlines()
    for row in data["rows"]:
        if row["name"] == "bnb-8bit" and not has_bnb:
            assert row["status"] == "SKIP" and "bitsandbytes is not installed here" in row["detail"]
            continue
        assert row["status"] == "PASS", row["detail"]
        r = row["result"]
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in COLUMNS), {k: r[k] for k in COLUMNS}
        assert r["steps"] == 3 and len(r["step_ms"]) == 3 and len(r["losses"]) == 5 and r["n_layer"] == 4
        if r["ladder_bytes_per_param"] is not None:  # the engine's model states, counted, against the ladder
            assert r["model_state_bytes_per_param"] == pytest.approx(r["ladder_bytes_per_param"], rel=0.05)
        (line,) = [x for x in table if x.startswith(f"| {row['label']} | `{row['config']}` | 3 | ")]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 11 and all(cells), line
    results = {row["name"]: row["result"] for row in data["rows"]}
    assert results["8bit-bf16"]["ds_q8_kernel_calls"] > 0 and results["8bit-bf16"]["optimizer"] == "Adam8bitBlock"
    assert results["deepspeed-adam"]["optimizer"] == "FusedAdam" and results["deepspeed-adam"]["ds_q8_kernel_calls"] == 0
    # bf16 masters in place hold neither masters nor master gradients; DeepSpeed's fp32 masters hold both
    assert results["8bit-bf16"]["model_states"]["masters"] == 0 < results["deepspeed-adam"]["model_states"]["masters"]
    assert [c["row"] for c in data["comparisons"]] == ["8bit-bf16"]  # the only pair of these rows
    assert "PASS train: " in run.stdout
    with tarfile.open(tmp_path / "train_logs.tar.gz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {f"{r}.log" for r in rows if r != "bnb-8bit" or has_bnb} <= logs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_train.log", "train.json", "train_logs.tar.gz",
                                                          "train_table.md"]
