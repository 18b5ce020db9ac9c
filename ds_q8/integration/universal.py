"""Universal checkpoints for ds_q8 optimizers: resume at any world size, code for code.

DeepSpeed's ``ds_to_universal`` looks only for fp32 ``exp_avg``/``exp_avg_sq``. The conversion
therefore writes each rank's state both ways:

* as fp32 under the universal names (exactly the dequantized codes), which ``ds_to_universal``
  cuts into one file per parameter as for any Adam; any tool that reads universal checkpoints
  sees real values, and a 32-bit optimizer can resume from them;
* as the 8-bit codes and block maxima of each whole parameter (``<output>/ds_q8/<param>.pt``),
  assembled from the segments every rank's layout records. Blocks belong to parameters, so a
  parameter's codes do not depend on how it was partitioned.

On ``engine.load_checkpoint`` with ``"checkpoint": {"load_universal": true}``, DeepSpeed first
writes the fp32 values into the optimizer; then :func:`restore_after_load` (run on every rank by
an engine hook) replaces each new partition's 8-bit segments with their saved codes and block maxima,
untouched. Without the ``ds_q8`` folder (a universal checkpoint written by a 32-bit optimizer, say),
or when the saved block size or map differs from the optimizer's, the fp32 values are requantized.

Optimizers with one state (``Momentum8bitBlock``) travel as ``exp_avg``; the ``exp_avg_sq`` that
``ds_to_universal`` requires is written as zeros and ignored on load.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import warnings
from argparse import Namespace
from typing import Dict, List, Optional

import torch

from .. import functional as F
from ..optim.qstate import QuantizedState
from ..optim.state_keys import CORRECTION_KEY, has_storage
from ..optim.tensor_states import state_bits_of
from ..optim import codec_versions as CV
from ..optim.state_io import (STATE_DICT_MARKER, STATE_FORMAT, UNIVERSAL_STATE_NAMES, states_of_entry,
                              universal_names_for)
from .lookup import checkpoint_folder, ds_q8_optimizer, optimizer_class

_OPTIM_SUFFIX = "_optim_states.pt"
_OUTER = "optimizer_state_dict"
# where the wrapped optimizer's state_dict sits inside DeepSpeed's per-rank file, by ZeRO stage
_INNER_KEYS = ("base_optimizer_state", "optimizer_state_dict")
#: folder of per-parameter 8-bit state inside a universal checkpoint
CODES_FOLDER = "ds_q8"
#: key of a parameter file's codec, ``{"name", "version"}`` (``optim/codec_versions.py``); files written before
#: state format 4 have none
CODEC_KEY = "codec"


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


def _marker(inner: dict, path: str) -> dict:
    marker = inner.get(STATE_DICT_MARKER)
    if not isinstance(marker, dict) or "optimizer" not in marker:
        raise ValueError(f"{path}: optimizer state was not written by a ds_q8 optimizer; "
                         "use DeepSpeed's ds_to_universal on it directly")
    return marker


def fp32_rank_state(inner: dict, path: str) -> dict:
    """One rank's ds_q8 optimizer state_dict, rewritten with fp32 states under universal names."""
    marker = _marker(inner, path)
    cls = optimizer_class(marker["optimizer"])
    out = cls.export_fp32_state_dict(inner, universal=True)
    default = cls.rule_when_built()  # for a marker that names no states
    for pid, st in out["state"].items():
        st.pop(CORRECTION_KEY, None)  # travels in the ds_q8 folder, per parameter (ParamCodes)
        # each entry's own states (a Muon matrix has one, its optimizer's AdamW entries two)
        own, _ = states_of_entry(marker, pid, default)
        names = [n for n in universal_names_for(own) if n is not None]
        for missing in UNIVERSAL_STATE_NAMES:
            if st and missing not in names:
                st[missing] = torch.zeros_like(st[names[0]])
    out[STATE_DICT_MARKER] = dict(marker)
    return out


