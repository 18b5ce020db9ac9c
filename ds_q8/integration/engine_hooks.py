"""Run ds_q8 code before or after a ``DeepSpeedEngine`` method, each hook installed once however
often ds_q8 is imported or registered."""
from __future__ import annotations

from typing import Callable

_INSTALLED = "_ds_q8_hooks"  # attribute of a wrapper: the hook names it and the wrappers below carry


def _install(method: str, name: str, make: Callable) -> bool:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:
        return False
    original = getattr(DeepSpeedEngine, method)
    names = getattr(original, _INSTALLED, frozenset())
    if name in names:
        return True
    hooked = make(original)
    setattr(hooked, _INSTALLED, names | {name})
    hooked.__wrapped__ = original
    hooked.__name__ = method
    setattr(DeepSpeedEngine, method, hooked)
    return True


def run_before(method: str, check: Callable, name: str = None) -> bool:
    """Make ``DeepSpeedEngine.<method>(self, *a, **kw)`` call ``check(self, *a, **kw)`` first.

    Returns False when DeepSpeed is not installed.
    """
    def make(original):
        def hooked(self, *args, **kwargs):
            check(self, *args, **kwargs)
            return original(self, *args, **kwargs)
        return hooked

    return _install(method, name or f"before:{check.__module__}.{check.__qualname__}", make)


def run_after(method: str, callback: Callable, name: str = None) -> bool:
    """Make ``DeepSpeedEngine.<method>(self, *a, **kw)`` call ``callback(self, result, *a, **kw)`` on
    its result before returning it. Returns False when DeepSpeed is not installed."""
    def make(original):
        def hooked(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            callback(self, result, *args, **kwargs)
            return result
        return hooked

    return _install(method, name or f"after:{callback.__module__}.{callback.__qualname__}", make)
