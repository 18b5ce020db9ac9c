"""GPT-2 1.5B at full depth on this machine: which rungs of the memory ladder fit, measured.

    python studies/xl_memory.py                  # rungs (e), (f), (d) and (b), 3 steps each, a table at the end
    python studies/xl_memory.py --rungs d b c    # also (c); a rung whose run is killed is reported so

For each rung this runs, at world size 1 on the CPU,

    python launch/train_gpt.py --model gpt2-xl --deepspeed_config CONFIG --context 64 --micro_batch 1 \\
        --grad_accum 1 --max_steps 3 --save_dir out/xl/RUNG --overwrite --no_progress

and prints the model-state bytes ds_q8.memory predicts for it (ZeRO-2, the parameter groups
train_gpt.py uses), the peak RSS of the run (it includes the end-of-run checkpoint save and
evaluation), its losses and seconds per step, and whether it fits in this machine's memory.

Rungs (``ds_q8.memory.LADDER``): (a) DeepSpeed Adam with fp32 masters and moments, (b) DeepSpeed
Adam with bf16 masters and moments, (c) ds_q8 8-bit with fp32 masters, (d) ds_q8 8-bit with bf16
masters and stochastic rounding, copied as DeepSpeed copies them (``--copy_bf16_masters``), (e) the same
config as (d) as users run it: the optimizer steps the bf16 parameters themselves, (f) as (e) with a
correction byte per master (``correction_byte``: 24-bit masters, written to nearest), (g) as (e) with
both moments in 4 bits (``optim_bits=4``).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LAUNCH = REPO / "launch"
sys.path[:0] = [str(HERE), str(LAUNCH), str(REPO)]

CONFIGS = {
    "a": "gpt2_xl_32bit_zero2.json",
    "b": "gpt2_xl_bf16_states_zero2.json",
    "c": "gpt2_xl_8bit_zero2.json",
    "d": "gpt2_xl_8bit_bf16master_zero2.json",
    "e": "gpt2_xl_8bit_bf16master_zero2.json",
    "f": "gpt2_xl_8bit_bf16master_correction_zero2.json",
    "g": "gpt2_xl_4bit_bf16master_zero2.json",
}
EXTRA = {"d": ["--copy_bf16_masters"]}  # the same config, with DeepSpeed's copies


def predicted(rung: str, context: int) -> dict:
    """The ladder's prediction for gpt2-xl with the byte vocabulary, grouped as train_gpt.py groups it."""
    import torch
    import ds_q8
    from ds_q8.memory import predict_model_states
    import gpt_data
    import gpt_models

    config = gpt_models.gpt2_config("gpt2-xl", gpt_data.make_tokenizer(None).vocab_size, context)
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    groups = ds_q8.param_groups(model, 0.0)
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    bits = [g.get("optim_bits", 8) for g in groups]
    parts = predict_model_states(sizes, rung, group_bits=bits)
    return dict(parts=parts, total=sum(parts.values()), n_params=sum(map(sum, sizes)))


def run(rung: str, steps: int, context: int, out: Path) -> dict:
    rec = train(out / rung, ["--model", "gpt2-xl", "--deepspeed_config", str(REPO / "ds_configs" / CONFIGS[rung]),
                             "--context", str(context), "--micro_batch", "1", "--grad_accum", "1", "--max_steps",
                             str(steps), "--overwrite"] + EXTRA.get(rung, []), f"({rung})")
    rec.update(rung=rung, config=CONFIGS[rung])
    return rec


def train(save_dir: Path, args, label: str) -> dict:
    """Run ``launch/train_gpt.py`` with ``args`` into ``save_dir``: its exit status and wall time, and from
    its summary the peak RSS, losses, seconds per step and optimizer-state bytes."""
    cmd = [sys.executable, str(LAUNCH / "train_gpt.py"), *args, "--save_dir", str(save_dir), "--no_progress"]
    print(f"== {label} {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    rec = dict(rc=rc, wall_s=time.perf_counter() - t0)
    summary = save_dir / "summary.json"
    if rc == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        losses = [json.loads(line)["loss"] for line in (save_dir / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in line]
        rec.update(peak_rss=s["peak_rss_bytes_rank0"], losses=losses, step_s=s["mean_step_time_s"],
                   state_bytes=s["optimizer_state_bytes"], finite=all(math.isfinite(x) for x in losses),
                   summary=s)
    return rec


def print_table(title: str, header, rule: str, lines) -> None:
    print(f"\n{title}\n| {' | '.join(header)} |\n{rule}")
    print("\n".join(lines))


def result_cells(rec: dict) -> tuple:
    """A run's peak RSS, losses and seconds per step as table cells (its exit status where it failed)."""
    if "peak_rss" not in rec:
        return "-", f"exit status {rec['rc']} after {rec['wall_s']:.0f} s", "-"
    return (f"{rec['peak_rss'] / 2 ** 30:.1f} GiB", ", ".join(f"{x:.3f}" for x in rec["losses"]),
            f"{rec['step_s']:.1f}")


def memory_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", nargs="+", default=["e", "f", "d", "b"], choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "out" / "xl"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.out)
    rows = []
    for rung in args.rungs:
        rec = run(rung, args.steps, args.context, out)
        rec["predicted"] = predicted(rung, args.context)
        rows.append(rec)
    total = memory_total()
    gib = 2 ** 30
    lines = []
    for r in rows:
        p = r["predicted"]
        pred = f"{p['total'] / gib:.1f} GiB ({p['total'] / p['n_params']:.2f} B/param)"
        fits = "yes" if r.get("peak_rss", total) < total else "no"
        lines.append(f"| ({r['rung']}) | `{r['config']}` | {pred} | {' | '.join(result_cells(r))} | {fits} |")
    header = ["rung", "config", "model states, predicted", "peak RSS, measured", "losses", "s / step", "fits"]
    print_table(f"gpt2-xl, byte vocabulary, context {args.context}, micro-batch 1, ZeRO-2, 1 rank, CPU; this "
                f"machine: {total / gib:.1f} GiB", header, "|---|---|---:|---:|---|---:|---|", lines)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
