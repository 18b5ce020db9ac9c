"""Saving, loading and converting the state of ds_q8 optimizers.

``state_dict()`` is torch's, plus a marker (``"ds_q8"``) that says which optimizer wrote it, the
names and maps of its states and the layout of every optimized tensor (its segments: which slice of
which parameter, 8-bit or fp32). Offline tools (``export_fp32``, the universal-checkpoint converter)
read that marker, never the class, so an instance-level layout (RMSprop with momentum) travels whole.

``load_state_dict`` keeps every state tensor in the dtype it was saved with (torch's loader would
cast uint8 codes to float), checks everything before replacing anything, and refuses keys it does
not know. State saved as fp32 under torch's or the universal checkpoint's names is requantized.

Formats: 4 names the map and codec version of the codes (``codec_versions.py``); 3 (since 0.2.0)
stores block maxima as bfloat16 with 64-element blocks by default and names no codec (``codec_versions``
reads its codes, converts or refuses them); 2 (0.1.x) stored float32 maxima, 2048-element blocks by
default. A format-2 state_dict still loads: each 8-bit entry is dequantized exactly with its saved layout
and requantized into the loading optimizer's layout and block size (one warning says so), since the two
formats cannot share codes.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from .layout import StateLayout
from .qstate import QuantizedState
from .state_keys import CORRECTION_KEY, storage_keys
from .rules import Rule

# DeepSpeed's universal checkpoints know only Adam's two state names. An optimizer whose states
# include both travels under them by name, its other states only as codes (AdEMAMix's exp_avg_slow,
# see ``integration/universal.py``); any other optimizer with at most two states travels under
# them in order (state1 -> exp_avg, state2 -> exp_avg_sq).
UNIVERSAL_STATE_NAMES = ("exp_avg", "exp_avg_sq")

#: key of the marker that ``state_dict`` adds so offline tools know which optimizer wrote it
STATE_DICT_MARKER = "ds_q8"
#: key of the marker's codecs: the map and version of each codec the saved codes use (``codec_versions.py``)
CODECS_KEY = "codecs"
#: version of the state layout written in the marker (4: the marker names each codec's version)
STATE_FORMAT = 4
#: formats this version reads (2: float32 block maxima, requantized on load; 3: codecs decided from the codes)
READABLE_FORMATS = (2, 3, 4)


def universal_names_for(state_names) -> tuple:
    """The name each state carries in DeepSpeed universal checkpoints (None: none, it travels as codes)."""
    names = tuple(state_names)
    if set(UNIVERSAL_STATE_NAMES) <= set(names):
        return tuple(n if n in UNIVERSAL_STATE_NAMES else None for n in names)
    k = len(names)
    if k > len(UNIVERSAL_STATE_NAMES):
        raise ValueError(f"an optimizer with {k} states cannot travel in a DeepSpeed universal checkpoint, "
                         f"which carries at most {len(UNIVERSAL_STATE_NAMES)} ({', '.join(UNIVERSAL_STATE_NAMES)})")
    return UNIVERSAL_STATE_NAMES[:k]


def marker(optimizer: str, state_names, state_signed, layouts: dict, tensor_states: Optional[dict] = None,
           codecs: Optional[dict] = None) -> dict:
    """The marker; ``tensor_states`` (entry -> :func:`tensor_states`) only for the entries whose group
    runs another rule than the optimizer's class rule (Muon's matrices beside its AdamW). Without such
    entries the key is absent, so an optimizer with one rule writes exactly what it always wrote.
    ``codecs``: ``codec_versions.marker_codecs`` of the codecs the saved codes use."""
    out = {"optimizer": optimizer, "format": STATE_FORMAT, "state_names": list(state_names),
           "state_signed": list(state_signed), "layouts": layouts, CODECS_KEY: dict(codecs or {})}
    if tensor_states:
        out["tensor_states"] = tensor_states
    return out


def tensor_states(state_names, state_signed) -> dict:
    """One entry's own state names and maps, for the marker's ``tensor_states``."""
    return {"state_names": list(state_names), "state_signed": list(state_signed)}


def states_of_entry(mark: dict, pid, rule: Optional[Rule] = None) -> Tuple[tuple, tuple]:
    """The state names and maps of saved entry ``pid``: its own where the marker lists them, else the
    marker header's (else ``rule``'s: the reading class's default)."""
    own = (mark.get("tensor_states") or {})
    own = own.get(pid, own.get(str(pid)))
    if own is not None:
        return tuple(own["state_names"]), tuple(own["state_signed"])
    names = mark.get("state_names", () if rule is None else rule.state_names)
    signed = mark.get("state_signed", () if rule is None else rule.state_signed)
    return tuple(names), tuple(signed)


@functools.lru_cache(maxsize=None)
def _fp32_keys(names: tuple) -> frozenset:
    return frozenset(names + UNIVERSAL_STATE_NAMES)


def fp32_names_in(st: dict, state_names: Sequence[str]) -> Optional[tuple]:
    """Which fp32 naming (torch's, then universal) ``st`` uses for its states, if any: one name per
    state, None for a state that the universal naming does not carry."""
    names = tuple(state_names)
    if _fp32_keys(names).isdisjoint(st):
        return None  # the usual case, one set test per tensor and step
    candidates = [names]
    try:
        candidates.append(universal_names_for(names))
    except ValueError:
        pass
    for cand in candidates:
        if all(n is None or torch.is_tensor(st.get(n)) for n in cand):
            return tuple(cand)
    return None


def _saved_layout(mark: dict, pid) -> dict:
    """The saved layout of state entry ``pid``, which every entry of 8-bit or packed state needs."""
    if mark.get("format") not in READABLE_FORMATS:
        raise ValueError(f"state entry {pid} holds quantized state but the state_dict has no '{STATE_DICT_MARKER}' "
                         f"marker of format {' or '.join(map(str, READABLE_FORMATS))} (found {mark.get('format')!r}): "
                         "it was not written by ds_q8 0.1 or later")
    layouts = mark.get("layouts", {})
    desc = layouts.get(pid, layouts.get(str(pid)))
    if desc is None:
        raise ValueError(f"state entry {pid} has no saved layout: the state_dict is damaged")
    return desc


# ---------------------------------------------------------------------------- offline export
def export_fp32(state_dict: dict, rule: Optional[Rule], universal: bool = False) -> dict:
    """A copy of a saved ``state_dict`` with every state as fp32 under torch's names (or, with
    ``universal``, DeepSpeed's). The names, maps and layouts come from the saved marker where it has
    them. A ZeRO partition's values are partition-long, with zeros in padding."""
    mark = state_dict.get(STATE_DICT_MARKER) or {}
    groups = state_dict["param_groups"]
    group_of = {pid: g for g in groups for pid in g["params"]}
    out_state = {}
    for pid, st in state_dict["state"].items():
        g = group_of.get(pid)
        if g is None:
            raise ValueError(f"state entry {pid} belongs to no parameter group")
        entry_names, signed = states_of_entry(mark, pid, rule)
        names = universal_names_for(entry_names) if universal else entry_names
        if not st or fp32_names_in(st, entry_names) == tuple(names):
            out_state[pid] = copy.copy(st)
            continue
        desc = _saved_layout(mark, pid)
        qs = QuantizedState.of_saved(st, desc, signed, g["quantization"])
        new = {k: v for k, v in st.items() if not (k.startswith("state") or k.startswith("absmax"))}
        for name, v in zip(names, qs.read("cpu")):
            if name is not None:
                new[name] = v.view(tuple(desc["shape"]))
        out_state[pid] = new
    return {"state": out_state, "param_groups": copy.deepcopy(groups)}


# ---------------------------------------------------------------------------- loading
def upgraded(state_dict: dict, live_groups: Sequence[dict], rule: Optional[Rule]) -> dict:
    """A format-2 ``state_dict`` (float32 block maxima) as one that loads into this version: every 8-bit
    entry as its exact fp32 values under torch's names (the loader requantizes them into the live
    layout), and each group's ``block_size`` the live group's, so that the requantized state and the
    group agree. Any other state_dict is returned as it is."""
    mark = state_dict.get(STATE_DICT_MARKER) if isinstance(state_dict, dict) else None
    if not isinstance(mark, dict) or mark.get("format") != 2 or not isinstance(state_dict.get("state"), dict):
        return state_dict
    out = export_fp32(state_dict, rule)
    groups = out["param_groups"]
    if len(groups) == len(live_groups):
        for saved, live in zip(groups, live_groups):
            saved["block_size"] = live["block_size"]
    new_mark = dict(mark, format=STATE_FORMAT, layouts={}, **{CODECS_KEY: {}})  # fp32 states: no codes
    warnings.warn("ds_q8: this checkpoint was written in state format 2 (ds_q8 0.1: float32 block maxima, "
                  f"block_size {sorted({g.get('block_size') for g in state_dict['param_groups']}, key=str)}); its "
                  "states were dequantized exactly and requantized into this optimizer's format (bfloat16 maxima, "
                  f"block_size {sorted({g['block_size'] for g in live_groups}, key=str)}), which moves each value "
                  "by at most half a code step. Save a checkpoint to keep it in the new format.",
                  RuntimeWarning, stacklevel=3)
    return {"state": out["state"], "param_groups": groups, STATE_DICT_MARKER: new_mark}


def plan_load(opt, state_dict: dict) -> List[Tuple[torch.Tensor, dict]]:
    """Check a state_dict against the optimizer ``opt`` and return ``(tensor, saved entry)`` pairs to
    restore; raise ValueError (nothing changed) for anything that does not fit."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"optimizer state_dict must be a dict, got {type(state_dict).__name__}")
    unknown = sorted(str(k) for k in state_dict if k not in ("state", "param_groups", STATE_DICT_MARKER))
    if unknown:
        raise ValueError(f"optimizer state_dict has unknown top-level keys {unknown}; "
                         f"expected 'state', 'param_groups' and '{STATE_DICT_MARKER}'")
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError("optimizer state_dict must have 'state' (dict) and 'param_groups' (list)")
    mark = state_dict.get(STATE_DICT_MARKER) or {}
    _check_marker(mark)
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} parameter groups, this optimizer has {len(opt.param_groups)}")
    plans = []
    for gi, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(
                f"group {gi}: checkpoint has {len(sg['params'])} parameters, optimizer has {len(g['params'])}")
        rule = opt.rule_for(g)
        known = storage_keys(rule.num_states) | frozenset(rule.state_names) | frozenset(UNIVERSAL_STATE_NAMES)
        for pid, p in zip(sg["params"], g["params"]):
            st = saved_state.get(pid)
            if not st:
                continue
            saved_names, _ = states_of_entry(mark, pid, rule)  # unnamed in the marker: as the live group
            if saved_names != tuple(rule.state_names):
                raise ValueError(f"checkpoint state of tensor {pid} (group {gi}) of "
                                 f"{mark.get('optimizer', 'an optimizer')} keeps states {list(saved_names)}, this "
                                 f"{type(opt).__name__} keeps {list(rule.state_names)} for its group: use the "
                                 "optimizer and settings that wrote it (RMSprop's momentum), with its groups split "
                                 "and tagged as they were (Muon's use_muon)")
            bad = sorted(str(k) for k in st if k not in known)
            if bad:
                raise ValueError(f"checkpoint state of tensor {pid} has unknown keys {bad}; "
                                 f"a {type(opt).__name__} state has {sorted(known)}")
            _check_saved(opt, st, p, sg, g, mark, pid)
            plans.append((p, st))
    return plans


def restored_entry(st: dict, device) -> dict:
    """A saved entry as live state on ``device``, every tensor in its saved dtype."""
    out = {}
    for key, value in st.items():
        if key == "step":
            out[key] = torch.tensor(float(value.item() if torch.is_tensor(value) else value))
        elif torch.is_tensor(value):
            out[key] = value.detach().to(device=device, dtype=value.dtype).clone()
        else:
            out[key] = value
    return out


def _check_marker(mark: dict) -> None:
    """The marker's own shape; what it says of each entry's states is checked entry by entry."""
    if not isinstance(mark, dict):
        raise ValueError(f"the '{STATE_DICT_MARKER}' entry of the state_dict must be a dict")


def _check_saved(opt, st: dict, p: torch.Tensor, saved_group: dict, group: dict, mark: dict, pid) -> None:
    """Check one saved tensor's state against the live tensor."""
    layout = opt.layout_of(p, group)
    rule = opt.rule_for(group)
    if "step" not in st:
        raise ValueError(f"checkpoint state for a tensor of shape {tuple(p.shape)} lacks 'step'")
    fp32_names = fp32_names_in(st, rule.state_names)
    if fp32_names is not None:
        for n in filter(None, fp32_names):
            if st[n].numel() != layout.numel:
                raise ValueError(
                    f"checkpoint {n} has {st[n].numel()} elements but the tensor of shape {tuple(p.shape)} "
                    f"has {layout.numel}: the checkpoint belongs to another model or partitioning")
            if not bool(torch.isfinite(st[n].float()).all()):
                raise ValueError(f"checkpoint {n} contains NaN or Inf")
        return
    for key in ("block_size", "quantization"):
        if saved_group.get(key) != group[key] and any(str(x).startswith("absmax") for x in st):
            raise ValueError(
                f"the checkpoint's 8-bit state was written with {key}={saved_group.get(key)!r}, "
                f"this optimizer uses {key}={group[key]!r}; use the same {key}, or load the state via "
                f"{type(opt).__name__}.export_fp32_state_dict(...) to requantize it")
    try:
        desc = _saved_layout(mark, pid)
    except ValueError as e:
        raise ValueError(f"checkpoint holds state for a tensor of shape {tuple(p.shape)}, but {e}") from None
    if not layout.same_as(desc):
        if len(desc["segments"]) == 1 and len(layout.segments) == 1 and list(desc["shape"]) != list(layout.shape):
            raise ValueError(f"checkpoint state has shape {tuple(desc['shape'])} but the parameter has shape "
                             f"{tuple(layout.shape)}: the checkpoint belongs to another model")
        if _only_bits_differ(desc, layout):
            changed = [f"{b.name or f'a parameter of {b.param_numel} elements'} ({'8' if a.eight_bit else '32'}-bit "
                       f"there, {'8' if b.eight_bit else '32'}-bit here)"
                       for a, b in zip(StateLayout.segments_of(desc), layout.segments) if a.eight_bit != b.eight_bit]
            raise ValueError(
                f"checkpoint state was written with other state bits for {', '.join(changed)}: other optim_bits, "
                "min_8bit_size or embeddings_32bit. A checkpoint written before embeddings_32bit existed keeps "
                "embeddings in 8 bits: build the optimizer with embeddings_32bit=False to resume it")
        raise ValueError(
            "checkpoint state was written for another partitioning of the parameters (another ZeRO stage or "
            f"world size, or other min_8bit_size/optim_bits): saved {len(desc['segments'])} segment(s) over "
            f"{desc['shape']}, this rank holds {len(layout.segments)} over {list(layout.shape)}. To resume at "
            "another world size convert the checkpoint: python -m ds_q8.checkpoint to-universal CKPT/TAG "
            "CKPT/TAG_universal, then load it with \"checkpoint\": {\"load_universal\": true}")
    QuantizedState({}, layout, rule.state_signed, group["quantization"]).check_saved(
        st, f"a tensor of shape {tuple(p.shape)}", type(opt).__name__)


def _only_bits_differ(desc: dict, layout: StateLayout) -> bool:
    """Whether a saved layout covers the same slices as ``layout`` and differs in 8/32-bit choices only."""
    saved = StateLayout.segments_of(desc)
    if list(desc.get("shape", [])) != list(layout.shape) or len(saved) != len(layout.segments):
        return False
    same = [(a.start, a.numel, a.param_start, a.param_numel) == (b.start, b.numel, b.param_start, b.param_numel)
            for a, b in zip(saved, layout.segments)]
    return all(same) and any(a.eight_bit != b.eight_bit for a, b in zip(saved, layout.segments))


# ---------------------------------------------------------------------------- fp32 state written by loaders
def adopt_fp32(opt, p: torch.Tensor, state: dict, collective: bool = False, group: Optional[dict] = None) -> bool:
    """Requantize state that a loader wrote as fp32 under torch's or universal names into ``opt``'s codes.

    DeepSpeed's universal-checkpoint loader writes fp32 ``exp_avg``/``exp_avg_sq`` and ``step`` straight
    into ``optimizer.state``; this turns them into codes and block maxima. Returns True when the state
    was replaced. On a sharded ZeRO partition requantizing takes an all-reduce, so it happens only when
    every rank does it together (``collective=True``). ``group``: the tensor's group where the caller
    knows it (the step does: finding it scans every group's list, which per tensor made a step quadratic)."""
    group = opt.tensors.group_of(p) if group is None else group
    state_names = opt.rule_for(group).state_names
    names = fp32_names_in(state, state_names)
    if names is None:
        return False  # the usual case: one set test per tensor and step
    layout = opt.layout_of(p, group)
    if layout.sharded and not collective:
        raise RuntimeError(
            f"{type(opt).__name__}: fp32 state ({', '.join(filter(None, names))}) was written into a ZeRO "
            "partition outside a checkpoint load; call optimizer.adopt_loaded_state() on every rank before stepping")
    values = {tn: state[n] for tn, n in zip(state_names, names) if n is not None}
    absent = [tn for tn in state_names if tn not in values]
    if absent:  # a universal checkpoint without ds_q8's codes carries two states only
        warnings.warn(f"{type(opt).__name__}: the checkpoint has no {', '.join(absent)} (a universal checkpoint "
                      "written without ds_q8's codes carries exp_avg and exp_avg_sq only); starting it from zero",
                      RuntimeWarning, stacklevel=3)
        values.update({tn: torch.zeros(layout.numel) for tn in absent})
    opt.load_dequantized_state(p, values, state.get("step", 0))
    return True


def adopt_loaded(opt) -> int:
    """Requantize the fp32 state a loader wrote into ``opt.state``, every tensor; call on every rank.
    Sharded tensors go first, in registration order (the same on every rank). Returns the count."""
    count = 0
    sharded = [p for p, lay in opt.tensors.layouts.items() if lay.sharded]
    for p in sharded:
        count += int(adopt_collectively(opt, p))
    done = set(map(id, sharded))
    for p in list(opt.state):
        if id(p) not in done:
            count += bool(adopt_fp32(opt, p, opt.state[p]))
    return count


def adopt_collectively(opt, p: torch.Tensor) -> bool:
    """Requantize fp32 state of one sharded tensor if any rank has some; call on every rank."""
    st = opt.state[p]
    layout = opt.tensors.layouts[p]
    names = opt.rule_of(p).state_names
    has = fp32_names_in(st, names) is not None
    flag = torch.tensor([1.0 if has else 0.0])
    layout.comm.all_reduce_max(flag)
    if float(flag) == 0.0:
        return False
    if has:
        return adopt_fp32(opt, p, st, collective=True)
    # another rank got fp32 state for this tensor: requantize what is here along with it
    values = opt.dequantized_state(p) or {n: torch.zeros(layout.numel) for n in names}
    opt.load_dequantized_state(p, values, st.get("step", 0))
    return False


def restore_codes(opt, p: torch.Tensor, saved: dict, corrected: bool) -> None:
    """Rebuild a tensor's state after a universal load, code for code (``saved``: each parameter's whole
    state as ``to-universal`` wrote it; see :meth:`QuantizedState.restore_params`); ``step`` is the
    loader's. ``corrected``: the tensor keeps correction bytes (those saved with each parameter, else 0)."""
    step = opt.state[p].get("step", 0)
    qs = opt.tensors.create_state(p)
    qs.entry["step"] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
    qs.restore_params(saved)
    if corrected:
        corr = torch.zeros(p.numel(), dtype=torch.int8)
        for seg in qs.layout.segments:
            have = saved.get(seg.name, {}).get(CORRECTION_KEY) if seg.numel else None
            if have is not None:
                corr[seg.start:seg.end] = have.reshape(-1)[seg.param_start:seg.param_end]
        qs.entry[CORRECTION_KEY] = corr.to(p.device)


__all__ = ["STATE_DICT_MARKER", "CODECS_KEY", "STATE_FORMAT", "READABLE_FORMATS", "upgraded",
           "UNIVERSAL_STATE_NAMES", "universal_names_for", "marker",
           "tensor_states", "states_of_entry",
           "fp32_names_in", "export_fp32", "plan_load", "restored_entry", "adopt_fp32", "adopt_loaded",
           "adopt_collectively", "restore_codes"]
