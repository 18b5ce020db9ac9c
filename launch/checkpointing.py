"""Which checkpoints in a save_dir are complete, and cleaning a save_dir for a fresh run.

DeepSpeed writes its ``latest`` file on rank 0 before the other ranks are known to have finished
writing their optimizer shards. A run killed at that moment leaves a ``latest`` that points at a
partial checkpoint, so resuming trusts a marker written only after every rank returned from
``save_checkpoint`` and flushed its files to disk instead.

The marker lists every file of the checkpoint with its size. A power loss can still lose data the
disk acknowledged late, and files can be damaged after the fact; a checkpoint whose files no
longer match its marker is passed over (with a message) for the previous complete one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Tuple

MARKER = "complete.json"
_TAG = re.compile(r"^step(\d+)$")
#: ``python -m ds_q8.checkpoint to-universal SAVE_DIR/stepN SAVE_DIR/stepN_universal`` names its output so
UNIVERSAL_SUFFIX = "_universal"


def tag_for(step: int) -> str:
    return f"step{step}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> dict:
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name != MARKER and not f.name.startswith(MARKER)}


def flush(save_dir: str, step: int) -> None:
    """Force the checkpoint's files and folder entries to disk; every rank calls it for what it wrote.

    ``torch.save`` returns once the data is in the page cache; without this a machine crash after
    the marker was written could leave the marker pointing at files that never reached the disk.
    """
    folder = Path(save_dir) / tag_for(step)
    for f in folder.rglob("*"):
        if f.is_file() and f.name != MARKER:
            _fsync(f)
    for d in [p for p in folder.rglob("*") if p.is_dir()] + [folder, Path(save_dir)]:
        _fsync(d)


def mark_complete(save_dir: str, step: int, info: dict) -> None:
    """Write the marker last and atomically: a crash leaves either no marker or a whole one."""
    folder = Path(save_dir) / tag_for(step)
    tmp = folder / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(dict(info, step=step, files=_files(folder))) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    _fsync(folder)


def check_complete(folder: Path) -> Optional[str]:
    """None when ``folder`` has a marker and every file it lists has the listed size; else why not."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return "no completion marker (a rank never finished writing it)"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"unreadable {MARKER}: {e}"
    files = info.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MARKER} lists no files"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the marker says {size}"
    return None


def latest_complete(save_dir: str, report=None) -> Optional[Tuple[str, int]]:
    """(tag, step) of the newest checkpoint every rank finished writing and that is still whole, or None.

    Newer checkpoint folders that fail the check are reported through ``report`` (default: stderr).
    """
    root = Path(save_dir)
    if not root.is_dir():
        return None
    found = sorted(((int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _TAG.match(d.name))),
                   reverse=True)
    for step, d in found:
        problem = check_complete(d)
        if problem is None:
            return d.name, step
        (report or _warn)(f"skipping checkpoint {d}: {problem}")
    return None


def resume_point(save_dir: str, world: int, report=None) -> Optional[Tuple[str, int, bool]]:
    """(tag to load, step, universal) for resuming ``save_dir`` at ``world`` ranks, or None.

    The newest complete checkpoint is loaded as it is when it was written at this world size. One
    written at another world size is loaded from its universal conversion ``<tag>_universal`` (with
    ``"checkpoint": {"load_universal": true}``); without one, SystemExit names the command that makes it.
    """
    found = latest_complete(save_dir, report)
    if found is None:
        return None
    tag, step = found
    folder = Path(save_dir) / tag
    saved = json.loads((folder / MARKER).read_text()).get("world_size")
    if saved is None or saved == world:
        return tag, step, False
    universal = Path(save_dir) / (tag + UNIVERSAL_SUFFIX)
    if not universal.is_dir():
        raise SystemExit(f"--resume: the last complete checkpoint {folder} was written by {saved} rank(s) and this "
                         f"run has {world}. Convert it once, then resume again:\n"
                         f"  python -m ds_q8.checkpoint to-universal {folder} {universal}")
    return universal.name, step, True


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def has_checkpoints(save_dir: str) -> bool:
    root = Path(save_dir)
    return root.is_dir() and any(_TAG.match(d.name) for d in root.iterdir())


def clear_run(save_dir: str, extra=("latest", "metrics.jsonl", "summary.json", "tensorboard")) -> None:
    """Remove what an earlier run of the trainer wrote into save_dir (and nothing else)."""
    root = Path(save_dir)
    if not root.is_dir():
        return
    for d in root.iterdir():
        name = d.name[:-len(UNIVERSAL_SUFFIX)] if d.name.endswith(UNIVERSAL_SUFFIX) else d.name
        if (_TAG.match(name) and d.is_dir()) or d.name in extra:
            if d.is_dir():
                shutil.rmtree(d)
            else:
                d.unlink()
