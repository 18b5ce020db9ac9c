"""What the step's paths take: each optimized tensor's :class:`TensorStep`, and the pieces it is cut
into for the kernels and the reference (:class:`Item8`, :class:`Item32`), with their rounding and
correction bytes (``optim/step.py`` says how a tensor becomes pieces)."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .qstate import QuantizedState

#: ``(key, index of the item's first element in its parameter)``: an item's stochastic rounding
Rounding = Tuple[int, int]


class Item8(NamedTuple):
    """An 8-bit piece for the kernels: it starts a block of its parameter. ``correction``: the piece's
    correction bytes (a bf16 parameter with ``correction_byte=True``), else None."""
    param: torch.Tensor
    grad: torch.Tensor
    codes: Tuple[torch.Tensor, ...]
    absmax: Tuple[torch.Tensor, ...]
    rounding: Optional[Rounding]
    correction: Optional[torch.Tensor] = None


class Item32(NamedTuple):
    """An fp32-state piece; ``rounding`` only for stochastic writes of 16-bit parameters."""
    param: torch.Tensor
    grad: torch.Tensor
    states: Tuple[torch.Tensor, ...]
    rounding: Optional[Rounding]
    correction: Optional[torch.Tensor] = None


class TensorStep(NamedTuple):
    """One optimized tensor's part of a step.

    ``hyper`` are the step scalars; ``segment_hyper`` (whole-parameter rules) one set per segment
    (:func:`segment_hypers`); ``sr_step`` (:func:`rounding.step_key`) asks for random bits, None for
    none; ``sums`` takes telemetry's requantization error (None: not measured)."""
    param: torch.Tensor
    grad: torch.Tensor
    state: QuantizedState
    group: dict
    hyper: Dict[str, float]
    segment_hyper: Optional[list] = None
    sr_step: Optional[int] = None
    sums: Optional[torch.Tensor] = None


__all__ = ["Rounding", "Item8", "Item32", "TensorStep"]
