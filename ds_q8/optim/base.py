"""The base class of every ds_q8 optimizer: torch's ``Optimizer`` surface over quantized state.

A concrete optimizer supplies its hyperparameters (constructor defaults and ``_check_group``), its
step scalars (``_hyper``: python floats computed once per group and step) and which update rule it
runs (``rule``, from ``rules.py``). Everything else is shared and lives in one place each:

  * which tensors it steps, with each one's layout and state: ``tensor_states.py`` (the registry);
    the state itself: ``qstate.py`` (:class:`QuantizedState`, over a
    :class:`~ds_q8.optim.layout.StateLayout`: which slices of which parameters it holds, 8-bit or
    fp32 per parameter, blocks aligned to parameter starts);
  * the step: ``step.py`` (kernels or reference), its non-finite decision: ``nonfinite.py``;
  * saving, loading and converting state, and adopting fp32 state a loader wrote: ``state_io.py``;
  * the options every optimizer takes (``group_options.OPTIONS``), with their checks and how the step
    reads them: ``group_options.py``.

``block_size=None`` in a group means one block (one absmax) per parameter, for ablations.
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, List, Optional

import torch

from .. import embeddings
from . import codec_versions, state_io, telemetry, nonfinite as NF
from . import step as S
from .checks import check_optimizer_kwargs
from .group_options import OPTIONS, check_common_group, check_four_bit, class_options, with_options
from .layout import StateLayout
from .qstate import QuantizedState
from .state_keys import has_storage, is_8bit
from .rules import Rule
from .tensor_states import OPTIM_BITS_ATTR, TensorStates, uses_8bit

#: each class's :meth:`Optimizer8bitBlock.rule_when_built` with no arguments, asked once
_DEFAULT_RULES: dict = {}


class Optimizer8bitBlock(torch.optim.Optimizer):
    #: the class's update rule (``rules.py``): every group's, unless a subclass's :meth:`rule_for`
    #: answers per group (Muon and its auxiliary AdamW; RMSprop with or without momentum). Only
    #: :meth:`rule_for` reads it; everything else asks :meth:`rule_for`, or :meth:`rule_when_built`
    #: where it has no live group (the marker's header, the class-level conversions, the memory estimate).
    rule: Optional[Rule] = None
    #: a function that tags a model's parameters for the groups this class forms (Muon8bitBlock's
    #: ``use_muon``), which DeepSpeed's ``set_optimizer_flags`` calls on the model; None: no tags
    tag_parameters: Optional[Callable[[torch.nn.Module], object]] = None
    #: the class's defaults of options that differ from :data:`OPTIONS` (e.g. ``quantization``), the one
    #: place a class changes an option's default: the constructor's signature shows them
    #: (``group_options.with_options``), and every group built without the option gets them
    option_defaults: Dict[str, object] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        with_options(cls)

    def __new__(cls, *args, **kwargs):
        # Runs before __init__ binds the arguments, so an unknown key (typically from a DeepSpeed
        # JSON "params" section) gets an error that lists the valid keys.
        check_optimizer_kwargs(cls, kwargs)
        return super().__new__(cls)

    def __init__(self, params, defaults: dict, **options):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"{type(self).__name__} got unknown option(s) {unknown}; valid: {', '.join(OPTIONS)}")
        options = dict(class_options(type(self)), **options)
        self.nonfinite = NF.check_mode(options.pop("nonfinite"))
        #: steps skipped because a gradient was NaN or Inf (with ``nonfinite="skip"``)
        self.skipped_steps = 0
        #: each optimized tensor's layout and quantized state (ZeRO integration registers its flat
        #: partitions; ordinary parameters get a one-segment layout on first use)
        self.tensors = TensorStates(self)
        #: how each step decided that its gradients were finite: "norm" (a gradient norm that DeepSpeed
        #: computed for this step, see :attr:`grad_norm_source`) or "pass" (a read of every gradient)
        self.nonfinite_checks: collections.Counter = collections.Counter()
        #: a callable the DeepSpeed integration sets: the global gradient norm (over all ranks) that the
        #: engine computed for the step now running, or None where it computed none
        self.grad_norm_source: Optional[Callable[[], object]] = None
        self._given_norm = None  # step(grad_norm=...) while that step runs
        self._pending_skips = NF.PendingSkips()
        self._telemetry: Optional[telemetry.Telemetry] = None  # track_quantization
        #: the last step's plan, reused while it holds (``plan.py``)
        self._plan = None
        self._built = False  # until then add_param_group leaves the embeddings' log line to the constructor
        super().__init__(params, dict(options, **defaults))
        self._built = True
        self._note_embeddings(self.param_groups)

    def rule_for(self, group: dict) -> Rule:
        """The rule that steps ``group``'s tensors (the class's :attr:`rule`, unless overridden).

        Everything that depends on a tensor's states (their number, names and maps, the storage
        keys, the saved marker, the report, the step) asks this, through :meth:`rule_of` for a tensor."""
        if self.rule is None:
            raise NotImplementedError(f"{type(self).__name__} names no update rule: set the class attribute "
                                      "'rule' (ds_q8.optim.rules) or override rule_for(group)")
        return self.rule

    @classmethod
    def rule_when_built(cls, **params) -> Rule:
        """The rule of the group that an instance built with ``params`` (the constructor's keyword
        arguments, a DeepSpeed config's ``"params"``) forms for one small parameter, as :meth:`rule_for`
        answers it: RMSprop8bitBlock built with ``momentum=0.9`` keeps two states, without it one."""
        if not params and cls in _DEFAULT_RULES:
            return _DEFAULT_RULES[cls]
        probe = cls([torch.zeros(1)], **params)
        rule = probe.rule_for(probe.param_groups[0])
        if not params:
            _DEFAULT_RULES[cls] = rule
        return rule

    def rule_of(self, p: torch.Tensor) -> Rule:
        """The rule of an optimized tensor's group (a ZeRO partition's: its layout's group)."""
        return self.rule_for(self._state_group(p))

    @property
    def state_names(self) -> tuple:
        """Every state name the groups' rules use, in group order (one rule: its names)."""
        names = []
        for group in self.param_groups:
            names += [n for n in self.rule_for(group).state_names if n not in names]
        return tuple(names)

    # torch pickles only defaults, state and param_groups; keep the step policy and its counter too
    def __getstate__(self):
        state = super().__getstate__()
        state["nonfinite"] = self.nonfinite
        state["skipped_steps"] = self.skipped_steps
        for transient in ("tensors",  # rebuilt on use (a ZeRO layout holds a process group)
                          "grad_norm_source",  # belongs to the engine that set it
                          "_pending_skips",  # device events
                          "_telemetry",  # device sums of one run
                          "_plan"):  # rebuilt by the next step
            state.pop(transient, None)
        return state

    def __setstate__(self, state):
        state = dict(state)
        # torch's load_state_dict also comes through here with only state and param_groups
        self.nonfinite = state.pop("nonfinite", getattr(self, "nonfinite", "skip"))
        self.skipped_steps = state.pop("skipped_steps", getattr(self, "skipped_steps", 0))
        for name, make in (("nonfinite_checks", collections.Counter), ("grad_norm_source", lambda: None), ("_given_norm", lambda: None),
                           ("_pending_skips", NF.PendingSkips), ("_telemetry", lambda: None), ("_plan", lambda: None)):
            if not hasattr(self, name):
                setattr(self, name, make())
        super().__setstate__(state)
        if not hasattr(self, "tensors"):  # unpickled: every parameter of the groups was given
            self.tensors = TensorStates(self)
            self.tensors.given_ids.update(id(p) for g in self.param_groups for p in g["params"])

    # ------------------------------------------------------------------ hyperparameters
    def add_param_group(self, param_group: dict) -> None:
        self._plan = None
        if isinstance(param_group, dict) and param_group.get("optim_bits") in (4, 8):
            # a group that chose its own bits gets them for its embeddings too, unless it says otherwise
            param_group.setdefault("embeddings_32bit", False)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_common_group(group)
            check_four_bit(group, self.rule_for(group), type(self).__name__)
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        self.tensors.given_ids.update(id(p) for p in group["params"])
        if getattr(self, "_built", True):
            self._note_embeddings([group])

    def _note_embeddings(self, groups) -> None:
        """Log once which embedding parameters keep 32-bit state by ``embeddings_32bit`` (``ds_q8.embeddings``)."""
        kept = embeddings.kept_at_32bit(groups)
        if kept:
            ids = {id(p) for p in kept}
            states = max(self.rule_for(g).num_states for g in groups if any(id(p) in ids for p in g["params"]))
            embeddings.note_kept(type(self).__name__, kept, states)

    def _check_group(self, group: dict) -> None:
        """Validate optimizer-specific hyperparameters (override)."""

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        """The step scalars of ``group`` at step number ``step`` (override)."""
        raise NotImplementedError

    def _initial_state(self, group: dict) -> Optional[tuple]:
        """Each state's starting value (None: all zero; override)."""
        return None

    def stochastic_params(self, group: dict, p: torch.Tensor) -> bool:
        """Whether ``p`` is written with stochastic rounding (on by default for 16-bit tensors)."""
        return S.stochastic_params(group, p.dtype)

    def rounding_modes(self, group: dict) -> tuple:
        """How each state of ``group`` is requantized, as the kernels take it (``group_options.rounding_modes``)."""
        return S.rounding_modes(group, self.rule_for(group).state_signed)

    def _maps(self, group: dict, device) -> List[torch.Tensor]:
        return S.maps_of(self.rule_for(group), group, device)

    # ------------------------------------------------------------------ layouts
    def register_layout(self, tensor: torch.Tensor, layout: StateLayout, group: Optional[dict] = None) -> None:
        """Say which parameters ``tensor`` holds (ZeRO integration calls this for its partitions), and
        its group where a wrapper keeps the tensor out of the groups (ZeRO-3)."""
        self._plan = None
        self.tensors.register_layout(tensor, layout, group)

    def layout_of(self, p: torch.Tensor, group: Optional[dict] = None) -> StateLayout:
        """The state layout of an optimized tensor (an ordinary parameter: one segment, all of it)."""
        return self.tensors.layout_of(p, group)

    def _state_group(self, p: torch.Tensor) -> dict:
        return self.tensors.group_of(p)

    # ------------------------------------------------------------------ state
    def quantized_state(self, p: torch.Tensor, group: Optional[dict] = None, create: bool = True) -> QuantizedState:
        """The :class:`QuantizedState` of an optimized tensor, its storage created on first use
        (``create=False``: as it is, possibly empty)."""
        return self.tensors.quantized_state(p, group, create)

    @staticmethod
    def is_8bit_state(state: dict) -> bool:
        return is_8bit(state)

    def check_state_name(self, name, tensor: Optional[torch.Tensor] = None) -> None:
        """Raise ValueError unless ``name`` is one of this optimizer's state names (of ``tensor``'s
        rule when given: with a rule per group, a tensor's states are its group's)."""
        names = self.state_names if tensor is None else self.rule_of(tensor).state_names
        if name not in names:
            whose = "" if tensor is None or names == self.state_names else " for this parameter's group"
            raise ValueError(f"{type(self).__name__} has no optimizer state {name!r}{whose}; its states are "
                             f"{', '.join(repr(n) for n in names)}")

    def dequantized_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """fp32 copies of ``p``'s state under torch's names (empty before the first step).

        For a ZeRO partition the copies are shaped like the partition; padding reads as zero."""
        if not has_storage(self.state.get(p, {})):
            return {}
        qs = self.quantized_state(p)
        return {name: v.view(qs.layout.shape) for name, v in zip(self.rule_of(p).state_names, qs.read(p.device))}

    def load_dequantized_state(self, p: torch.Tensor, values: Dict[str, torch.Tensor], step,
                               shared_absmax: Optional[Dict[int, List[float]]] = None) -> None:
        """Set ``p``'s state from fp32 tensors named as in :meth:`dequantized_state` (requantizing).

        On a sharded ZeRO partition this takes part in an all-reduce (the maxima of blocks cut by
        partition edges), unless ``shared_absmax`` gives them (slot -> one value per state): call it
        on every rank then."""
        layout = self.layout_of(p, self._state_group(p))
        names = self.rule_of(p).state_names
        missing = [n for n in names if n not in values]
        if missing:
            raise KeyError(f"state for {self.__class__.__name__} needs {list(names)}, missing {missing}")
        flat = []
        for name in names:
            v = values[name].detach().to(device=p.device, dtype=torch.float32).reshape(-1)
            if v.numel() != layout.numel:
                raise ValueError(f"state '{name}' has {v.numel()} elements, the tensor has {layout.numel}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"state '{name}' contains NaN or Inf")
            flat.append(v)
        qs = self.tensors.create_state(p)
        qs.entry["step"] = torch.tensor(float(int(step.item()) if torch.is_tensor(step) else int(step)))
        qs.write(flat, shared_absmax)

    def segment_state(self, tensor: torch.Tensor, si: int, name: str) -> torch.Tensor:
        """fp32 values of state ``name`` over segment ``si`` of an optimized tensor."""
        self.check_state_name(name, tensor)
        return self.quantized_state(tensor).read_segment(si, self.rule_of(tensor).state_names.index(name))

    def set_segment_state(self, tensor: torch.Tensor, si: int, name: str, param_values: torch.Tensor) -> None:
        """Set state ``name`` of segment ``si`` from the whole parameter's fp32 values (requantizing;
        see :meth:`QuantizedState.write_segment`)."""
        self.check_state_name(name, tensor)
        v = param_values.detach().to(device=tensor.device, dtype=torch.float32).reshape(-1)
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"optimizer state '{name}' must be finite")
        self.quantized_state(tensor).write_segment(si, self.rule_of(tensor).state_names.index(name), v)

    # ------------------------------------------------------------------ telemetry
    def track_quantization(self, every: Optional[int] = 1) -> None:
        """Measure the requantization error of every ``every``-th step (None or 0: stop).
        Cheap, and without host syncs on a GPU; see ``optim/telemetry.py`` and :meth:`quantization_report`."""
        self._telemetry = None if not every else telemetry.Telemetry(every)

    def quantization_report(self) -> dict:
        """What the quantized states (8- or 4-bit) hold now and how much the last measured requantization
        lost, per state, in total and per parameter (``optim/telemetry.py``). The code fractions need no
        tracking; the error needs :meth:`track_quantization` (None otherwise)."""
        self.settle()
        # every quantized tensor, each with its own group's rule (Muon's matrices keep momentum_buffer)
        states = [(p, self.quantized_state(p, create=False), self.rule_of(p).state_names)
                  for p, st in self.state.items() if is_8bit(st)]
        return telemetry.report(states, self._telemetry)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, *, grad_norm=None):
        """``grad_norm``: the gradients' global norm, already computed (``clip_grad_norm_``'s): it answers
        the non-finite check instead of a read of every gradient (``optim/nonfinite.py``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.settle()
        self._given_norm = NF.check_norm(grad_norm)
        try:
            S.optimizer_step(self)
        finally:
            self._given_norm = None
        return loss

    def settle(self) -> None:
        """Take in the skip decisions of earlier CUDA steps (see ``optim/nonfinite.py``): a skipped
        step is counted in ``skipped_steps`` and its step counts are taken back. ``step()`` and
        ``state_dict()`` call it; call it before reading ``skipped_steps`` right after a CUDA step."""
        if self._pending_skips.entries:
            self._pending_skips.settle(self)

    # ------------------------------------------------------------------ saving and loading (state_io.py)
    @classmethod
    def universal_names(cls) -> tuple:
        """The names this optimizer's states carry in DeepSpeed universal checkpoints."""
        return state_io.universal_names_for(cls.rule_when_built().state_names)

    def state_dict(self) -> dict:
        self.settle()
        sd = super().state_dict()
        layouts, tensor_states, codecs, index = {}, {}, set(), 0
        head = type(self).rule_when_built()
        for group in self.param_groups:
            rule = self.rule_for(group)
            for p in group["params"]:
                if p in self.state:
                    layout = self.layout_of(p, group)
                    layouts[index] = layout.describe()
                    if is_8bit(self.state[p]):  # the codecs of the codes saved, so a loader knows what they mean
                        codecs.add(codec_versions.codec_name(group["quantization"], layout.state_bits))
                    if rule.state_names != head.state_names or rule.state_signed != head.state_signed:
                        tensor_states[index] = state_io.tensor_states(rule.state_names, rule.state_signed)
                index += 1
        # entries whose group runs the class's rule are described by the marker's header; only the others
        # name their states (so an optimizer with one rule writes the marker it always wrote)
        sd[state_io.STATE_DICT_MARKER] = state_io.marker(type(self).__name__, head.state_names, head.state_signed,
                                                         layouts, tensor_states, codec_versions.marker_codecs(codecs))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like torch, but keep every state tensor in the dtype it was saved with, check
        everything before replacing anything, and refuse keys it does not know (``state_io.py``)."""
        state_dict = state_io.upgraded(state_dict, self.param_groups, type(self).rule_when_built())
        # codes in today's codec versions (a format-3 checkpoint decided over every rank's share of it)
        state_dict = codec_versions.current(state_dict, reduce=self._sum_over_ranks())
        plans = state_io.plan_load(self, state_dict)
        # nothing has changed so far: now replace
        self._plan = None
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.state.clear()
        self.tensors.qstates.clear()
        for p, st in plans:
            self.state[p] = state_io.restored_entry(st, p.device)
            self._adopt_fp32_state(p, self.state[p], collective=True)

    @classmethod
    def export_fp32_state_dict(cls, state_dict: dict, universal: bool = False) -> dict:
        """A copy of a saved ``state_dict`` with every state as fp32 under torch's names (``universal``:
        under the names DeepSpeed universal checkpoints expect). Needs no parameters: the state names,
        maps and layouts come from the saved marker. The values are the dequantized codes, exactly."""
        return state_io.export_fp32(codec_versions.current(state_dict), cls.rule_when_built(), universal)

    def _sum_over_ranks(self) -> Optional[Callable[[torch.Tensor], None]]:
        """An in-place all-reduce sum over the ranks that share this optimizer's ZeRO partitions, or None
        without partitions (every rank of a ZeRO run registers its partitions' layouts with their comm)."""
        comm = next((lay.comm for lay in self.tensors.layouts.values() if lay.comm is not None), None)
        return None if comm is None else comm.all_reduce_sum

    def _adopt_fp32_state(self, p: torch.Tensor, state: dict, collective: bool = False,
                          group: Optional[dict] = None) -> bool:
        """Requantize state that a loader wrote as fp32 (``state_io.adopt_fp32``)."""
        return state_io.adopt_fp32(self, p, state, collective, group)

    def adopt_loaded_state(self) -> int:
        """Requantize fp32 state that a loader wrote straight into ``self.state``; call on every rank.

        ``step`` does this by itself for ordinary parameters; the DeepSpeed checkpoint hook does it
        for ZeRO partitions. Returns the number of tensors converted."""
        return state_io.adopt_loaded(self)

    def adopt_tensor_collectively(self, p: torch.Tensor) -> bool:
        """Requantize fp32 state of one sharded tensor if any rank has some; call on every rank."""
        return state_io.adopt_collectively(self, p)

    def restore_codes(self, p: torch.Tensor, saved: Dict[str, dict]) -> None:
        """Rebuild a tensor's state after a universal load, code for code (``state_io.restore_codes``)."""
        state_io.restore_codes(self, p, saved, S.corrected(self._state_group(p), p.dtype))


__all__ = ["Optimizer8bitBlock", "OPTIONS", "uses_8bit", "OPTIM_BITS_ATTR"]
