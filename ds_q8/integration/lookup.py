"""What every DeepSpeed hook of ds_q8 looks up the same way: the optimizer classes by JSON name, the
ds_q8 optimizer inside an engine, and the folder a ``load_checkpoint`` call reads.

This module imports nothing of ds_q8 but ``ds_q8.optim`` (the package, not its modules, which are being
rewritten), so that the registry, the hooks and the checkpoint tools can all use it without importing
each other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional


def optimizer_classes() -> Dict[str, type]:
    """DeepSpeed JSON ``"type"`` name -> class, for every optimizer ``ds_q8.optim`` exports."""
    from .. import optim
    from ..optim import Optimizer8bitBlock

    out = {}
    for name in optim.__all__:
        cls = getattr(optim, name)
        if isinstance(cls, type) and issubclass(cls, Optimizer8bitBlock) and cls is not Optimizer8bitBlock:
            out[name] = cls
    return out


def optimizer_class(name: str) -> type:
    """The class a checkpoint's marker names; ValueError for a name ``ds_q8.optim`` does not export."""
    classes = optimizer_classes()
    if name not in classes:
        raise ValueError(f"checkpoint written by unknown optimizer {name!r}; known: {sorted(classes)}")
    return classes[name]


def ds_q8_optimizer(engine, depth: int = 4):
    """The ds_q8 optimizer an engine steps, found through at most ``depth`` layers of ``.optimizer``
    (the engine's own, then DeepSpeed's wrappers); None for an engine without one."""
    from ..optim import Optimizer8bitBlock

    opt = getattr(engine, "optimizer", None)
    for _ in range(depth):
        if isinstance(opt, Optimizer8bitBlock):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def checkpoint_tag(load_dir, tag=None, universal: bool = False) -> Optional[str]:
    """The tag ``engine.load_checkpoint(load_dir, tag)`` loads: ``tag``, or for None the one DeepSpeed
    reads from ``<load_dir>/latest`` (``latest_universal`` when the engine loads universal checkpoints,
    as DeepSpeed does); None where that file does not exist."""
    if tag is not None:
        return str(tag)
    latest = Path(load_dir) / ("latest_universal" if universal else "latest")
    return latest.read_text().strip() if latest.is_file() else None


def checkpoint_folder(load_dir, tag=None, universal: bool = False) -> Optional[Path]:
    """The tag folder that call loads, or None where there is none (no ``latest`` file, no folder)."""
    tag = checkpoint_tag(load_dir, tag, universal)
    if tag is None:
        return None
    folder = Path(load_dir) / tag
    return folder if folder.is_dir() else None
