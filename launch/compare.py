"""Train the same GPT with 8-bit and 32-bit optimizer state, fp32 and bf16 masters, Adam and Muon; write a
report and plots.

    python launch/compare.py                         # tiny GPT on CPU, nine runs, under ten minutes
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
All runs share model, data, seed, steps and schedule; only the DeepSpeed config differs.

On a CPU, before the first step (:func:`plan`): the ops a first run compiles are built, and launch/cpu_probe.py
times the model's forward and backward in fp32, in bf16, and in fp32 read from bf16 weights. Where torch has
no native bf16 matrix products (oneDNN says so, or bf16 measured 2.5x slower than the last: AVX2 CPUs), the
bf16 runs compute in fp32 from their bf16 weights (``train_gpt.py --compute fp32``; masters, gradients and
optimizer state stay bf16). Without ``--max_steps`` the step count is the most, up to 200, that fits
``--budget_s`` at the probe's speed (at least :data:`MIN_STEPS`). The plan and the expected time are printed
before the first run; the report states what each run computed in, its masters, state, model and steps, and
the CPU (``<save_dir>/plan.json``).
Writes ``<save_dir>/report.md`` and ``<save_dir>/loss.png``; the runs live in ``<save_dir>/<run>``
(each with metrics.jsonl and summary.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# as train_gpt.py, before torch loads (the probe runs here): OpenMP threads that spin while waiting made the
# probe's fp32 pass 1.9 s instead of 0.17 s on the busy 2-core Xeon
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
#: run -> the precision of its optimizer state (the embeddings keep 32-bit state in every 8-bit and 4-bit run)
STATE = {"32bit": "fp32 moments", "8bit": "8-bit moments", "bf16_states": "bf16 moments",
         "8bit_bf16": "8-bit moments", "8bit_bf16_nosr": "8-bit moments",
         "8bit_bf16_corr": "8-bit moments, int8 correction", "4bit_bf16": "4-bit moments",
         "muon": "fp32 momentum, fp32 AdamW moments", "muon8bit": "8-bit momentum, 8-bit AdamW moments"}

DEFAULT_STEPS = 200  # the most steps a run takes when --max_steps is not given
MIN_STEPS = 50  # the fewest the budget may choose: past the warm-up (30 steps) and into the decay
#: the time model of plan(), fitted on the 2-core Intel Xeon of docs/development.md: one training step is
#: STEP_FACTOR forward-and-backward passes of the probe plus the optimizer's STEP_EXTRA_S (0.19-0.22 s a step
#: against a probe's 0.17 s); a run adds RUN_OVERHEAD_S (starting Python, DeepSpeed and the engine, ten
#: evaluations and the checkpoint: 16-20 s); a Muon run adds RUN_EXTRA's seconds a step and a run (its
#: Newton-Schulz iterations, and DeepSpeed's Muon module, compiled on import)
STEP_FACTOR, STEP_EXTRA_S, RUN_OVERHEAD_S = 1.2, 0.02, 18.0
RUN_EXTRA = {"muon": (0.12, 25.0), "muon8bit": (0.12, 25.0)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="8-bit vs 32-bit Adam, fp32 and bf16 masters, and 8-bit vs DeepSpeed's "
                                             "Muon, on the same GPT: report and loss plot.")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                    help="which runs, in this order (default: all nine)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FILE",
                    help="the DeepSpeed config of run NAME (repeatable)")
    ap.add_argument("--save_dir", default=str(REPO / "out" / "compare"))
    ap.add_argument("--max_steps", type=int, default=None,
                    help=f"steps of every run (default: the most, up to {DEFAULT_STEPS}, that fit --budget_s; "
                         f"at least {MIN_STEPS})")
    ap.add_argument("--budget_s", type=float, default=540.0,
                    help="seconds the whole comparison may take, builds included, when --max_steps is not given")
    ap.add_argument("--compute", default=None, choices=["bf16", "fp32"],
                    help="what the bf16 runs compute in (default: chosen by the probe; on a GPU, bf16)")
    ap.add_argument("--launcher", default="",
                    help='command that starts each run, e.g. "deepspeed --num_gpus 8" (default: this python)')
    ap.add_argument("--report_only", action="store_true", help="only rebuild the report from existing runs")
    args, passthrough = ap.parse_known_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
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
    for flag in ("--compute", "--label", "--max_steps"):
        if any(a == flag or a.startswith(flag + "=") for a in args.passthrough):
            ap.error(f"{flag} is compare.py's own: give it before --")
    return args


def passed(args, flag: str, default: str) -> str:
    """The value of ``flag`` among the arguments passed through to every run, else ``default``."""
    for i, a in enumerate(args.passthrough):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args.passthrough):
            return args.passthrough[i + 1]
    return default


def train_command(args, run: str, plan: dict, index: int = 0) -> list:
    launcher = shlex.split(args.launcher)
    # the deepspeed launcher starts python itself; anything else (mpirun, nothing) needs the interpreter
    prefix = launcher if launcher and Path(launcher[0]).name == "deepspeed" else launcher + [sys.executable]
    steps = plan["steps"]
    bf16 = plan["bf16"].get(run, False)
    compute = plan["compute"] if bf16 else "fp32"
    label = f"{index + 1}/{len(args.runs)} {run} ({'bf16' if bf16 else 'fp32'} masters, {compute} compute)"
    extra = [] if passed(args, "--eval_interval", None) else ["--eval_interval", str(max(1, steps // 10))]
    return prefix + [str(HERE / "train_gpt.py"), "--deepspeed_config", args.configs[run], "--max_steps",
                     str(steps), "--save_dir", str(Path(args.save_dir) / run), "--overwrite", "--compute", compute,
                     "--label", label] + extra + args.passthrough


def config_bf16(path: str) -> bool:
    return bool(json.loads(Path(path).read_text()).get("bf16", {}).get("enabled", False))


def prebuild() -> None:
    """Compile, before the probe and the first run, the ops a first run would compile: ds_q8's CPU kernels
    and DeepSpeed's CPU communication op (each announced on one line; nothing to do when cached)."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    import ds_q8
    from ds_q8.op_builder.notice import announce_deepspeed_op
    from ds_q8.integration.noise import quiet

    quiet()
    ds_q8.ops.load_op("cpu")
    announce_deepspeed_op(ShareMemCommBuilder, "DeepSpeed's CPU communication op", "about two minutes")
    ShareMemCommBuilder().load(verbose=False)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def plan(args, start: float) -> dict:
    """What the runs will do, chosen before the first: ``steps``, ``compute`` (what the bf16 runs compute
    in), ``bf16`` (run -> whether its config has bf16 masters), the CPU and the probe that chose them, the
    expected seconds. Printed, and saved as ``<save_dir>/plan.json`` for the report."""
    import torch

    import cpu_probe

    bf16 = {run: config_bf16(args.configs[run]) for run in args.runs}
    p = dict(steps=args.max_steps or DEFAULT_STEPS, compute=args.compute or "bf16", bf16=bf16, cpu=None,
             probe=None, expected_s=None, why=None)
    on_cpu = not args.launcher and not torch.cuda.is_available()
    if not on_cpu:
        p["why"] = "on a GPU: bf16 runs compute in bf16" if args.compute is None else "--compute"
        return p
    print("preparing: the ops a first run compiles, then a probe of this CPU's fp32 and bf16 speed", flush=True)
    prebuild()
    micro = int(passed(args, "--micro_batch", json.loads(Path(args.configs[BASELINE]).read_text())
                       .get("train_micro_batch_size_per_gpu", 16)))
    model = passed(args, "--model", "tiny")
    context = int(passed(args, "--context", 128 if model == "tiny" else 1024))
    n_layer = passed(args, "--n_layer", None)
    probe = cpu_probe.measure(model, context, micro, n_layer=int(n_layer) if n_layer else None)
    p.update(cpu=probe.cpu, probe=probe.describe(), seconds=probe.seconds)
    slow = probe.bf16_is_slow()
    if args.compute is None:
        ratio = probe.seconds["bf16"] / probe.seconds["bf16_fp32_compute"]
        p["compute"] = "fp32" if slow else "bf16"
        p["why"] = (f"no native bf16 matrix products here (bf16 took {ratio:.1f}x the time of fp32 compute from "
                    "bf16 weights): the bf16 runs compute in fp32 from their bf16 weights; masters, gradients and "
                    "state stay bf16" if slow else
                    f"native bf16 matrix products here (bf16 took {ratio:.1f}x the time of fp32 compute from bf16 "
                    "weights): the bf16 runs compute in bf16")
    else:
        p["why"] = f"--compute {args.compute}"
    per_step = sum(STEP_FACTOR * probe.seconds["bf16" if bf16[r] and p["compute"] == "bf16" else
                                                "bf16_fp32_compute" if bf16[r] else "fp32"]
                   + STEP_EXTRA_S + RUN_EXTRA.get(r, (0.0, 0.0))[0] for r in args.runs)
    overhead = sum(RUN_OVERHEAD_S + RUN_EXTRA.get(r, (0.0, 0.0))[1] for r in args.runs)
    left = args.budget_s - (time.time() - start) - overhead
    if args.max_steps is None:
        fit = int(left / per_step) // 10 * 10
        p["steps"] = max(MIN_STEPS, min(DEFAULT_STEPS, fit))
    p["expected_s"] = per_step * p["steps"] + overhead
    return p


