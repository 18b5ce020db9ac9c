"""Fault injection for the trainer, driven by the ``DS_Q8_FAULT`` environment variable (tests only:
``faulty_train.py`` hooks it into ``launch/train_gpt.py`` from outside).

Crash-safety and rank-death tests need a process to die at a chosen moment, including inside a
checkpoint write, which an outside ``kill`` can only hit by chance. ``DS_Q8_FAULT`` holds
``ACTION:POINT:STEP[:RANK]``:

* ACTION ``kill``: SIGKILL this process (nothing is flushed or cleaned up, as in a machine or OOM kill);
  ``stop``: SIGSTOP it (the rank stays alive but silent, as a hung rank would).
* POINT ``step``: right after optimizer step STEP; ``mid_step``: inside optimizer step STEP, once the
  optimizer has stepped its first parameter group and before it steps the second (parameters and
  state half updated); ``save``: after this rank's files of the checkpoint at STEP are written and
  flushed, before it is marked complete; ``mid_save``: while the checkpoint at STEP is being written:
  its first file is cut to half its length, then the action fires.
* RANK: only this rank acts (default: every rank).

Unset it does nothing.
"""
from __future__ import annotations

import os
import signal

ENV = "DS_Q8_FAULT"
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_POINTS = ("step", "mid_step", "save", "mid_save")


def parse(text: str):
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in _ACTIONS or parts[1] not in _POINTS:
        raise ValueError(f"{ENV} must be ACTION:POINT:STEP[:RANK] with ACTION in {sorted(_ACTIONS)} and POINT in "
                         f"{list(_POINTS)}, got {text!r}")
    rank = int(parts[3]) if len(parts) == 4 else None
    return parts[0], parts[1], int(parts[2]), rank


def _planned(point: str, step: int, rank: int):
    text = os.environ.get(ENV)
    if not text:
        return None
    action, where, at, only = parse(text)
    if where == point and at == step and only in (None, rank):
        return action
    return None


def fire(action: str) -> None:
    os.kill(os.getpid(), _ACTIONS[action])


def at(point: str, step: int, rank: int) -> None:
    action = _planned(point, step, rank)
    if action is not None:
        fire(action)


def arm_mid_save(engine, step: int, rank: int) -> None:
    """Make the next checkpoint write of ``engine`` end half-way through its first file."""
    action = _planned("mid_save", step, rank)
    if action is None:
        return
    ckpt = engine.checkpoint_engine
    real_save = ckpt.save

    def save_then_fail(state_dict, path, *args, **kwargs):
        real_save(state_dict, path, *args, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
            f.flush()
            os.fsync(f.fileno())
        fire(action)

    ckpt.save = save_then_fail


def arm_mid_step(optimizer, step: int, rank: int) -> None:
    """Make ``optimizer`` (the one DeepSpeed steps group by group) fire on the second group of ``step``."""
    action = _planned("mid_step", step, rank)
    if action is None:
        return
    real_step, calls = optimizer.step, []

    def step_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fire(action)
        return real_step(*args, **kwargs)

    optimizer.step = step_then_fail
