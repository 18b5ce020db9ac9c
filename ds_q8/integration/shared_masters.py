"""bf16 masters without copies: ZeRO-1/2 steps the rank's slice of DeepSpeed's own bf16 parameters.

With ``"bf16": {"bf16_master_weights_and_grads": true}`` DeepSpeed's ZeRO-1/2 optimizer keeps two
things that hold nothing new when the optimizer is a ds_q8 one:

* the master partition, ``parallel_partitioned_bit16_groups[i][rank].clone()`` in bf16: after every
  step DeepSpeed copies it back into that slice bit for bit, so the two are always equal. Here the
  master becomes a view of the slice itself (2 bytes per parameter, divided by the ranks, saved);
* the gradient handed to the optimizer: DeepSpeed flattens the reduced gradients of the rank's
  parameters into a new tensor (``flatten(averaged_gradients[i])``), because it had stored them in
  the order in which backward produced them. Here each parameter's reduced gradient is stored at its
  place in the partition instead (``copy_grads_in_partition``), so the partition's gradient is one
  slice of that buffer, and DeepSpeed is handed that slice where it looks for a pre-flattened
  gradient (``averaged_gradients[i].flat_partition``). That saves the copy, which existed beside the
  reduced gradients while DeepSpeed made it (2 bytes per parameter at the step's peak).

Nothing in the arithmetic changes: the optimizer reads the same gradient values and writes the same
bf16 values (stochastic rounding draws the same bits), DeepSpeed's copy back becomes a copy onto
itself, and checkpoints hold what they held. ZeRO-3 needs neither: its masters already are its bf16
partitions when their dtype is the parameters' (``stage3.py``), and it partitions gradients per
parameter. ZeRO-Offload keeps its masters on the host by design and is left as it is.

:data:`ENABLED` turns both off (the copying path of DeepSpeed, for comparisons).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch

from .lookup import ds_q8_optimizer

#: False: keep DeepSpeed's master copy and flattened gradient (read when an engine is built)
ENABLED = True

_LAYOUT = "_ds_q8_ordered_grads"


@dataclass
class OrderedGrads:
    """Where each of this rank's parameters keeps its reduced gradient in the contiguous buffer."""

    offsets: Dict[int, int]  # DeepSpeed's param id -> element offset of the whole parameter's gradient
    views: List[Tuple[int, int]]  # per group: (start, numel) of the partition's gradient in the buffer
    pads: List[Tuple[int, int]]  # (start, numel) of the zeros past the last parameter of a partition
    total: int
    # data pointers of the buffers laid out so since the last step: with gradient accumulation the
    # step's gradients can sit in the buffer of an earlier micro-step (DeepSpeed adds into it)
    storages: Set[int] = field(default_factory=set)


class _Preflattened(list):
    """``averaged_gradients[i]`` with the partition's gradient as one tensor (DeepSpeed reads
    ``flat_partition`` before it would flatten the list)."""

    def __init__(self, tensors, flat_partition):
        super().__init__(tensors)
        self.flat_partition = flat_partition


def _eligible(wrapper) -> bool:
    if not ENABLED or ds_q8_optimizer(wrapper, depth=1) is None:
        return False
    needed = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group")
    if not all(hasattr(wrapper, name) for name in needed) or getattr(wrapper, "cpu_offload", True):
        return False
    return all(m.dtype == wrapper.dtype for m in wrapper.single_partition_of_fp32_groups)


def share_masters(wrapper) -> int:
    """Make each master partition a view of the rank's slice of the flat bf16 parameters; returns how
    many groups now share (0 where the masters are fp32, offloaded, or not ds_q8's)."""
    import torch.distributed as dist

    if not _eligible(wrapper):
        return 0
    shared = 0
    for i, master in enumerate(wrapper.single_partition_of_fp32_groups):
        lp = wrapper.parallel_partitioned_bit16_groups[i][dist.get_rank(group=wrapper.real_dp_process_group[i])]
        if lp.shape != master.shape or lp.device != master.device:
            continue
        if not torch.equal(lp, master):
            raise RuntimeError(f"ZeRO group {i}: the bf16 master partition differs from the parameters it was "
                               "copied from; cannot share them")
        master.data = lp.data  # the Parameter the optimizer holds keeps its identity
        shared += 1
    if shared:
        wrapper._link_all_hp_params()  # the fragments DeepSpeed reads (safe_get_full_fp32_param) follow
    return shared