class ParamCodes:
    """One parameter's state assembled from the segments of every rank: 8-bit codes and block maxima,
    or fp32 values (kept here too: DeepSpeed's loader casts optimizer state to the master weights'
    dtype, which would round fp32 state to bf16 under bf16 master weights)."""

    def __init__(self, name: str, numel: int, block_size, quantization: str, state_names, num_blocks: int,
                 eight_bit: bool = True, state_bits: int = 8, absmax_dtypes=None):
        self.name, self.numel, self.block_size, self.quantization = name, numel, block_size, quantization
        self.eight_bit, self.state_names, self.state_bits = eight_bit, list(state_names), int(state_bits)
        k = len(self.state_names)
        if eight_bit:  # one code an element (4-bit codes too: packed again by the layout that loads them)
            self.codes = [torch.zeros(numel, dtype=torch.uint8) for _ in range(k)]
            dtypes = absmax_dtypes or (F.ABSMAX_DTYPE,) * k
            self.absmax = [torch.zeros(num_blocks, dtype=dt) for dt in dtypes]
        else:
            self.values = [torch.zeros(numel, dtype=torch.float32) for _ in range(k)]
        self.covered = torch.zeros(numel, dtype=torch.bool)
        #: the bf16 master's correction bytes (``correction_byte=True``), or None
        self.correction: Optional[torch.Tensor] = None

    def payload(self) -> dict:
        out = {"numel": self.numel, "block_size": self.block_size, "quantization": self.quantization,
               "state_names": self.state_names, "eight_bit": self.eight_bit}
        if self.state_bits != 8:
            out["state_bits"] = self.state_bits
        if self.correction is not None:
            out[CORRECTION_KEY] = self.correction
        if self.eight_bit:
            # the codes are in their codec's current version (``to_fp32_checkpoint`` converts older ones)
            name = CV.codec_name(self.quantization, self.state_bits)
            out.update(codes=self.codes, absmax=self.absmax, **{CODEC_KEY: {"name": name,
                                                                             "version": CV.CODEC_VERSIONS[name]}})
        else:
            out.update(values=self.values)
        return out


def collect_param_codes(inner: dict, path: str, into: Dict[str, ParamCodes]) -> None:
    """Add one rank's segments (from its saved layouts) to ``into``, keyed by parameter name."""
    marker = _marker(inner, path)
    if marker.get("format") == 2:
        raise ValueError(f"{path}: the optimizer state is in format 2 (ds_q8 0.1, float32 block maxima), whose codes "
                         "this version cannot carry over; resume from the checkpoint once at its world size (the "
                         "loader requantizes it) and save, then convert the new checkpoint")
    if marker.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: the optimizer state has no layout marker of format {STATE_FORMAT} (found "
                         f"{marker.get('format')!r}); convert its codes first (codec_versions.current)")
    group_of = {pid: g for g in inner["param_groups"] for pid in g["params"]}
    for pid, st in inner["state"].items():
        desc = marker["layouts"].get(pid, marker["layouts"].get(str(pid)))
        if not st or desc is None or not has_storage(st):
            continue
        g = group_of[pid]
        names, signed = states_of_entry(marker, pid)
        k = len(names)
        qs = QuantizedState.of_saved(st, desc, signed, g["quantization"])
        for si, seg, first, codes, absmax, values in qs.segment_params():
            if not seg.name:
                raise ValueError(f"{path}: a parameter slice has no name; the universal route needs DeepSpeed's "
                                 "parameter names (engine.param_names)")
            entry = into.get(seg.name)
            if entry is None:
                _, _, bs = qs.layout.segment_blocks(si)
                entry = into[seg.name] = ParamCodes(seg.name, seg.param_numel, g["block_size"], g["quantization"],
                                                    names, (seg.param_numel + bs - 1) // bs, seg.eight_bit,
                                                    qs.layout.state_bits, absmax and tuple(a.dtype for a in absmax))
            elif entry.state_names != list(names):
                raise ValueError(f"{path}: parameter {seg.name} has states {list(names)} here and "
                                 f"{entry.state_names} in another rank's file: the files are not of one checkpoint")
            corr = st.get(CORRECTION_KEY)
            if corr is not None:
                if entry.correction is None:
                    entry.correction = torch.zeros(seg.param_numel, dtype=torch.int8)
                entry.correction[seg.param_start:seg.param_end] = corr.reshape(-1)[seg.start:seg.end]
            for i in range(k):
                if seg.eight_bit:
                    entry.codes[i][seg.param_start:seg.param_end] = codes[i]
                    entry.absmax[i][first:first + absmax[i].numel()] = absmax[i]
                else:
                    entry.values[i][seg.param_start:seg.param_end] = values[i]
            entry.covered[seg.param_start:seg.param_end] = True


