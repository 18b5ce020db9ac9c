"""Which checkpoints in a save_dir are complete, and cleaning a save_dir for a fresh run.

DeepSpeed writes its ``latest`` file on rank 0 before the other ranks are known to have finished
writing their optimizer shards. A run killed at that moment leaves a ``latest`` that points at a
partial checkpoint, so resuming trusts a marker written only after every rank returned from
``save_checkpoint`` instead.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional, Tuple

MARKER = "complete.json"
_TAG = re.compile(r"^step(\d+)$")


def tag_for(step: int) -> str:
    return f"step{step}"


def mark_complete(save_dir: str, step: int, info: dict) -> None:
    (Path(save_dir) / tag_for(step) / MARKER).write_text(json.dumps(dict(info, step=step)) + "\n")


def latest_complete(save_dir: str) -> Optional[Tuple[str, int]]:
    """(tag, step) of the newest checkpoint every rank finished writing, or None."""
    best = None
    root = Path(save_dir)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        m = _TAG.match(d.name)
        if m and (d / MARKER).is_file():
            step = int(m.group(1))
            if best is None or step > best[1]:
                best = (d.name, step)
    return best


def has_checkpoints(save_dir: str) -> bool:
    root = Path(save_dir)
    return root.is_dir() and any(_TAG.match(d.name) for d in root.iterdir())


def clear_run(save_dir: str, extra=("latest", "metrics.jsonl", "summary.json", "tensorboard")) -> None:
    """Remove what an earlier run of the trainer wrote into save_dir (and nothing else)."""
    root = Path(save_dir)
    if not root.is_dir():
        return
    for d in root.iterdir():
        if (_TAG.match(d.name) and d.is_dir()) or d.name in extra:
            if d.is_dir():
                shutil.rmtree(d)
            else:
                d.unlink()
