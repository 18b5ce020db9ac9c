"""Saving, loading and converting the state of ds_q8 optimizers.

``state_dict()`` is torch's, plus a marker (``"ds_q8"``) that says which optimizer wrote it, the
names and maps of its states and the layout of every optimized tensor (its segments: which slice of
which parameter, 8-bit or fp32). Offline tools (``export_fp32_state_dict``, the universal-checkpoint
converter) read that marker, never the class, so an instance-level layout (RMSprop with momentum)
travels whole.

``load_state_dict`` keeps every state tensor in the dtype it was saved with (torch's loader would
cast uint8 codes to float), checks everything before replacing anything, and refuses keys it does
not know. State saved as fp32 under torch's or the universal checkpoint's names is requantized.
A checkpoint written before layouts existed (no ``format`` in the marker) still loads: for an
ordinary parameter its codes are taken as they are; for a ZeRO partition, whose blocks then ran
across parameters, its values are requantized once into parameter-aligned blocks.
"""
from __future__ import annotations

import copy
import warnings
from typing import Dict, List, Optional

import torch

from .. import functional as F
from .layout import StateLayout
from .stepping import state_views as _views

# DeepSpeed's universal checkpoints know only Adam's two state names; any optimizer with at most
# two states travels under them, in order (state1 -> exp_avg, state2 -> exp_avg_sq).
UNIVERSAL_STATE_NAMES = ("exp_avg", "exp_avg_sq")

#: key of the marker that ``state_dict`` adds so offline tools know which optimizer wrote it
STATE_DICT_MARKER = "ds_q8"
#: version of the state layout written in the marker (absent: written before segments existed)
STATE_FORMAT = 2


def universal_names_for(state_names) -> tuple:
    """The names states carry in DeepSpeed universal checkpoints (at most two)."""
    k = len(state_names)
    if k > len(UNIVERSAL_STATE_NAMES):
        raise ValueError(f"an optimizer with {k} states cannot travel in a DeepSpeed universal checkpoint, "
                         f"which carries at most {len(UNIVERSAL_STATE_NAMES)} ({', '.join(UNIVERSAL_STATE_NAMES)})")
    return UNIVERSAL_STATE_NAMES[:k]


def _map(kind: str, signed: bool, device) -> torch.Tensor:
    from .base import get_map

    return get_map(kind, signed, device)


def fp32_values_from_saved(st: dict, desc: Optional[dict], signed, quantization: str, block_size,
                           numel: int) -> List[torch.Tensor]:
    """Flat fp32 values (one per state, ``numel`` long) of one saved tensor's state.

    ``desc`` is the saved layout (format 2); None reads the old format, whose 8-bit blocks started
    at the tensor's start and whose fp32 state sat under ``state{i}``.
    """
    out = []
    for i, sgn in enumerate(signed, start=1):
        m = _map(quantization, sgn, "cpu")
        values = torch.zeros(numel, dtype=torch.float32)
        if desc is None:
            s = st[f"state{i}"]
            if s.dtype == torch.uint8:
                bs = F.resolve_block_size(block_size, s.numel())
                values = F.dequantize_flat(s.reshape(-1).cpu(), st[f"absmax{i}"].cpu(), m, bs)
            else:
                values = s.detach().reshape(-1).to("cpu", torch.float32).clone()
            out.append(values)
            continue
        layout = StateLayout.from_description(desc)
        codes = st[f"state{i}"].reshape(-1).cpu() if layout.has8 else None
        absmax = st[f"absmax{i}"].cpu() if layout.has8 else None
        f32 = st[f"state{i}_fp32"].reshape(-1).cpu() if layout.has32 else None
        for piece in layout.pieces8 + layout.shared8:
            _, _, bs = layout.segment_blocks(piece.segment)
            if piece.slot >= 0:
                v = m[codes[piece.codes_start:piece.codes_start + piece.numel].long()] * absmax[piece.absmax_start]
            else:
                v = F.dequantize_flat(codes[piece.codes_start:piece.codes_start + piece.numel],
                                      absmax[piece.absmax_start:piece.absmax_start + piece.absmax_count], m, bs)
            values[piece.start:piece.end] = v
        for piece in layout.pieces32:
            values[piece.start:piece.end] = f32[piece.codes_start:piece.codes_start + piece.numel]
        out.append(values)
    return out


