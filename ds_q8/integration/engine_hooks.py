"""How a ds_q8 patch attaches to an attribute of DeepSpeed (a ``DeepSpeedEngine`` method, a module's
function): run ds_q8 code before or after the original, or replace it by a function built from it.

Each patch has a name and is applied once per attribute however often ds_q8 is imported or installs
its patches: every wrapper carries the names of the patches under it (``_ds_q8_hooks``), so a second
install finds its name there and leaves the attribute as it is. What is patched where is listed in
``integration.patches``.
"""
from __future__ import annotations

from typing import Callable, FrozenSet

_INSTALLED = "_ds_q8_hooks"  # attribute of a wrapper: the patch names it and the wrappers below carry


def installed(attribute) -> FrozenSet[str]:
    """Names of the ds_q8 patches applied to this attribute's current value."""
    return getattr(attribute, _INSTALLED, frozenset())


def replace(owner, attr: str, make: Callable, name: str) -> None:
    """Set ``owner.<attr>`` to ``make(original)``, unless the patch ``name`` is already applied there."""
    original = getattr(owner, attr)
    names = installed(original)
    if name in names:
        return
    hooked = make(original)
    setattr(hooked, _INSTALLED, names | {name})
    hooked.__wrapped__ = original
    hooked.__name__ = attr
    setattr(owner, attr, hooked)


def run_before(owner, attr: str, check: Callable, name: str) -> None:
    """Make ``owner.<attr>(self, *a, **kw)`` call ``check(self, *a, **kw)`` first."""
    def make(original):
        def hooked(self, *args, **kwargs):
            check(self, *args, **kwargs)
            return original(self, *args, **kwargs)
        return hooked

    replace(owner, attr, make, name)


def run_after(owner, attr: str, callback: Callable, name: str) -> None:
    """Make ``owner.<attr>(self, *a, **kw)`` call ``callback(self, result, *a, **kw)`` on its result
    before returning it."""
    def make(original):
        def hooked(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            callback(self, result, *args, **kwargs)
            return result
        return hooked

    replace(owner, attr, make, name)
