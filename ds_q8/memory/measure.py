"""Model states (parameters, gradients, masters, master gradients, optimizer state) counted on a live
DeepSpeed engine, to check the ladder that ``python -m ds_q8.memory --ladder`` predicts
(``predict.predict_model_states``; ``studies/xl_memory.py``, ``tests/test_memory_ladder.py``):
:func:`measure_model_states` reads the optimizer's own tensors, :func:`watch_model_states` counts every
storage reachable from the engine, once, after backward and while the optimizer steps.
:func:`measured_state_bytes` counts the optimizer state alone (``predict_state.estimate_state_bytes`` predicts it).
"""
from __future__ import annotations

from typing import Dict

import torch

from ..optim.base import Optimizer8bitBlock
from ..optim.state_keys import has_storage

def _base_optimizer(obj):
    """Follow ``.optimizer`` from an engine or ZeRO wrapper down to the torch optimizer."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer) and obj.state:
            return obj
        inner = getattr(obj, "optimizer", None)
        if inner is None:
            break
        obj = inner
    if isinstance(obj, torch.optim.Optimizer):
        return obj
    raise TypeError(f"cannot find a torch optimizer inside {type(obj).__name__}")


def measured_state_bytes(obj) -> Dict[str, int]:
    """Bytes of optimizer-state tensors this rank holds, from a DeepSpeed engine or an optimizer.

    Returns ``{"total": ..., "codes": ..., "absmax": ..., "fp32": ...}``; the step counter is not
    counted.
    """
    opt = _base_optimizer(obj)
    out = {"total": 0, "codes": 0, "absmax": 0, "fp32": 0}
    if isinstance(opt, Optimizer8bitBlock):
        for p, st in opt.state.items():
            if has_storage(st):
                for kind, n in opt.quantized_state(p, create=False).nbytes().items():
                    out[kind] += n
                    out["total"] += n
        return out
    for st in opt.state.values():  # another optimizer (a 32-bit baseline): every state tensor
        for key, v in st.items():
            if not torch.is_tensor(v) or key == "step":
                continue
            nbytes = v.numel() * v.element_size()
            out["total"] += nbytes
            if v.dtype == torch.uint8:
                out["codes"] += nbytes
            elif key.startswith("absmax"):
                out["absmax"] += nbytes
            else:
                out["fp32"] += nbytes
    return out


def measure_model_states(engine, run_step) -> Dict[str, int]:
    """Bytes of a live ZeRO-2 engine's model states, part by part (see :func:`predict_model_states`).

    ``run_step()`` must run one training step (forward, backward, ``engine.step()``): the gradients
    live from the backward pass to the optimizer's step, so that step is watched for them.
    """
    wrapper = engine.optimizer
    base = _base_optimizer(engine)
    seen = {"master_grads": 0, "grads": 0}
    grad_storages = set()
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731

    def watched_base(*args, **kwargs):  # the optimizer's step: the gradient in the masters' dtype, where
        seen["master_grads"] = max(seen["master_grads"], sum(  # it is not a view of the reduced gradients
            nbytes(p.grad) for g in base.param_groups for p in g["params"]
            if p.grad is not None and ptr(p.grad) not in grad_storages))
        return base_step(*args, **kwargs)

    def watched_wrapper(*args, **kwargs):  # ZeRO's step, entered with the reduced gradient partition
        lp = getattr(wrapper, "grads_in_partition", None)  # one buffer (contiguous_gradients) ...
        held = [lp] if lp is not None else [t for ts in (getattr(wrapper, "averaged_gradients", None) or {}).values()
                                            if ts is not None for t in ts if torch.is_tensor(t)]  # ... or one per param
        seen["grads"] = max(seen["grads"], sum(nbytes(t) for t in held))
        grad_storages.update(ptr(t) for t in held)
        return wrapper_step(*args, **kwargs)

    base_step, wrapper_step = base.step, wrapper.step
    with _watching({base: watched_base, wrapper: watched_wrapper}):
        run_step()
    params = sum(nbytes(p) for p in engine.module.parameters())
    param_storages = {ptr(p) for p in engine.module.parameters()}
    masters = sum(nbytes(t) for t in getattr(wrapper, "single_partition_of_fp32_groups", [])
                  if ptr(t) not in param_storages)  # a master that is a view of the parameters holds nothing more
    states = sum(nbytes(v) for st in base.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step")
    return dict(params=params, grads=seen["grads"], masters=masters, master_grads=seen["master_grads"],
                optimizer_states=states)


def reachable_storages(*roots, keep=None) -> Dict[int, int]:
    """Every tensor storage reachable from ``roots`` (an engine, an optimizer, a module), each once:
    ``{data pointer: bytes}``. The walk follows the attributes of torch, DeepSpeed and ds_q8 objects,
    the items of lists, tuples, sets and dicts, and each tensor's ``.grad`` and attributes, so it finds
    the master partitions, gradient buffers and states where DeepSpeed and ds_q8 keep them. ``keep``
    (a tensor -> bool), when given, counts only the storages of the tensors it accepts."""
    found: Dict[int, int] = {}
    seen, todo = set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if obj.device.type != "meta" and obj.numel() and (keep is None or keep(obj)):
                storage = obj.untyped_storage()
                if storage.data_ptr():
                    found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())
            if obj.is_leaf:  # only leaves keep a .grad (asking a non-leaf warns)
                todo.append(obj.grad)
            todo.extend(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "ds_q8") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return found


def watch_model_states(engine, run_step) -> Dict[str, int]:
    """Bytes of every storage reachable from a live engine (:func:`reachable_storages`): right after
    backward (when ZeRO's step is entered, before it touches the gradients) and while the optimizer
    steps, the larger of each. ``run_step()`` runs one step (forward, backward, ``engine.step()``)."""
    wrapper = engine.optimizer
    base = _base_optimizer(engine)
    seen = {"after_backward": 0, "during_step": 0}
    base_step, wrapper_step = base.step, wrapper.step

    def count(key):
        seen[key] = max(seen[key], sum(reachable_storages(engine).values()))

    def watched_base(*args, **kwargs):
        count("during_step")
        return base_step(*args, **kwargs)

    def watched_wrapper(*args, **kwargs):
        count("after_backward")
        return wrapper_step(*args, **kwargs)

    with _watching({base: watched_base, wrapper: watched_wrapper}):
        run_step()
    return seen


class _watching:
    """Set each object's ``step`` for a while, then put back what its instance had (DeepSpeed's
    wrapper may carry a per-engine ``step`` of its own, see ``integration.grad_norm``)."""

    def __init__(self, steps):
        self.steps = steps
        self.saved = {id(o): (o, vars(o).get("step")) for o in steps}

    def __enter__(self):
        for obj, step in self.steps.items():
            obj.step = step

    def __exit__(self, *exc):
        for obj, before in self.saved.values():
            if before is None:
                vars(obj).pop("step", None)
            else:
                obj.step = before