class StateIO:
    """state_dict / load_state_dict / fp32 export for :class:`~ds_q8.optim.base.Optimizer8bitBlock`."""

    # ------------------------------------------------------------------ names
    @classmethod
    def universal_names(cls) -> tuple:
        """The names this optimizer's states carry in DeepSpeed universal checkpoints."""
        return universal_names_for(cls.state_names)

    def _state_keys(self) -> frozenset:
        k = len(self.state_signed)
        own = {"step"} | {f"{n}{i}" for n in ("state", "absmax") for i in range(1, k + 1)}
        own |= {f"state{i}_fp32" for i in range(1, k + 1)}
        return frozenset(own) | self._fp32_state_names

    @staticmethod
    def _fp32_names_in(st: dict, state_names: tuple) -> Optional[tuple]:
        """Which fp32 naming (torch's, then universal) ``st`` uses for all states, if any."""
        names = tuple(state_names)
        candidates = [names]
        if len(names) <= len(UNIVERSAL_STATE_NAMES):
            candidates.append(UNIVERSAL_STATE_NAMES[:len(names)])
        for cand in candidates:
            if cand and all(torch.is_tensor(st.get(n)) for n in cand):
                return tuple(cand)
        return None

    @property
    def _fp32_state_names(self) -> frozenset:
        """The names fp32 state can arrive under: this optimizer's and the universal checkpoint's."""
        return frozenset(tuple(self.state_names) + UNIVERSAL_STATE_NAMES)

    # ------------------------------------------------------------------ fp32 state written by a loader
    def _adopt_fp32_state(self, p: torch.Tensor, state: dict, collective: bool = False) -> bool:
        """Requantize state that arrived as fp32 under torch's or universal names.

        DeepSpeed's universal-checkpoint loader writes fp32 ``exp_avg``/``exp_avg_sq`` and ``step``
        straight into ``optimizer.state``; this turns them into codes and block maxima. Returns True
        when the state was replaced. On a sharded ZeRO partition requantizing takes an all-reduce,
        so it happens only when every rank does it together (``collective=True``, as the
        checkpoint-loading hook and :meth:`adopt_loaded_state` do).
        """
        if self._fp32_state_names.isdisjoint(state):
            return False  # the usual case, one set test per tensor and step
        names = self._fp32_names_in(state, self.state_names)
        if names is None:
            return False
        layout = self.layout_of(p, self._state_group(p))
        if layout.sharded and not collective:
            raise RuntimeError(
                f"{type(self).__name__}: fp32 state ({', '.join(names)}) was written into a ZeRO partition "
                "outside a checkpoint load; call optimizer.adopt_loaded_state() on every rank before stepping")
        step = state.get("step", 0)
        values = {tn: state[n] for tn, n in zip(self.state_names, names)}
        self.load_dequantized_state(p, values, step)
        return True

    def adopt_loaded_state(self) -> int:
        """Requantize fp32 state that a loader wrote straight into ``self.state``; call on every rank.

        ``step`` does this by itself for ordinary parameters; the DeepSpeed checkpoint hook does it
        for ZeRO partitions. Returns the number of tensors converted.
        """
        count = 0
        sharded = [p for p, lay in self._layouts.items() if lay.sharded]
        for p in sharded:  # every rank, in registration order: the same order everywhere
            count += int(self.adopt_tensor_collectively(p))
        done = set(map(id, sharded))
        for p in list(self.state):
            if id(p) not in done:
                count += bool(self._adopt_fp32_state(p, self.state[p]))
        return count

    def adopt_tensor_collectively(self, p: torch.Tensor) -> bool:
        """Requantize fp32 state of one sharded tensor if any rank has some; call on every rank."""
        st = self.state[p]
        layout = self._layouts[p]
        has = self._fp32_names_in(st, self.state_names) is not None
        flag = torch.tensor([1.0 if has else 0.0])
        layout.comm.all_reduce_max(flag)
        if float(flag) == 0.0:
            return False
        if has:
            return self._adopt_fp32_state(p, st, collective=True)
        # another rank got fp32 state for this tensor: requantize what is here along with it
        values = self.dequantized_state(p) or {n: torch.zeros(layout.numel) for n in self.state_names}
        self.load_dequantized_state(p, values, st.get("step", 0))
        return False

    def restore_codes(self, p: torch.Tensor, saved: Dict[str, dict]) -> None:
        """Rebuild a tensor's state after a universal load, code for code.

        ``saved`` maps parameter names to their whole state as ``to-universal`` wrote it (codes and
        block maxima, or fp32 values, per state); every segment takes its slice unchanged. ``step``
        is the loader's.
        """
        group = self._state_group(p)
        layout = self.layout_of(p, group)
        st = self.state[p]
        k = len(self.state_signed)
        fresh: dict = {}
        self._init_state(p, group, fresh)
        step = st.get("step", 0)
        fresh["step"] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
        if layout.has32:
            f32, _ = _views(fresh, k, codes=False)
            for si, seg in enumerate(layout.segments):
                if seg.eight_bit or seg.numel == 0:
                    continue
                values = saved[seg.name]["values"]
                c0 = layout.segment_codes[si]
                for i in range(k):
                    f32[i][c0:c0 + seg.numel] = values[i][seg.param_start:seg.param_end].to(p.device)
        if layout.has8:
            codes, absmax = _views(fresh, k, codes=True)
            for si, seg in enumerate(layout.segments):
                if not seg.eight_bit or seg.numel == 0:
                    continue
                entry = saved[seg.name]
                if int(entry["numel"]) != seg.param_numel:
                    raise ValueError(f"universal checkpoint holds {entry['numel']} elements for {seg.name}, "
                                     f"the parameter has {seg.param_numel}")
                first, nb, _ = layout.segment_blocks(si)
                c0, a0 = layout.segment_codes[si], layout.segment_absmax[si]
                for i in range(k):
                    codes[i][c0:c0 + seg.numel] = entry["codes"][i][seg.param_start:seg.param_end].to(p.device)
                    absmax[i][a0:a0 + nb] = entry["absmax"][i][first:first + nb].to(p.device)
        layout.forget_views()
        self.state[p] = fresh

    # ------------------------------------------------------------------ save
    def state_dict(self) -> dict:
        sd = super().state_dict()
        layouts = {}
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    layouts[index] = self.layout_of(p, group).describe()
                index += 1
        sd[STATE_DICT_MARKER] = {"optimizer": type(self).__name__, "format": STATE_FORMAT,
                                 "state_names": list(self.state_names), "state_signed": list(self.state_signed),
                                 "layouts": layouts}
        return sd

    @classmethod
    def export_fp32_state_dict(cls, state_dict: dict, universal: bool = False) -> dict:
        """A copy of a saved ``state_dict`` with every state as fp32 under torch's names.

        With ``universal=True`` the states are named as DeepSpeed universal checkpoints expect.
        Works on a state dict alone (no parameters needed), so checkpoints can be converted offline:
        the state names, maps and layouts come from the saved marker. A ZeRO partition's values are
        partition-long, with zeros in padding. The values are the dequantized codes, exactly.
        """
        marker = state_dict.get(STATE_DICT_MARKER) or {}
        state_names = tuple(marker.get("state_names", cls.state_names))
        signed = tuple(marker.get("state_signed", cls.state_signed))
        names = universal_names_for(state_names) if universal else state_names
        layouts = marker.get("layouts", {}) if marker.get("format") == STATE_FORMAT else None
        groups = state_dict["param_groups"]
        group_of = {pid: g for g in groups for pid in g["params"]}
        out_state = {}
        for pid, st in state_dict["state"].items():
            g = group_of.get(pid)
            if g is None:
                raise ValueError(f"state entry {pid} belongs to no parameter group")
            if not st or cls._fp32_names_in(st, state_names) == tuple(names):
                out_state[pid] = copy.copy(st)
                continue
            desc = None
            if layouts is not None:
                desc = layouts.get(pid, layouts.get(str(pid)))
                if desc is None:
                    raise ValueError(f"state entry {pid} has no saved layout: the state_dict is damaged")
                numel, shape = _numel(desc["shape"]), tuple(desc["shape"])
            else:
                first = st.get("state1")
                if first is None:
                    raise ValueError(f"state entry {pid} lacks state1: not a {cls.__name__} state_dict")
                numel, shape = first.numel(), tuple(first.shape)
            values = fp32_values_from_saved(st, desc, signed, g["quantization"], g["block_size"], numel)
            new = {k: v for k, v in st.items() if not (k.startswith("state") or k.startswith("absmax"))}
            for name, v in zip(names, values):
                new[name] = v.view(shape)
            out_state[pid] = new
        return {"state": out_state, "param_groups": copy.deepcopy(groups)}

    # ------------------------------------------------------------------ load
    def load_state_dict(self, state_dict: dict) -> None:
        """Load like torch, but keep every state tensor in the dtype it was saved with (see the module doc)."""
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
        marker = state_dict.get(STATE_DICT_MARKER) or {}
        self._check_marker(marker)
        layouts = marker.get("layouts", {}) if marker.get("format") == STATE_FORMAT else None
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved_groups)} parameter groups, this optimizer has {len(self.param_groups)}"
            )
        pairs = []
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"group {gi}: checkpoint has {len(sg['params'])} parameters, optimizer has {len(g['params'])}"
                )
            for pid, p in zip(sg["params"], g["params"]):
                pairs.append((pid, p, sg, g))
        known = self._state_keys()
        plans = []
        for pid, p, sg, g in pairs:
            st = saved_state.get(pid)
            if not st:
                continue
            bad = sorted(str(k) for k in st if k not in known)
            if bad:
                raise ValueError(f"checkpoint state of tensor {pid} has unknown keys {bad}; "
                                 f"a {type(self).__name__} state has {sorted(known)}")
            layout = self.layout_of(p, g)
            desc = None
            if layouts is not None:
                desc = layouts.get(pid, layouts.get(str(pid)))
            plans.append((pid, p, g, st, layout, self._check_saved_state(st, p, sg, g, layout, desc, layouts)))
        # nothing has changed so far: now replace
        torch_sd = {"state": {}, "param_groups": saved_groups}
        super().load_state_dict(torch_sd)
        for p in list(self.state):
            self.state.pop(p)
        for layout in self._layouts.values():
            layout.forget_views()
        requantized = 0
        for pid, p, g, st, layout, how in plans:
            if how in ("as_is", "old_fp32"):
                restored = {}
                for key, value in st.items():
                    if how == "old_fp32" and key.startswith("state"):
                        key = key + "_fp32"
                    if key == "step":
                        restored[key] = torch.tensor(float(value.item() if torch.is_tensor(value) else value))
                    elif torch.is_tensor(value):
                        restored[key] = value.detach().to(device=p.device, dtype=value.dtype).clone()
                    else:
                        restored[key] = value
                self.state[p] = restored
                self._adopt_fp32_state(p, restored, collective=True)
            else:  # old format: values requantized into this layout
                values = fp32_values_from_saved(st, None, self.state_signed, g["quantization"], g["block_size"],
                                                layout.numel)
                self.load_dequantized_state(p, dict(zip(self.state_names, values)), st.get("step", 0))
                requantized += 1
        if requantized:
            warnings.warn(f"{type(self).__name__}: the checkpoint was written before ds_q8 aligned quantization "
                          f"blocks to parameters; {requantized} partition state(s) were requantized once "
                          "(each value moves by at most half a code step)", RuntimeWarning, stacklevel=2)

    def _check_marker(self, marker: dict) -> None:
        name = type(self).__name__
        if not isinstance(marker, dict):
            raise ValueError(f"the '{STATE_DICT_MARKER}' entry of the state_dict must be a dict")
        saved_names = marker.get("state_names")
        if saved_names is not None and tuple(saved_names) != tuple(self.state_names):
            raise ValueError(f"checkpoint of {marker.get('optimizer', 'an optimizer')} keeps states "
                             f"{list(saved_names)}, this {name} keeps {list(self.state_names)}: use the optimizer "
                             "(and settings, e.g. momentum) that wrote it")

    def _check_saved_state(self, st: dict, p: torch.Tensor, saved_group: dict, group: dict, layout: StateLayout,
                           desc: Optional[dict], layouts) -> str:
        """Check one saved tensor's state against the live tensor; returns how to load it."""
        k = len(self.state_signed)
        if "step" not in st:
            raise ValueError(f"checkpoint state for a tensor of shape {tuple(p.shape)} lacks 'step'")
        fp32_names = self._fp32_names_in(st, self.state_names)
        if fp32_names is not None:
            for n in fp32_names:
                if st[n].numel() != layout.numel:
                    raise ValueError(
                        f"checkpoint {n} has {st[n].numel()} elements but the tensor of shape {tuple(p.shape)} "
                        f"has {layout.numel}: the checkpoint belongs to another model or partitioning"
                    )
                if not bool(torch.isfinite(st[n].float()).all()):
                    raise ValueError(f"checkpoint {n} contains NaN or Inf")
            return "as_is"
        for key in ("block_size", "quantization"):
            if saved_group.get(key) != group[key] and any(str(x).startswith("absmax") for x in st):
                raise ValueError(
                    f"the checkpoint's 8-bit state was written with {key}={saved_group.get(key)!r}, "
                    f"this optimizer uses {key}={group[key]!r}; use the same {key}, or load the state via "
                    f"{type(self).__name__}.export_fp32_state_dict(...) to requantize it"
                )
        if layouts is None:
            return self._check_old_state(st, p, saved_group, layout, k)
        if desc is None:
            raise ValueError(f"checkpoint holds state for a tensor of shape {tuple(p.shape)} but no layout for it: "
                             "the state_dict is damaged")
        if not layout.same_as(desc):
            if len(desc["segments"]) == 1 and len(layout.segments) == 1 and list(desc["shape"]) != list(layout.shape):
                raise ValueError(f"checkpoint state has shape {tuple(desc['shape'])} but the parameter has shape "
                                 f"{tuple(layout.shape)}: the checkpoint belongs to another model")
            raise ValueError(
                "checkpoint state was written for another partitioning of the parameters (another ZeRO stage or "
                f"world size, or other min_8bit_size/optim_bits): saved {len(desc['segments'])} segment(s) over "
                f"{desc['shape']}, this rank holds {len(layout.segments)} over {list(layout.shape)}. To resume at "
                "another world size convert the checkpoint: python -m ds_q8.checkpoint to-universal CKPT/TAG "
                "CKPT/TAG_universal, then load it with \"checkpoint\": {\"load_universal\": true}")
        codes_shape, fp32_shape = layout.state_shapes()
        for i in range(1, k + 1):
            for key, want, dtype in ((f"state{i}", codes_shape if layout.has8 else None, torch.uint8),
                                     (f"absmax{i}", (layout.num_blocks,) if layout.has8 else None, torch.float32),
                                     (f"state{i}_fp32", fp32_shape if layout.has32 else None, torch.float32)):
                v = st.get(key)
                if want is None:
                    if v is not None:
                        raise ValueError(f"checkpoint has {key}, which this tensor's layout has no place for")
                    continue
                if not torch.is_tensor(v):
                    raise ValueError(f"checkpoint state for a tensor of shape {tuple(p.shape)} lacks {key}: "
                                     f"not a {type(self).__name__} checkpoint")
                if v.dtype != dtype or v.numel() != _numel(want):
                    raise ValueError(f"checkpoint {key} has {v.numel()} elements of {v.dtype}; this tensor's layout "
                                     f"needs {_numel(want)} of {dtype}: the checkpoint belongs to another model or "
                                     "partitioning")
                if key.startswith("absmax") and not bool((torch.isfinite(v) & (v >= 0)).all()):
                    raise ValueError(f"checkpoint {key} holds NaN, Inf or negative block maxima: "
                                     "the checkpoint is corrupted")
                if key.endswith("_fp32") and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"checkpoint {key} contains NaN or Inf")
        return "as_is"

    def _check_old_state(self, st: dict, p: torch.Tensor, group: dict, layout: StateLayout, k: int) -> str:
        """A state_dict from before layouts: one state tensor per optimized tensor, blocks from its start."""
        for i in range(1, k + 1):
            s = st.get(f"state{i}")
            if not torch.is_tensor(s):
                raise ValueError(f"checkpoint state for a tensor of shape {tuple(p.shape)} lacks state{i}: "
                                 f"not a {type(self).__name__} checkpoint")
            if s.numel() != layout.numel:
                raise ValueError(
                    f"checkpoint state{i} has {s.numel()} elements but the tensor of shape {tuple(p.shape)} "
                    f"has {layout.numel}: the checkpoint belongs to another model or partitioning"
                )
            if s.dtype == torch.uint8:
                bs = group.get("block_size")
                if bs is not None:
                    F.check_block_size(bs, "checkpoint block_size")
                bs = F.resolve_block_size(bs, s.numel())
                a = st.get(f"absmax{i}")
                if a is None or a.numel() != F.num_blocks(s.numel(), bs):
                    got = None if a is None else a.numel()
                    raise ValueError(
                        f"checkpoint absmax{i} has {got} entries; {s.numel()} elements with block_size={bs} "
                        f"need {F.num_blocks(s.numel(), bs)}"
                    )
                if not bool((torch.isfinite(a) & (a >= 0)).all()):
                    raise ValueError(f"checkpoint absmax{i} holds NaN, Inf or negative block maxima: "
                                     "the checkpoint is corrupted")
            elif s.dtype != torch.float32:
                raise ValueError(f"checkpoint state{i} has dtype {s.dtype}; expected uint8 or float32")
        eight = st["state1"].dtype == torch.uint8
        if layout.whole8 and eight:
            return "as_is"  # an ordinary parameter: the old blocks are the parameter's own, same codes
        if layout.whole32 and not eight:
            return "old_fp32"  # the same values, now under state{i}_fp32
        return "requantize"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["StateIO", "STATE_DICT_MARKER", "STATE_FORMAT", "UNIVERSAL_STATE_NAMES", "universal_names_for",
           "fp32_values_from_saved"]
