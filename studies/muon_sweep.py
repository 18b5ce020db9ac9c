"""Muon's learning-rate sweep: DeepSpeed's Muon against Muon8bitBlock at several ``muon_lr`` peaks.

Each run is the main job's ``muon`` or ``muon8bit`` run (``ds_configs/tiny_cpu_muon.json`` and
``tiny_cpu_muon8bit.json``: one rank, 200 steps) with the Muon groups' peak (and the scheduler's peaks
for those groups) set to ``muon_lr``; variants of Muon8bitBlock change one option. Prints the final eval
loss of each and its difference from DeepSpeed's Muon at the same rate, and writes the table to
``--out``/muon_sweep.md.

    python studies/muon_sweep.py                                   # 0.01 0.02 0.04 0.08, the default variants
    python studies/muon_sweep.py --lrs 0.08 --variants muon muon8bit muon8bit:bs2048 muon8bit:fp32

Variants: ``muon`` (DeepSpeed's), ``muon8bit`` (Muon8bitBlock at its defaults), and ``muon8bit:`` with
``bsN`` (block_size=N), ``dir32`` (direction_bits=32) or ``fp32`` (optim_bits=32, fp32 momentum), joined by ``+``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
CONFIGS = {"muon": HERE.parent / "ds_configs" / "tiny_cpu_muon.json",
           "muon8bit": HERE.parent / "ds_configs" / "tiny_cpu_muon8bit.json"}


def config_for(variant: str, muon_lr: float) -> dict:
    """The variant's DeepSpeed config with the Muon groups' peak at ``muon_lr`` (warm-up from a tenth)."""
    base, _, changes = variant.partition(":")
    if base not in CONFIGS:
        raise ValueError(f"variant {variant!r} must start with muon or muon8bit")
    cfg = json.loads(CONFIGS[base].read_text())
    params = cfg["optimizer"]["params"]
    old = params["muon_lr"]
    params["muon_lr"] = muon_lr
    sched = cfg["scheduler"]["params"]
    peaks = list(sched["warmup_max_lr"])
    for key in ("warmup_max_lr", "warmup_min_lr"):  # the groups at the Muon rate move with it
        sched[key] = [v * muon_lr / old if abs(m - old) < 1e-12 else v for v, m in zip(sched[key], peaks)]
    for change in filter(None, changes.split("+")):
        if base != "muon8bit":
            raise ValueError(f"variant {variant!r}: only muon8bit takes changes")
        if change.startswith("bs") and change[2:].isdigit():
            params["block_size"] = int(change[2:])
        elif change == "dir32":
            params["direction_bits"] = 32
        elif change == "fp32":
            params["optim_bits"] = 32
        else:
            raise ValueError(f"variant {variant!r}: unknown change {change!r} (bsN, dir32, fp32)")
    return cfg


def run(variant: str, muon_lr: float, steps: int, out: Path, extra: List[str]) -> Optional[float]:
    folder = out / f"{variant.replace(':', '_').replace('+', '_')}_lr{muon_lr:g}"
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "ds_config.json"
    config.write_text(json.dumps(config_for(variant, muon_lr), indent=1))
    cmd = [sys.executable, str(HERE.parent / "launch" / "train_gpt.py"), "--deepspeed_config", str(config), "--max_steps", str(steps),
           "--save_dir", str(folder / "run"), "--save_interval", "0", "--eval_interval", "0", "--no_progress",
           "--overwrite", *extra]
    with open(folder / "log.txt", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    summary = folder / "run" / "summary.json"
    if rc != 0 or not summary.exists():
        print(f"{variant} at {muon_lr:g}: failed (rc {rc}), see {folder / 'log.txt'}")
        return None
    return float(json.loads(summary.read_text())["final_eval_loss"])


def table(results: Dict[float, Dict[str, Optional[float]]], variants: List[str]) -> str:
    head = ["muon_lr"] + [v if v == "muon" else f"{v} (vs muon)" for v in variants]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * len(variants) + "|"]
    for lr, row in sorted(results.items()):
        cells = [f"{lr:g}"]
        ref = row.get("muon")
        for v in variants:
            x = row.get(v)
            if x is None:
                cells.append("failed" if v in row else "")
            elif v == "muon" or ref is None:
                cells.append(f"{x:.4f}")
            else:
                cells.append(f"{x:.4f} ({100 * (x / ref - 1):+.2f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04, 0.08])
    ap.add_argument("--variants", nargs="+", default=["muon", "muon8bit", "muon8bit:dir32"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(HERE.parent / "out" / "muon_sweep"))
    args, extra = ap.parse_known_args(argv)
    if args.steps < 1 or not all(lr > 0 for lr in args.lrs):
        ap.error("--steps must be >= 1 and every --lrs value > 0")
    for v in args.variants:
        try:
            config_for(v, 0.02)
        except ValueError as e:
            ap.error(str(e))
    out = Path(args.out)
    results: Dict[float, Dict[str, Optional[float]]] = {}
    for lr in args.lrs:
        for v in args.variants:
            results.setdefault(lr, {})[v] = loss = run(v, lr, args.steps, out, extra)
            if loss is not None:
                print(f"{v} at muon_lr {lr:g}: {loss:.4f}", flush=True)
    text = (f"Final eval loss after {args.steps} steps (the main job's tiny GPT, one rank), per Muon peak "
            "learning rate; in brackets the difference from DeepSpeed's Muon at the same rate.\n\n"
            + table(results, args.variants))
    os.makedirs(out, exist_ok=True)
    (out / "muon_sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
