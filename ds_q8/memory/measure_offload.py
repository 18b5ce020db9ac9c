"""Host memory of a live ZeRO-Offload engine (``"offload_optimizer": {"device": "cpu"}``), counted once per
storage, to check what ``ds_q8.memory.predict_offload`` predicts (``python -m ds_q8.memory --offload``).

:func:`measure_host_states` names each host buffer by the part it plays (the parts of
``predict_offload.HOST_PARTS``) and also counts every host storage reachable from the engine
(:func:`host_storages`), so a buffer that no part names shows up as a difference between the two.
Scalars (step counters, norms, flags: storages of one element) are left out of both.

On an accelerator, host storages are those in CPU memory. Without one (DeepSpeed's CPU accelerator,
where "device" buffers are host memory too) they are every storage the engine holds minus those
DeepSpeed keeps on the device side: the parameters and their gradients, ZeRO's flat 16-bit groups,
its reduction buckets and its device-side gradient buffers (:data:`DEVICE_BUFFERS`).
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch

from .measure import _base_optimizer, reachable_storages

#: the ZeRO wrapper's attributes that live on the accelerator (ZeRO-1/2 and ZeRO-3)
DEVICE_BUFFERS = ("bit16_groups_flat", "parallel_partitioned_bit16_groups", "temp_grad_buffer_for_gpu_offload",
                  "grads_in_partition", "averaged_gradients", "ipg_buckets", "lp_param_buffer",
                  "fp16_partitioned_groups_flat")


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() > 1


def _device_pointers(engine) -> set:
    """Storages DeepSpeed keeps on the device side, for an engine on the CPU accelerator."""
    ptrs = set()
    for p in engine.module.parameters():
        for t in (p, p.grad, getattr(p, "ds_tensor", None)):
            if torch.is_tensor(t) and t.numel():
                ptrs.add(t.untyped_storage().data_ptr())
    wrapper = engine.optimizer
    ptrs.update(reachable_storages(*[getattr(wrapper, name, None) for name in DEVICE_BUFFERS]))
    return ptrs


def host_storages(engine) -> Dict[int, int]:
    """``{data pointer: bytes}`` of every host storage reachable from ``engine``, each once."""
    found = reachable_storages(engine, keep=_is_host)
    if torch.device(engine.device).type == "cpu":
        for ptr in _device_pointers(engine):
            found.pop(ptr, None)
    return found


def _stage3(wrapper) -> bool:
    return hasattr(wrapper, "fp32_partitioned_groups_flat")


def _roles(engine) -> Dict[str, Iterable]:
    """Each host part and the tensors that play it, in the order in which a shared storage is attributed."""
    wrapper, base = engine.optimizer, _base_optimizer(engine)
    masters = list(wrapper.fp32_partitioned_groups_flat if _stage3(wrapper)
                   else wrapper.single_partition_of_fp32_groups)
    states = [v for st in base.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    if _stage3(wrapper):
        accumulation = [getattr(wrapper, "grad_partitions_flat_buffer", None)]
    else:
        accumulation = list((getattr(wrapper, "accumulated_grads_in_cpu", None) or {}).values())
    return {
        "masters": masters,
        "master_grads": [m.grad for m in masters],
        "optimizer_states": states,
        "bf16_image": list(getattr(wrapper, "param_buffer_of_bit16_for_cpu_offload_groups", None) or []),
        "grad_accumulation": accumulation,
        "unused": [getattr(wrapper, "temp_grad_buffer_for_cpu_offload", None)],
        "state_index": [t for layout in getattr(getattr(base, "tensors", None), "layouts", {}).values()
                        for key, v in vars(layout).items() if isinstance(key, tuple) and key[0] == "_shared_index"
                        for t in v],
    }


def measure_host_states(engine) -> Dict[str, int]:
    """Host bytes of a live offload engine (ZeRO-1/2 or 3), part by part, each storage once:

    * ``masters``: the master partitions the CPU optimizer steps (``single_partition_of_fp32_groups``,
      ZeRO-3's ``fp32_partitioned_groups_flat``), fp32 or bf16;
    * ``master_grads``: their gradients, where DeepSpeed copies the reduced gradients;
    * ``optimizer_states``: the optimizer's state tensors (not the step counter);
    * ``bf16_image``: ZeRO-1/2's bf16 copy of the masters that is sent to the device;
    * ``grad_accumulation``: ZeRO-1/2's per-parameter gradient buffers (fp32 masters with gradient
      accumulation) and ZeRO-3's flat gradient partition;
    * ``unused``: ZeRO-1/2's ``temp_grad_buffer_for_cpu_offload``;
    * ``state_index``: a ds_q8 optimizer's index of the blocks that partition edges cut (int64, made on
      the first step; see ``StateLayout.shared_index``);
    * ``total``: every host storage reachable from the engine (:func:`host_storages`): the sum of the
      parts when they name every one.
    """
    host = host_storages(engine)
    parts, counted = {}, set()
    for part, tensors in _roles(engine).items():
        parts[part] = 0
        for t in tensors:
            if not torch.is_tensor(t) or not _is_host(t):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in host and ptr not in counted:
                counted.add(ptr)
                parts[part] += host[ptr]
    parts["total"] = sum(host.values())
    return parts