def to_fp32_checkpoint(input_folder: str, output_folder: str,
                       codes: Optional[Dict[str, ParamCodes]] = None) -> List[str]:
    """Copy a checkpoint tag folder, rewriting each rank's optimizer state as fp32 universal names.

    With ``codes`` (a dict), each parameter's 8-bit state is also assembled into it.
    """
    if not os.path.isdir(input_folder):
        raise FileNotFoundError(f"checkpoint folder {input_folder!r} does not exist")
    if os.path.exists(output_folder):
        raise FileExistsError(f"output folder {output_folder!r} already exists; choose a new one")
    optim_files = sorted(glob.glob(os.path.join(input_folder, "*" + _OPTIM_SUFFIX)))
    if not optim_files:
        raise ValueError(f"{input_folder!r} has no *{_OPTIM_SUFFIX} files; pass a checkpoint tag folder "
                         "(e.g. checkpoints/global_step100)")
    # convert everything in memory first, so a bad file leaves no half-written output behind
    loaded = []
    for path in optim_files:
        rank_sd = torch.load(path, map_location="cpu", weights_only=False)
        outer, key, inner = _find_optimizer_state(rank_sd, path)
        _marker(inner, path)
        loaded.append((path, rank_sd, outer, key, inner))
    # one decision for the whole checkpoint where its format names no codec: every rank's codes are evidence
    evidence = sum((CV.evidence_of(inner) for *_, inner in loaded), CV.Evidence())
    converted = {}
    for path, rank_sd, outer, key, inner in loaded:
        inner = CV.current(inner, evidence=evidence)
        if codes is not None:
            collect_param_codes(inner, path, codes)
        outer[key] = fp32_rank_state(inner, path)
        converted[os.path.basename(path)] = rank_sd
    if codes:
        holes = [c.name for c in codes.values() if not bool(c.covered.all())]
        if holes:
            raise ValueError(f"{input_folder!r}: the rank files do not cover all of parameters {holes[:5]}: "
                             "a rank's file is missing")
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


def _codes_file(folder: str, name: str) -> str:
    return os.path.join(folder, CODES_FOLDER, name + ".pt")


