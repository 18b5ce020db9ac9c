"""What ds_q8 needs of DeepSpeed, and the one error it raises when a DeepSpeed lacks it.

The patch table (``integration.patches``) names private places of DeepSpeed. A release that renames one
does not break ``import ds_q8``: the table is installed only when DeepSpeed first meets a ds_q8 optimizer
(``integration.entry``), and there every target is looked up before anything is patched. Those that
are missing are reported together in one :class:`DeepSpeedContractError`, with the supported range
(``integration.supported``). A release outside that range whose places all exist is patched, with one
warning.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Optional, Sequence, Tuple

from . import supported


class DeepSpeedContractError(RuntimeError):
    """This DeepSpeed lacks places ds_q8 patches: ``missing`` lists each target with what is missing."""

    def __init__(self, version: Optional[str], missing: Sequence[Tuple[str, str]]):
        self.version = version
        self.missing = list(missing)
        self.supported = supported.RANGE
        lines = "\n".join(f"  - {target}: {reason}" for target, reason in self.missing)
        super().__init__(
            f"ds_q8 supports DeepSpeed {supported.RANGE} (tested: {', '.join(supported.TESTED)}); "
            f"DeepSpeed {version or '(version unknown)'} lacks {len(self.missing)} place(s) that ds_q8 "
            f"patches:\n{lines}\nInstall a supported release: pip install \"{supported.REQUIREMENT}\". "
            f"The plain optimizers (without DeepSpeed) are not affected.")


def deepspeed_version() -> Optional[str]:
    """The imported DeepSpeed's ``__version__`` (None where it has none)."""
    import deepspeed

    return getattr(deepspeed, "__version__", None)


def fail(missing: Iterable[Tuple[str, str]]) -> None:
    """Raise the one error for these ``(target, reason)`` pairs (none: return)."""
    missing = list(missing)
    if missing:
        version = None
        try:
            version = deepspeed_version()
        except ImportError:
            pass
        raise DeepSpeedContractError(version, missing)


_warned = set()


def warn_outside_range(version: Optional[str]) -> bool:
    """One warning per version outside the supported range (every target was found); True if warned."""
    if version is None or supported.supports(version) or version in _warned:
        return False
    _warned.add(version)
    warnings.warn(f"ds_q8 was tested with DeepSpeed {supported.RANGE}, not {version}; every place it patches "
                  f"exists in {version}, so it proceeds, but what those places do was not checked",
                  UserWarning, stacklevel=3)
    return True
