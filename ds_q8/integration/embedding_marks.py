"""Mark the embeddings of the model ``deepspeed.initialize`` is given, by name, before DeepSpeed builds the
optimizer.

``import ds_q8`` marks embedding parameters as their modules register them (``ds_q8.embeddings``); a model
built before that import carries no marks. ``deepspeed.initialize`` holds the model and calls
``set_optimizer_flags`` with it before the engine builds the optimizer from the JSON ``"type"``, so the
marks are set there, with each parameter's name for the log line, and every group's
``embeddings_32bit`` then finds them in plain ``model.parameters()``. The marks are per parameter: ZeRO's
partitions keep the choice per original parameter (``zero_layout``), at every stage and world size.
"""
from __future__ import annotations

from torch import nn

from ..embeddings import mark_embeddings


def _mark_embeddings(original):
    def set_optimizer_flags(config_class, model):
        original(config_class, model)
        if isinstance(model, nn.Module):
            mark_embeddings(model)

    return set_optimizer_flags
