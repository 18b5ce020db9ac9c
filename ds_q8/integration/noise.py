"""The one place where warnings that dependencies print, and ds_q8 cannot change, are filtered.

Called by ds_q8's programs (``launch/train_gpt.py``) and by the test suite (``conftest.py``),
never on ``import ds_q8``: a library does not silence other libraries for its users.

* DeepSpeed's warm-up schedulers compute their first rate while they are built, and log
  ``Attempting to get learning rate from scheduler before it has started`` doing so, once per run.
* DeepSpeed's ZeRO calls ``torch.distributed.reduce_scatter_tensor`` and ``all_gather_into_tensor``,
  which this torch deprecates with a ``FutureWarning`` on every call site (it lands inside the
  progress bar at 2 ranks).
"""
from __future__ import annotations

import logging
import warnings

_DEEPSPEED_LOG_NOISE = ("Attempting to get learning rate from scheduler before it has started",)
_TORCH_DEPRECATIONS = (r".*reduce_scatter_tensor.* is deprecated", r".*all_gather_into_tensor.* is deprecated")


class _DropMessages(logging.Filter):
    def __init__(self, messages):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(m in text for m in self.messages)


def quiet() -> None:
    """Filter the dependency warnings listed in this module's docstring (idempotent)."""
    for pattern in _TORCH_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
    logger = logging.getLogger("DeepSpeed")  # DeepSpeed's logger; filters stay when it configures it
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages(_DEEPSPEED_LOG_NOISE))
