"""Which parameters are embeddings, recognised where a module can be seen, and the one log line that says
which of them keep 32-bit state.

An embedding row gets a gradient only at the steps whose batch holds its token, and that gradient is
small beside the rows of frequent tokens in its block: 8-bit state serves such rows badly. On a byte-level
GPT-2 (width 128, constant lr 4e-3) the 8-bit state of the token and position embeddings alone held
some seeds on a loss plateau that 32-bit state leaves (``studies/results/convergence/embeddings_*.json``).
So every group keeps its embeddings' state in 32 bits by default (the group option ``embeddings_32bit``),
also when the optimizer is given ``model.parameters()``, which carries no module.

An optimizer sees tensors only, so the modules mark their parameters (attribute ``ds_q8_embedding``,
whose value names the parameter):

* ``import ds_q8`` marks the parameters of the ``nn.Embedding`` and ``nn.EmbeddingBag`` modules (their
  subclasses too) alive at that moment, and installs torch's global parameter-registration hook, which
  marks those that such a module registers from then on, however the model is built or loaded
  (``from_pretrained``, a resized vocabulary). A weight tied to another module (GPT-2's ``lm_head``) is
  the same tensor, so it is marked as well;
* ``deepspeed.initialize`` marks the embeddings of the model it is given, by their names, before it
  builds the optimizer (``integration.patches``).

Not recognised: the parameters of a ``copy.deepcopy`` made after ``import ds_q8`` (torch copies a
parameter without its attributes and registers nothing), and a table used through ``F.embedding``
without an embedding module. ``ds_q8.param_groups(model)`` finds embeddings by walking the model.
"""
from __future__ import annotations

import logging
from typing import Iterable, List, Optional

import torch
from torch import nn

from .optim.tensor_states import EMBEDDING_ATTR, OPTIM_BITS_ATTR, keeps_embeddings_32bit

log = logging.getLogger("ds_q8")

_hook = []  # the handle of the registration hook, once installed


#: the modules whose own parameters are embeddings (their subclasses too: StableEmbedding, a model's own)
EMBEDDING_MODULES = (nn.Embedding, nn.EmbeddingBag)


def is_embedding_module(module: nn.Module) -> bool:
    return isinstance(module, EMBEDDING_MODULES)


def _on_register(module: nn.Module, name: str, param: Optional[torch.Tensor]):
    # torch calls this for every parameter any module registers: keep it cheap, and never fail
    if param is not None and is_embedding_module(module) and getattr(param, EMBEDDING_ATTR, None) is None:
        try:
            setattr(param, EMBEDDING_ATTR, f"{type(module).__name__}.{name}")
        except (AttributeError, TypeError):  # a tensor type that takes no attributes: left unmarked
            pass
    return None


def install_hook() -> None:
    """Mark the parameters of every embedding module alive now, and of every one built from now on, as it
    registers them (once per process; ``import ds_q8`` calls it)."""
    if _hook:
        return
    _hook.append(nn.modules.module.register_module_parameter_registration_hook(_on_register))
    # a model built before the import: one pass over the live objects finds its embedding modules (about
    # 0.1 s with a GPT-2 and transformers loaded; the type test reads no attribute of a foreign object)
    import gc

    for obj in gc.get_objects():
        if issubclass(type(obj), EMBEDDING_MODULES):
            for name, p in obj.named_parameters(recurse=False):
                _on_register(obj, name, p)


def mark_embeddings(model: nn.Module) -> List[str]:
    """Mark the parameters of ``model``'s embedding modules with their names; returns the names."""
    names = []
    for prefix, module in model.named_modules():
        if not is_embedding_module(module):
            continue
        for name, p in module.named_parameters(prefix=prefix, recurse=False):
            setattr(p, EMBEDDING_ATTR, name)
            names.append(name)
    return names


def kept_at_32bit(groups: Iterable[dict]) -> List[torch.Tensor]:
    """The marked embedding parameters of ``groups`` that keep 32-bit state because of ``embeddings_32bit``
    alone: without it their group's optim_bits and min_8bit_size would give them 4 or 8 bits."""
    out, seen = [], set()
    for group in groups:
        if not keeps_embeddings_32bit(group) or group.get("optim_bits") not in (4, 8):
            continue
        for p in group["params"]:
            if id(p) in seen or getattr(p, EMBEDDING_ATTR, None) is None or getattr(p, OPTIM_BITS_ATTR, None) == 32:
                continue
            seen.add(id(p))
            if getattr(p, "ds_numel", p.numel()) >= group["min_8bit_size"]:
                out.append(p)
    return out


_said = set()  # the lines already logged in this process


def note_kept(owner: str, params: List[torch.Tensor], num_states: int) -> Optional[str]:
    """Log once per process (on rank 0 under torch.distributed) which embedding parameters ``owner`` keeps
    at 32-bit state, why, and how to keep them in 8 bits; returns the line (None: nothing to say)."""
    if not params:
        return None
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    named = ", ".join(f"{getattr(p, EMBEDDING_ATTR)} {list(s)}" for p, s in zip(params, shapes))
    line = (f"ds_q8: {owner} keeps 32-bit state for {len(params)} embedding parameter(s) ({named}; {numel:,} "
            f"elements, {numel * 4 * num_states / 2 ** 20:.1f} MiB of state): 8-bit state for rarely seen rows held "
            "a GPT-2 on a loss plateau. Pass embeddings_32bit=False (an optimizer argument or a DeepSpeed "
            "\"params\" key) to keep them at the group's optim_bits; docs/usage.md#embeddings")
    if line in _said:
        return line
    _said.add(line)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_rank() != 0):
        log.warning(line)
    return line


__all__ = ["EMBEDDING_ATTR", "EMBEDDING_MODULES", "is_embedding_module", "install_hook", "mark_embeddings", "kept_at_32bit", "note_kept"]
