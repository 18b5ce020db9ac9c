"""Memory per rank predicted for a model / ZeRO stage / world size (the model states of each way to train,
the ladder), and the command that prints it.

``python -m ds_q8.memory --model gpt2-xl --stage 2 --world-size 1 8`` prints a table comparing
32-bit state (torch Adam: two fp32 tensors) with ds_q8's 8-bit block-wise state (``predict_state``
predicts what each rank holds; ``measure.py`` measures it); ``--ladder`` prints the whole model
states of each way to train with bf16 parameters (the ladder; ``measure.py`` counts them on live
engines); ``--offload`` the host and device bytes under ZeRO-Offload (``predict_offload`` predicts them,
``measure_offload`` counts them on live engines).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Dict, Iterable, List, Sequence

from .. import functional as F
from . import predict_offload
from .predict_state import estimate_state_bytes


# ---------------------------------------------------------------------------- model states
#: The memory ladder: ways to keep a model's training state under ZeRO-2 with bf16 parameters.
#: (label, optimizer, bytes per element of the master weights, of the gradient handed to the optimizer
#: beside the reduced one, of each Adam moment (None: ds_q8's 8-bit state), of the masters' correction
#: byte)
LADDER = {
    "a": ("DeepSpeed Adam, bf16 mixed precision (fp32 masters, fp32 moments)", "Adam", 4, 4, 4, 0),
    "b": ("DeepSpeed Adam, bf16 masters and bf16 moments", "Adam", 2, 2, 2, 0),
    "c": ("ds_q8 Adam8bitBlock, fp32 masters", "Adam8bitBlock", 4, 4, None, 0),
    "d": ("ds_q8 Adam8bitBlock, bf16 masters copied as DeepSpeed copies them (before 0.3)", "Adam8bitBlock", 2, 2,
          None, 0),
    "e": ("ds_q8 Adam8bitBlock, bf16 masters: the parameters themselves, no copies", "Adam8bitBlock", 0, 0, None, 0),
    "f": ("ds_q8 Adam8bitBlock, bf16 masters in place with a correction byte (24-bit masters)", "Adam8bitBlock", 0,
          0, None, 1),
    "g": ("ds_q8 Adam8bitBlock with optim_bits=4, bf16 masters in place", "Adam8bitBlock", 0, 0, None, 0),
}
#: the rungs whose ds_q8 state is not 8-bit: their bits (``optim_bits``) for every group not kept in fp32
LADDER_BITS = {"g": 4}
MODEL_STATE_PARTS = ("params", "grads", "masters", "master_grads", "optimizer_states")


def predict_model_states(groups: Sequence[Sequence[int]], rung: str, block_size: int = F.DEFAULT_BLOCK_SIZE,
                         min_8bit_size: int = F.DEFAULT_MIN_8BIT_SIZE, group_bits: Sequence[int] = None) -> Dict[str, int]:
    """Bytes of a rung of :data:`LADDER` at ZeRO-2 on one rank, part by part.

    * ``params``: the bf16 parameters the model computes with (2 bytes each);
    * ``grads``: ZeRO-2's bf16 gradient partition (2 bytes each);
    * ``masters``: the optimizer's copy of the parameters, one flat partition per group padded to an
      even length (DeepSpeed's alignment at one rank); none where the masters are views of the bf16
      parameters (``integration.shared_masters``);
    * ``master_grads``: the gradient partition handed to the optimizer, in the masters' dtype, where it
      is a copy of the reduced gradients: it lives during the step, one group at a time, all of it
      when one group holds most parameters;
    * ``optimizer_states``: two Adam moments per padded element, or ds_q8's per-parameter 8-bit state
      (``group_bits``: 32 for a group kept in fp32, such as ``ds_q8.param_groups``'s embeddings), and
      with ``correction_byte=True`` (rung f) one byte per padded element of the masters; rung (g) keeps
      the 8-bit groups' moments in 4 bits (``optim_bits=4``).
    """
    if rung not in LADDER:
        raise ValueError(f"rung must be one of {sorted(LADDER)}, got {rung!r}")
    _, optimizer, master, master_grad, moment, correction = LADDER[rung]
    if rung in LADDER_BITS:
        bits = LADDER_BITS[rung]
        group_bits = [bits if b != 32 else 32 for b in (group_bits or [8] * len(groups))]
    sizes = [sum(int(n) for n in g) for g in groups]
    padded = sum(math.ceil(n / 2) * 2 for n in sizes)
    total = sum(sizes)
    states = (2 * moment * padded if moment is not None else
              estimate_state_bytes(groups, 2, 1, optimizer, block_size=block_size, min_8bit_size=min_8bit_size,
                                   group_bits=group_bits)) + correction * padded
    return dict(params=2 * total, grads=2 * total, masters=master * padded, master_grads=master_grad * padded,
                optimizer_states=states)


def ladder_table(groups, block_size: int = F.DEFAULT_BLOCK_SIZE,
                 min_8bit_size: int = F.DEFAULT_MIN_8BIT_SIZE) -> List[dict]:
    """Every rung's predicted bytes, in total and per parameter."""
    n = sum(sum(g) for g in groups)
    rows = []
    for rung, (label, optimizer, *_) in LADDER.items():
        parts = predict_model_states(groups, rung, block_size, min_8bit_size)
        total = sum(parts.values())
        rows.append(dict(rung=rung, label=label, optimizer=optimizer, bytes=total, per_param=total / n, **parts))
    return rows


def gpt2_param_groups(n_layer: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024) -> List[List[int]]:
    """Parameter sizes of a GPT-2 as two groups: [embeddings], [everything else]."""
    d = n_embd
    block = [2 * d, d * 3 * d, 3 * d, d * d, d, 2 * d, d * 4 * d, 4 * d, 4 * d * d, d]
    return [[vocab_size * d, n_positions * d], block * n_layer + [2 * d]]


def gpt2_muon_groups(n_layer: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024):
    """A GPT-2's parameter sizes split as Muon splits them, and each group's number of states:
    ``([embeddings, hidden matrices, vectors], [2, 1, 2])``. The matrices take Muon (one momentum);
    the embeddings (the output head is tied to them), biases and norms the auxiliary AdamW (two)."""
    d = n_embd
    matrices = [d * 3 * d, d * d, d * 4 * d, 4 * d * d] * n_layer
    vectors = [2 * d, 3 * d, d, 2 * d, 4 * d, d] * n_layer + [2 * d]
    return [[vocab_size * d, n_positions * d], matrices, vectors], [2, 1, 2]


#: optimizers whose groups keep different numbers of states; ``--model`` splits GPT-2 for them
PER_GROUP_SPLITS = {"Muon8bitBlock": gpt2_muon_groups}

GPT2_SIZES = {
    "gpt2": (12, 768),
    "gpt2-medium": (24, 1024),
    "gpt2-large": (36, 1280),
    "gpt2-xl": (48, 1600),
}


def _fmt(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024.0
    return str(nbytes)


def report(groups, stages: Iterable[int], world_sizes: Iterable[int], optimizer: str, block_size: int,
           min_8bit_size: int, embeddings_32bit: bool, group_states: Sequence[int] = None) -> List[dict]:
    rows = []
    k_groups = len(groups)
    group_bits = None
    if embeddings_32bit and k_groups in (2, 3):  # the embedding group first
        group_bits = [32] + [8] * (k_groups - 1)
    for stage in stages:
        for ws in world_sizes:
            b32 = estimate_state_bytes(groups, stage, ws, optimizer, bits=32, group_states=group_states)
            b8 = estimate_state_bytes(groups, stage, ws, optimizer, bits=8, block_size=block_size,
                                      min_8bit_size=min_8bit_size, group_bits=group_bits, group_states=group_states)
            rows.append(dict(stage=stage, world_size=ws, bytes_32bit=b32, bytes_8bit=b8,
                             ratio=b8 / b32 if b32 else float("nan")))
    return rows


def _dump(path, payload) -> None:
    """Write ``payload`` as JSON to ``path`` (``--json``), when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def _emit(path, payload, lines) -> int:
    """Print a table's lines and write its rows (``--json``); the command's exit status."""
    print("\n".join(lines))
    _dump(path, payload)
    return 0


def _print_offload(args, groups, label) -> int:
    if args.grad_accum < 1:
        raise SystemExit(f"--grad-accum must be an integer >= 1, got {args.grad_accum}")
    if 0 in args.stage:
        raise SystemExit("--offload needs a ZeRO stage of 1, 2 or 3 (ZeRO-Offload), got 0")
    rows = predict_offload.offload_table(groups, args.stage, args.world_size, block_size=args.block_size,
                                     min_8bit_size=args.min_8bit_size, gradient_accumulation_steps=args.grad_accum)
    return _emit(args.json, {"model": label, "offload": rows}, [
        f"ZeRO-Offload, {label}, bf16 parameters, gradient accumulation {args.grad_accum}, "
        f"block_size={args.block_size}: model states per rank",
        f"{'stage':>5} {'ranks':>5} {'host B/param':>12} {'host':>10} {'all ranks':>10} {'device':>10}  what",
        *(f"{r['stage']:>5} {r['world_size']:>5} {r['host_per_param']:>12.3f} {_fmt(r['host']):>10} "
          f"{_fmt(r['host_all_ranks']):>10} {_fmt(r['device']):>10}  {r['label']}" for r in rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_q8.memory",
                                 description="Optimizer-state bytes per rank, 32-bit vs ds_q8 8-bit.")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", choices=sorted(GPT2_SIZES), default="gpt2-xl", help="a GPT-2 size (shapes only)")
    src.add_argument("--params", type=float, help="a single parameter group of this many elements")
    src.add_argument("--decoder", choices=sorted(predict_offload.DECODERS),
                     help="a Llama-style decoder of this size (shapes only: Llama-2's)")
    ap.add_argument("--stage", type=int, nargs="+", default=[2], choices=[0, 1, 2, 3])
    ap.add_argument("--world-size", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--optimizer", default="Adam8bitBlock")
    ap.add_argument("--block-size", type=int, default=F.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--min-8bit-size", type=int, default=F.DEFAULT_MIN_8BIT_SIZE)
    ap.add_argument("--embeddings-32bit", action="store_true",
                    help="keep the embedding group in 32-bit (as ds_q8.param_groups does)")
    ap.add_argument("--ladder", action="store_true",
                    help="instead: model-state bytes at ZeRO-2, one rank, for (a) DeepSpeed fp32 Adam with bf16 "
                         "mixed precision, (b) DeepSpeed bf16 masters and states, (c) ds_q8 8-bit with fp32 "
                         "masters, (d) ds_q8 8-bit with copied bf16 masters, (e) ds_q8 8-bit stepping the bf16 "
                         "parameters themselves (what a bf16-master config gets)")
    ap.add_argument("--offload", action="store_true",
                    help="instead: host and device bytes per rank under ZeRO-Offload (offload_optimizer cpu) for "
                         "DeepSpeed's AdamW and ds_q8, fp32 and bf16 masters (ds_q8.memory.predict_offload)")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="with --offload: gradient accumulation steps (more than 1 adds DeepSpeed's per-parameter "
                         "gradient buffers on the host at stages 1 and 2 with fp32 masters)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.params is not None:
        if args.params < 1:
            ap.error(f"--params must be >= 1, got {args.params}")
        groups, label = [[int(args.params)]], f"{int(args.params):,} parameters"
    elif args.decoder is not None:
        groups = predict_offload.decoder_param_groups(*predict_offload.DECODERS[args.decoder])
        label = f"{args.decoder} decoder ({sum(map(sum, groups)):,} parameters)"
    else:
        groups = gpt2_param_groups(*GPT2_SIZES[args.model])
        label = f"{args.model} ({sum(map(sum, groups)):,} parameters)"
    group_states = None
    if args.optimizer in PER_GROUP_SPLITS and args.params is None:
        groups, group_states = PER_GROUP_SPLITS[args.optimizer](*GPT2_SIZES[args.model])
    if args.offload:
        return _print_offload(args, groups, label)
    if args.ladder:
        try:
            F.check_block_size(args.block_size)
        except ValueError as e:
            ap.error(str(e))
        rows = ladder_table(groups, args.block_size, args.min_8bit_size)
        print(f"model states at ZeRO-2 on one rank, {label}, bf16 parameters, block_size={args.block_size}")
        print(f"{'':4} {'B/param':>8} {'total':>10}  what")
        for r in rows:
            print(f"({r['rung']}) {r['per_param']:>8.3f} {_fmt(r['bytes']):>10}  {r['label']}")
        _dump(args.json, {"model": label, "ladder": rows})
        return 0
    try:
        rows = report(groups, args.stage, args.world_size, args.optimizer, args.block_size,
                      args.min_8bit_size, args.embeddings_32bit, group_states)
    except ValueError as e:
        ap.error(str(e))
    return _emit(args.json, {"model": label, "rows": rows}, [
        f"optimizer state per rank, {label}, {args.optimizer}, block_size={args.block_size}",
        f"{'stage':>5} {'ranks':>5} {'32-bit':>12} {'8-bit':>12} {'ratio':>6}",
        *(f"{r['stage']:>5} {r['world_size']:>5} {_fmt(r['bytes_32bit']):>12} {_fmt(r['bytes_8bit']):>12} "
          f"{r['ratio']:>6.3f}" for r in rows)])

