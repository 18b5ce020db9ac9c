"""Make ds_q8 optimizers selectable by name from a DeepSpeed JSON config.

DeepSpeed resolves an optimizer ``"type"`` it does not know as an attribute of ``torch.optim``,
and ZeRO accepts only optimizer classes listed in ``ZERO_SUPPORTED_OPTIMIZERS``. Registering
therefore means both: the class on ``torch.optim`` and the class in that list. It also installs
the checks that refuse ZeRO settings which would corrupt 8-bit state (see
``integration.engine_checks``) and damaged checkpoint files (``integration.checkpoint_files``), and
every other DeepSpeed patch: ``integration.patches`` lists them all.

``import ds_q8`` does only what needs no DeepSpeed (:func:`connect`): the classes on ``torch.optim``,
and a wrapper of ``deepspeed.initialize`` once DeepSpeed is imported. The rest is installed when
``deepspeed.initialize`` meets a ds_q8 optimizer (``integration.entry``), on every rank, or at once by
:func:`register_with_deepspeed`.
"""
from __future__ import annotations

import warnings

from .integration.lookup import optimizer_classes

#: DeepSpeed JSON ``"type"`` name -> optimizer class: every optimizer ``ds_q8.optim`` exports
OPTIMIZERS = optimizer_classes()


def register_with_deepspeed() -> bool:
    """Register every ds_q8 optimizer and install every DeepSpeed patch now (once however often called);
    returns False when DeepSpeed is not installed (``torch.optim`` has the classes all the same).
    Raises ``ds_q8.DeepSpeedContractError``, naming the supported range and every missing place, when
    this DeepSpeed lacks a place ds_q8 patches."""
    from .integration import patches

    return patches.install()


def _on_deepspeed(module) -> None:
    from .integration import patches

    try:
        patches.install(patches.entry_rows())
    except Exception as e:  # never break DeepSpeed's import; the table itself reports what is missing
        warnings.warn(f"ds_q8 cannot wrap deepspeed.initialize ({e}); call ds_q8.register_with_deepspeed() "
                      f"before deepspeed.initialize to use ds_q8 optimizers with this DeepSpeed", UserWarning)


def connect() -> None:
    """What ``import ds_q8`` does: the optimizer classes on ``torch.optim``, and ``deepspeed.initialize``
    wrapped now if DeepSpeed is imported, else right after it is. Imports no DeepSpeed."""
    from .integration import entry, patches

    patches.install(patches.import_rows())
    entry.after_import("deepspeed", _on_deepspeed)
