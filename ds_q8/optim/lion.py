"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms") with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import beta_hyper, check_betas, check_range


class Lion8bitBlock(Optimizer8bitBlock):
    """Lion: step by the sign of an interpolation of momentum and gradient; decoupled weight decay.

    ``c = beta1 * m + (1 - beta1) * g``; ``p = p * (1 - lr * weight_decay) - lr * sign(c)``;
    ``m = beta2 * m + (1 - beta2) * g``. One state, ``exp_avg``.
    """
    rule = rules.LION

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **options):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), **options)

    def _check_group(self, group: dict) -> None:
        check_betas(group)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(beta_hyper(group), lr=group["lr"], weight_decay=group["weight_decay"],
                    decay_factor=1.0 - group["lr"] * group["weight_decay"])
