"""Every place ds_q8 patches DeepSpeed (and ``torch.optim``), in one table, and the one ``install``
that applies it.

The integration modules hold the logic and patch nothing themselves. A row names its target as
``module:attribute.path`` (the module part is imported, the rest read as attributes), how it is
patched, the ds_q8 function that does it and why:

* ``before`` / ``after``: the target method first calls ``function(self, *args, **kwargs)``, or
  calls ``function(self, result, *args, **kwargs)`` on its result;
* ``replace``: the target becomes ``function(original)``;
* ``set``: every ``name: value`` of ``function()`` becomes an attribute of the target;
* ``append``: every item of ``function()`` not in the target list is appended to it;
* ``per-engine``: not applied by :func:`install` (its target is checked); the function patches one
  engine's object (or the wrapper DeepSpeed built for it) when the row named in ``why`` runs, and
  leaves the class alone.

Rows are applied in order; two ``before`` rows on one method therefore run last-listed first.

When: ``import ds_q8`` applies the rows of torch (:func:`import_rows`), and the ``deepspeed.initialize``
row once DeepSpeed is imported (:func:`entry_rows`); the whole table is installed when DeepSpeed first
meets a ds_q8 optimizer (``integration.entry``) or ``ds_q8.register_with_deepspeed()`` is called.
Every target is looked up first; those a DeepSpeed lacks raise one ``contract.DeepSpeedContractError``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from . import (checkpoint_files, contract, embedding_marks, engine_checks, engine_hooks, entry, grad_norm, host_copies,
               muon_tags, shared_masters, universal, zero_layout)
from .lookup import optimizer_classes

BEFORE, AFTER, REPLACE, SET, APPEND, PER_ENGINE = "before", "after", "replace", "set", "append", "per-engine"
_KINDS = (BEFORE, AFTER, REPLACE, SET, APPEND, PER_ENGINE)


@dataclass(frozen=True)
class Patch:
    """One row of the table: ``target`` is patched ``how``, by ``function``, because ``why``."""

    target: str
    how: str
    function: Callable
    why: str

    def __post_init__(self):
        if self.how not in _KINDS:
            raise ValueError(f"patch of {self.target}: unknown kind {self.how!r}; one of {_KINDS}")

    @property
    def dotted(self) -> str:
        return self.target.replace(":", ".")

    @property
    def package(self) -> str:
        """The installed package the target belongs to (``deepspeed``, ``torch``)."""
        return self.target.split(":")[0].split(".")[0]

    @property
    def name(self) -> str:
        """What marks this patch as applied on its target (see ``engine_hooks``)."""
        return f"ds_q8:{self.how}:{self.function.__module__}.{self.function.__qualname__}"


def _optimizer_class_list() -> list:
    return list(optimizer_classes().values())


def _is_ds_q8(optimizer) -> bool:
    from ..optim import Optimizer8bitBlock

    return isinstance(optimizer, Optimizer8bitBlock)


def _guard_initialize(original):
    return entry.guard(original, install_once, _after_configure_optimizer, _is_ds_q8, optimizer_classes())


ENTRY = "deepspeed:initialize"
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_LINKAGE = "deepspeed.utils.mixed_precision_linkage"
_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"

PATCHES: Tuple[Patch, ...] = (
    Patch("torch.optim", SET, optimizer_classes,
          "DeepSpeed resolves an optimizer \"type\" it does not know as an attribute of torch.optim"),
    Patch(ENTRY, REPLACE, _guard_initialize,
          "install this table when deepspeed.initialize meets a ds_q8 optimizer, before DeepSpeed builds anything"),
    Patch("deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS", APPEND, _optimizer_class_list,
          "ZeRO accepts only optimizer classes listed there"),
    Patch(f"{_ENGINE}._configure_zero_optimizer", BEFORE, engine_checks.check_zero_config,
          "refuse elastic_checkpoint and NVMe optimizer offload, which corrupt 8-bit state, and the offload paths "
          "that step with DeepSpeed's own 32-bit optimizers (ZenFlow, SuperOffload, partial offload), on every rank "
          "before any buffer is allocated"),
    Patch("deepspeed.runtime.base_optimizer:ZeROOptimizer._configure_master_weights", REPLACE,
          engine_checks._master_weights_without_cpu_adam,
          "DeepSpeed allows 16-bit master weights only with optimizers that keep bf16 state or DeepSpeedCPUAdam; "
          "a ds_q8 optimizer keeps 8-bit state and steps 16-bit masters itself"),
    Patch(f"{_ENGINE}.load_checkpoint", BEFORE, checkpoint_files._check_engine_load,
          "refuse truncated or corrupted checkpoint files (CRC-32 of this rank's files) on every rank "
          "before DeepSpeed replaces anything"),
    Patch(f"{_ENGINE}._configure_zero_optimizer", AFTER, zero_layout._attach_hook,
          "tell the ds_q8 optimizer which parameter slices each ZeRO flat partition holds"),
    Patch(f"{_ENGINE}._configure_zero_optimizer", AFTER, shared_masters._share_hook,
          "with bf16 masters, ZeRO-1/2's master partition is a copy of the rank's slice of the bf16 parameters "
          "that DeepSpeed copies back after every step: make it a view of that slice, and lay out the reduced "
          "gradients in partition order so that the step needs no flattened copy of them"),
    Patch(f"{_ENGINE}._configure_zero_optimizer", AFTER, host_copies._drop_hook,
          "with ZeRO-Offload, DeepSpeed keeps host buffers that repeat what the host holds for a ds_q8 optimizer: "
          "ZeRO-1/2's bf16 image of bf16 masters (the masters take its place) and its never-used gradient buffer "
          "(released); ZeRO-3's second gradient partition (each sub-group's gradient becomes its slice of the "
          "flat one)"),
    Patch(f"{_STAGE3}.reload_states", AFTER, host_copies._after_reload_states,
          "reload_states gives ZeRO-3's flat gradient buffer new storage: the sub-groups' gradients follow it"),
    Patch(f"{_STAGE12}.copy_grads_in_partition", REPLACE, shared_masters._copy_grads_in_partition,
          "store each reduced gradient at its place in the partition where shared_masters laid one out"),
    Patch(f"{_STAGE12}.step", BEFORE, shared_masters._hand_preflattened,
          "hand the partition's gradient as one view of that buffer (DeepSpeed's pre-flattened gradient), "
          "so that the step does not flatten a copy"),
    Patch(f"{_STAGE12}.state_dict", AFTER, shared_masters._own_storage,
          "a checkpoint's master partitions are saved as views of the whole bf16 group once shared: give each "
          "its own storage, so that each rank's file holds its partition only"),
    Patch(f"{_ENGINE}._configure_bf16_optimizer", AFTER, zero_layout._attach_hook,
          "the same for the flat partitions of DeepSpeed's bf16 optimizer"),
    Patch(f"{_LINKAGE}:get_full_hp_param", REPLACE, zero_layout._patched_get_full_hp_param,
          "safe_get_full_optimizer_state reads ds_q8's 8-bit state (link_hp_params binds this to each "
          "parameter, again after every load)"),
    Patch(f"{_LINKAGE}:set_full_hp_param", REPLACE, zero_layout._patched_set_full_hp_param,
          "safe_set_full_optimizer_state writes ds_q8's 8-bit state"),
    Patch(f"{_STAGE3}.get_full_hp_param", REPLACE, zero_layout._patched_z3_get,
          "the same read under ZeRO stage 3, which has its own method"),
    Patch(f"{_STAGE3}.set_full_hp_param", REPLACE, zero_layout._patched_z3_set,
          "the same write under ZeRO stage 3"),
    Patch(f"{_ENGINE}.load_checkpoint", BEFORE, universal._refuse_other_world_size,
          "DeepSpeed cannot resume ZeRO optimizer state at another world size; say how ds_q8 does, on every "
          "rank, before anything loads"),
    Patch(f"{_ENGINE}._load_zero_checkpoint", AFTER, universal._restore_hook,
          "after DeepSpeed loaded a universal checkpoint's fp32 values, put the saved 8-bit codes back"),
    Patch(f"{_ENGINE}._configure_optimizer", AFTER, grad_norm._attach_hook,
          "answer the step's non-finite check with the gradient norm DeepSpeed computed, saving a read of "
          "every gradient"),
    Patch("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step", PER_ENGINE, grad_norm._from_wrapper,
          "applied by grad_norm's after-_configure_optimizer row: the wrapper's _global_grad_norm is the "
          "ds_q8 step's only while this wrapper's step runs"),
    Patch(f"{_STAGE3}.step", PER_ENGINE, grad_norm._from_wrapper,
          "the same for the ZeRO stage 3 wrapper"),
    Patch("deepspeed.runtime.bf16_optimizer:BF16_Optimizer.step", PER_ENGINE, grad_norm._from_wrapper,
          "the same for DeepSpeed's bf16 optimizer"),
    Patch("deepspeed:set_optimizer_flags", REPLACE, muon_tags._tag_for_muon8bit,
          "deepspeed.initialize tags use_muon (2-D, not embed/lm_head) only for \"type\": \"Muon\"; tag the same "
          "way for Muon8bitBlock"),
    Patch("deepspeed:set_optimizer_flags", REPLACE, embedding_marks._mark_embeddings,
          "mark the embedding parameters of the model deepspeed.initialize was given, by name, before the engine "
          "builds the optimizer: they keep 32-bit state by default (embeddings_32bit), also for a model built "
          "before import ds_q8"),
    Patch(f"{_STAGE12}._is_muon_group", REPLACE, muon_tags._is_muon_group,
          "ZeRO-1/2 runs DeepSpeed's own fp32 Muon for any optimizer named *muon* whose parameters carry "
          "use_muon; Muon8bitBlock does the whole step itself"),
    Patch(f"{_STAGE12}.get_flat_partition", REPLACE, muon_tags._without_muon_tags,
          "the same check, inline there: use_muon is hidden from it while it runs for a ds_q8 optimizer"),
    Patch(f"{_STAGE12}._get_flat_partition_unpadded", REPLACE, muon_tags._without_muon_tags,
          "the same in its unpadded variant"),
    Patch(f"{_ENGINE}.clip_fp32_gradients", PER_ENGINE, grad_norm._from_fp32_clip,
          "applied by grad_norm's after-_configure_optimizer row: without ZeRO or 16-bit training the engine's "
          "own clip drops the norm it computed; keep it for the next ds_q8 step"),
)


def _get(obj, part: str):
    if not hasattr(obj, part):
        raise AttributeError(f"{getattr(obj, '__name__', obj)!r} has no {part!r}")
    return getattr(obj, part)


def resolve(target: str):
    """The object a target names (``module:attribute.path``, or a bare module)."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = _get(obj, part)
    return obj


