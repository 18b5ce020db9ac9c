"""SGD with momentum and 8-bit block-wise momentum buffer."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import check_range


class Momentum8bitBlock(Optimizer8bitBlock):
    """torch.optim.SGD with momentum (dampening, nesterov, L2 weight decay) and 8-bit state.

    Plain SGD keeps no state, so ``momentum`` must be positive; it defaults to 0.9.
    """
    rule = rules.MOMENTUM

    def __init__(self, params, lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, **options):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), **options)

    def _check_group(self, group: dict) -> None:
        check_range("momentum", group["momentum"], 0.0, 1.0, lo_open=True)
        check_range("dampening", group["dampening"], 0.0, 1.0)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
        if group["nesterov"] and group["dampening"] != 0.0:
            raise ValueError("nesterov=True requires dampening=0")

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            lr=group["lr"],
            momentum=group["momentum"],
            one_minus_dampening=1.0 - group["dampening"],
            weight_decay=group["weight_decay"],
            nesterov=1.0 if group["nesterov"] else 0.0,
            first_step=1.0 if step == 1 else 0.0,
        )
