"""One base class for every ds_q8 optimizer.

It owns what all of them share: argument checks (``checks.py``), each optimized tensor's state
layout (``layout.py``: which parameters it holds, 8-bit or fp32 state per parameter, blocks aligned
to parameter starts), lazy state creation, the step (``stepping.py``: fused kernels, the
reference, and agreement on blocks that ZeRO partitions cut) and state I/O (``state_io.py``).

A concrete optimizer supplies only
  * ``state_names``: torch's names of its states (``("exp_avg", "exp_avg_sq")``),
  * ``state_signed``: which map each state uses (signed for moments that change sign),
  * ``update_rule``: the name under which the fused kernels know its update,
  * ``_check_group``: validation of its own hyperparameters,
  * ``_hyper``: the step's scalars (python floats), computed once per group and step,
  * ``_update_fp32``: the update on float32 tensors, written as one IEEE operation per line so
    that a compiled kernel can reproduce it exactly;
  * and, for rules scaled by a whole-parameter norm (LAMB, LARS), ``needs_norms = True`` with
    ``_norm_terms``/``_norm_hyper``: a read-only first pass whose per-parameter norms (summed
    over the parameter's segments, and across ranks under ZeRO) become step scalars.

``block_size=None`` in a group means one block (one absmax) per parameter, for ablations.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Dict, List, Optional

import torch

from .. import functional as F
from .. import ops
from . import nonfinite as NF
from .checks import (QUANTIZATIONS, beta_hyper, check_adam_group, check_betas, check_common_group, check_range,
                     resolve_betas)
from .layout import StateLayout
from .state_io import STATE_DICT_MARKER, UNIVERSAL_STATE_NAMES, StateIO
from . import rounding, stepping, telemetry
from .stepping import StepRunner, segment_values, state_views

#: parameter attribute that asks for 32-bit state for that tensor (set by StableEmbedding)
OPTIM_BITS_ATTR = "ds_q8_optim_bits"


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


def uses_8bit(param: torch.Tensor, group: dict, numel: Optional[int] = None) -> bool:
    """Whether an original parameter keeps 8-bit state: judged on its full size, its group and its
    ``ds_q8_optim_bits`` mark, never on the size of a partition that holds part of it."""
    if getattr(param, OPTIM_BITS_ATTR, None) == 32:
        return False
    n = param.numel() if numel is None else numel
    return group["optim_bits"] == 8 and n >= group["min_8bit_size"]


class Optimizer8bitBlock(StateIO, torch.optim.Optimizer):
    state_names: tuple = ()
    state_signed: tuple = ()
    update_rule: str = ""
    #: Rules whose step is scaled by a whole-parameter quantity (the LAMB/LARS trust ratio) set this.
    needs_norms: bool = False

    def __new__(cls, *args, **kwargs):
        # Runs before __init__ binds the arguments, so an unknown key (typically from a DeepSpeed
        # JSON "params" section) gets an error that lists the valid keys.
        from ..integration.params import check_optimizer_kwargs

        check_optimizer_kwargs(cls, kwargs)
        return super().__new__(cls)

    def __init__(self, params, defaults: dict, nonfinite: str = "skip"):
        common = dict(block_size=F.DEFAULT_BLOCK_SIZE, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                      stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto")
        common.update(defaults)
        self.nonfinite = NF.check_mode(nonfinite)
        #: steps skipped because a gradient was NaN or Inf (with ``nonfinite="skip"``)
        self.skipped_steps = 0
        # optimized tensor -> StateLayout; ZeRO integration registers its flat partitions here,
        # ordinary parameters get a one-segment layout on first use
        self._layouts: Dict[torch.Tensor, StateLayout] = {}
        # ids of the tensors the optimizer was given: a tensor it steps that is not among them and has
        # no registered layout came from an unknown flattening wrapper
        self._given_ids: set = set()
        #: how each step decided that its gradients were finite: "norm" (a gradient norm that DeepSpeed
        #: computed for this step, see :attr:`grad_norm_source`) or "pass" (a read of every gradient)
        self.nonfinite_checks: collections.Counter = collections.Counter()
        #: a callable the DeepSpeed integration sets: the global gradient norm (over all ranks) that the
        #: engine computed for the step now running, or None where it computed none
        self.grad_norm_source: Optional[Callable[[], object]] = None
        self._pending_skips = NF.PendingSkips()
        self._telemetry: Optional[telemetry.Telemetry] = None  # track_quantization
        super().__init__(params, common)

    # torch pickles only defaults, state and param_groups; keep the step policy and its counter too
    def __getstate__(self):
        state = super().__getstate__()
        state["nonfinite"] = self.nonfinite
        state["skipped_steps"] = self.skipped_steps
        state.pop("_layouts", None)  # rebuilt on use (a ZeRO layout holds a process group)
        state.pop("grad_norm_source", None)  # belongs to the engine that set it
        state.pop("_pending_skips", None)  # device events
        state.pop("_telemetry", None)  # device sums of one run
        return state

    def __setstate__(self, state):
        state = dict(state)
        # torch's load_state_dict also comes through here with only state and param_groups
        self.nonfinite = state.pop("nonfinite", getattr(self, "nonfinite", "skip"))
        self.skipped_steps = state.pop("skipped_steps", getattr(self, "skipped_steps", 0))
        if not hasattr(self, "_layouts"):
            self._layouts = {}
        if not hasattr(self, "_given_ids"):
            self._given_ids = set()
        self.nonfinite_checks = getattr(self, "nonfinite_checks", collections.Counter())
        self.grad_norm_source = getattr(self, "grad_norm_source", None)
        self._pending_skips = getattr(self, "_pending_skips", NF.PendingSkips())
        self._telemetry = getattr(self, "_telemetry", None)
        super().__setstate__(state)

    # ------------------------------------------------------------------ checks
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_common_group(group)
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        self._given_ids.update(id(p) for p in group["params"])

    def _check_group(self, group: dict) -> None:
        """Validate optimizer-specific hyperparameters (override)."""

    # ------------------------------------------------------------------ layouts
    def _uses_8bit(self, p: torch.Tensor, group: dict) -> bool:
        return uses_8bit(p, group)

    def register_layout(self, tensor: torch.Tensor, layout: StateLayout) -> None:
        """Say which parameters ``tensor`` holds (ZeRO integration calls this for its partitions)."""
        if layout.numel != tensor.numel():
            raise ValueError(f"layout of {layout.numel} elements for a tensor of {tensor.numel()}")
        self._layouts[tensor] = layout

    def layout_of(self, p: torch.Tensor, group: Optional[dict] = None) -> StateLayout:
        """The state layout of an optimized tensor (an ordinary parameter: one segment, all of it)."""
        layout = self._layouts.get(p)
        if layout is None:
            group = self._find_group(p) if group is None else group
            if self.needs_norms and id(p) not in self._given_ids:
                gi = next((i for i, g in enumerate(self.param_groups) if g is group), "?")
                raise RuntimeError(
                    f"{type(self).__name__} scales each parameter's update by a norm of the whole parameter, but "
                    f"parameter group {gi} now holds a tensor of {p.numel()} elements that it was not given and "
                    "whose parameter boundaries it does not know: a wrapper flattened the parameters into "
                    "partitions. DeepSpeed's ZeRO stages 1-3 and bf16 optimizer are known (import ds_q8 before "
                    "deepspeed.initialize); with another wrapper use an element-wise optimizer such as "
                    "AdamW8bitBlock or Lion8bitBlock.")
            gi, pi, count = self._position(p, group)
            layout = StateLayout.for_parameter(p, self._uses_8bit(p, group), group["block_size"], param_index=pi,
                                               group_index=gi, num_params=count)
            self._layouts[p] = layout
        return layout

    def _position(self, p: torch.Tensor, group: dict):
        """(group index, position among the group's trainable parameters, their number) of ``p``:
        the order DeepSpeed's ZeRO partitions keep, so that a parameter has one identity everywhere."""
        gi = next((i for i, g in enumerate(self.param_groups) if g is group), 0)
        trainable = [q for q in group["params"] if q.requires_grad]
        if not any(q is p for q in trainable):  # a tensor stepped by hand: its place among all of them
            trainable = group["params"]
        pi = next((i for i, q in enumerate(trainable) if q is p), 0)
        return gi, pi, max(1, len(trainable))

    def stochastic_params(self, group: dict, p: torch.Tensor) -> bool:
        """Whether ``p`` is written with stochastic rounding (on by default for 16-bit tensors)."""
        if p.dtype not in (torch.bfloat16, torch.float16):
            return False
        choice = group.get("stochastic_rounding")
        return True if choice is None else bool(choice)

    def stochastic_states(self, group: dict) -> tuple:
        """Which states are requantized with stochastic rounding (one bool per state): the unsigned ones,
        second moments and Adagrad's sum, unless the group asks for ``state_rounding="nearest"``.

        Rounded to nearest, an exponential average that moves by less than half a code per step (a
        second moment with beta2=0.999 moves by 0.1%) loses those moves: it lags its fp32 value, by half
        on a GPT-2 attention matrix after 300 steps, and the steps grow by as much as 1.6x.
        Rounded stochastically it is right on average."""
        if group.get("state_rounding", "stochastic") != "stochastic":
            return (False,) * len(self.state_signed)
        return tuple(not signed for signed in self.state_signed)

    # ------------------------------------------------------------------ telemetry
    def track_quantization(self, every: Optional[int] = 1) -> None:
        """Measure the requantization error of every ``every``-th step (None or 0: stop).
        Cheap, and without host syncs on a GPU; see ``optim/telemetry.py`` and :meth:`quantization_report`."""
        self._telemetry = None if not every else telemetry.Telemetry(every)

    def quantization_report(self) -> dict:
        """What the 8-bit states hold now and how much the last measured requantization lost, per state,
        in total and per parameter (``optim/telemetry.py``). The code fractions need no tracking; the
        error needs :meth:`track_quantization` (None otherwise)."""
        self.settle()
        return telemetry.report(self, self._telemetry)

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        layout = self.layout_of(p, group)
        codes_shape, fp32_shape = layout.state_shapes()
        state["step"] = torch.tensor(0.0)
        for i, signed in enumerate(self.state_signed, start=1):
            if layout.has8:
                zero_index = int(torch.argmin(get_map(group["quantization"], signed, "cpu").abs()))
                state[f"state{i}"] = torch.full(codes_shape, zero_index, dtype=torch.uint8, device=p.device)
                state[f"absmax{i}"] = torch.zeros(layout.num_blocks, dtype=torch.float32, device=p.device)
            if layout.has32:
                state[f"state{i}_fp32"] = torch.zeros(fp32_shape, dtype=torch.float32, device=p.device)

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

    def _state_group(self, p: torch.Tensor) -> dict:
        """The group of an optimized tensor, also when a wrapper (ZeRO-3) took it out of the groups."""
        layout = self._layouts.get(p)
        return layout.group if layout is not None and layout.group is not None else self._find_group(p)

    def dequantized_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """fp32 copies of ``p``'s state under torch's names (empty before the first step).

        For a ZeRO partition the copies are shaped like the partition; padding reads as zero.
        """
        state = self.state.get(p, {})
        if "step" not in state or not any(k.startswith("state") for k in state):
            return {}
        group = self._state_group(p)
        layout = self.layout_of(p, group)
        k = len(self.state_signed)
        out = [torch.zeros(layout.numel, dtype=torch.float32, device=p.device) for _ in range(k)]
        maps = self._maps(group, p.device)
        for si in range(len(layout.segments)):
            for s, e, values in segment_values(layout, state, si, maps, k):
                for o, v in zip(out, values):
                    o[s:e] = v
        return {name: o.view(layout.shape) for name, o in zip(self.state_names, out)}

    def load_dequantized_state(self, p: torch.Tensor, values: Dict[str, torch.Tensor], step,
                               shared_absmax: Optional[Dict[int, List[float]]] = None) -> None:
        """Set ``p``'s state from fp32 tensors named as in :meth:`dequantized_state` (requantizing).

        On a sharded ZeRO partition this takes part in an all-reduce (the maxima of blocks cut by
        partition edges), unless ``shared_absmax`` gives them (slot -> one value per state): call it
        on every rank then.
        """
        group = self._state_group(p)
        layout = self.layout_of(p, group)
        missing = [n for n in self.state_names if n not in values]
        if missing:
            raise KeyError(f"state for {self.__class__.__name__} needs {list(self.state_names)}, missing {missing}")
        flat = []
        for name in self.state_names:
            v = values[name].detach().to(device=p.device, dtype=torch.float32).reshape(-1)
            if v.numel() != layout.numel:
                raise ValueError(f"state '{name}' has {v.numel()} elements, the tensor has {layout.numel}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"state '{name}' contains NaN or Inf")
            flat.append(v)
        fresh: dict = {}
        self._init_state(p, group, fresh)
        fresh["step"] = torch.tensor(float(int(step.item()) if torch.is_tensor(step) else int(step)))
        self._quantize_into(fresh, layout, group, flat, shared_absmax)
        layout.forget_views()
        self.state[p] = fresh

    # ------------------------------------------------------------------ one parameter's state
    def check_state_name(self, name) -> None:
        """Raise ValueError unless ``name`` is one of this optimizer's state names."""
        if name not in self.state_names:
            raise ValueError(f"{type(self).__name__} has no optimizer state {name!r}; its states are "
                             f"{', '.join(repr(n) for n in self.state_names)}")

    def _state_for(self, tensor: torch.Tensor):
        group = self._state_group(tensor)
        state = self.state[tensor]
        if "step" not in state:
            self._init_state(tensor, group, state)
        return group, self.layout_of(tensor, group), state

    def segment_state(self, tensor: torch.Tensor, si: int, name: str) -> torch.Tensor:
        """fp32 values of state ``name`` over segment ``si`` of an optimized tensor."""
        self.check_state_name(name)
        group, layout, state = self._state_for(tensor)
        i = self.state_names.index(name)
        maps = self._maps(group, tensor.device)
        parts = [values[i] for _, _, values in segment_values(layout, state, si, maps, len(self.state_signed))]
        return torch.cat(parts) if parts else torch.zeros(0)

    def set_segment_state(self, tensor: torch.Tensor, si: int, name: str, param_values: torch.Tensor) -> None:
        """Set state ``name`` of segment ``si`` from the whole parameter's fp32 values (requantizing).

        Blocks cut by partition edges take their absmax from the whole parameter, so every rank that
        holds part of one writes the same maximum without communicating.
        """
        self.check_state_name(name)
        group, layout, state = self._state_for(tensor)
        i = self.state_names.index(name)
        seg = layout.segments[si]
        v = param_values.detach().to(device=tensor.device, dtype=torch.float32).reshape(-1)
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"optimizer state '{name}' must be finite")
        local = v[seg.param_start:seg.param_end]
        if not seg.eight_bit:
            f32, _ = state_views(state, len(self.state_signed), codes=False)
            base = layout.segment_codes[si]
            f32[i][base:base + seg.numel] = local
            return
        codes, absmax = state_views(state, len(self.state_signed), codes=True)
        m = self._maps(group, tensor.device)[i]
        _, _, bs = layout.segment_blocks(si)
        for piece in layout.pieces_of(si):
            x = v[seg.param_start + piece.start - seg.start:seg.param_start + piece.end - seg.start]
            if piece.slot >= 0:
                block = (seg.param_start + piece.start - seg.start) // bs
                am = v[block * bs:min((block + 1) * bs, seg.param_numel)].abs().amax().reshape(1)
                piece_bs = piece.numel
            else:
                am, piece_bs = F.block_absmax(x, bs), bs
            absmax[i][piece.absmax_start:piece.absmax_start + am.numel()] = am
            codes[i][piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(x, am, m, piece_bs)

    def _quantize_into(self, state: dict, layout: StateLayout, group: dict, values: List[torch.Tensor],
                       shared_absmax: Optional[Dict[int, List[float]]] = None) -> None:
        """Write fp32 ``values`` (flat, tensor-long, one per state) into ``state``'s codes and fp32 parts."""
        k = len(self.state_signed)
        if layout.has32:
            f32, _ = state_views(state, k, codes=False)
            for piece in layout.pieces32:
                for f, v in zip(f32, values):
                    f[piece.codes_start:piece.codes_start + piece.numel] = v[piece.start:piece.end]
        if not layout.has8 and not layout.sharded:
            return
        device = values[0].device if values else "cpu"
        maps = self._maps(group, device)
        if layout.has8:
            codes, absmax = state_views(state, k, codes=True)
            for piece in layout.pieces8:
                _, _, bs = layout.segment_blocks(piece.segment)
                for c, a, m, v in zip(codes, absmax, maps, values):
                    x = v[piece.start:piece.end]
                    am = F.block_absmax(x, bs)
                    a[piece.absmax_start:piece.absmax_start + piece.absmax_count] = am
                    c[piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(x, am, m, bs)
        if not layout.sharded:
            return
        if shared_absmax is None:
            vec = torch.zeros(layout.num_slots * k, dtype=torch.float32, device=device)
            for piece in layout.shared8:
                for i, v in enumerate(values):
                    local = v[piece.start:piece.end].abs().max() if piece.numel else torch.zeros(())
                    vec[i * layout.num_slots + piece.slot] = local
            layout.comm.all_reduce_max(vec)
            agreed = {s: [float(vec[i * layout.num_slots + s]) for i in range(k)] for s in range(layout.num_slots)}
        else:
            agreed = shared_absmax
        for piece in layout.shared8:
            for i, (c, a, m, v) in enumerate(zip(codes, absmax, maps, values)):
                am = torch.tensor([agreed[piece.slot][i]], dtype=torch.float32, device=device)
                a[piece.absmax_start:piece.absmax_start + 1] = am
                c[piece.codes_start:piece.codes_start + piece.numel] = F.quantize_with_absmax(
                    v[piece.start:piece.end], am, m, piece.numel)

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
        self.settle()
        flag = None  # CUDA: the skip decision as a device tensor that the kernels read
        if self.nonfinite != "off":
            if NF.skip_on_device(self, work):
                norm = self.grad_norm_source() if self.grad_norm_source is not None else None
                self.nonfinite_checks["norm" if norm is not None else "device"] += 1
                flag = NF.device_flag([p.grad for _, p in work], norm)
            elif not self._grads_finite(work):
                if self.nonfinite == "raise":
                    raise FloatingPointError(
                        f"{self.__class__.__name__}: a gradient contains NaN or Inf; nothing was updated "
                        "(nonfinite='raise'; use 'skip' to skip such steps)"
                    )
                NF.report_skip(self)
                return loss
        runner = StepRunner(self, skip=flag)
        counters = []
        hypers: Dict[tuple, Dict[str, float]] = {}  # _hyper depends on the group and step count only
        for group, p in work:
            layout = self.layout_of(p, group)
            state = self.state[p]
            if self._adopt_fp32_state(p, state):
                state = self.state[p]
            if "step" not in state:
                self._init_state(p, group, state)
            step_t = state["step"]
            if not torch.is_tensor(step_t):  # an int written by a loader
                step_t = state["step"] = torch.tensor(float(step_t))
            step_t += 1
            counters.append(state)
            count = int(step_t.item())
            hkey = (id(group), count)
            h = hypers.get(hkey)
            if h is None:
                h = hypers[hkey] = self._hyper(group, count)
            random = self.stochastic_params(group, p) or (layout.has8 and any(self.stochastic_states(group)))
            sr = rounding.step_key(group.get("sr_seed", 0), count) if random else None
            seg_hyper = self._segment_hypers(p, p.grad, state, layout, group, h) if self.needs_norms else None
            sums = None if self._telemetry is None else self._telemetry.sums_for(p, layout, len(self.state_signed), count)
            runner.add(p, p.grad, state, layout, group, h, seg_hyper, sr, sums)
        runner.run()
        if flag is not None:
            self._pending_skips.add(flag, counters)
        return loss

    def settle(self) -> None:
        """Take in the skip decisions of earlier CUDA steps (see ``optim/nonfinite.py``): a skipped
        step is counted in ``skipped_steps`` and its step counts are taken back. ``step()`` and
        ``state_dict()`` call it; call it before reading ``skipped_steps`` right after a CUDA step."""
        if self._pending_skips.entries:
            self._pending_skips.settle(self)

    def state_dict(self) -> dict:
        self.settle()
        return super().state_dict()

    def _grads_finite(self, work) -> bool:
        """Whether every gradient on every rank is finite.

        A gradient norm that DeepSpeed already computed for this step (with gradient clipping, on by
        default) answers it: the norm is finite exactly when every gradient element is, and it is
        the same on every rank. Otherwise every gradient is read (one compiled pass on CPU).
        """
        norm = self.grad_norm_source() if self.grad_norm_source is not None else None
        if norm is not None:
            self.nonfinite_checks["norm"] += 1
            return math.isfinite(float(norm))
        self.nonfinite_checks["pass"] += 1
        use_kernel = any(ops.group_impl(g) != "reference" for g in self.param_groups)
        return NF.grads_all_finite([p.grad for _, p in work], use_kernel)

    @staticmethod
    def _write_param(dst: torch.Tensor, p32: torch.Tensor, sr, offset: int = 0) -> None:
        """Write fp32 values into a parameter (or its chunk): rounded to nearest, or stochastically
        with ``sr = (key, index of dst's first element in its parameter)``."""
        if sr is None or dst.dtype == torch.float32:
            dst.copy_(p32.view(dst.shape))
            return
        index = torch.arange(sr[1] + offset, sr[1] + offset + p32.numel(), device=p32.device)
        dst.copy_(rounding.round_stochastic(p32.reshape(-1), dst.dtype, sr[0], index).view(dst.shape))

    def _reference_step_32bit(self, p, grad, states, sr, h) -> None:
        if p.dtype == torch.float32:
            self._update_fp32(p.data, grad.to(torch.float32), list(states), h)
        else:
            p32 = p.data.to(torch.float32)
            self._update_fp32(p32, grad.to(torch.float32), list(states), h)
            self._write_param(p.data, p32, sr)

    def _reference_step_8bit(self, p, grad, codes, absmax, sr, group, h, error_sums=None) -> None:
        """The specification of the 8-bit step, on a tensor (or piece) whose first element starts a block.

        ``sr`` is None or ``(key, index of p's first element in its parameter)``: the random bits of
        stochastic rounding (``rounding.py``), for 16-bit parameter writes and for the states that
        :meth:`stochastic_states` names. ``error_sums`` (telemetry) takes the requantization error."""
        bs = F.resolve_block_size(group["block_size"], p.numel())
        maps = self._maps(group, p.device)
        state_keys = [rounding.state_key(sr[0], i) if sr is not None and on else None
                      for i, on in enumerate(self.stochastic_states(group))]
        param_sr = sr if self.stochastic_params(group, p) else None
        n = p.numel()
        # a non-contiguous parameter (e.g. a transposed view) is stepped in a flat copy, written back below
        in_place = p.data.is_contiguous()
        pf = p.data.view(-1) if in_place else p.data.reshape(-1).clone()
        gf = grad.reshape(-1)
        flat_codes = [c.view(-1) for c in codes]
        chunk = max(bs, stepping.REFERENCE_CHUNK // bs * bs)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            b0, b1 = start // bs, F.num_blocks(end, bs)
            p32 = pf[start:end] if p.dtype == torch.float32 else pf[start:end].to(torch.float32)
            g32 = gf[start:end].to(torch.float32)
            states = [F.dequantize_flat(c[start:end], a[b0:b1], m, bs) for c, a, m in zip(flat_codes, absmax, maps)]
            self._update_fp32(p32, g32, states, h)
            for c, a, m, s, key in zip(flat_codes, absmax, maps, states, state_keys):
                new_absmax = F.block_absmax(s, bs)
                a[b0:b1] = new_absmax
                bits = None if key is None else rounding.random_bits(
                    key, torch.arange(sr[1] + start, sr[1] + end, device=p.device))
                c[start:end] = F.quantize_with_absmax(s, new_absmax, m, bs, bits)
            if error_sums is not None:
                for i, (c, a, m, s) in enumerate(zip(flat_codes, absmax, maps, states)):
                    telemetry.add_error(error_sums, i, F.dequantize_flat(c[start:end], a[b0:b1], m, bs), s)
            if p.dtype != torch.float32:
                self._write_param(pf[start:end], p32, param_sr, start)
        if not in_place:
            p.data.copy_(pf.view(p.shape))

    # ------------------------------------------------------------------ whole-parameter rules
    def _norm_terms(self, p, g, states, h) -> tuple:
        """Tensors (float32, one chunk) whose whole-parameter L2 norms the step needs (override).

        ``states`` are scratch copies and may be changed; ``p`` and ``g`` must not be.
        """
        raise NotImplementedError

    def _norm_hyper(self, h: Dict[str, float], norms: List[float]) -> Dict[str, float]:
        """The step's scalars once the norms of ``_norm_terms`` are known (override)."""
        raise NotImplementedError

    def _segment_hypers(self, p, grad, state, layout: StateLayout, group, h) -> list:
        """First pass of a whole-parameter rule: each segment's step scalars; no state is changed.

        Squares are summed in float64 per parameter over its segments, chunk by chunk (the chunks
        dequantize the same codes the update pass will), and across ranks for a sharded partition.
        """
        k = len(self.state_signed)
        maps = self._maps(group, p.device)
        pf, gf = layout.param_views(p), grad.reshape(-1)
        sums: Optional[torch.Tensor] = None
        for si, seg in enumerate(layout.segments):
            for s, e, values in segment_values(layout, state, si, maps, k):
                terms = self._norm_terms(pf[s:e].to(torch.float32), gf[s:e].to(torch.float32),
                                         [v.clone() for v in values], h)
                if sums is None:
                    sums = torch.zeros(layout.num_params, len(terms), dtype=torch.float64)
                for j, t in enumerate(terms):
                    sums[seg.param_index, j] += float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)
        if sums is None:  # no segment here (or an empty parameter): the norms are 0
            probe = self._norm_terms(torch.zeros(0), torch.zeros(0), [torch.zeros(0) for _ in range(k)], h)
            sums = torch.zeros(layout.num_params, len(probe), dtype=torch.float64)
        if layout.sharded:
            layout.comm.all_reduce_sum(sums)
        norms = sums.sqrt().tolist()
        by_param: Dict[int, Dict[str, float]] = {}
        out = []
        for seg in layout.segments:
            hp = by_param.get(seg.param_index)
            if hp is None:
                hp = by_param[seg.param_index] = self._norm_hyper(h, norms[seg.param_index])
            out.append(hp)
        return out


__all__ = ["Optimizer8bitBlock", "check_range", "get_map", "uses_8bit", "OPTIM_BITS_ATTR", "STATE_DICT_MARKER",
           "UNIVERSAL_STATE_NAMES", "beta_hyper", "check_adam_group", "check_betas", "resolve_betas", "QUANTIZATIONS"]