def owner_of(target: str) -> Tuple[object, str]:
    """The object holding a target's attribute, and the attribute's name."""
    module, _, path = target.partition(":")
    head, _, attr = path.rpartition(".")
    owner = resolve(f"{module}:{head}")
    _get(owner, attr)
    return owner, attr


def _apply(row: Patch, where) -> None:
    if row.how == SET:
        for name, value in row.function().items():
            if getattr(where, name, None) is not value:
                setattr(where, name, value)
    elif row.how == APPEND:
        for value in row.function():
            if value not in where:
                where.append(value)
    else:
        apply = {BEFORE: engine_hooks.run_before, AFTER: engine_hooks.run_after, REPLACE: engine_hooks.replace}
        apply[row.how](*where, row.function, row.name)


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def _look_up(table: Sequence[Patch]):
    """``(found, absent, missing)``: each applicable row with where it applies, the packages that cannot
    be imported, and ``(target, reason)`` for each target an imported package lacks."""
    found, absent, missing = [], set(), []
    for row in table:
        if row.package in absent or not _importable(row.package):
            absent.add(row.package)
            continue
        try:
            where = resolve(row.target) if row.how in (SET, APPEND) else owner_of(row.target)
        except (ImportError, AttributeError) as e:
            if row.dotted not in dict(missing):  # several rows may patch one place
                missing.append((row.dotted, str(e)))
            continue
        if row.how != PER_ENGINE:
            found.append((row, where))
    return found, absent, missing


