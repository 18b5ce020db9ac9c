"""ZeRO-Offload with a ds_q8 optimizer: DeepSpeed's host buffers that hold nothing new, removed.

With ``"offload_optimizer": {"device": "cpu"}`` the masters, their gradients and the optimizer state
live in host memory. Beside them DeepSpeed 0.19 keeps host buffers that, for a ds_q8 optimizer, repeat
what the host already holds or are never read:

* ZeRO-1/2, ``param_buffer_of_bit16_for_cpu_offload_groups[i]``: the bf16 image of master partition i,
  written after every step and copied from there to the device. With bf16 masters
  (``bf16_master_weights_and_grads``) it is a copy of the masters, bit for bit, so the master partition
  itself takes its place: DeepSpeed's copy into it becomes a copy onto itself and the device copy reads
  the masters (2 bytes a parameter, divided by the ranks). With fp32 masters it is the conversion to
  bf16 that the device copy needs, and stays.
* ZeRO-1/2, ``temp_grad_buffer_for_cpu_offload``: as many elements as the largest parameter, in the
  parameters' dtype, which DeepSpeed allocates and never reads or writes. Released.
* ZeRO-3, ``grad_partitions_flat_buffer``: the rank's gradient partitions, parameter after parameter.
  At each accumulation boundary DeepSpeed copies each one into its sub-group's
  ``fp32_partitioned_groups_flat[i].grad``, a second host buffer of the same elements in the same
  order. Where both have one dtype (bf16 masters with DeepSpeed's default gradient accumulation dtype,
  or fp32 masters with ``"data_types": {"grad_accum_dtype": "fp32"}``) each sub-group's gradient
  becomes its slice of the flat buffer and the copy a copy onto itself. ``reload_states`` gives the
  flat buffer new storage; the slices follow it there.

The optimizer reads and writes the same values, so losses, parameters and checkpoints do not change
(``tests/test_offload_memory.py`` compares both layouts bit for bit). What stays on the host is what
the CPU step needs: the masters, one gradient partition, the 8-bit state.

:data:`ENABLED` False keeps DeepSpeed's buffers (its own layout, for comparisons).
"""
from __future__ import annotations

import itertools

import torch

from .lookup import ds_q8_optimizer

#: False: keep DeepSpeed's host buffers (read when an engine is built)
ENABLED = True

_ALIASED = "_ds_q8_grads_in_flat_buffer"  # ZeRO-3 wrapper: its sub-group gradients are slices of the flat one


def _offloaded_ds_q8(wrapper) -> bool:
    return ENABLED and ds_q8_optimizer(wrapper, depth=1) is not None


def drop_stage12_copies(wrapper) -> int:
    """ZeRO-1/2 with offload: the masters stand in for their bf16 image where they are bf16, and the
    unused gradient buffer goes. Returns the bytes released."""
    if not (_offloaded_ds_q8(wrapper) and getattr(wrapper, "cpu_offload", False)):
        return 0
    released = 0
    images = getattr(wrapper, "param_buffer_of_bit16_for_cpu_offload_groups", [])
    for i, (master, image) in enumerate(zip(wrapper.single_partition_of_fp32_groups, images)):
        if image is master or (master.dtype, master.shape, master.device) != (image.dtype, image.shape, image.device):
            continue
        if not torch.equal(master, image) and image.any():  # zeros until the first step, then a copy
            raise RuntimeError(f"ZeRO group {i}: the bf16 image of the master partition differs from it")
        images[i] = master
        released += image.numel() * image.element_size()
    unused = getattr(wrapper, "temp_grad_buffer_for_cpu_offload", None)
    if torch.is_tensor(unused):
        released += unused.numel() * unused.element_size()
        wrapper.temp_grad_buffer_for_cpu_offload = None
    return released


def _flat_grad_slices(wrapper):
    """``[(sub-group, start, numel)]`` of the sub-groups' gradients inside ``grad_partitions_flat_buffer``,
    or None where they are not laid out back to back in one dtype (then nothing is shared)."""
    flat = getattr(wrapper, "grad_partitions_flat_buffer", None)
    masters = getattr(wrapper, "fp32_partitioned_groups_flat", None)
    if flat is None or not masters or getattr(wrapper, "swap_optimizer", False):
        return None
    if set(getattr(wrapper, "subgroup_to_device", {}).values()) - {"cpu"}:
        return None  # partial offload: some sub-groups step on the device
    slices, at = [], 0
    for i, params in enumerate(wrapper.fp16_groups):
        numel = sum(p.partition_numel() for p in params)
        grad = masters[i].grad
        if grad is None or grad.numel() != numel or masters[i].numel() != numel:
            return None
        if (grad.dtype, grad.device) != (flat.dtype, flat.device):
            return None
        slices.append((i, at, numel))
        at += numel
    expected = sum(p.partition_numel() for p in itertools.chain.from_iterable(wrapper.fp16_groups))
    return slices if at == flat.numel() == expected else None


def share_stage3_grads(wrapper) -> int:
    """ZeRO-3 with offload: each sub-group's gradient becomes its slice of ``grad_partitions_flat_buffer``
    (see the module's text). Returns the bytes released."""
    if not (_offloaded_ds_q8(wrapper) and getattr(wrapper, "offload_optimizer", False)):
        return 0
    slices = _flat_grad_slices(wrapper)
    if slices is None:
        return 0
    flat, released = wrapper.grad_partitions_flat_buffer, 0
    for i, start, numel in slices:
        master = wrapper.fp32_partitioned_groups_flat[i]
        old, view = master.grad, flat.narrow(0, start, numel)
        if old.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            released += old.numel() * old.element_size()
            view.copy_(old)
        master.grad = view
    setattr(wrapper, _ALIASED, True)
    return released


def _after_reload_states(wrapper, *args, **kwargs) -> None:
    """``reload_states`` moved the flat gradient buffer to new storage: point the sub-groups there again."""
    if getattr(wrapper, _ALIASED, False):
        share_stage3_grads(wrapper)


def _drop_hook(engine, wrapper, *args, **kwargs) -> None:
    if wrapper is None:
        return
    drop_stage12_copies(wrapper)
    share_stage3_grads(wrapper)
