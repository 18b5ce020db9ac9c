"""Make ds_q8 optimizers selectable by name from a DeepSpeed JSON config.

DeepSpeed resolves an optimizer ``"type"`` it does not know as an attribute of ``torch.optim``,
and ZeRO accepts only optimizer classes listed in ``ZERO_SUPPORTED_OPTIMIZERS``. Registering
therefore means both: the class on ``torch.optim`` and the class in that list. It also installs
the checks that refuse ZeRO settings which would corrupt 8-bit state (see
``integration.engine_checks``) and damaged checkpoint files (``integration.checkpoint_files``), and
every other DeepSpeed patch: ``integration.patches`` lists them all. Everything happens on
``import ds_q8``, on every rank.
"""
from __future__ import annotations

from .integration.lookup import optimizer_classes

#: DeepSpeed JSON ``"type"`` name -> optimizer class: every optimizer ``ds_q8.optim`` exports
OPTIMIZERS = optimizer_classes()


def register_with_deepspeed() -> bool:
    """Register every ds_q8 optimizer and install every DeepSpeed patch (once however often called);
    returns False when DeepSpeed is not installed (``torch.optim`` has the classes all the same)."""
    from .integration import patches

    return patches.install()