def install(table: Sequence[Patch] = PATCHES) -> bool:
    """Apply every row once (a second call changes nothing). Every target is looked up first, per-engine
    ones included: where an installed package lacks any, one ``DeepSpeedContractError`` names them all
    and nothing is patched. Returns False when a package the table patches cannot be imported
    (DeepSpeed not installed): none of that package's rows are applied then, the others are."""
    found, absent, missing = _look_up(table)
    contract.fail(missing)
    for row, where in found:
        _apply(row, where)
    if any(row.package == "deepspeed" for row, _ in found):
        contract.warn_outside_range(contract.deepspeed_version())
    if table is PATCHES and not absent and not _installed:
        _installed.append(True)
    return not absent


_installed = []  # the whole table was installed in this process


def install_once() -> bool:
    """Install the whole table unless it was; True when this call installed it."""
    if _installed:
        return False
    install()
    return True


def import_rows() -> Tuple[Patch, ...]:
    """What ``import ds_q8`` applies: the rows of torch, which DeepSpeed does not need to be there."""
    return tuple(row for row in PATCHES if row.package == "torch")


def entry_rows() -> Tuple[Patch, ...]:
    """What is applied once DeepSpeed is imported: its public ``initialize``, nothing private."""
    return tuple(row for row in PATCHES if row.target == ENTRY)


def _after_configure_optimizer(engine) -> None:
    # the rows after the engine's _configure_optimizer, for an engine whose optimizer callable made a ds_q8
    # optimizer while that method ran, before the table was installed
    for row in PATCHES:
        if row.target == f"{_ENGINE}._configure_optimizer" and row.how == AFTER:
            row.function(engine, None)


def describe(table: Sequence[Patch] = PATCHES) -> List[str]:
    """One line per row: target, how, function, why."""
    return [f"{row.dotted}  [{row.how}]  {row.function.__module__.rpartition('.')[2]}.{row.function.__qualname__}"
            f"  -- {row.why}" for row in table]
