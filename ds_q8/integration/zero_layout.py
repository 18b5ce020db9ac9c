"""Tell ds_q8 optimizers which slices of which parameters DeepSpeed's partitions hold.

Under ZeRO (and DeepSpeed's bf16 optimizer) the wrapped optimizer is handed flat fp32 partitions.
Right after DeepSpeed builds its wrapper, this module reads DeepSpeed's own bookkeeping and
registers a :class:`~ds_q8.optim.layout.StateLayout` for every partition:

* stages 1 and 2, and ``BF16_Optimizer``: each low-precision parameter's ``_hp_mapping`` gives its
  fragment inside the flat partition (``hp_fragment_address``) and inside itself
  (``lp_fragment_address``);
* stage 3: each sub-group's fp32 flat concatenates, parameter by parameter, this rank's
  ``partition_numel()`` elements of it: elements ``[rank * n, (rank + 1) * n)``, padded past the end.

The ranks that share a block cut by a partition edge learn its slot in the per-step all-reduce once,
here, with one ``all_gather_object`` per process group. It also links every parameter to its
segment, so that ``deepspeed.utils.safe_get_full_optimizer_state`` and ``safe_set_full_optimizer_state``
read and write ds_q8's 8-bit state (``integration.patches`` makes DeepSpeed's accessors ask ds_q8 first).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..optim import Optimizer8bitBlock
from ..optim.base import uses_8bit
from ..optim.tensor_states import state_bits_of
from ..optim.layout import Comm, Segment, StateLayout, shared_blocks

#: attribute set on every parameter of a ZeRO-wrapped ds_q8 optimizer
LINK_ATTR = "_ds_q8_link"


class TorchDistComm(Comm):
    """All-reduces on a ``torch.distributed`` process group (a CPU tensor visits the GPU under NCCL)."""

    def __init__(self, group):
        self.group = group

    def _reduce(self, t: torch.Tensor, op) -> None:
        import torch.distributed as dist

        work = t
        if not t.is_cuda and dist.get_backend(self.group) == "nccl":
            work = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(work, op=op, group=self.group)
        if work is not t:
            t.copy_(work)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        self._reduce(t, dist.ReduceOp.MAX)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        self._reduce(t, dist.ReduceOp.SUM)


class ParamLink:
    """Where one original parameter's state lives: tensor, segment (None: held by other ranks)."""

    def __init__(self, optimizer: Optimizer8bitBlock, tensor: torch.Tensor, param_index: int,
                 segment: Optional[int], numel: int, shape, group):
        self.optimizer = optimizer
        self.tensor = tensor
        self.param_index = param_index
        self.segment = segment
        self.numel = numel
        self.shape = tuple(shape)
        self.process_group = group


class _Partition:
    """What DeepSpeed says about one flat partition, before it becomes a StateLayout."""

    def __init__(self, tensor, group: dict, params: list, segments: List[Segment], process_group, shapes,
                 group_index: int = 0):
        self.tensor, self.group, self.params, self.segments = tensor, group, params, segments
        self.process_group, self.shapes, self.group_index = process_group, shapes, group_index


def _name(names, p) -> Optional[str]:
    try:
        return names.get(p) if names is not None else None
    except Exception:  # a dict keyed by tensors compares by identity; anything else: no name
        return None


def _fragment_partitions(wrapper, lp_groups, hp_partitions, process_groups) -> List[_Partition]:
    """Stages 1/2 and BF16_Optimizer: segments from each parameter's ``_hp_mapping``."""
    base = wrapper.optimizer
    names = getattr(wrapper, "param_names", None)
    out = []
    for i, (params, flat) in enumerate(zip(lp_groups, hp_partitions)):
        group = base.param_groups[i]
        segments = []
        for idx, lp in enumerate(params):
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            hp, lo = mapping.hp_fragment_address, mapping.lp_fragment_address
            segments.append(Segment(int(hp.start), int(hp.numel), idx, int(lo.start), lp.numel(),
                                    uses_8bit(lp, group), _name(names, lp)))
        out.append(_Partition(flat, group, list(params), segments, process_groups[i], [tuple(p.shape) for p in params],
                              group_index=i))
    return out


def _stage3_partitions(wrapper) -> List[_Partition]:
    """Stage 3: each sub-group's flat is this rank's slice of each of its parameters, in order."""
    import torch.distributed as dist

    base = wrapper.optimizer
    names = getattr(wrapper, "param_names", None)
    out = []
    for sg, params in enumerate(wrapper.fp16_groups):
        flat = wrapper.fp32_partitioned_groups_flat[sg]
        group = base.param_groups[wrapper.sub_group_to_group_id[sg]]
        pg = (wrapper.sub_group_process_groups[sg] if hasattr(wrapper, "sub_group_process_groups")
              else wrapper.dp_process_group)
        rank = dist.get_rank(group=pg)
        segments, offset = [], 0
        for idx, p in enumerate(params):
            part, total = int(p.partition_numel()), int(p.ds_numel)
            held = max(0, min(part, total - rank * part))
            if held:
                segments.append(Segment(offset, held, idx, rank * part, total, uses_8bit(p, group, numel=total),
                                        _name(names, p)))
            offset += part
        out.append(_Partition(flat, group, list(params), segments, pg, [tuple(p.ds_shape) for p in params],
                              group_index=wrapper.sub_group_to_group_id[sg]))
    return out


