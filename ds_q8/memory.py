"""Optimizer-state bytes per rank predicted for a model / ZeRO stage / world size (``model_states.py`` measures them).

``python -m ds_q8.memory --model gpt2-xl --stage 2 --world-size 1 8`` prints a table comparing
32-bit state (torch Adam: two fp32 tensors) with ds_q8's 8-bit block-wise state; ``--ladder`` prints
the whole model states of each way to train with bf16 parameters (the ladder; ``model_states.py`` counts
them on live engines).

The prediction follows how ZeRO lays out what the optimizer sees:
  * stage 0: every parameter is its own tensor on every rank;
  * stages 1 and 2: one flat tensor per parameter group, padded to a multiple of
    2 * world_size, of which each rank holds an equal share;
  * stage 3: each parameter is cut into world_size equal parts (rounded up); a rank
    concatenates its parts into sub-groups of about ``sub_group_size`` elements.
Whatever a rank holds, ds_q8 keeps state per parameter slice: 8-bit codes plus one absmax (bfloat16) per
block of the *parameter* that the slice touches (a block cut by a partition edge is counted by
each rank holding part of it), or fp32 for parameters below ``min_8bit_size`` elements, in 32-bit
groups or marked 32-bit. Padding has no state.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Dict, Iterable, List, Sequence


from . import format4
from . import functional as F
from .optim.layout import Segment, StateLayout, shared_blocks
from .optim.qstate import ABSMAX_BYTES, QuantizedState

def _num_states(optimizer: str, optimizer_params: dict = None) -> int:
    """How many states ``optimizer`` keeps per tensor when built with ``optimizer_params``, as its
    ``rule_for`` answers for the group it forms (RMSprop8bitBlock with momentum: two)."""
    from .registry import OPTIMIZERS

    if optimizer in OPTIMIZERS:
        return OPTIMIZERS[optimizer].rule_when_built(**(optimizer_params or {})).num_states
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")


def tensor_state_bytes(numel: int, num_states: int, bits: int, block_size: int, min_8bit_size: int) -> int:
    """Bytes of one tensor's optimizer state (without the step counter)."""
    if numel == 0:
        return 0
    if bits == 8 and numel >= min_8bit_size:
        return num_states * (numel + ABSMAX_BYTES * F.num_blocks(numel, block_size))
    if bits == 4 and numel >= min_8bit_size:  # Adam's two moments (format4.py): bf16 and fp32 maxima
        maxima = sum(dtype.itemsize for dtype in format4.ABSMAX_DTYPES)
        return 2 * format4.packed_bytes(0, numel) + maxima * F.num_blocks(numel, block_size)
    return num_states * 4 * numel


