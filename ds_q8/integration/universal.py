"""Make a ZeRO checkpoint written by a ds_q8 optimizer readable by DeepSpeed's universal tools.

Each rank's ``*_optim_states.pt`` holds that rank's partition as uint8 codes plus per-block
maxima, under the names ``state1``/``absmax1``/... DeepSpeed's ``ds_to_universal`` looks only for
fp32 ``exp_avg``/``exp_avg_sq``, and blocks end at partition boundaries, so codes cannot be cut
and re-joined for another world size. The conversion therefore dequantizes every rank's
partition to fp32 (exactly: codes times block maxima), names the states as universal
checkpoints expect, and hands the result to ``ds_to_universal``. On load, DeepSpeed writes the
fp32 state into the optimizer, which requantizes it with the new partitioning before its next
step (``Optimizer8bitBlock._adopt_fp32_state``).

Optimizers with one state (``Momentum8bitBlock``) travel as ``exp_avg``; the ``exp_avg_sq``
that ``ds_to_universal`` requires is written as zeros and ignored on load.
"""
from __future__ import annotations

import glob
import os
import shutil
from argparse import Namespace
from typing import List

import torch

from ..optim.base import STATE_DICT_MARKER, UNIVERSAL_STATE_NAMES

_OPTIM_SUFFIX = "_optim_states.pt"
_OUTER = "optimizer_state_dict"
# where the wrapped optimizer's state_dict sits inside DeepSpeed's per-rank file, by ZeRO stage
_INNER_KEYS = ("base_optimizer_state", "optimizer_state_dict")


def _optimizer_class(name: str):
    from ..registry import OPTIMIZERS

    if name not in OPTIMIZERS:
        raise ValueError(f"checkpoint written by unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def _find_optimizer_state(rank_sd: dict, path: str):
    outer = rank_sd.get(_OUTER)
    if not isinstance(outer, dict):
        raise ValueError(f"{path}: no '{_OUTER}' entry; not a DeepSpeed ZeRO optimizer checkpoint")
    for key in _INNER_KEYS:
        inner = outer.get(key)
        if isinstance(inner, dict) and "state" in inner:
            return outer, key, inner
        if isinstance(inner, list):
            raise ValueError(f"{path}: an elastic checkpoint (per-group list); ds_q8 optimizers do not write these")
    raise ValueError(f"{path}: no optimizer state_dict under {list(_INNER_KEYS)}")


def fp32_rank_state(inner: dict, path: str) -> dict:
    """One rank's ds_q8 optimizer state_dict, rewritten with fp32 states under universal names."""
    marker = inner.get(STATE_DICT_MARKER)
    if not isinstance(marker, dict) or "optimizer" not in marker:
        raise ValueError(f"{path}: optimizer state was not written by a ds_q8 optimizer; "
                         "use DeepSpeed's ds_to_universal on it directly")
    cls = _optimizer_class(marker["optimizer"])
    out = cls.export_fp32_state_dict(inner, universal=True)
    names = cls.universal_names()
    for st in out["state"].values():
        for missing in UNIVERSAL_STATE_NAMES[len(names):]:
            if st:
                st[missing] = torch.zeros_like(st[names[0]])
    out[STATE_DICT_MARKER] = dict(marker)
    return out


def to_fp32_checkpoint(input_folder: str, output_folder: str) -> List[str]:
    """Copy a checkpoint tag folder, rewriting each rank's optimizer state as fp32 universal names."""
    if not os.path.isdir(input_folder):
        raise FileNotFoundError(f"checkpoint folder {input_folder!r} does not exist")
    if os.path.exists(output_folder):
        raise FileExistsError(f"output folder {output_folder!r} already exists; choose a new one")
    optim_files = sorted(glob.glob(os.path.join(input_folder, "*" + _OPTIM_SUFFIX)))
    if not optim_files:
        raise ValueError(f"{input_folder!r} has no *{_OPTIM_SUFFIX} files; pass a checkpoint tag folder "
                         "(e.g. checkpoints/global_step100)")
    # convert everything in memory first, so a bad file leaves no half-written output behind
    converted = {}
    for path in optim_files:
        rank_sd = torch.load(path, map_location="cpu", weights_only=False)
        outer, key, inner = _find_optimizer_state(rank_sd, path)
        outer[key] = fp32_rank_state(inner, path)
        converted[os.path.basename(path)] = rank_sd
    tmp = output_folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(input_folder):
        src = os.path.join(input_folder, name)
        if name in converted:
            torch.save(converted[name], os.path.join(tmp, name))
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(tmp, name))
    os.replace(tmp, output_folder)
    return sorted(converted)


def to_universal(input_folder: str, output_folder: str, keep_fp32: bool = False, workers: int = 1) -> None:
    """Convert a ds_q8 ZeRO checkpoint tag folder into a DeepSpeed universal checkpoint folder.

    Load the result with ``"checkpoint": {"load_universal": true}`` in the DeepSpeed config and
    ``engine.load_checkpoint(parent_dir, tag=basename(output_folder))``, at any world size.
    """
    from deepspeed.checkpoint import ds_to_universal

    if os.path.exists(output_folder):
        raise FileExistsError(f"output folder {output_folder!r} already exists; choose a new one")
    fp32_folder = output_folder.rstrip("/") + ".fp32"
    to_fp32_checkpoint(input_folder, fp32_folder)
    try:
        ds_to_universal.main(Namespace(input_folder=fp32_folder, output_folder=output_folder,
                                       num_extract_workers=workers, num_merge_workers=workers,
                                       keep_temp_folder=False, strict=True, inject_missing_state=True))
    finally:
        if not keep_fp32:
            shutil.rmtree(fp32_folder, ignore_errors=True)