def announce(args, p: dict, start: float) -> None:
    if p["probe"]:
        print(f"this CPU: {p['probe']}", flush=True)
    print(f"plan: {len(args.runs)} runs of {p['steps']} steps each; {p['why']}", flush=True)
    if p["expected_s"] is not None:
        spent = time.time() - start
        budget = "" if args.max_steps else f" (budget {minutes(args.budget_s)})"
        print(f"expected: about {minutes(p['expected_s'])} of training from here, {minutes(spent + p['expected_s'])} "
              f"in all{budget}", flush=True)


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


def _model(s: dict) -> str:
    shape = f", {s['micro_batch']} x {s['context']} tokens a step" if "context" in s else ""
    return f"{s['model']}{shape}"


def report(runs: dict, plot_name: str, p: dict = None) -> str:
    names = list(runs)
    summaries = {n: runs[n]["summary"] for n in names}
    base = summaries[BASELINE]
    rows = [
        ("optimizer", lambda s, m: s["optimizer"]),
        ("DeepSpeed config", lambda s, m: f"`{Path(s['config']).name}`"),
        ("model", lambda s, m: _model(s)),
        ("parameters", lambda s, m: f"{s['n_params']:,}"),
        ("ranks", lambda s, m: s["world_size"]),
        ("steps", lambda s, m: s["steps"]),
        ("compute (forward and backward)", lambda s, m: s.get("compute", "")),
        ("master weights", lambda s, m: s.get("masters", "")),
        ("train loss, mean of last 10 steps", lambda s, m: f"{_mean_last(m, 'loss'):.4f}"),
        ("final eval loss", lambda s, m: f"{s['final_eval_loss']:.4f}"),
        ("eval loss vs 32-bit", lambda s, m: f"{100 * (s['final_eval_loss'] / base['final_eval_loss'] - 1):+.2f}%"),
        ("final eval perplexity", lambda s, m: f"{s['final_eval_ppl']:.3f}"),
        ("mean step time (s, first step excluded)", lambda s, m: f"{s['mean_step_time_s']:.4f}"),
        ("tokens/s", lambda s, m: f"{s['tokens_per_s']:.0f}"),
        ("optimizer state", None),
        ("optimizer state, all ranks (bytes)", lambda s, m: f"{s['optimizer_state_bytes']:,}"),
        ("optimizer state per parameter (bytes)", lambda s, m: f"{s['optimizer_state_bytes'] / s['n_params']:.3f}"),
        ("peak RSS of rank 0 (MB)", lambda s, m: f"{s['peak_rss_bytes_rank0'] / 2**20:.0f}"),
    ]
    muon_base = summaries.get(MUON_BASELINE)
    if muon_base is not None and "muon8bit" in summaries:
        after = [label for label, _ in rows].index("eval loss vs 32-bit") + 1
        rows.insert(after, ("eval loss vs DeepSpeed Muon", lambda s, m: (
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
        cells = [STATE.get(n, "") if fn is None else str(fn(summaries[n], runs[n]["metrics"])) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    if p and p.get("cpu"):
        lines += [f"Measured on {p['probe']}.", "", f"Plan: {p['why']}; {p['steps']} steps a run. Wall time "
                  f"{minutes(p['wall_s'])}" + (f" (expected {minutes(p['expected_s'])} of training)"
                                               if p.get("expected_s") else "") + ".", ""]
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
    start = time.time()
    args = parse_args(argv)
    save_dir = Path(args.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    plan_path = save_dir / "plan.json"
    if not args.report_only:
        p = plan(args, start)
        announce(args, p, start)
        for i, run in enumerate(args.runs):
            cmd = train_command(args, run, p, i)
            print(f"== {run}: {shlex.join(cmd)}", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd)
            if rc != 0:
                raise SystemExit(f"the {run} run failed with exit status {rc}")
            p.setdefault("run_s", {})[run] = time.time() - t0
            left = len(args.runs) - i - 1
            if left:
                mean = sum(p["run_s"].values()) / len(p["run_s"])
                print(f"== {run} took {minutes(p['run_s'][run])}; {left} run(s) left, about {minutes(mean * left)} "
                      f"at this pace", flush=True)
        p["wall_s"] = time.time() - start
        plan_path.write_text(json.dumps(p, indent=1) + "\n")
    p = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    runs = {run: load_run(save_dir, run) for run in args.runs}
    plot(runs, save_dir / "loss.png")
    path = save_dir / "report.md"
    path.write_text(report(runs, "loss.png", p))
    print(path.read_text())
    print(f"report: {path}\nplot:   {save_dir / 'loss.png'}")
    return path


if __name__ == "__main__":
    main()
