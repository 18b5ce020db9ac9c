"""The shipped ZeRO-Offload config on the largest GPT-2 that trains at full depth here, beside DeepSpeed's AdamW.

    python studies/offload_fit.py                           # gpt2-xl with ds_q8, gpt2-large with both
    python studies/offload_fit.py --runs q8:gpt2-xl ds:gpt2-large q8:gpt2-large

Each run is, at world size 1 on the CPU,

    python launch/train_gpt.py --model MODEL --deepspeed_config CONFIG --context 64 --micro_batch 1 \\
        --grad_accum 1 --max_steps 5 --stop_at 3 --save_dir out/offload_fit/NAME --overwrite --no_progress

with CONFIG ``ds_configs/decoder_7b_8bit_bf16master_zero2_offload.json`` (``q8``: AdamW8bitBlock, bf16
masters, 8-bit state on the host) or its twin ``decoder_7b_32bit_zero2_offload.json`` (``ds``: DeepSpeed's
AdamW, i.e. DeepSpeedCPUAdam with fp32 masters and moments). A run that needs more memory than the machine
has (host bytes predicted by ``ds_q8.memory.predict_offload`` plus the bf16 parameters) is not started: it is reported
with its prediction. After the ds_q8 run on gpt2-xl (``--resume``), the same run resumes from its step-3
checkpoint to step 5, and DeepSpeed's ``zero_to_fp32.py`` (copied beside the checkpoints) converts the step-5
checkpoint; the converted weights are compared with the parameters the run saved. Peak RSS includes the
evaluation and the checkpoint save.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LAUNCH = REPO / "launch"
sys.path[:0] = [str(HERE), str(LAUNCH), str(REPO)]

from xl_memory import memory_total, print_table, result_cells, train  # noqa: E402

CONFIGS = {"q8": "decoder_7b_8bit_bf16master_zero2_offload.json", "ds": "decoder_7b_32bit_zero2_offload.json"}
ROWS = {"q8": "q8_bf16", "ds": "deepspeed"}  # ds_q8.memory.predict_offload's row of each config
GIB = 2 ** 30


def predicted_bytes(which: str, model: str, context: int) -> dict:
    """Host bytes (ds_q8.memory.predict_offload) and the bf16 parameters, for ``model`` grouped as train_gpt.py groups it."""
    import torch
    import ds_q8
    from ds_q8.memory.predict_offload import predict_device_states, predict_host_states
    import gpt_data
    import gpt_models
    from transformers import GPT2LMHeadModel

    config = gpt_models.gpt2_config(model, gpt_data.make_tokenizer(None).vocab_size, context)
    with torch.device("meta"):
        groups = ds_q8.param_groups(GPT2LMHeadModel(config), 0.0)
    sizes = [[p.numel() for p in g["params"]] for g in groups]
    bits = [g.get("optim_bits", 8) for g in groups]
    host = sum(predict_host_states(sizes, ROWS[which], 2, group_bits=bits).values())
    device = sum(predict_device_states(sizes, 2).values())
    return dict(host=host, device=device, n_params=sum(map(sum, sizes)))


def fit(which: str, model: str, context: int, out: Path) -> dict:
    name = f"{which}_{model}"
    pred = predicted_bytes(which, model, context)
    rec = dict(name=name, which=which, model=model, config=CONFIGS[which], predicted=pred)
    if pred["host"] + pred["device"] > memory_total():
        rec["skipped"] = "its model states alone exceed this machine's memory"
        return rec
    rec.update(train(out / name, ["--model", model, "--deepspeed_config", str(REPO / "ds_configs" / CONFIGS[which]),
                                  "--context", str(context), "--micro_batch", "1", "--grad_accum", "1",
                                  "--max_steps", "5", "--stop_at", "3", "--overwrite"], name))
    return rec


def resume_and_convert(rec: dict, context: int, out: Path) -> dict:
    """Resume ``rec``'s run from step 3 to step 5, then convert its step-5 checkpoint with zero_to_fp32.py."""
    import torch

    save_dir = out / rec["name"]
    resumed = train(save_dir, ["--model", rec["model"], "--deepspeed_config",
                               str(REPO / "ds_configs" / rec["config"]), "--context", str(context), "--micro_batch",
                               "1", "--grad_accum", "1", "--max_steps", "5", "--resume"], f"{rec['name']} resumed")
    if resumed["rc"] != 0:
        return dict(resumed=resumed)
    target = save_dir / "fp32"
    t0 = time.perf_counter()
    rc = subprocess.call([sys.executable, str(save_dir / "zero_to_fp32.py"), str(save_dir), str(target), "--tag",
                          "step5"])
    conv = dict(rc=rc, wall_s=time.perf_counter() - t0)
    if rc == 0:
        converted = {}
        for f in sorted(target.glob("pytorch_model*.bin")):
            converted.update(torch.load(f, map_location="cpu", weights_only=True))
        saved = torch.load(save_dir / "step5" / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
        conv.update(tensors=len(converted), elements=sum(v.numel() for v in converted.values()),
                    equal=all(torch.equal(v, saved[k].float()) for k, v in converted.items()))
    return dict(resumed=resumed, zero_to_fp32=conv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["q8:gpt2-xl", "ds:gpt2-xl", "ds:gpt2-large", "q8:gpt2-large"],
                    help="CONFIG:MODEL pairs, CONFIG q8 or ds")
    ap.add_argument("--resume", default="q8:gpt2-xl", help="the run that then resumes to step 5 and is converted "
                                                          "with zero_to_fp32.py ('' for none)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "out" / "offload_fit"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows, resumed = [], None
    for spec in args.runs:
        which, _, model = spec.partition(":")
        if which not in CONFIGS or not model:
            ap.error(f"--runs: each entry must be q8:MODEL or ds:MODEL, got {spec!r}")
        rec = fit(which, model, args.context, out)
        if spec == args.resume and rec.get("rc") == 0:
            resumed = rec["after"] = resume_and_convert(rec, args.context, out)
        rows.append(rec)
    lines = []
    for r in rows:
        p = r["predicted"]
        cells = ("not run: " + r["skipped"], "-", "-") if "skipped" in r else result_cells(r)
        lines.append(f"| `{r['config']}` | {r['model']} | {p['n_params'] / 1e9:.3f}e9 | "
                     f"{(p['host'] + p['device']) / GIB:.1f} GiB ({p['host'] / p['n_params']:.2f} B/param host) | "
                     f"{' | '.join(cells)} |")
    print_table(f"ZeRO-2 offload on this machine ({memory_total() / GIB:.1f} GiB), byte vocabulary, context "
                f"{args.context}, micro-batch 1, 1 rank, CPU", ["config", "model", "parameters",
                                                                "host + device, predicted", "peak RSS", "losses",
                                                                "s / step"], "|---|---|---:|---:|---:|---|---:|", lines)
    if resumed:
        res, conv = resumed["resumed"], resumed.get("zero_to_fp32", {})
        print(f"resumed from step 3: exit status {res['rc']}, losses {res.get('losses')}, peak RSS "
              f"{res.get('peak_rss', 0) / GIB:.1f} GiB; zero_to_fp32.py: exit status {conv.get('rc')}, "
              f"{conv.get('tensors')} tensors, {conv.get('elements')} elements, equal to the saved parameters: "
              f"{conv.get('equal')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
