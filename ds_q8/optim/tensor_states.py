"""Which tensors an optimizer steps, and the layout and quantized state of each.

An optimizer steps ordinary parameters, or under ZeRO the flat partitions that a wrapper made of
them. :class:`TensorStates` keeps, per stepped tensor, its :class:`~ds_q8.optim.layout.StateLayout`
(registered by the ZeRO integration for a partition, made on first use for a parameter) and its
:class:`~ds_q8.optim.qstate.QuantizedState` over the entry of ``optimizer.state`` that torch saves.
It asks the optimizer only for its groups, their rules (``rule_for``) and a fresh state's start.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .layout import StateLayout
from .qstate import QuantizedState

#: parameter attribute that asks for 32-bit state for that tensor (set by StableEmbedding)
OPTIM_BITS_ATTR = "ds_q8_optim_bits"
#: parameter attribute that says an embedding module registered the tensor; its value names it (``ds_q8.embeddings``)
EMBEDDING_ATTR = "ds_q8_embedding"


def keeps_embeddings_32bit(group: dict) -> bool:
    """Whether ``group`` keeps its embeddings' state in 32 bits (``embeddings_32bit``). A group saved before
    the option existed has no such key: its embeddings kept 8-bit state, and a resumed run keeps them so."""
    return bool(group.get("embeddings_32bit", False))


def uses_8bit(param: torch.Tensor, group: dict, numel: Optional[int] = None) -> bool:
    """Whether an original parameter keeps 8-bit state: judged on its full size, its group (``optim_bits``,
    ``min_8bit_size``, ``embeddings_32bit``), its ``ds_q8_optim_bits`` mark and its embedding mark, never
    on the size of a partition that holds part of it."""
    if getattr(param, OPTIM_BITS_ATTR, None) == 32:
        return False
    if keeps_embeddings_32bit(group) and getattr(param, EMBEDDING_ATTR, None) is not None:
        return False
    n = param.numel() if numel is None else numel
    return group["optim_bits"] in (4, 8) and n >= group["min_8bit_size"]


def state_bits_of(group: dict) -> int:
    """Bits of each code of a group's quantized states: 4 with ``optim_bits=4``, else 8."""
    return 4 if group.get("optim_bits") == 4 else 8


class TensorStates:
    """The per-tensor registry of one optimizer: layouts, quantized states, the tensors it was given."""

    def __init__(self, opt):
        self.opt = opt
        #: optimized tensor -> StateLayout
        self.layouts: Dict[torch.Tensor, StateLayout] = {}
        #: the group of a registered tensor that a wrapper takes out of the groups (ZeRO-3)
        self.groups: Dict[torch.Tensor, dict] = {}
        self.qstates: Dict[torch.Tensor, QuantizedState] = {}
        #: ids of the tensors the optimizer was given: a tensor it steps that is not among them and has
        #: no registered layout came from an unknown flattening wrapper
        self.given_ids: set = set()

    # ------------------------------------------------------------------ layouts
    def register_layout(self, tensor: torch.Tensor, layout: StateLayout, group: Optional[dict] = None) -> None:
        if layout.numel != tensor.numel():
            raise ValueError(f"layout of {layout.numel} elements for a tensor of {tensor.numel()}")
        self.layouts[tensor] = layout
        if group is not None:
            self.groups[tensor] = group
        self.qstates.pop(tensor, None)

    def layout_of(self, p: torch.Tensor, group: Optional[dict] = None) -> StateLayout:
        layout = self.layouts.get(p)
        if layout is None:
            group = self.find_group(p) if group is None else group
            if self.opt.rule_for(group).needs_norms and id(p) not in self.given_ids:
                self._refuse_unknown_flattening(p, group)
            gi, pi, count = self.position(p, group)
            layout = StateLayout.for_parameter(p, uses_8bit(p, group), group["block_size"], param_index=pi,
                                               group_index=gi, num_params=count, state_bits=state_bits_of(group))
            self.layouts[p] = layout
        return layout

    def _refuse_unknown_flattening(self, p: torch.Tensor, group: dict) -> None:
        gi = next((i for i, g in enumerate(self.opt.param_groups) if g is group), "?")
        raise RuntimeError(
            f"{type(self.opt).__name__} scales each parameter's update by a norm of the whole parameter, but "
            f"parameter group {gi} now holds a tensor of {p.numel()} elements that it was not given and "
            "whose parameter boundaries it does not know: a wrapper flattened the parameters into "
            "partitions. DeepSpeed's ZeRO stages 1-3 and bf16 optimizer are known (import ds_q8 before "
            "deepspeed.initialize); with another wrapper use an element-wise optimizer such as "
            "AdamW8bitBlock or Lion8bitBlock.")

    def position(self, p: torch.Tensor, group: dict):
        """(group index, position among the group's trainable parameters, their number) of ``p``:
        the order DeepSpeed's ZeRO partitions keep, so that a parameter has one identity everywhere."""
        gi = next((i for i, g in enumerate(self.opt.param_groups) if g is group), 0)
        trainable = [q for q in group["params"] if q.requires_grad]
        if not any(q is p for q in trainable):  # a tensor stepped by hand: its place among all of them
            trainable = group["params"]
        pi = next((i for i, q in enumerate(trainable) if q is p), 0)
        return gi, pi, max(1, len(trainable))

    def find_group(self, p: torch.Tensor) -> dict:
        for group in self.opt.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not managed by this optimizer")

    def group_of(self, p: torch.Tensor) -> dict:
        """The group of an optimized tensor, also when a wrapper (ZeRO-3) took it out of the groups."""
        group = self.groups.get(p)
        return group if group is not None else self.find_group(p)

    # ------------------------------------------------------------------ states
    def quantized_state(self, p: torch.Tensor, group: Optional[dict] = None, create: bool = True) -> QuantizedState:
        entry = self.opt.state[p]
        qs = self.qstates.get(p)
        if qs is None or qs.entry is not entry:
            group = self.group_of(p) if group is None else group
            qs = self.qstates[p] = QuantizedState(entry, self.layout_of(p, group),
                                                  self.opt.rule_for(group).state_signed, group["quantization"])
        if create and "step" not in entry:
            return self.create_state(p, group, entry)
        return qs

    def create_state(self, p: torch.Tensor, group: Optional[dict] = None, entry: Optional[dict] = None):
        """Fresh state for ``p`` (its step 0), in ``entry`` or a new entry of the optimizer's state."""
        group = self.group_of(p) if group is None else group
        entry = {} if entry is None else entry
        qs = QuantizedState.create(entry, self.layout_of(p, group), self.opt.rule_for(group).state_signed,
                                   group["quantization"], p.device, self.opt._initial_state(group))
        self.opt.state[p] = entry
        self.qstates[p] = qs
        return qs


__all__ = ["TensorStates", "uses_8bit", "state_bits_of", "keeps_embeddings_32bit", "OPTIM_BITS_ATTR", "EMBEDDING_ATTR"]
