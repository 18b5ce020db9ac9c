"""Host and device bytes per rank under ZeRO-Offload (``"offload_optimizer": {"device": "cpu"}``), predicted
from the parameter sizes; ``ds_q8.memory.measure_offload`` counts the host part on a live engine.

``python -m ds_q8.memory --offload --model gpt2-xl --stage 2 3 --world-size 1 8`` prints a table per row
of :data:`OFFLOAD_ROWS`. What a rank holds on the host, following DeepSpeed 0.19's layouts:

* stages 1 and 2 (one flat partition per parameter group, padded as ``predict_state.rank_segments`` pads it):
  the master partition and its gradient (4 bytes each with fp32 masters, 2 with bf16), the optimizer
  state (two moments for every element of the partition, or ds_q8's 8-bit state per parameter slice,
  ``predict_state.estimate_state_bytes``, plus the correction byte per element where asked for), a bf16 image of
  the masters that is copied to the device (2), DeepSpeed's ``temp_grad_buffer_for_cpu_offload`` (2 bytes
  per element of the largest parameter; never used) and, with fp32 masters and gradient accumulation,
  a bf16 buffer per parameter of the partition, whole (2 per element);
* stage 3 (every parameter cut into ``ceil(n / world_size)``-element parts): the masters and their
  gradient (by the masters' dtype), a flat gradient partition in the gradient accumulation dtype (2 for
  bf16), and the optimizer state.

With a ds_q8 optimizer (``integration.host_copies``) the bf16 image is the bf16 masters themselves,
the unused buffer is released and, at stage 3, the masters' gradients are slices of the flat gradient
partition when both have one dtype. On the device each rank keeps the bf16 parameters (all of them at
stages 1 and 2, its part at stage 3) and, at stages 1 and 2, a bf16 gradient buffer of the largest
parameter; activations and the reduction buckets come on top.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

from .. import functional as F
from .predict_state import estimate_state_bytes, rank_layout, rank_segments

#: row -> (label, JSON optimizer type, master bytes, bytes of each Adam moment (None: ds_q8's 8-bit state),
#: correction bytes per master element)
OFFLOAD_ROWS = {
    "deepspeed": ("DeepSpeed AdamW (DeepSpeedCPUAdam), fp32 masters and moments", "AdamW", 4, 4, 0),
    "deepspeed_bf16": ("DeepSpeed AdamW (DeepSpeedCPUAdam), bf16 masters and moments", "AdamW", 2, 2, 0),
    "q8": ("ds_q8 AdamW8bitBlock, fp32 masters", "AdamW8bitBlock", 4, None, 0),
    "q8_bf16": ("ds_q8 AdamW8bitBlock, bf16 masters (stochastic rounding)", "AdamW8bitBlock", 2, None, 0),
    "q8_bf16_correction": ("ds_q8 AdamW8bitBlock, bf16 masters with a correction byte", "AdamW8bitBlock", 2, None,
                           1),
}
HOST_PARTS = ("masters", "master_grads", "optimizer_states", "bf16_image", "grad_accumulation", "unused",
              "state_index")
PARAM_BYTES = 2  # bf16 parameters and gradients


def _rank_numels(groups, stage: int, world_size: int, rank: int) -> List[int]:
    """Elements of each group's flat master partition on ``rank``, padding included."""
    out = []
    for sizes in groups:
        sizes = [int(n) for n in sizes if int(n) > 0]
        if stage in (1, 2):
            align = 2 * world_size
            out.append(math.ceil(sum(sizes) / align) * align // world_size)
        else:
            out.append(sum(math.ceil(n / world_size) for n in sizes))
    return out


def _whole_params_held(groups, world_size: int, rank: int) -> int:
    """Elements of every parameter of which ``rank`` holds a part at stages 1 and 2, whole."""
    return sum(int(sizes[i]) for sizes in groups for i, _, _ in rank_segments(sizes, 2, world_size, rank))


def state_index_bytes(groups, stage: int, world_size: int, rank: int, block_size: int, min_8bit_size: int,
                      group_bits: Sequence[int] = None) -> int:
    """Bytes of a ds_q8 optimizer's index of the 8-bit blocks that partition edges cut on ``rank``
    (``StateLayout.shared_index``: four int64 per element of such a block part, two per part; tensors of
    one element are scalars, left out as ``measure_offload`` leaves them out)."""
    total = 0
    for gi, sizes in enumerate(groups):
        bits = group_bits[gi] if group_bits is not None else 8
        layout = rank_layout(sizes, stage, world_size, rank,
                             lambda i, sizes=sizes, bits=bits: bits in (4, 8) and int(sizes[i]) >= min_8bit_size,
                             block_size)
        elements, pieces = sum(p.numel for p in layout.shared8), len(layout.shared8)
        total += 8 * (4 * elements * (elements > 1) + 2 * pieces * (pieces > 1))
    return total


def predict_host_states(groups: Sequence[Sequence[int]], row: str, stage: int = 2, world_size: int = 1,
                        rank: int = None, block_size: int = F.DEFAULT_BLOCK_SIZE,
                        min_8bit_size: int = F.DEFAULT_MIN_8BIT_SIZE, group_bits: Sequence[int] = None,
                        gradient_accumulation_steps: int = 1, grad_accum_bytes: int = PARAM_BYTES,
                        host_copies: bool = True) -> Dict[str, int]:
    """Host bytes of one rank (``rank``; None: the rank that holds the most) of a ZeRO-Offload engine,
    part by part (``HOST_PARTS``, as ``measure_offload.measure_host_states`` names them), for ``groups``
    (each parameter group's parameter sizes) and a row of :data:`OFFLOAD_ROWS`.

    ``gradient_accumulation_steps`` > 1 adds ZeRO-1/2's per-parameter buffers with fp32 masters;
    ``grad_accum_bytes`` is the element size of ZeRO-3's flat gradient partition (DeepSpeed's
    ``data_types.grad_accum_dtype``, by default the parameters' bf16); ``host_copies`` False predicts
    DeepSpeed's layout for a ds_q8 row (``integration.host_copies.ENABLED = False``).
    """
    if row not in OFFLOAD_ROWS:
        raise ValueError(f"row must be one of {sorted(OFFLOAD_ROWS)}, got {row!r}")
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3 (ZeRO-Offload), got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
    ranks = range(world_size) if rank is None else [rank]
    best = None
    for r in ranks:
        parts = _rank_host_states(groups, row, stage, world_size, r, block_size, min_8bit_size, group_bits,
                                  gradient_accumulation_steps, grad_accum_bytes, host_copies)
        if best is None or sum(parts.values()) > sum(best.values()):
            best = parts
    return best


def _rank_host_states(groups, row, stage, world_size, rank, block_size, min_8bit_size, group_bits, gas,
                      grad_accum_bytes, host_copies) -> Dict[str, int]:
    _, optimizer, master, moment, correction = OFFLOAD_ROWS[row]
    q8 = moment is None
    removed = q8 and host_copies
    held = sum(_rank_numels(groups, stage, world_size, rank))
    if q8:
        states = estimate_state_bytes(groups, stage, world_size, optimizer, block_size=block_size,
                                      min_8bit_size=min_8bit_size, group_bits=group_bits, rank=rank)
    else:
        states = 2 * moment * held
    parts = dict.fromkeys(HOST_PARTS, 0)
    parts.update(masters=master * held, master_grads=master * held, optimizer_states=states + correction * held)
    if q8:
        parts["state_index"] = state_index_bytes(groups, stage, world_size, rank, block_size, min_8bit_size,
                                                 group_bits)
    if stage == 3:
        shared = removed and grad_accum_bytes == master
        parts["grad_accumulation"] = 0 if shared else grad_accum_bytes * held
        return parts
    if not (removed and master == PARAM_BYTES):
        parts["bf16_image"] = PARAM_BYTES * held
    if not removed:
        parts["unused"] = PARAM_BYTES * max(int(n) for sizes in groups for n in sizes)
    if master != PARAM_BYTES and gas > 1:
        parts["grad_accumulation"] = PARAM_BYTES * _whole_params_held(groups, world_size, rank)
    return parts


def predict_device_states(groups: Sequence[Sequence[int]], stage: int = 2, world_size: int = 1) -> Dict[str, int]:
    """Model-state bytes a rank keeps on the device under ZeRO-Offload (whatever the optimizer): the bf16
    parameters (padded flat groups at stages 1 and 2; the rank's parts at stage 3) and, at stages 1 and 2,
    DeepSpeed's bf16 gradient buffer of the largest parameter. Activations and reduction buckets are not
    counted."""
    if stage in (1, 2):
        params = PARAM_BYTES * sum(_rank_numels(groups, stage, world_size, 0)) * world_size
        largest = PARAM_BYTES * max(int(n) for sizes in groups for n in sizes)
        return dict(params=params, grad_buffer=largest)
    return dict(params=PARAM_BYTES * sum(_rank_numels(groups, 3, world_size, 0)), grad_buffer=0)


def offload_table(groups, stages=(2, 3), world_sizes=(1, 8), rows=tuple(OFFLOAD_ROWS), **kwargs) -> List[dict]:
    """One entry per row, stage and world size: host bytes per rank (and per parameter of the model), the
    device bytes, and each host part."""
    n = sum(int(x) for g in groups for x in g)
    out = []
    for stage in stages:
        for ws in world_sizes:
            device = sum(predict_device_states(groups, stage, ws).values())
            for row in rows:
                parts = predict_host_states(groups, row, stage, ws, **kwargs)
                host = sum(parts.values())
                out.append(dict(row=row, label=OFFLOAD_ROWS[row][0], stage=stage, world_size=ws, host=host,
                                host_per_param=host / n, host_all_ranks=host * ws, device=device,
                                device_per_param=device / n, parts=parts))
    return out


def decoder_param_groups(n_layer: int, d: int, ffn: int, vocab: int) -> List[List[int]]:
    """A Llama-style decoder's parameter sizes (attention q, k, v, o; gated MLP; RMSNorm weights; untied
    input and output embeddings) as two groups: [matrices and embeddings], [norm weights]."""
    layer = [d * d] * 4 + [d * ffn] * 3
    return [[vocab * d] + layer * n_layer + [vocab * d], [d, d] * n_layer + [d]]


#: name -> (n_layer, d_model, ffn, vocab) of the 7B- and 13B-class decoders (Llama-2's shapes)
DECODERS = {"7b": (32, 4096, 11008, 32000), "13b": (40, 5120, 13824, 32000)}
