"""Train the same GPT with 8-bit and 32-bit optimizer state, fp32 and bf16 masters, Adam and Muon; write a
report and plots.

    python launch/compare.py                         # tiny GPT on CPU, eight runs, a few minutes
    python launch/compare.py --runs 8bit 32bit       # just the first two
    python launch/compare.py --max_steps 2000 --config 8bit=ds_configs/gpt2_small_8bit_zero2.json \
        --config 32bit=MY_32BIT.json --launcher "deepspeed --num_gpus 8" -- --model gpt2

The runs (``--runs``; ``--config NAME=FILE`` replaces a run's DeepSpeed config):

* ``32bit``: DeepSpeed's Adam (torch.optim.Adam), fp32 masters and moments;
* ``8bit``: ds_q8 Adam8bitBlock, fp32 masters;
* ``bf16_states``: DeepSpeed's Adam with bf16 master weights and bf16 moments;
* ``8bit_bf16``: Adam8bitBlock with bf16 master weights, written with stochastic rounding;
* ``8bit_bf16_nosr``: the same rounded to nearest, to show what stochastic rounding buys;
* ``8bit_bf16_corr``: bf16 masters with a correction byte (``"correction_byte": true``): an int8 of each
  parameter's rounding residue, so the masters behave as 24-bit values written to nearest;
* ``muon``: DeepSpeed's own Muon (``"type": "Muon"``: MuonWithAuxAdam, fp32 momentum, run by ZeRO-2),
  with torch's AdamW for the parameters Muon leaves out;
* ``muon8bit``: ds_q8 Muon8bitBlock, the same tags, learning rates and schedule with 8-bit momentum and
  8-bit auxiliary AdamW; compared with ``muon`` as well as with the 32-bit baseline.

Arguments after ``--`` (and any this script does not know) go to every run of train_gpt.py.
All runs share model, data, seed and schedule; only the DeepSpeed config differs.
Writes ``<save_dir>/report.md`` and ``<save_dir>/loss.png``; the runs live in ``<save_dir>/<run>``
(each with metrics.jsonl and summary.json).
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

# run -> (default config, label in the report and plot)
RUNS = {
    "32bit": ("tiny_cpu_32bit.json", "32-bit Adam, fp32 masters"),
    "8bit": ("tiny_cpu_8bit.json", "8-bit, fp32 masters"),
    "bf16_states": ("tiny_cpu_bf16_states.json", "32-bit Adam, bf16 masters and moments"),
    "8bit_bf16": ("tiny_cpu_8bit_bf16master.json", "8-bit, bf16 masters, stochastic rounding"),
    "8bit_bf16_nosr": ("tiny_cpu_8bit_bf16master_nosr.json", "8-bit, bf16 masters, round to nearest"),
    "8bit_bf16_corr": ("tiny_cpu_8bit_bf16master_correction.json", "8-bit, bf16 masters, correction byte"),
    "4bit_bf16": ("tiny_cpu_4bit_bf16master.json", "4-bit, bf16 masters, stochastic rounding"),
    "muon": ("tiny_cpu_muon.json", "DeepSpeed Muon, fp32 momentum"),
    "muon8bit": ("tiny_cpu_muon8bit.json", "Muon8bitBlock, 8-bit momentum"),
}
MUON_BASELINE = "muon"  # what muon8bit is held against as well
BASELINE = "32bit"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="8-bit vs 32-bit Adam, fp32 and bf16 masters, and 8-bit vs DeepSpeed's "
                                             "Muon, on the same GPT: report and loss plot.")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                    help="which runs, in this order (default: all nine)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FILE",
                    help="the DeepSpeed config of run NAME (repeatable)")
    ap.add_argument("--save_dir", default=str(REPO / "out" / "compare"))
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--launcher", default="",
                    help='command that starts each run, e.g. "deepspeed --num_gpus 8" (default: this python)')
    ap.add_argument("--report_only", action="store_true", help="only rebuild the report from existing runs")
    args, passthrough = ap.parse_known_args(argv)
    if args.max_steps < 1:
        ap.error(f"--max_steps must be an integer >= 1, got {args.max_steps}")
    args.configs = {run: str(REPO / "ds_configs" / cfg) for run, (cfg, _) in RUNS.items()}
    for item in args.config:
        name, sep, path = item.partition("=")
        if not sep or name not in RUNS:
            ap.error(f"--config must be NAME=FILE with NAME one of {list(RUNS)}, got {item!r}")
        args.configs[name] = path
    if BASELINE not in args.runs:
        ap.error(f"--runs must include {BASELINE!r}, the baseline the others are compared with")
    args.passthrough = [a for a in passthrough if a != "--"]
    if not any(a.startswith("--eval_interval") for a in args.passthrough):
        args.passthrough += ["--eval_interval", "20"]  # ten points for the difference plot
    return args


def train_command(args, run: str) -> list:
    launcher = shlex.split(args.launcher)
    # the deepspeed launcher starts python itself; anything else (mpirun, nothing) needs the interpreter
    prefix = launcher if launcher and Path(launcher[0]).name == "deepspeed" else launcher + [sys.executable]
    return prefix + [str(HERE / "train_gpt.py"), "--deepspeed_config", args.configs[run], "--max_steps",
                     str(args.max_steps), "--save_dir", str(Path(args.save_dir) / run), "--overwrite"] + args.passthrough


def load_run(save_dir: Path, run: str) -> dict:
    d = save_dir / run
    summary_path = d / "summary.json"
    if not summary_path.is_file():
        raise SystemExit(f"{d} has no summary.json: run the comparison without --report_only first")
    return dict(summary=json.loads(summary_path.read_text()), metrics=read_metrics(d / "metrics.jsonl"))


COLORS = {"32bit": "tab:orange", "8bit": "tab:blue", "bf16_states": "tab:green", "8bit_bf16": "tab:purple",
          "8bit_bf16_nosr": "tab:red", "8bit_bf16_corr": "tab:olive", "4bit_bf16": "tab:pink",
          "muon": "tab:brown", "muon8bit": "tab:cyan"}
STYLES = {"32bit": "-", "8bit": "--", "bf16_states": "-.", "8bit_bf16": ":", "8bit_bf16_nosr": (0, (5, 1, 1, 1)),
          "8bit_bf16_corr": (0, (1, 1)), "4bit_bf16": (0, (3, 1)),
          "muon": "-", "muon8bit": "--"}


def plot(runs: dict, path: Path) -> None:
    """Left: train (faint) and eval loss of every run. Right: each run's eval loss minus the 32-bit
    run's, where curves that lie on top of each other on the left come apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(12, 4.4))
    base_eval = {m["step"]: m["eval_loss"] for m in runs[BASELINE]["metrics"] if "eval_loss" in m}
    for name, r in runs.items():
        label, color, style = RUNS[name][1], COLORS[name], STYLES[name]
        ax.plot([m["step"] for m in r["metrics"]], [m["loss"] for m in r["metrics"]], color=color, alpha=0.25, lw=1)
        ev = [m for m in r["metrics"] if "eval_loss" in m]
        ax.plot([m["step"] for m in ev], [m["eval_loss"] for m in ev], marker="o", ls=style, color=color, ms=3,
                label=label)
        shared = [m for m in ev if m["step"] in base_eval]
        diff.plot([m["step"] for m in shared], [m["eval_loss"] - base_eval[m["step"]] for m in shared], marker="o",
                  ls=style, color=color, ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token); train faint, eval with markers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    diff.axhline(0.0, color="black", lw=0.8)
    diff.set_xlabel("step")
    diff.set_ylabel("eval loss minus the 32-bit run's (nats/token)")
    diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean_last(metrics: list, key: str, n: int = 10) -> float:
    vals = [m[key] for m in metrics if key in m][-n:]
    return sum(vals) / len(vals) if vals else float("nan")


