"""Adagrad with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import check_range


class Adagrad8bitBlock(Optimizer8bitBlock):
    """torch.optim.Adagrad (lr_decay, L2 weight decay, initial_accumulator_value) with 8-bit state ``sum``.

    ``quantization`` defaults to ``"dynamic6"`` here (``option_defaults``): the update divides the exact
    gradient by the root of the quantized sum alone, and sums sit close to their block's maximum, where the
    dynamic map is finer than "minifloat"'s E4M4 (tests/test_optim_family.py: 0.0068 against 0.033 of the
    distance moved)."""
    rule = rules.ADAGRAD
    option_defaults = dict(quantization="dynamic6")

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 **options):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps),
                         **options)

    def _check_group(self, group: dict) -> None:
        check_range("lr_decay", group["lr_decay"], 0.0, math.inf)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        check_range("initial_accumulator_value", group["initial_accumulator_value"], 0.0, math.inf)
        check_range("eps", group["eps"], 0.0, math.inf)

    def _initial_state(self, group: dict):
        return (float(group["initial_accumulator_value"]),)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            clr=group["lr"] / (1.0 + (step - 1) * group["lr_decay"]),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )
