"""Model-state memory per rank under ZeRO-2 with bf16: 8-bit block-wise Adam vs 32-bit Adam.

Every rank holds the bf16 weights (2 B/param) and bf16 gradients (2 B/param); ZeRO-2 splits the
rest, K bytes per parameter, over the N data-parallel ranks:
  32-bit Adam: K = 4 (fp32 master) + 4 + 4 (two fp32 moments)                 = 12
  8-bit Adam:  K = 4 (fp32 master) + 1 + 1 (two uint8 moments) + 2 * 2 / block = 6.0625 at block 64
               (one bfloat16 maximum per block and moment)
  8-bit Adam, bf16 masters stepped in place (``bf16_master_weights_and_grads``, the memory ladder's
               rung (e)): K = 0 + 2.0625: the masters are the bf16 weights themselves
  8-bit Adam, in place with a correction byte (``correction_byte``, rung (f), 24-bit masters):
               K = 1 + 2.0625
Parameters in 32-bit groups (the embeddings, see ``ds_q8.param_groups``) cost K = 12 (K = 8 in place,
9 with the correction byte).
Activations, temporaries and communication buffers come on top and depend on batch and context.

Run ``python studies/memory_plan.py`` to print the plan for GPT-2 1.5B (counted on the meta device), and
``python studies/memory_plan.py --offload`` for ZeRO-Offload (``offload_optimizer`` cpu, the setting of
``ds_configs/decoder_7b_8bit_bf16master_zero2_offload.json``): host and device bytes per rank of 7B- and
13B-class decoders at 1 and 8 ranks, DeepSpeed's AdamW beside ds_q8 (``ds_q8.memory.predict_offload`` predicts them).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

from ds_q8.memory import predict_offload
from ds_q8.functional import DEFAULT_BLOCK_SIZE
from ds_q8.memory import tensor_state_bytes

# the trainer's GPT-2 sizes (launch/gpt_models.py), for the printout
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))

GB = 1e9
BF16_WEIGHT_AND_GRAD = 2 + 2


def optimizer_bytes_per_param(optim_bits: int, block_size: int = DEFAULT_BLOCK_SIZE, master_bytes: int = 4) -> float:
    """K: the master copy (``master_bytes``: 4 for fp32, 0 where the bf16 weights are the masters, 1 for
    their correction byte) plus both Adam moments, per parameter (moments as ds_q8.memory counts them)."""
    if optim_bits not in (8, 32):
        raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits!r}")
    # one full block, so its absmax is counted exactly once
    moments = tensor_state_bytes(block_size, 2, optim_bits, block_size, min_8bit_size=0) / block_size
    return master_bytes + moments


def model_state_bytes(n_params: int, world_size: int, optim_bits: int, n_params_32bit: int = 0,
                      block_size: int = DEFAULT_BLOCK_SIZE, master_bytes: int = 4) -> float:
    """Bytes of weights, gradients and optimizer state on one rank under ZeRO-2 with bf16."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= n_params_32bit <= n_params:
        raise ValueError(f"n_params_32bit must be in [0, n_params={n_params}], got {n_params_32bit}")
    k_main = optimizer_bytes_per_param(optim_bits, block_size, master_bytes)
    k_32 = optimizer_bytes_per_param(32, master_bytes=master_bytes)
    sharded = (n_params - n_params_32bit) * k_main + n_params_32bit * k_32
    return n_params * BF16_WEIGHT_AND_GRAD + sharded / world_size


def plan(n_params: int, n_params_32bit: int, world_sizes=(1, 8, 64), block_size: int = DEFAULT_BLOCK_SIZE) -> List[Dict]:
    rows = []
    for n in world_sizes:
        b32 = model_state_bytes(n_params, n, 32)
        b8 = model_state_bytes(n_params, n, 8, n_params_32bit, block_size)
        e = model_state_bytes(n_params, n, 8, n_params_32bit, block_size, master_bytes=0)
        f = model_state_bytes(n_params, n, 8, n_params_32bit, block_size, master_bytes=1)
        rows.append(dict(world_size=n, adam32_gb=b32 / GB, adam8_gb=b8 / GB, saved_gb=(b32 - b8) / GB,
                         adam8_inplace_gb=e / GB, adam8_corrected_gb=f / GB))
    return rows


def format_plan(n_params: int, n_params_32bit: int, rows: List[Dict]) -> str:
    lines = [
        f"model states per rank, ZeRO-2 + bf16, {n_params:,} = {n_params / 1e9:.4f}e9 params "
        f"({n_params_32bit / 1e6:.1f}M kept 32-bit as embeddings)",
        "| world size | 32-bit Adam (GB) | 8-bit Adam (GB) | saved (GB) | 8-bit, bf16 masters in place (GB) "
        "| and a correction byte (GB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['adam32_gb']:.2f} | {r['adam8_gb']:.2f} | {r['saved_gb']:.2f} | "
                     f"{r['adam8_inplace_gb']:.2f} | {r['adam8_corrected_gb']:.2f} |")
    return "\n".join(lines)


def embedding_params(config) -> int:
    """Token + position embedding parameters of a GPT-2 config (the LM head is tied to the tokens)."""
    return config.vocab_size * config.n_embd + config.n_positions * config.n_embd


def offload_plan(models=("7b", "13b"), world_sizes=(1, 8), stages=(2, 3), grad_accum: int = 8,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> Dict[str, List[Dict]]:
    """Per decoder: ``predict_offload.offload_table``'s rows (host and device bytes per rank, every row)."""
    return {m: predict_offload.offload_table(predict_offload.decoder_param_groups(*predict_offload.DECODERS[m]), stages,
                                         world_sizes, block_size=block_size, gradient_accumulation_steps=grad_accum)
            for m in models}


def format_offload_plan(plans: Dict[str, List[Dict]], grad_accum: int) -> str:
    lines = []
    for model, rows in plans.items():
        n = sum(map(sum, predict_offload.decoder_param_groups(*predict_offload.DECODERS[model])))
        lines += [f"ZeRO-Offload, {model} decoder ({n / 1e9:.3f}e9 params, bf16, gradient accumulation "
                  f"{grad_accum}): model states per rank",
                  "| stage | ranks | optimizer | host per rank (GB) | host B/param, all ranks | host, all ranks (GB) "
                  "| device per rank (GB) |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['stage']} | {r['world_size']} | {r['label']} | {r['host'] / GB:.1f} | "
                         f"{r['host_per_param'] * r['world_size']:.2f} | {r['host_all_ranks'] / GB:.1f} | "
                         f"{r['device'] / GB:.1f} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> None:
    from gpt_models import GPT2_CONTEXT, GPT2_VOCAB_SIZE, SIZES, count_params_on_meta, gpt2_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(SIZES))
    ap.add_argument("--world_sizes", default="1,8,64", help="comma-separated data-parallel sizes")
    ap.add_argument("--block_size", type=int, default=DEFAULT_BLOCK_SIZE, help="quantization block size of the 8-bit state")
    ap.add_argument("--offload", action="store_true",
                    help="instead: host and device bytes under ZeRO-Offload for the 7B and 13B decoders at 1 and 8 "
                         "ranks")
    ap.add_argument("--grad_accum", type=int, default=8, help="with --offload: gradient accumulation steps")
    args = ap.parse_args(argv)
    if args.offload:
        if args.grad_accum < 1:
            raise SystemExit(f"--grad_accum must be an integer >= 1, got {args.grad_accum}")
        print(format_offload_plan(offload_plan(grad_accum=args.grad_accum, block_size=args.block_size),
                                  args.grad_accum))
        return
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        raise SystemExit(f"--world_sizes must be comma-separated integers >= 1, got {args.world_sizes!r}")
    config = gpt2_config(args.model, GPT2_VOCAB_SIZE, GPT2_CONTEXT)
    n = count_params_on_meta(config)
    emb = embedding_params(config)
    print(format_plan(n, emb, plan(n, emb, world_sizes, args.block_size)))
    print(f"all parameters 8-bit (no 32-bit embedding group), world size 1: "
          f"{model_state_bytes(n, 1, 8, 0, args.block_size) / GB:.2f} GB")


if __name__ == "__main__":
    main()