def _muon_line(ours: dict, theirs: dict) -> str:
    """muon8bit against DeepSpeed's Muon: eval loss, state and momentum bytes."""
    d_eval = ours["final_eval_loss"] - theirs["final_eval_loss"]
    pct = 100 * (ours["final_eval_loss"] / theirs["final_eval_loss"] - 1)
    text = (f"- {RUNS['muon8bit'][1]} against {RUNS[MUON_BASELINE][1]}: eval loss {d_eval:+.4f} nats/token "
            f"({pct:+.2f}%); optimizer state {ours['optimizer_state_bytes'] / theirs['optimizer_state_bytes']:.3f}x "
            "its bytes")
    if "muon_params" in ours and "muon_params" in theirs:
        text += (f"; Muon momentum {ours['muon_momentum_bytes']:,} against {theirs['muon_momentum_bytes']:,} bytes "
                 f"for {ours['muon_params']:,} Muon parameters")
        if ours.get("muon_momentum_elements_8bit"):
            text += (f" ({ours['muon_momentum_bytes_8bit'] / ours['muon_momentum_elements_8bit']:.4f} bytes per "
                     f"parameter in the 8-bit groups, {ours['muon_momentum_elements_8bit']:,} parameters; the rest "
                     "is kept in 32 bits, as the trainer's groups keep the embeddings)")
        if theirs.get("muon_staging_bytes"):
            text += (f"; DeepSpeed's ZeRO-2 also holds {theirs['muon_staging_bytes']:,} bytes of staged momentum "
                     "outside the optimizer state")
    return text + "."


