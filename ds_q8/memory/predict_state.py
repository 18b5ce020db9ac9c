"""Optimizer-state bytes of what one rank holds, predicted for a model / ZeRO stage / world size
(``measure.measured_state_bytes`` measures them; ``ds_q8.memory`` prints them).

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

import math
from typing import List, Sequence

from .. import functional as F
from ..optim.codecs import codec_for
from ..optim.layout import Segment, StateLayout, shared_blocks
from ..optim.qstate import QuantizedState


def _num_states(optimizer: str, optimizer_params: dict = None) -> int:
    """How many states ``optimizer`` keeps per tensor when built with ``optimizer_params``, as its
    ``rule_for`` answers for the group it forms (RMSprop8bitBlock with momentum: two)."""
    from ..registry import OPTIMIZERS

    if optimizer in OPTIMIZERS:
        return OPTIMIZERS[optimizer].rule_when_built(**(optimizer_params or {})).num_states
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")


def tensor_state_bytes(numel: int, num_states: int, bits: int, block_size: int, min_8bit_size: int) -> int:
    """Bytes of one tensor's optimizer state (without the step counter)."""
    if numel == 0:
        return 0
    if bits in (4, 8) and numel >= min_8bit_size:  # the codec of that width (4 bits: Adam's two moments)
        return codec_for(bits).state_bytes(numel, num_states, block_size)
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
