"""Parameter groups for ds_q8 optimizers: weight decay where it belongs, 32-bit state for embeddings.

The 8/32-bit choice is made per original parameter, under ZeRO too (each partition's layout knows
which parameter slices it holds), so a ``ds_q8_optim_bits = 32`` mark on one parameter is kept;
the groups make the choice visible in the config and in checkpoints.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from torch import nn

from .embeddings import is_embedding_module
from .optim.base import OPTIM_BITS_ATTR


def param_groups(model: nn.Module, weight_decay: float = 0.0, embeddings_32bit: bool = True,
                 no_decay_names: Iterable[str] = ("bias", "norm", "ln_", "layernorm", "layer_norm"),
                 lr: Optional[float] = None) -> List[dict]:
    """Split ``model``'s trainable parameters into up to four groups.

    * weights with decay, 8-bit state;
    * biases and normalisation parameters without decay, 8-bit state;
    * embeddings (``nn.Embedding``, ``nn.EmbeddingBag``, ``StableEmbedding``) and anything marked
      ``ds_q8_optim_bits = 32``, with ``optim_bits=32``, split again by decay.

    With ``embeddings_32bit=False`` the embeddings join the 8-bit groups, which then say
    ``embeddings_32bit: False`` (the optimizers' default keeps embeddings at 32 bits in any group).
    Tied weights appear once. Empty groups are dropped. ``lr``, when given, is set on each group.
    """
    seen = set()
    buckets = {(True, 8): [], (False, 8): [], (True, 32): [], (False, 32): []}
    embedding_params = set()
    if embeddings_32bit:
        for module in model.modules():
            if is_embedding_module(module):
                for p in module.parameters(recurse=True):
                    embedding_params.add(id(p))
    lowered = tuple(n.lower() for n in no_decay_names)
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        bits = 32 if (id(p) in embedding_params or getattr(p, OPTIM_BITS_ATTR, None) == 32) else 8
        decay = p.ndim >= 2 and not any(k in name.lower() for k in lowered)
        buckets[(decay, bits)].append(p)
    groups = []
    for (decay, bits), params in buckets.items():
        if not params:
            continue
        g = {"params": params, "weight_decay": weight_decay if decay else 0.0}
        if bits == 32:
            g["optim_bits"] = 32
        elif not embeddings_32bit:
            g["embeddings_32bit"] = False
        if lr is not None:
            g["lr"] = lr
        groups.append(g)
    return groups