def report(runs: dict, plot_name: str) -> str:
    names = list(runs)
    summaries = {n: runs[n]["summary"] for n in names}
    base = summaries[BASELINE]
    rows = [
        ("optimizer", lambda s, m: s["optimizer"]),
        ("DeepSpeed config", lambda s, m: f"`{Path(s['config']).name}`"),
        ("parameters", lambda s, m: f"{s['n_params']:,}"),
        ("ranks", lambda s, m: s["world_size"]),
        ("steps", lambda s, m: s["steps"]),
        ("train loss, mean of last 10 steps", lambda s, m: f"{_mean_last(m, 'loss'):.4f}"),
        ("final eval loss", lambda s, m: f"{s['final_eval_loss']:.4f}"),
        ("eval loss vs 32-bit", lambda s, m: f"{100 * (s['final_eval_loss'] / base['final_eval_loss'] - 1):+.2f}%"),
        ("final eval perplexity", lambda s, m: f"{s['final_eval_ppl']:.3f}"),
        ("mean step time (s, first step excluded)", lambda s, m: f"{s['mean_step_time_s']:.4f}"),
        ("tokens/s", lambda s, m: f"{s['tokens_per_s']:.0f}"),
        ("optimizer state, all ranks (bytes)", lambda s, m: f"{s['optimizer_state_bytes']:,}"),
        ("optimizer state per parameter (bytes)", lambda s, m: f"{s['optimizer_state_bytes'] / s['n_params']:.3f}"),
        ("peak RSS of rank 0 (MB)", lambda s, m: f"{s['peak_rss_bytes_rank0'] / 2**20:.0f}"),
    ]
    muon_base = summaries.get(MUON_BASELINE)
    if muon_base is not None and "muon8bit" in summaries:
        rows.insert(8, ("eval loss vs DeepSpeed Muon", lambda s, m: (
            f"{100 * (s['final_eval_loss'] / muon_base['final_eval_loss'] - 1):+.2f}%" if "muon_params" in s else "")))
    if any("muon_params" in s for s in summaries.values()):
        rows.append(("Muon momentum per Muon parameter (bytes)", lambda s, m: (
            f"{s['muon_momentum_bytes'] / s['muon_params']:.3f}" if "muon_params" in s else "")))
    if all("peak_device_bytes_rank0" in s for s in summaries.values()):
        rows.append(("peak GPU memory of rank 0 (MB)", lambda s, m: f"{s['peak_device_bytes_rank0'] / 2**20:.0f}"))
    title = "8-bit vs 32-bit Adam, fp32 and bf16 masters" + (", and Muon" if muon_base is not None else "")
    lines = [f"# {title}: {base['model']} GPT-2", "",
             "| | " + " | ".join(RUNS[n][1] for n in names) + " |", "|---|" + "---:|" * len(names)]
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(str(fn(summaries[n], runs[n]["metrics"])) for n in names) + " |")
    lines.append("")
    for n in names:
        if n == BASELINE:
            continue
        d_eval = summaries[n]["final_eval_loss"] - base["final_eval_loss"]
        ratio = summaries[n]["optimizer_state_bytes"] / base["optimizer_state_bytes"]
        lines.append(f"- {RUNS[n][1]}: eval loss {d_eval:+.4f} nats/token against the 32-bit run (perplexity ratio "
                     f"{math.exp(d_eval):.4f}); optimizer state {ratio:.3f}x its bytes.")
    if muon_base is not None and "muon8bit" in summaries:
        lines.append(_muon_line(summaries["muon8bit"], muon_base))
    lines += [
        "",
        "Peak RSS includes the Python process, libraries and the data; on a small model it hides the optimizer "
        "difference, which the state bytes show exactly. Step times on a shared CPU are noisy. The right-hand plot "
        "shows each run's eval loss minus the 32-bit run's.",
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
        for run in args.runs:
            cmd = train_command(args, run)
            print(f"== {run}: {shlex.join(cmd)}", flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                raise SystemExit(f"the {run} run failed with exit status {rc}")
    runs = {run: load_run(save_dir, run) for run in args.runs}
    plot(runs, save_dir / "loss.png")
    path = save_dir / "report.md"
    path.write_text(report(runs, "loss.png"))
    print(path.read_text())
    print(f"report: {path}\nplot:   {save_dir / 'loss.png'}")
    return path


if __name__ == "__main__":
    main()
