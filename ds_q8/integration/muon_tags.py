"""Keep DeepSpeed's own Muon away from Muon8bitBlock, and tag parameters as DeepSpeed tags them.

DeepSpeed's ZeRO-1/2 (``stage_1_and_2.py``) runs its own fp32 Muon inside ``get_flat_partition``
for any optimizer whose class name contains "muon" and whose parameters carry ``use_muon``: with
``Muon8bitBlock`` and tagged parameters it would orthogonalize the gradient itself, keep a 4-byte
fp32 momentum in the optimizer's state, and hand ds_q8 an already-orthogonalized "gradient" (Muon
applied twice). ds_q8 does the whole step itself, so while those calls run for a ds_q8 optimizer
the tags are hidden from them, and ``_is_muon_group`` answers False.

``deepspeed.initialize`` tags parameters (``set_optimizer_flags``: 2-D and not named embed or
lm_head) only for ``"type": "Muon"``; for a ds_q8 class with ``tag_parameters`` (``Muon8bitBlock``) ds_q8
tags them the same way, so the default tagging under DeepSpeed is DeepSpeed's, names included.
"""
from __future__ import annotations

from ..optim import Optimizer8bitBlock
from .lookup import optimizer_classes

TAG = "use_muon"


def _ours(wrapper) -> bool:
    return isinstance(getattr(wrapper, "optimizer", None), Optimizer8bitBlock)


def _is_muon_group(original):
    def is_muon_group(self, tensor_list):
        if _ours(self):
            return False
        return original(self, tensor_list)

    return is_muon_group


def _without_muon_tags(original):
    def flat_partition(self, tensor_list, *args, **kwargs):
        if not _ours(self):
            return original(self, tensor_list, *args, **kwargs)
        hidden = [(t, t.__dict__.pop(TAG)) for t in tensor_list if TAG in getattr(t, "__dict__", {})]
        try:
            return original(self, tensor_list, *args, **kwargs)
        finally:
            for t, value in hidden:
                setattr(t, TAG, value)

    return flat_partition


def _tag_for_muon8bit(original):
    def set_optimizer_flags(config_class, model):
        original(config_class, model)
        name = str(getattr(config_class, "optimizer_name", "") or "").lower()
        cls = {n.lower(): c for n, c in optimizer_classes().items()}.get(name)
        if model is not None and cls is not None and cls.tag_parameters is not None:
            cls.tag_parameters(model)

    return set_optimizer_flags
