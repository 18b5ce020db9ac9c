"""Make ds_q8 optimizers selectable by name from a DeepSpeed JSON config.

DeepSpeed resolves an optimizer ``"type"`` it does not know as an attribute of ``torch.optim``,
and ZeRO accepts only optimizer classes listed in ``ZERO_SUPPORTED_OPTIMIZERS``. Registering
therefore means both: the class on ``torch.optim`` and the class in that list. It also installs
the checks that refuse ZeRO settings which would corrupt 8-bit state (see
``integration.engine_checks``) and damaged checkpoint files (``integration.checkpoint_files``). Everything happens on ``import ds_q8``, on every rank.
"""
from __future__ import annotations

import torch

from .integration.lookup import optimizer_classes

#: DeepSpeed JSON ``"type"`` name -> optimizer class: every optimizer ``ds_q8.optim`` exports
OPTIMIZERS = optimizer_classes()


def register_with_deepspeed() -> bool:
    """Register every ds_q8 optimizer; returns False when DeepSpeed is not installed."""
    for name, cls in OPTIMIZERS.items():
        setattr(torch.optim, name, cls)
    try:
        from deepspeed.runtime.zero import utils as zero_utils
    except ImportError:
        return False
    for cls in OPTIMIZERS.values():
        if cls not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
            zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(cls)
    from .integration import checkpoint_files, engine_checks, grad_norm, universal, zero_layout

    engine_checks.install()
    engine_checks.install_master_weights()
    checkpoint_files.install()
    zero_layout.install()
    universal.install()
    grad_norm.install()
    return True
