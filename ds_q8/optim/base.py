"""One base class for every ds_q8 optimizer.

It owns what all of them share: argument checks, the state layout (8-bit codes plus per-block
absmax, or fp32 for small tensors and 32-bit groups), lazy state creation, the chunked
dequantize -> update -> requantize loop of the reference path, dispatch to fused kernels, and a
``load_state_dict`` that keeps uint8 codes uint8.

A concrete optimizer supplies only
  * ``state_names``: torch's names of its states (``("exp_avg", "exp_avg_sq")``),
  * ``state_signed``: which map each state uses (signed for moments that change sign),
  * ``update_rule``: the name under which the fused kernels know its update,
  * ``_check_group``: validation of its own hyperparameters,
  * ``_hyper``: the step's scalars (python floats), computed once per parameter and step,
  * ``_update_fp32``: the update on float32 tensors, written as one IEEE operation per line so
    that a compiled kernel can reproduce it exactly;
  * and, for rules scaled by a whole-parameter norm (LAMB, LARS), ``needs_norms = True`` with
    ``_norm_terms``/``_norm_hyper``: a read-only first pass whose norms become step scalars.

``block_size=None`` in a group means one block (one absmax) per tensor, for ablations.
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Dict, List, Optional

import torch

from .. import functional as F
from . import nonfinite as NF

#: parameter attribute that asks for 32-bit state for that tensor (set by StableEmbedding)
OPTIM_BITS_ATTR = "ds_q8_optim_bits"

# Elements processed per chunk by the reference path: bounds its fp32 temporaries.
_REFERENCE_CHUNK = 1 << 20

_QUANTIZATIONS = ("dynamic", "linear")

# DeepSpeed's universal checkpoints know only Adam's two state names; any optimizer with at most
# two states travels under them, in order (state1 -> exp_avg, state2 -> exp_avg_sq).
UNIVERSAL_STATE_NAMES = ("exp_avg", "exp_avg_sq")

#: key of the marker that ``state_dict`` adds so offline tools know which optimizer wrote it
STATE_DICT_MARKER = "ds_q8"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_range(name: str, value, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    """Raise ValueError naming ``name`` unless ``value`` is a number in the stated interval."""
    if hi == math.inf:  # no hyperparameter may be infinite: one inf lr or eps turns every update to NaN
        hi_open = True
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    interval = f"{left}{lo}, {hi}{right}"
    if not _is_number(value) or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if bad_lo or bad_hi:
        raise ValueError(f"{name} must be in {interval}, got {value}")


def get_map(kind: str, signed: bool, device) -> torch.Tensor:
    """The 256-entry map for a quantization kind, cached per device."""
    key = (kind, signed, str(device))
    m = _device_maps.get(key)
    if m is None:
        base = F.create_dynamic_map(signed) if kind == "dynamic" else F.create_linear_map(signed)
        m = base.to(device)
        _device_maps[key] = m
    return m


_device_maps: Dict[tuple, torch.Tensor] = {}


def block_size_of(group: dict, p: torch.Tensor) -> int:
    """The block length for ``p``'s state: the group's ``block_size``, or all of ``p`` when it is None."""
    return F.resolve_block_size(group["block_size"], p.numel())


class Optimizer8bitBlock(torch.optim.Optimizer):
    state_names: tuple = ()
    state_signed: tuple = ()
    update_rule: str = ""
    #: Rules whose step is scaled by a whole-tensor quantity (the LAMB/LARS trust ratio) set this.
    #: step() then runs a first pass over the tensor that changes nothing, takes the L2 norm of
    #: each tensor ``_norm_terms`` returns, and lets ``_norm_hyper`` fold the norms into the
    #: step's scalars; the update itself stays one elementwise ``_update_fp32`` pass.
    needs_norms: bool = False

    def __new__(cls, *args, **kwargs):
        # Runs before __init__ binds the arguments, so an unknown key (typically from a DeepSpeed
        # JSON "params" section) gets an error that lists the valid keys.
        from ..integration.params import check_optimizer_kwargs

        check_optimizer_kwargs(cls, kwargs)
        return super().__new__(cls)

    def __init__(self, params, defaults: dict, nonfinite: str = "skip"):
        common = dict(block_size=F.DEFAULT_BLOCK_SIZE, min_8bit_size=4096, optim_bits=8, quantization="dynamic")
        common.update(defaults)
        self.nonfinite = NF.check_mode(nonfinite)
        #: steps skipped because a gradient was NaN or Inf (with ``nonfinite="skip"``)
        self.skipped_steps = 0
        # Element counts of each group's parameters as given: a whole-tensor rule compares them with
        # what the group holds at step time to notice flattening wrappers (ZeRO).
        self._given_numels: List[List[int]] = []
        super().__init__(params, common)

    # torch pickles only defaults, state and param_groups; keep the step policy and its counter too
    def __getstate__(self):
        state = super().__getstate__()
        state["nonfinite"] = self.nonfinite
        state["skipped_steps"] = self.skipped_steps
        state["_given_numels"] = self._given_numels
        return state

    def __setstate__(self, state):
        state = dict(state)
        # torch's load_state_dict also comes through here with only state and param_groups
        self.nonfinite = state.pop("nonfinite", getattr(self, "nonfinite", "skip"))
        self.skipped_steps = state.pop("skipped_steps", getattr(self, "skipped_steps", 0))
        self._given_numels = state.pop("_given_numels", getattr(self, "_given_numels", []))
        super().__setstate__(state)

    # ------------------------------------------------------------------ checks
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_common(group)
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        self._given_numels.append([p.numel() for p in group["params"]])

    def _check_common(self, group: dict) -> None:
        check_range("lr", group["lr"], 0.0, math.inf)
        if group["block_size"] is not None:
            try:
                F.check_block_size(group["block_size"])
            except ValueError:
                raise ValueError(
                    f"block_size must be a power of two in [{F.MIN_BLOCK_SIZE}, {F.MAX_BLOCK_SIZE}] "
                    f"or None (one block per tensor), got {group['block_size']!r}"
                ) from None
        mbs = group["min_8bit_size"]
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 0:
            raise ValueError(f"min_8bit_size must be an integer >= 0, got {mbs!r}")
        if group["optim_bits"] not in (8, 32) or isinstance(group["optim_bits"], bool):
            raise ValueError(f"optim_bits must be 8 or 32, got {group['optim_bits']!r}")
        if group["quantization"] not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {group['quantization']!r}")

    def _check_group(self, group: dict) -> None:
        """Validate optimizer-specific hyperparameters (override)."""

    # ------------------------------------------------------------------ state
    def _uses_8bit(self, p: torch.Tensor, group: dict) -> bool:
        if getattr(p, OPTIM_BITS_ATTR, None) == 32:
            return False
        return group["optim_bits"] == 8 and p.numel() >= group["min_8bit_size"]

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        state["step"] = 0
        if self._uses_8bit(p, group):
            nb = F.num_blocks(p.numel(), block_size_of(group, p))
            for i, signed in enumerate(self.state_signed, start=1):
                zero_index = int(torch.argmin(get_map(group["quantization"], signed, "cpu").abs()))
                state[f"state{i}"] = torch.full(p.shape, zero_index, dtype=torch.uint8, device=p.device)
                state[f"absmax{i}"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            for i in range(1, len(self.state_signed) + 1):
                state[f"state{i}"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    @staticmethod
    def is_8bit_state(state: dict) -> bool:
        s = state.get("state1")
        return s is not None and s.dtype == torch.uint8

    def _maps(self, group: dict, device) -> List[torch.Tensor]:
        return [get_map(group["quantization"], s, device) for s in self.state_signed]

    def _find_group(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not managed by this optimizer")

    def dequantized_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """fp32 copies of ``p``'s state under torch's names (empty before the first step)."""
        state = self.state.get(p, {})
        if "state1" not in state:
            return {}
        group = self._find_group(p)
        out = {}
        if self.is_8bit_state(state):
            for i, (name, m) in enumerate(zip(self.state_names, self._maps(group, p.device)), start=1):
                out[name] = F.dequantize_flat(
                    state[f"state{i}"].reshape(-1), state[f"absmax{i}"], m, block_size_of(group, p)
                ).view(p.shape)
        else:
            for i, name in enumerate(self.state_names, start=1):
                out[name] = state[f"state{i}"].detach().clone()
        return out

    def load_dequantized_state(self, p: torch.Tensor, values: Dict[str, torch.Tensor], step: int) -> None:
        """Set ``p``'s state from fp32 tensors named as in :meth:`dequantized_state` (requantizing)."""
        group = self._find_group(p)
        missing = [n for n in self.state_names if n not in values]
        if missing:
            raise KeyError(f"state for {self.__class__.__name__} needs {list(self.state_names)}, missing {missing}")
        fresh: dict = {}
        self._init_state(p, group, fresh)
        fresh["step"] = int(step)
        eight = self.is_8bit_state(fresh)
        for i, (name, m) in enumerate(zip(self.state_names, self._maps(group, p.device)), start=1):
            v = values[name].detach().to(device=p.device, dtype=torch.float32).reshape(-1)
            if v.numel() != p.numel():
                raise ValueError(f"state '{name}' has {v.numel()} elements, the parameter has {p.numel()}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"state '{name}' contains NaN or Inf")
            if eight:
                am = F.block_absmax(v, block_size_of(group, p))
                fresh[f"absmax{i}"] = am
                fresh[f"state{i}"] = F.quantize_with_absmax(v, am, m, block_size_of(group, p)).view(p.shape)
            else:
                fresh[f"state{i}"] = v.clone().view(p.shape)
        self.state[p] = fresh

    # ------------------------------------------------------------------ step
    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        raise NotImplementedError

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{self.__class__.__name__} does not support sparse gradients; "
                        "use a dense embedding (sparse=False)"
                    )
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"{self.__class__.__name__} supports float32/float16/bfloat16 params, got {p.dtype}")
                work.append((group, p))
        if self.nonfinite != "off" and not NF.grads_all_finite([p.grad for _, p in work]):
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"{self.__class__.__name__}: a gradient contains NaN or Inf; nothing was updated "
                    "(nonfinite='raise'; use 'skip' to skip such steps)"
                )
            NF.report_skip(self)
            return loss
        # 8-bit parameters that share a group and step count share every hyperparameter, so their
        # kernels run as one batch (one call for many small tensors); the rest go one at a time.
        batches: Dict[tuple, tuple] = {}
        hypers: Dict[tuple, Dict[str, float]] = {}  # _hyper depends on the group and step count only
        for group, p in work:
            grad = p.grad
            state = self.state[p]
            if self._adopt_fp32_state(p, state):
                state = self.state[p]
            state1 = state.get("state1")
            if state1 is None:
                self._init_state(p, group, state)
                state1 = state["state1"]
            state["step"] = int(state["step"]) + 1
            hkey = (id(group), state["step"])
            h = hypers.get(hkey)
            if h is None:
                h = hypers[hkey] = self._hyper(group, state["step"])
            if self.needs_norms:
                self._check_whole_tensors(group)
                h = self._norm_hyper(h, self._tensor_norms(p, grad, state, group, h))
                self._step_param(p, grad, state, group, h)
            elif p.is_cpu or p.is_cuda:
                eight = state1.dtype is torch.uint8
                if not eight and p.is_cuda:
                    self._step_param(p, grad, state, group, h)
                    continue
                key = hkey + (eight,)
                batch = batches.get(key)
                if batch is None:
                    batch = batches[key] = (group, h, eight, [])
                batch[3].append((p, grad, state))
            else:
                self._step_param(p, grad, state, group, h)
        if batches:
            from .. import ops

            for group, h, eight, items in batches.values():
                fused = ops.fused_step_many if eight else ops.fused_step_fp32_many
                for p, grad, state in fused(self, items, group, h):
                    self._step_param(p, grad, state, group, h)
        return loss

    def _step_param(self, p, grad, state, group, h) -> None:
        if self.is_8bit_state(state):
            from .. import ops

            if not ops.fused_step(self, p, grad, state, group, h):
                self._reference_step_8bit(p, grad, state, group, h)
        else:
            self._reference_step_32bit(p, grad, state, h)

    # ------------------------------------------------------------------ whole-tensor rules
    def _norm_terms(self, p, g, states, h) -> tuple:
        """Tensors (float32, one chunk) whose whole-tensor L2 norms the step needs (override).

        ``states`` are scratch copies and may be changed; ``p`` and ``g`` must not be.
        """
        raise NotImplementedError

    def _norm_hyper(self, h: Dict[str, float], norms: List[float]) -> Dict[str, float]:
        """The step's scalars once the norms of ``_norm_terms`` are known (override)."""
        raise NotImplementedError

    def _tensor_norms(self, p, grad, state, group, h) -> List[float]:
        """First pass of a whole-tensor rule: L2 norms over all of ``p``; no state is changed.

        It walks the same chunks and dequantizes the same codes as the update pass, so a norm of
        the updated state is a norm of exactly what the update will then compute. Squares are
        summed in float64.
        """
        eight = self.is_8bit_state(state)
        k = len(self.state_signed)
        n = p.numel()
        bs = block_size_of(group, p) if eight else 1
        maps = self._maps(group, p.device) if eight else []
        pf, gf = p.detach().reshape(-1), grad.reshape(-1)
        flat = [state[f"state{i}"].view(-1) for i in range(1, k + 1)]
        sums: List[float] = []
        chunk = max(bs, _REFERENCE_CHUNK // bs * bs)
        # an empty tensor still makes one (empty) chunk, so its norms are 0
        for start in range(0, max(n, 1), chunk):
            end = min(n, start + chunk)
            if eight:
                b0, b1 = start // bs, F.num_blocks(end, bs)
                absmax = [state[f"absmax{i}"][b0:b1] for i in range(1, k + 1)]
                states = [F.dequantize_flat(c[start:end], a, m, bs) for c, a, m in zip(flat, absmax, maps)]
            else:
                states = [s[start:end].clone() for s in flat]
            terms = self._norm_terms(pf[start:end].to(torch.float32), gf[start:end].to(torch.float32), states, h)
            part = [float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2) for t in terms]
            sums = part if not sums else [a + b for a, b in zip(sums, part)]
        return [math.sqrt(x) for x in sums]

    def _check_whole_tensors(self, group: dict) -> None:
        """Refuse to step when a wrapper replaced the group's parameters by flat partitions.

        ZeRO (stages 1-3) hands the optimizer one flat fp32 partition per group that cuts across
        parameters, so a per-parameter norm cannot be formed from it.
        """
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        given = self._given_numels[gi] if gi < len(self._given_numels) else None
        held = [q.numel() for q in group["params"]]
        if held != given:
            raise RuntimeError(
                f"{self.__class__.__name__} scales each parameter's update by a norm of the whole parameter, "
                f"but parameter group {gi} now holds tensors of {held} elements instead of the {given} it was "
                "given: its parameters were flattened into partitions, which hide parameter boundaries (ZeRO "
                "stages 1-3 and DeepSpeed's bf16 optimizer do this). Run it with ZeRO stage 0 in fp32 or fp16, "
                "or use an optimizer without a per-parameter norm (e.g. AdamW8bitBlock, Lion8bitBlock)."
            )

    def _reference_step_32bit(self, p, grad, state, h) -> None:
        states = [state[f"state{i}"] for i in range(1, len(self.state_signed) + 1)]
        if p.dtype == torch.float32:
            self._update_fp32(p.data, grad.to(torch.float32), states, h)
        else:
            p32 = p.data.to(torch.float32)
            self._update_fp32(p32, grad.to(torch.float32), states, h)
            p.data.copy_(p32)

    def _reference_step_8bit(self, p, grad, state, group, h) -> None:
        bs = block_size_of(group, p)
        maps = self._maps(group, p.device)
        n = p.numel()
        # a non-contiguous parameter (e.g. a transposed view) is stepped in a flat copy, written back below
        in_place = p.data.is_contiguous()
        pf = p.data.view(-1) if in_place else p.data.reshape(-1).clone()
        gf = grad.reshape(-1)
        k = len(self.state_signed)
        codes = [state[f"state{i}"].view(-1) for i in range(1, k + 1)]
        absmax = [state[f"absmax{i}"] for i in range(1, k + 1)]
        chunk = max(bs, _REFERENCE_CHUNK // bs * bs)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            b0, b1 = start // bs, F.num_blocks(end, bs)
            p32 = pf[start:end] if p.dtype == torch.float32 else pf[start:end].to(torch.float32)
            g32 = gf[start:end].to(torch.float32)
            states = [F.dequantize_flat(c[start:end], a[b0:b1], m, bs) for c, a, m in zip(codes, absmax, maps)]
            self._update_fp32(p32, g32, states, h)
            for c, a, m, s in zip(codes, absmax, maps, states):
                new_absmax = F.block_absmax(s, bs)
                a[b0:b1] = new_absmax
                c[start:end] = F.quantize_with_absmax(s, new_absmax, m, bs)
            if p.dtype != torch.float32:
                pf[start:end].copy_(p32)
        if not in_place:
            p.data.copy_(pf.view(p.shape))

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def universal_names(cls) -> tuple:
        """The names this optimizer's states carry in DeepSpeed universal checkpoints."""
        k = len(cls.state_signed)
        if k > len(UNIVERSAL_STATE_NAMES):
            raise ValueError(
                f"{cls.__name__} keeps {k} states; DeepSpeed universal checkpoints carry at most "
                f"{len(UNIVERSAL_STATE_NAMES)} ({', '.join(UNIVERSAL_STATE_NAMES)})"
            )
        return UNIVERSAL_STATE_NAMES[:k]

    @classmethod
    def _fp32_names_in(cls, st: dict, state_names: Optional[tuple] = None) -> Optional[tuple]:
        """Which fp32 naming (torch's, then universal) ``st`` uses for all states, if any.

        ``state_names`` overrides the class's names for optimizers whose layout is chosen per
        instance (RMSprop with or without momentum).
        """
        names = tuple(cls.state_names if state_names is None else state_names)
        candidates = [names]
        if len(names) <= len(UNIVERSAL_STATE_NAMES):
            candidates.append(UNIVERSAL_STATE_NAMES[:len(names)])
        for cand in candidates:
            if cand and all(torch.is_tensor(st.get(n)) for n in cand):
                return tuple(cand)
        return None

    @functools.cached_property
    def _fp32_state_names(self) -> frozenset:
        """The names fp32 state can arrive under: this optimizer's and the universal checkpoint's."""
        return frozenset(self.state_names + UNIVERSAL_STATE_NAMES)

    def _adopt_fp32_state(self, p: torch.Tensor, state: dict) -> bool:
        """Requantize state that arrived as fp32 under torch's or universal names.

        DeepSpeed's universal-checkpoint loader writes fp32 ``exp_avg``/``exp_avg_sq`` and ``step``
        straight into ``optimizer.state``; this turns them into codes and block maxima before the
        next update. Returns True when the state was replaced.
        """
        if self._fp32_state_names.isdisjoint(state):
            return False  # the usual case, one set test per parameter and step
        names = self._fp32_names_in(state, self.state_names)
        if names is None:
            return False
        step = state.get("step", 0)
        step = int(step.item()) if torch.is_tensor(step) else int(step or 0)
        values = {tn: state[n] for tn, n in zip(self.state_names, names)}
        self.load_dequantized_state(p, values, step)
        return True

    def adopt_loaded_state(self) -> int:
        """Requantize fp32 state that a loader wrote straight into ``self.state``.

        :meth:`step` does this by itself; call it to inspect the state right after DeepSpeed's
        universal-checkpoint loader ran. Returns the number of parameters converted.
        """
        return sum(self._adopt_fp32_state(p, st) for p, st in list(self.state.items()))

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd[STATE_DICT_MARKER] = {"optimizer": type(self).__name__}
        return sd

    @classmethod
    def export_fp32_state_dict(cls, state_dict: dict, universal: bool = False) -> dict:
        """A copy of a saved ``state_dict`` with every state as fp32 under torch's names.

        With ``universal=True`` the states are named as DeepSpeed universal checkpoints expect
        (see :meth:`universal_names`). Works on a state dict alone (no parameters needed), so
        checkpoints can be converted offline. The values are the dequantized codes, exactly.
        """
        names = cls.universal_names() if universal else cls.state_names
        groups = state_dict["param_groups"]
        group_of = {pid: g for g in groups for pid in g["params"]}
        out_state = {}
        for pid, st in state_dict["state"].items():
            g = group_of.get(pid)
            if g is None:
                raise ValueError(f"state entry {pid} belongs to no parameter group")
            if not st or cls._fp32_names_in(st) == tuple(names):
                out_state[pid] = copy.copy(st)
                continue
            new = {k: v for k, v in st.items() if not (k.startswith("state") or k.startswith("absmax"))}
            for i, (signed, name) in enumerate(zip(cls.state_signed, names), start=1):
                codes = st.get(f"state{i}")
                if codes is None:
                    raise ValueError(f"state entry {pid} lacks state{i}: not a {cls.__name__} state_dict")
                if codes.dtype == torch.uint8:
                    m = get_map(g["quantization"], signed, codes.device)
                    bs = F.resolve_block_size(g["block_size"], codes.numel())
                    values = F.dequantize_flat(codes.reshape(-1), st[f"absmax{i}"], m, bs)
                    new[name] = values.view(codes.shape)
                else:
                    new[name] = codes.detach().to(torch.float32).clone()
            out_state[pid] = new
        return {"state": out_state, "param_groups": copy.deepcopy(groups)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like torch, but keep every state tensor in the dtype it was saved with.

        torch's loader casts floating state to the parameter's dtype, which would turn uint8
        codes into floats and fp32 absmax into bf16. The saved dtypes are restored and the
        state is checked against the parameters before anything is replaced. State saved as fp32
        under torch's names (e.g. by :meth:`export_fp32_state_dict`) is requantized.
        """
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError("optimizer state_dict must have 'state' (dict) and 'param_groups' (list)")
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
                pairs.append((pid, p, sg))
        for pid, p, sg in pairs:
            if pid in saved_state:
                self._check_saved_state(saved_state[pid], p, sg)
        self._check_saved_layout(saved_groups, saved_state)
        torch_sd = {k: v for k, v in state_dict.items() if k != STATE_DICT_MARKER}
        super().load_state_dict(torch_sd)
        for pid, p, _ in pairs:
            if pid not in saved_state:
                continue
            restored = {}
            for key, value in saved_state[pid].items():
                if torch.is_tensor(value) and key != "step":
                    restored[key] = value.detach().to(device=p.device, dtype=value.dtype).clone()
                elif key == "step":
                    restored[key] = int(value.item()) if torch.is_tensor(value) else int(value)
                else:
                    restored[key] = value
            self.state[p] = restored
            self._adopt_fp32_state(p, restored)

    def _check_saved_layout(self, saved_groups: list, saved_state: dict) -> None:
        """Codes only mean something under the block size and map they were written with."""
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            has_codes = any(self.is_8bit_state(saved_state.get(pid, {})) for pid in sg["params"])
            if not has_codes:
                continue
            for key in ("block_size", "quantization"):
                if sg.get(key) != g[key]:
                    raise ValueError(
                        f"group {gi}: the checkpoint's 8-bit state was written with {key}={sg.get(key)!r}, "
                        f"this optimizer uses {key}={g[key]!r}; use the same {key}, or load the state via "
                        f"{type(self).__name__}.export_fp32_state_dict(...) to requantize it"
                    )

    def _check_saved_state(self, st: dict, p: torch.Tensor, group: dict) -> None:
        name = self.__class__.__name__
        k = len(self.state_signed)
        if not st:
            return
        fp32_names = self._fp32_names_in(st, self.state_names)
        if fp32_names is not None:
            for n in fp32_names:
                if st[n].numel() != p.numel():
                    raise ValueError(
                        f"checkpoint {n} has {st[n].numel()} elements but the parameter of shape {tuple(p.shape)} "
                        f"has {p.numel()}: the checkpoint belongs to another model or partitioning"
                    )
                if not bool(torch.isfinite(st[n].float()).all()):
                    raise ValueError(f"checkpoint {n} contains NaN or Inf")
            return
        expected = [f"state{i}" for i in range(1, k + 1)]
        missing = [key for key in expected + ["step"] if key not in st]
        if missing:
            raise ValueError(f"checkpoint state for a parameter of shape {tuple(p.shape)} lacks {missing}: "
                             f"not a {name} checkpoint")
        for i in range(1, k + 1):
            s = st[f"state{i}"]
            if s.numel() != p.numel():
                raise ValueError(
                    f"checkpoint state{i} has {s.numel()} elements but the parameter of shape {tuple(p.shape)} "
                    f"has {p.numel()}: the checkpoint belongs to another model or partitioning"
                )
            if s.dtype == torch.uint8:
                bs = group.get("block_size")
                if bs is not None:
                    F.check_block_size(bs, "checkpoint block_size")
                bs = F.resolve_block_size(bs, p.numel())
                a = st.get(f"absmax{i}")
                if a is None or a.numel() != F.num_blocks(p.numel(), bs):
                    got = None if a is None else a.numel()
                    raise ValueError(
                        f"checkpoint absmax{i} has {got} entries; {p.numel()} elements with block_size={bs} "
                        f"need {F.num_blocks(p.numel(), bs)}"
                    )
                if not bool((torch.isfinite(a) & (a >= 0)).all()):
                    raise ValueError(f"checkpoint absmax{i} holds NaN, Inf or negative block maxima: "
                                     "the checkpoint is corrupted")
            elif s.dtype != torch.float32:
                raise ValueError(f"checkpoint state{i} has dtype {s.dtype}; expected uint8 or float32")


def resolve_betas(betas) -> tuple:
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        return tuple(betas)
    raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")


def check_betas(group: dict) -> None:
    """Validate ``group["betas"]`` (a list from JSON becomes a tuple)."""
    beta1, beta2 = resolve_betas(group["betas"])
    group["betas"] = (beta1, beta2)
    check_range("betas[0]", beta1, 0.0, 1.0, hi_open=True)
    check_range("betas[1]", beta2, 0.0, 1.0, hi_open=True)


def check_adam_group(group: dict) -> None:
    """The checks shared by the Adam-style rules (Adam, AdamW, LAMB): betas, eps, weight_decay."""
    check_betas(group)
    check_range("eps", group["eps"], 0.0, math.inf)
    check_range("weight_decay", group["weight_decay"], 0.0, math.inf)


def beta_hyper(group: dict) -> Dict[str, float]:
    """The step scalars every two-beta rule uses."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2)


__all__ = ["Optimizer8bitBlock", "check_range", "get_map", "OPTIM_BITS_ATTR"]
