"""Refuse damaged checkpoint files before DeepSpeed applies any of them.

``torch.load`` reports a truncated file as ``OSError: [Errno 22] Invalid argument`` and reads a
file with flipped bytes without complaint. DeepSpeed loads the model weights first and the
optimizer shards after, so a damaged shard would leave an engine half-loaded. Every torch
checkpoint file is a zip archive with a CRC-32 per record; checking them first (one extra read of
the files this rank loads) turns both cases into an error that names the file, raised on every rank
before anything was replaced.
"""
from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import List

from .lookup import checkpoint_folder, ds_q8_optimizer

_SHARD = re.compile(r"zero_pp_rank_(\d+)_")


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated or its contents do not match their checksums."""


def verify_file(path) -> None:
    """Raise CorruptCheckpointError unless ``path`` is a whole torch zip checkpoint."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise CorruptCheckpointError(f"checkpoint file {path} is truncated or not a torch checkpoint ({e})") from None
    except (OSError, EOFError, zipfile.LargeZipFile) as e:
        raise CorruptCheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
    if bad is not None:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupted: record {bad!r} fails its CRC-32 check")


def files_of_rank(folder: Path, rank: int) -> List[Path]:
    """The files of a tag folder this rank reads: shared ones plus its own ZeRO shard."""
    def shard_of(name):  # "zero_pp_rank_3_mp_rank_00_optim_states.pt", with a "bf16_" prefix under bf16
        m = _SHARD.search(name)
        return None if m is None else int(m.group(1))

    return sorted(f for f in folder.glob("*.pt") if shard_of(f.name) in (None, rank))


def check_before_load(load_dir, tag, rank: int, universal: bool = False) -> None:
    """Verify this rank's files; every rank raises if any rank found a damaged one. ``universal``: the
    engine loads universal checkpoints, and a None ``tag`` is read from ``latest_universal``."""
    import torch
    import torch.distributed as dist

    problem = None
    folder = checkpoint_folder(load_dir, tag, universal)
    if folder is not None:
        try:
            for f in files_of_rank(folder, rank):
                verify_file(f)
        except CorruptCheckpointError as e:
            problem = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if problem is None else 1.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if problem is None and float(flag) > 0:
            problem = f"another rank found a damaged file in checkpoint {folder} (see its error); nothing was loaded"
    if problem is not None:
        raise CorruptCheckpointError(problem)


def _shard_rank(engine) -> int:
    # ZeRO shard files are numbered by the rank within the data-parallel group, as DeepSpeed names them
    import torch.distributed as dist

    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    if group is not None and dist.is_initialized():
        return dist.get_rank(group=group)
    return int(getattr(engine, "global_rank", 0))


def _check_engine_load(engine, load_dir, tag=None, *args, **kwargs) -> None:
    if ds_q8_optimizer(engine) is None:
        return  # an engine without a ds_q8 optimizer loads as DeepSpeed alone would
    check_before_load(load_dir, tag, _shard_rank(engine), bool(engine.load_universal_checkpoint()))