def to_universal(input_folder: str, output_folder: str, keep_fp32: bool = False, workers: int = 1) -> None:
    """Convert a ds_q8 ZeRO checkpoint tag folder into a DeepSpeed universal checkpoint folder.

    Load the result with ``"checkpoint": {"load_universal": true}`` in the DeepSpeed config and
    ``engine.load_checkpoint(parent_dir, tag=basename(output_folder))``, at any world size. Nothing
    is written at ``output_folder`` unless the whole conversion succeeds.
    """
    from deepspeed.checkpoint import ds_to_universal

    if os.path.exists(output_folder):
        raise FileExistsError(f"output folder {output_folder!r} already exists; choose a new one")
    base = output_folder.rstrip("/")
    fp32_folder, partial = base + ".fp32", base + ".partial"
    codes: Dict[str, ParamCodes] = {}
    shutil.rmtree(partial, ignore_errors=True)
    to_fp32_checkpoint(input_folder, fp32_folder, codes)
    try:
        ds_to_universal.main(Namespace(input_folder=fp32_folder, output_folder=partial,
                                       num_extract_workers=workers, num_merge_workers=workers,
                                       keep_temp_folder=False, strict=True, inject_missing_state=True))
        if codes:
            os.makedirs(os.path.join(partial, CODES_FOLDER))
            for name, entry in codes.items():
                torch.save(entry.payload(), _codes_file(partial, name))
        os.replace(partial, base)
        # DeepSpeed's converter names the folder it wrote in <parent>/latest_universal: the partial one
        latest = os.path.join(os.path.dirname(base) or ".", "latest_universal")
        if os.path.isfile(latest):
            with open(latest) as f:
                named = f.read().strip()
            if named == os.path.basename(partial):
                with open(latest + ".tmp", "w") as f:
                    f.write(os.path.basename(base))
                os.replace(latest + ".tmp", latest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if not keep_fp32:
            shutil.rmtree(fp32_folder, ignore_errors=True)


# ---------------------------------------------------------------------------- loading
def _saved_state(folder: Optional[str], segments, group: dict, opt, cache: dict) -> Optional[List[dict]]:
    """The saved whole-parameter state of each segment's parameter, or None when any is missing or does
    not fit (8-bit where it now keeps fp32 or the other way round, another block size or map)."""
    if folder is None:
        return None
    out = []
    for seg in segments:
        if seg.name is None:
            return None
        if seg.name not in cache:
            path = _codes_file(folder, seg.name)
            cache[seg.name] = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
        saved = cache[seg.name]
        rule = opt.rule_for(group)
        if (saved is None or bool(saved.get("eight_bit", True)) != seg.eight_bit
                or list(saved["state_names"]) != list(rule.state_names)
                or (seg.eight_bit and int(saved.get("state_bits", 8)) != state_bits_of(group))
                or (seg.eight_bit and (saved["block_size"] != group["block_size"]
                                       or saved["quantization"] != group["quantization"]))):
            return None
        if seg.eight_bit:
            saved = cache[seg.name] = _in_current_codes(folder, saved, rule.state_signed, opt, cache)
        out.append(saved)
    return out


def _in_current_codes(folder: str, saved: dict, signed, opt, cache: dict) -> dict:
    """A parameter file's codes in their codec's current version (``optim/codec_versions.py``): as they are
    where current, converted where an older version is known, refused by name where it is not. A file
    written before state format 4 names no codec: its minifloat codes are decided over all the folder's files."""
    name = CV.codec_name(saved["quantization"], saved.get("state_bits", 8))
    codec = saved.get(CODEC_KEY)
    if codec is not None and codec.get("name") != name:
        raise ValueError(f"{folder}: a parameter file's codes are of codec {codec.get('name')!r}, but its "
                         f"quantization and state_bits make them {name!r}: the file is damaged")
    if codec is not None:
        version = codec.get("version")
    else:
        version = _unnamed_minifloat_version(folder, opt, cache) if name == "minifloat" else 1
    if version == CV.CODEC_VERSIONS[name]:
        return saved
    codes = [CV.upgraded_codes(c, name, version, s) for c, s in zip(saved["codes"], signed)]
    return dict(saved, codes=codes, **{CODEC_KEY: {"name": name, "version": CV.CODEC_VERSIONS[name]}})


def _unnamed_minifloat_version(folder: str, opt, cache: dict) -> int:
    """The minifloat codec version of a universal checkpoint whose parameter files name none, decided once
    from every such file's signed codes (every rank reads the same files, so every rank decides alike)."""
    key = (CODEC_KEY, "minifloat")  # not a parameter name
    if key not in cache:
        signed = {n: s for g in opt.param_groups for n, s in zip(opt.rule_for(g).state_names,
                                                                 opt.rule_for(g).state_signed)}
        evidence = CV.Evidence()
        for path in sorted(glob.glob(os.path.join(folder, CODES_FOLDER, "*.pt"))):
            p = torch.load(path, map_location="cpu", weights_only=True)
            if (p.get(CODEC_KEY) is not None or not p.get("eight_bit", True)
                    or CV.codec_name(p["quantization"], p.get("state_bits", 8)) != "minifloat"):
                continue
            for codes, state in zip(p["codes"], p["state_names"]):
                if signed.get(state, False):
                    evidence = evidence + CV.codes_evidence(codes, p["block_size"] or max(1, int(p["numel"])))
        version, why = CV.decide_minifloat(evidence)
        warnings.warn(f"ds_q8: the universal checkpoint {folder} was converted before its parameter files named their "
                      f"codec; their signed minifloat codes were read as {why}.", RuntimeWarning, stacklevel=2)
        cache[key] = version
    return cache[key]


def restore_after_load(engine, load_dir, tag=None, *args, **kwargs) -> None:
    """After DeepSpeed loaded a universal checkpoint: put every saved code back (every rank)."""
    opt = ds_q8_optimizer(engine)
    if opt is None or not engine.load_universal_checkpoint():
        return
    load_optimizer_states = kwargs.get("load_optimizer_states", args[0] if args else True)
    if not load_optimizer_states:
        return
    # DeepSpeed hands _load_zero_checkpoint the tag it resolved; no folder leaves the fp32 values to requantize
    folder = checkpoint_folder(load_dir, tag, universal=True)
    folder = None if folder is None else str(folder)
    cache: dict = {}
    for tensor, layout in list(opt.tensors.layouts.items()):
        group = opt.tensors.groups.get(tensor)
        if group is None:
            continue  # an ordinary parameter (ZeRO-0 has no universal checkpoints)
        held = [seg for seg in layout.segments if seg.numel]
        saved = _saved_state(folder, held, group, opt, cache)
        ok = torch.tensor([1.0 if saved is not None else 0.0])
        if layout.sharded:  # all ranks take the same route for a tensor whose blocks they share
            ok.neg_()
            layout.comm.all_reduce_max(ok)
            ok.neg_()
        if float(ok) == 1.0:
            opt.restore_codes(tensor, dict(zip([seg.name for seg in held], saved)))
        elif layout.sharded:
            opt.adopt_tensor_collectively(tensor)
        else:
            opt._adopt_fp32_state(tensor, opt.state[tensor])


def _restore_hook(engine, result, *args, **kwargs) -> None:
    restore_after_load(engine, *args, **kwargs)


_SHARD_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_world_size(folder: str) -> Optional[int]:
    """The data-parallel world size a ZeRO checkpoint folder was written at (its optimizer shards)."""
    ranks = {int(m.group(1)) for m in map(_SHARD_FILE.search, os.listdir(folder)) if m}
    return len(ranks) or None


def _refuse_other_world_size(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                             load_lr_scheduler_states=True, load_module_only=False, *args, **kwargs) -> None:
    """DeepSpeed cannot resume ZeRO optimizer state at another world size (at stage 3 some ranks do not
    even find their files); say, on every rank and before anything loads, how ds_q8 resumes it."""
    if (ds_q8_optimizer(engine) is None or engine.load_universal_checkpoint() or not load_optimizer_states
            or load_module_only or not engine.zero_optimization()):
        return
    folder = checkpoint_folder(load_dir, tag)
    if folder is None:
        return
    folder = str(folder)
    saved, now = saved_world_size(folder), getattr(engine, "seq_dp_world_size", None)
    if saved is not None and now is not None and saved != now:
        from deepspeed.runtime.zero.utils import ZeRORuntimeException

        raise ZeRORuntimeException(
            f"checkpoint {folder} was written at a data-parallel world size of {saved}, this run has {now}. "
            f"Convert it once: python -m ds_q8.checkpoint to-universal {folder} {folder}_universal ; then load "
            f"tag '{os.path.basename(folder)}_universal' with \"checkpoint\": {{\"load_universal\": true}}. "
            "The 8-bit state moves code for code.")
