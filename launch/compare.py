"""Train the same GPT twice, with 8-bit and with 32-bit Adam, and write a report with a loss plot.

    python launch/compare.py                         # tiny GPT on CPU, a few minutes
    python launch/compare.py --max_steps 2000 --config8 ds_configs/gpt2_small_8bit_zero2.json \\
        --config32 MY_32BIT.json --launcher "deepspeed --num_gpus 8" -- --model gpt2

Arguments after ``--`` (and any this script does not know) go to both runs of train_gpt.py.
Both runs share model, data, seed and schedule; only the DeepSpeed config differs.
Writes ``<save_dir>/report.md`` and ``<save_dir>/loss.png``; the runs live in ``<save_dir>/8bit`` and
``<save_dir>/32bit`` (each with metrics.jsonl and summary.json).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from metrics_log import read_metrics  # noqa: E402

RUNS = ("8bit", "32bit")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="8-bit vs 32-bit Adam on the same GPT: report and loss plot.")
    ap.add_argument("--config8", default=str(REPO / "ds_configs" / "tiny_cpu_8bit.json"))
    ap.add_argument("--config32", default=str(REPO / "ds_configs" / "tiny_cpu_32bit.json"))
    ap.add_argument("--save_dir", default=str(REPO / "out" / "compare"))
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--launcher", default="",
                    help='command that starts each run, e.g. "deepspeed --num_gpus 8" (default: this python)')
    ap.add_argument("--report_only", action="store_true", help="only rebuild the report from existing runs")
    args, passthrough = ap.parse_known_args(argv)
    if args.max_steps < 1:
        ap.error(f"--max_steps must be an integer >= 1, got {args.max_steps}")
    args.passthrough = [a for a in passthrough if a != "--"]
    return args


def train_command(args, run: str) -> list:
    config = args.config8 if run == "8bit" else args.config32
    launcher = shlex.split(args.launcher)
    # the deepspeed launcher starts python itself; anything else (mpirun, nothing) needs the interpreter
    prefix = launcher if launcher and Path(launcher[0]).name == "deepspeed" else launcher + [sys.executable]
    return prefix + [str(HERE / "train_gpt.py"), "--deepspeed_config", config, "--max_steps", str(args.max_steps),
                     "--save_dir", str(Path(args.save_dir) / run), "--overwrite"] + args.passthrough


def load_run(save_dir: Path, run: str) -> dict:
    d = save_dir / run
    summary_path = d / "summary.json"
    if not summary_path.is_file():
        raise SystemExit(f"{d} has no summary.json: run the comparison without --report_only first")
    return dict(summary=json.loads(summary_path.read_text()), metrics=read_metrics(d / "metrics.jsonl"))


def plot(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"8bit": "tab:blue", "32bit": "tab:orange"}
    for name, r in runs.items():
        label = f"{name} ({r['summary']['optimizer']})"
        steps = [m["step"] for m in r["metrics"]]
        ax.plot(steps, [m["loss"] for m in r["metrics"]], color=colors[name], alpha=0.45, lw=1,
                label=f"{label} train")
        ev = [m for m in r["metrics"] if "eval_loss" in m]
        ax.plot([m["step"] for m in ev], [m["eval_loss"] for m in ev], "o-", color=colors[name], ms=4,
                label=f"{label} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean_last(metrics: list, key: str, n: int = 10) -> float:
    vals = [m[key] for m in metrics if key in m][-n:]
    return sum(vals) / len(vals) if vals else float("nan")


def report(runs: dict, plot_name: str) -> str:
    s8, s32 = runs["8bit"]["summary"], runs["32bit"]["summary"]
    rows = [
        ("optimizer", lambda s, m: s["optimizer"]),
        ("DeepSpeed config", lambda s, m: f"`{Path(s['config']).name}`"),
        ("parameters", lambda s, m: f"{s['n_params']:,}"),
        ("ranks", lambda s, m: s["world_size"]),
        ("steps", lambda s, m: s["steps"]),
        ("train loss, mean of last 10 steps", lambda s, m: f"{_mean_last(m, 'loss'):.4f}"),
        ("final eval loss", lambda s, m: f"{s['final_eval_loss']:.4f}"),
        ("final eval perplexity", lambda s, m: f"{s['final_eval_ppl']:.3f}"),
        ("mean step time (s, first step excluded)", lambda s, m: f"{s['mean_step_time_s']:.4f}"),
        ("tokens/s", lambda s, m: f"{s['tokens_per_s']:.0f}"),
        ("optimizer state, all ranks (bytes)", lambda s, m: f"{s['optimizer_state_bytes']:,}"),
        ("optimizer state per parameter (bytes)", lambda s, m: f"{s['optimizer_state_bytes'] / s['n_params']:.3f}"),
        ("peak RSS of rank 0 (MB)", lambda s, m: f"{s['peak_rss_bytes_rank0'] / 2**20:.0f}"),
    ]
    if "peak_device_bytes_rank0" in s8 and "peak_device_bytes_rank0" in s32:
        rows.append(("peak GPU memory of rank 0 (MB)", lambda s, m: f"{s['peak_device_bytes_rank0'] / 2**20:.0f}"))
    lines = [f"# 8-bit vs 32-bit Adam: {s8['model']} GPT-2", "",
             "| | 8-bit | 32-bit |", "|---|---:|---:|"]
    for label, fn in rows:
        lines.append(f"| {label} | {fn(s8, runs['8bit']['metrics'])} | {fn(s32, runs['32bit']['metrics'])} |")
    d_eval = s8["final_eval_loss"] - s32["final_eval_loss"]
    ratio = s8["optimizer_state_bytes"] / s32["optimizer_state_bytes"]
    lines += [
        "",
        f"Eval loss, 8-bit minus 32-bit: {d_eval:+.4f} nats/token "
        f"(perplexity ratio {math.exp(d_eval):.4f}). Optimizer state: 8-bit holds {ratio:.3f}x the bytes of 32-bit.",
        "Peak RSS includes the Python process, libraries and the data; on a small model it hides the optimizer "
        "difference, which the state bytes show exactly. Step times on a shared CPU are noisy.",
        "",
        f"![train and eval loss]({plot_name})",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> Path:
    args = parse_args(argv)
    save_dir = Path(args.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for run in RUNS:
            cmd = train_command(args, run)
            print(f"== {run}: {shlex.join(cmd)}", flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                raise SystemExit(f"the {run} run failed with exit status {rc}")
    runs = {run: load_run(save_dir, run) for run in RUNS}
    plot(runs, save_dir / "loss.png")
    path = save_dir / "report.md"
    path.write_text(report(runs, "loss.png"))
    print(path.read_text())
    print(f"report: {path}\nplot:   {save_dir / 'loss.png'}")
    return path


if __name__ == "__main__":
    main()