def state_tensor_sizes(groups: Sequence[Sequence[int]], stage: int, world_size: int,
                       sub_group_size: int = 1_000_000_000) -> List[List[int]]:
    """Sizes of the tensors one rank's optimizer holds state for, per parameter group.

    ``groups`` lists each parameter group's parameter sizes. Ranks can differ only by padding,
    so the sizes returned are those of the rank with the most elements.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    out = []
    for sizes in groups:
        sizes = [int(n) for n in sizes if int(n) > 0]
        if stage == 0:
            out.append(sizes)
        elif stage in (1, 2):
            total = sum(sizes)
            align = 2 * world_size
            padded = math.ceil(total / align) * align
            out.append([padded // world_size] if total else [])
        else:
            subs, current = [], 0
            for i, n in enumerate(sizes):
                current += math.ceil(n / world_size)
                if current >= sub_group_size or i == len(sizes) - 1:
                    subs.append(current)
                    current = 0
            out.append(subs)
    return out


def rank_segments(sizes: Sequence[int], stage: int, world_size: int, rank: int) -> List[tuple]:
    """``(param_index, param_start, numel)`` of every slice of a group's parameters that ``rank`` holds.

    Stages 1 and 2 concatenate the group, pad it to a multiple of 2 * world_size and give each rank
    an equal share; stage 3 gives each rank ``ceil(n / world_size)`` elements of every parameter.
    """
    _check_layout_args(stage, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank!r}")
    sizes = [int(n) for n in sizes]
    if stage == 0:
        return [(i, 0, n) for i, n in enumerate(sizes) if n > 0]
    out = []
    if stage in (1, 2):
        total = sum(sizes)
        padded = math.ceil(total / (2 * world_size)) * 2 * world_size
        lo, hi = rank * padded // world_size, (rank + 1) * padded // world_size
        offset = 0
        for i, n in enumerate(sizes):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append((i, a - offset, b - a))
            offset += n
        return out
    for i, n in enumerate(sizes):
        part = math.ceil(n / world_size)
        held = max(0, min(part, n - rank * part))
        if held:
            out.append((i, rank * part, held))
    return out


def rank_layout(sizes: Sequence[int], stage: int, world_size: int, rank: int, eight_bit, block_size,
                state_bits: int = 8) -> StateLayout:
    """The layout of what ``rank`` holds of one group (:func:`rank_segments`, slices side by side), with
    ``eight_bit(i)`` saying whether parameter ``i`` keeps 8-bit state: the object whose storage the
    optimizer will allocate, so the estimate counts what it will hold."""
    segments, offset = [], 0
    for i, start, numel in rank_segments(sizes, stage, world_size, rank):
        segments.append(Segment(offset, numel, i, start, int(sizes[i]), bool(eight_bit(i))))
        offset += numel
    cut = shared_blocks(segments, block_size)
    return StateLayout((offset,), segments, block_size, slots={b: j for j, b in enumerate(cut)}, num_slots=len(cut),
                       state_bits=state_bits)


def _check_layout_args(stage, world_size) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def estimate_state_bytes(groups: Sequence[Sequence[int]], stage: int, world_size: int, optimizer: str = "Adam8bitBlock",
                         bits: int = 8, block_size: int = F.DEFAULT_BLOCK_SIZE,
                         min_8bit_size: int = F.DEFAULT_MIN_8BIT_SIZE,
                         group_bits: Sequence[int] = None, sub_group_size: int = 1_000_000_000,
                         rank: int = None, param_bits: Sequence[Sequence[int]] = None,
                         group_states: Sequence[int] = None, optimizer_params: dict = None) -> int:
    """Predicted optimizer-state bytes on one rank (``rank``; None: the rank that holds the most).

    Each parameter keeps 8-bit state when its group's bits are 8, its full size reaches
    ``min_8bit_size`` and ``param_bits`` (per group, per parameter: 8 or 32, e.g. 32 for a
    StableEmbedding) does not say 32, whatever partition holds it. ``group_bits`` overrides
    ``bits`` per group. ``sub_group_size`` (stage 3) does not change the bytes: sub-groups end at
    parameter boundaries. ``group_states`` gives each group's number of states where the optimizer
    runs a rule per group (``Muon8bitBlock``: 1 for Muon's matrices, 2 for the auxiliary AdamW; see
    :func:`gpt2_muon_groups`); by default every group keeps as many as ``optimizer`` built with
    ``optimizer_params`` (its keyword arguments, a DeepSpeed config's ``"params"``) keeps for its group.
    """
    F.check_block_size(block_size)
    _check_layout_args(stage, world_size)
    k_all = _num_states(optimizer, optimizer_params)
    if group_states is not None:
        if len(group_states) != len(groups):
            raise ValueError(f"group_states must give one number per group ({len(groups)}), got {len(group_states)}")
        for k in group_states:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= F.MAX_STATES:
                raise ValueError(f"group_states: each entry must be an integer in [1, {F.MAX_STATES}], got {k!r}")
    ranks = range(world_size) if rank is None else [rank]
    best = 0
    for r in ranks:
        total = 0
        for gi, sizes in enumerate(groups):
            b = group_bits[gi] if group_bits is not None else bits
            if b not in (4, 8, 32):
                raise ValueError(f"bits must be 4, 8 or 32, got {b!r}")
            def eight_bit(i, gi=gi, b=b):
                pb = param_bits[gi][i] if param_bits is not None else 8
                return b in (4, 8) and pb != 32 and int(sizes[i]) >= min_8bit_size

            layout = rank_layout(sizes, stage, world_size, r, eight_bit, block_size, state_bits=4 if b == 4 else 8)
            k = k_all if group_states is None else group_states[gi]
            total += sum(QuantizedState.bytes_for(layout, k).values())
        best = max(best, total)
    return best


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_q8.memory",
                                 description="Optimizer-state bytes per rank, 32-bit vs ds_q8 8-bit.")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", choices=sorted(GPT2_SIZES), default="gpt2-xl", help="a GPT-2 size (shapes only)")
    src.add_argument("--params", type=float, help="a single parameter group of this many elements")
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
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.params is not None:
        if args.params < 1:
            ap.error(f"--params must be >= 1, got {args.params}")
        groups, label = [[int(args.params)]], f"{int(args.params):,} parameters"
    else:
        groups = gpt2_param_groups(*GPT2_SIZES[args.model])
        label = f"{args.model} ({sum(map(sum, groups)):,} parameters)"
    group_states = None
    if args.optimizer in PER_GROUP_SPLITS and args.params is None:
        groups, group_states = PER_GROUP_SPLITS[args.optimizer](*GPT2_SIZES[args.model])
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
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": label, "ladder": rows}, f, indent=1)
        return 0
    try:
        rows = report(groups, args.stage, args.world_size, args.optimizer, args.block_size,
                      args.min_8bit_size, args.embeddings_32bit, group_states)
    except ValueError as e:
        ap.error(str(e))
    print(f"optimizer state per rank, {label}, {args.optimizer}, block_size={args.block_size}")
    print(f"{'stage':>5} {'ranks':>5} {'32-bit':>12} {'8-bit':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['stage']:>5} {r['world_size']:>5} {_fmt(r['bytes_32bit']):>12} {_fmt(r['bytes_8bit']):>12} "
              f"{r['ratio']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": label, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