def order_gradients(wrapper) -> bool:
    """Lay out the contiguous gradient buffer in partition order (see the module's text), for a wrapper
    whose masters :func:`share_masters` shared; False where DeepSpeed's own order stays (no contiguous
    gradients, fp32 accumulation, padded round-robin groups)."""
    if not getattr(wrapper, "contiguous_gradients", False):
        return False
    groups = range(len(wrapper.bit16_groups))
    if any(any(wrapper.round_robin_bit16_padding[i]) or wrapper._use_compact_grad_partition_buffer(i) for i in groups):
        return False
    offsets, views, pads, at = {}, [], [], 0
    for i in groups:
        params, size, first = wrapper.params_in_partition[i], int(wrapper.partition_size[i]), int(wrapper.first_offset[i])
        region = 0
        for p in params:
            offsets[wrapper.get_param_id(p)] = at + region
            region += p.numel()
        if not params:
            first = 0
        pad = max(0, first + size - region)
        if pad:
            pads.append((at + region, pad))
        views.append((at + first, size))
        at += region + pad
    setattr(wrapper, _LAYOUT, OrderedGrads(offsets, views, pads, at))
    return True


def _copy_grads_in_partition(original):
    """DeepSpeed's copy of a reduced gradient into the contiguous buffer, at the parameter's place in
    its partition where :func:`order_gradients` laid one out (at the next free place otherwise)."""
    def copy_grads_in_partition(self, param, group_idx=None):
        layout = getattr(self, _LAYOUT, None)
        if layout is None:  # laid out only without offload and compact fp32 buffers (order_gradients)
            return original(self, param, group_idx)
        if self.grads_in_partition is None:
            buf = torch.empty(layout.total, dtype=self.dtype, device=param.device)
            for start, numel in layout.pads:
                buf.narrow(0, start, numel).zero_()
            self.grads_in_partition, self.grads_in_partition_offset = buf, 0
            layout.storages.add(buf.untyped_storage().data_ptr())
        grad = self.get_gradient_for_reduction(param)
        dest = self.grads_in_partition.view(-1).narrow(0, layout.offsets[self.get_param_id(param)], param.numel())
        dest.copy_(grad.view(-1))
        grad.data = dest.data.view_as(grad)

    return copy_grads_in_partition


def _flat_view(tensors, layout: OrderedGrads, group: int):
    """The partition's gradient as one view of the buffer, when ``tensors`` (DeepSpeed's list for the
    group) are exactly its consecutive pieces; None otherwise (DeepSpeed then flattens as before)."""
    start, numel = layout.views[group]
    pieces = [t for t in tensors if not getattr(t, "_zero_padding", False)]
    if not pieces:
        return None
    storage = pieces[0].untyped_storage()
    if storage.data_ptr() not in layout.storages or storage.nbytes() != layout.total * pieces[0].element_size():
        return None
    at = start
    for t in pieces:
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous()
                or t.storage_offset() != at):
            return None
        at += t.numel()
    if sum(t.numel() for t in tensors) != numel or at > start + numel:
        return None  # the rest, if any, is the zeroed pad laid out after the group's last parameter
    return pieces[0].new_empty(0).set_(storage, start, (numel,))


def _hand_preflattened(self, *args, **kwargs) -> None:
    """Before ZeRO-1/2's step: give each group's reduced gradients as one view (see :func:`_flat_view`)."""
    layout = getattr(self, _LAYOUT, None)
    if layout is None:
        return
    for i, tensors in list(self.averaged_gradients.items()):
        if tensors is None or getattr(tensors, "flat_partition", None) is not None:
            continue
        flat = _flat_view(tensors, layout, i)
        if flat is not None:
            self.averaged_gradients[i] = _Preflattened(tensors, flat)
    layout.storages.clear()


def _own_storage(self, state_dict, *args, **kwargs) -> None:
    """After ZeRO-1/2's ``state_dict``: the saved master partitions are views, now of the whole flat bf16
    group; ``torch.save`` writes a view's whole storage, so each rank's file would hold every rank's
    parameters. Give each its own storage, as DeepSpeed's copy had."""
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS

    if not _shares(self):
        return
    saved = state_dict.get(SINGLE_PARTITION_OF_FP32_GROUPS)
    if saved is not None:
        state_dict[SINGLE_PARTITION_OF_FP32_GROUPS] = [
            t.clone() if torch.is_tensor(t) and t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
            for t in saved]


def _shares(wrapper) -> bool:
    groups = getattr(wrapper, "parallel_partitioned_bit16_groups", None) or []
    masters = getattr(wrapper, "single_partition_of_fp32_groups", None) or []
    return any(m.untyped_storage().data_ptr() == g[0].untyped_storage().data_ptr() for m, g in zip(masters, groups)
               if len(g))


def _share_hook(engine, wrapper, *args, **kwargs) -> None:
    if share_masters(wrapper):
        order_gradients(wrapper)
