"""Run a check before a ``DeepSpeedEngine`` method, installed once however often ds_q8 is imported."""
from __future__ import annotations

from typing import Callable

_MARK = "_ds_q8_hooked"


def run_before(method: str, check: Callable) -> bool:
    """Make ``DeepSpeedEngine.<method>(self, *a, **kw)`` call ``check(self, *a, **kw)`` first.

    Returns False when DeepSpeed is not installed.
    """
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return False
    original = getattr(DeepSpeedEngine, method)
    if getattr(original, _MARK, False):
        return True

    def hooked(self, *args, **kwargs):
        check(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(hooked, _MARK, True)
    hooked.__wrapped__ = original
    hooked.__name__ = method
    setattr(DeepSpeedEngine, method, hooked)
    return True
