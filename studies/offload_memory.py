"""Host bytes a parameter under ZeRO-Offload, counted on live engines beside ds_q8.memory.predict_offload's prediction.

    python studies/offload_memory.py                      # GPT-2 124M, ZeRO-2 and 3, 1 and 2 ranks, every row
    python studies/offload_memory.py --model tiny --ranks 1 --stages 2

Each row of ``ds_q8.memory.predict_offload.OFFLOAD_ROWS`` is a config made from the shipped offload pair,
``ds_configs/decoder_7b_8bit_bf16master_zero2_offload.json`` and its DeepSpeed twin
``decoder_7b_32bit_zero2_offload.json``: DeepSpeed's AdamW as shipped (fp32 masters and moments) and with
bf16 masters and moments; ds_q8 with fp32 masters, as shipped (bf16 masters, stochastic rounding) and with a
correction byte. Each runs ``launch/train_gpt.py --max_steps 2 --grad_accum 2 --micro_batch 1 --context 64``
on the CPU at the ZeRO stage and world size asked for (two ranks through the deepspeed launcher), and the
trainer's summary reports every host storage of each rank's engine, part by part
(``ds_q8.memory.measure_offload``). The table gives the rank holding the most: its host bytes per parameter of the
model, the prediction, and whether they agree to the byte on every rank.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LAUNCH = REPO / "launch"
sys.path.insert(0, str(REPO))

Q8 = REPO / "ds_configs" / "decoder_7b_8bit_bf16master_zero2_offload.json"
DS = REPO / "ds_configs" / "decoder_7b_32bit_zero2_offload.json"
PORT = 33047  # the deepspeed launcher's rendezvous port for two ranks


def row_config(row: str, stage: int) -> dict:
    """The shipped offload config (or its DeepSpeed twin) changed into ``row`` at ``stage``."""
    cfg = json.loads((DS if row.startswith("deepspeed") else Q8).read_text())
    cfg["zero_optimization"]["stage"] = stage
    if row == "deepspeed_bf16":
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    elif row == "q8":
        cfg["bf16"] = {"enabled": True}
        cfg["optimizer"]["params"].pop("stochastic_rounding")
    elif row == "q8_bf16_correction":
        cfg["optimizer"]["params"].pop("stochastic_rounding")
        cfg["optimizer"]["params"]["correction_byte"] = True
    return cfg


def measure(row: str, stage: int, ranks: int, model: str, work: Path) -> dict:
    """Run the trainer for ``row``; its summary (with ``host_states`` per rank). A summary already in
    ``work`` from the same config and model is read instead (an interrupted table continues)."""
    cfg_file, save_dir = work / f"{row}_s{stage}_r{ranks}.json", work / f"{row}_s{stage}_r{ranks}"
    cfg = json.dumps(row_config(row, stage))
    done = save_dir / "summary.json"
    if done.is_file() and cfg_file.is_file() and cfg_file.read_text() == cfg:
        summary = json.loads(done.read_text())
        if summary.get("model") == model and summary.get("world_size") == ranks and "host_states" in summary:
            return summary
    cfg_file.write_text(cfg)
    launcher = [] if ranks == 1 else [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
                                      "--master_port", str(PORT)]
    train = [str(LAUNCH / "train_gpt.py")] if launcher else [sys.executable, str(LAUNCH / "train_gpt.py")]
    cmd = launcher + train + ["--model", model, "--deepspeed_config", str(cfg_file), "--context", "64",
                              "--micro_batch", "1", "--grad_accum", "2", "--max_steps", "2", "--eval_interval", "0",
                              "--eval_batches", "1", "--save_interval", "0", "--save_dir", str(save_dir),
                              "--overwrite", "--no_progress"]
    print(f"== {row}, ZeRO-{stage}, {ranks} rank(s)", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((save_dir / "summary.json").read_text())


def compare(row: str, stage: int, ranks: int, summary: dict) -> dict:
    from ds_q8.memory.predict_offload import predict_host_states

    sizes, bits = summary["param_group_sizes"], summary["param_group_bits"]
    measured = [{k: v for k, v in r.items() if k != "total"} for r in summary["host_states"]]
    predicted = [predict_host_states(sizes, row, stage, ranks, rank=r, group_bits=bits, gradient_accumulation_steps=2)
                 for r in range(ranks)]
    n = sum(map(sum, sizes))
    top = max(range(ranks), key=lambda r: summary["host_states"][r]["total"])
    return dict(row=row, stage=stage, ranks=ranks, n_params=n, measured=summary["host_states"], predicted=predicted,
                measured_per_param=summary["host_states"][top]["total"] / n,
                predicted_per_param=sum(predicted[top].values()) / n,
                exact=measured == predicted and all(r["total"] == sum(m.values())
                                                    for r, m in zip(summary["host_states"], measured)))


def main(argv=None) -> int:
    from ds_q8.memory.predict_offload import OFFLOAD_ROWS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="a GPT-2 size of launch/gpt_models.py")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--rows", nargs="+", default=list(OFFLOAD_ROWS), choices=list(OFFLOAD_ROWS))
    ap.add_argument("--out", default=str(REPO / "out" / "offload_memory"), help="configs and runs (kept)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    work = Path(args.out) / args.model
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for stage in args.stages:
        for ranks in args.ranks:
            for row in args.rows:
                out.append(compare(row, stage, ranks, measure(row, stage, ranks, args.model, work)))
    print(f"\nZeRO-Offload host bytes a parameter, {args.model} ({out[0]['n_params']:,} parameters with the byte "
          "vocabulary), the rank that holds the most, 2 micro-batches a step")
    print("| stage | ranks | row | measured | predicted | equal on every rank |")
    print("|---:|---:|---|---:|---:|---|")
    for r in out:
        print(f"| {r['stage']} | {r['ranks']} | {OFFLOAD_ROWS[r['row']][0]} | {r['measured_per_param']:.3f} | "
              f"{r['predicted_per_param']:.3f} | {'yes' if r['exact'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["exact"] for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