def partitions_of(wrapper) -> Optional[List[_Partition]]:
    """The flat partitions of a DeepSpeed optimizer wrapper, or None for wrappers that do not flatten."""
    if hasattr(wrapper, "fp32_partitioned_groups_flat") and hasattr(wrapper, "fp16_groups"):
        return _stage3_partitions(wrapper)
    if hasattr(wrapper, "single_partition_of_fp32_groups") and hasattr(wrapper, "bit16_groups"):
        return _fragment_partitions(wrapper, wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups,
                                    wrapper.real_dp_process_group)
    if hasattr(wrapper, "fp32_groups_flat_partition") and hasattr(wrapper, "bf16_groups"):
        return _fragment_partitions(wrapper, wrapper.bf16_groups, wrapper.fp32_groups_flat_partition,
                                    wrapper.real_dp_process_group)
    return None


def _agree_on_slots(parts: List[_Partition]) -> List[Dict[tuple, int]]:
    """Slot numbers of the shared blocks of each partition, the same on every rank of its group."""
    import torch.distributed as dist

    slots: List[Dict[tuple, int]] = [dict() for _ in parts]
    by_group: Dict[int, list] = {}
    for i, part in enumerate(parts):
        by_group.setdefault(id(part.process_group), []).append(i)
    for members in by_group.values():
        pg = parts[members[0]].process_group
        local = [shared_blocks(parts[i].segments, parts[i].group["block_size"]) for i in members]
        if dist.get_world_size(group=pg) > 1:
            gathered = [None] * dist.get_world_size(group=pg)
            dist.all_gather_object(gathered, local, group=pg)
        else:
            gathered = [local]
        for j, i in enumerate(members):
            union = sorted({tuple(b) for rank_lists in gathered for b in rank_lists[j]})
            slots[i] = {b: s for s, b in enumerate(union)}
    return slots


def attach(wrapper) -> int:
    """Register the layouts of ``wrapper``'s partitions with its ds_q8 optimizer; returns how many."""
    base = getattr(wrapper, "optimizer", None)
    if not isinstance(base, Optimizer8bitBlock):
        return 0
    parts = partitions_of(wrapper)
    if parts is None:
        return 0
    slots = _agree_on_slots(parts)
    comms: Dict[int, TorchDistComm] = {}
    for part, part_slots in zip(parts, slots):
        comm = comms.setdefault(id(part.process_group), TorchDistComm(part.process_group))
        layout = StateLayout(part.tensor.shape, part.segments, part.group["block_size"], comm=comm,
                             slots=part_slots, num_slots=len(part_slots), num_params=len(part.params),
                             param_shapes=part.shapes,
                             # the group's index names its parameters in stochastic rounding's random
                             # bits, as for unwrapped parameters: with it missing, every group of a
                             # partitioned optimizer drew group 0's bits (Muon's AdamW group is group 1)
                             group_index=part.group_index, state_bits=state_bits_of(part.group))
        base.register_layout(part.tensor, layout, part.group)
        held = {seg.param_index: si for si, seg in enumerate(layout.segments)}
        for idx, (p, shape) in enumerate(zip(part.params, part.shapes)):
            numel = int(getattr(p, "ds_numel", p.numel()))
            setattr(p, LINK_ATTR, ParamLink(base, part.tensor, idx, held.get(idx), numel, shape, part.process_group))
    return len(parts)


# ---------------------------------------------------------------------------- per-parameter state API
def _full_state(link: ParamLink, key: str, device) -> torch.Tensor:
    """One parameter's dequantized state ``key``, assembled across ranks (a collective)."""
    opt = link.optimizer
    opt.check_state_name(key, link.tensor)
    buf = torch.zeros(link.numel, dtype=torch.float32, device=device)
    if link.segment is not None:
        seg = opt.layout_of(link.tensor).segments[link.segment]
        buf[seg.param_start:seg.param_end] = opt.segment_state(link.tensor, link.segment, key).to(device)
    TorchDistComm(link.process_group).all_reduce_sum(buf)
    return buf.view(link.shape)


def _set_full_state(link: ParamLink, key: str, value: torch.Tensor) -> None:
    opt = link.optimizer
    opt.check_state_name(key, link.tensor)
    if value.numel() != link.numel:
        raise ValueError(f"optimizer state '{key}' of a parameter of {link.numel} elements cannot be set "
                         f"from a tensor of {value.numel()}")
    if link.segment is not None:
        opt.set_segment_state(link.tensor, link.segment, key, value.reshape(-1))


def _patched_get_full_hp_param(original):
    def get_full_hp_param(self, optim_state_key=None):
        link = getattr(self, LINK_ATTR, None)
        if optim_state_key is None or link is None:
            return original(self, optim_state_key)
        return _full_state(link, optim_state_key, self.device)

    return get_full_hp_param


def _patched_set_full_hp_param(original):
    def set_full_hp_param(self, value, optim_state_key=None):
        link = getattr(self, LINK_ATTR, None)
        if optim_state_key is None or link is None:
            return original(self, value, optim_state_key)
        _set_full_state(link, optim_state_key, value)

    return set_full_hp_param


def _patched_z3_get(original):
    def get_full_hp_param(self, param, optim_state_key=None):
        link = getattr(param, LINK_ATTR, None)
        if optim_state_key is None or link is None or not param.requires_grad:
            return original(self, param, optim_state_key)
        return _full_state(link, optim_state_key, param.device)

    return get_full_hp_param


def _patched_z3_set(original):
    def set_full_hp_param(self, value, param, optim_state_key=None):
        link = getattr(param, LINK_ATTR, None)
        if optim_state_key is None or link is None or not param.requires_grad:
            return original(self, value, param, optim_state_key)
        _set_full_state(link, optim_state_key, value)

    return set_full_hp_param


def _attach_hook(engine, wrapper, *args, **kwargs) -> None:
    attach(wrapper)
