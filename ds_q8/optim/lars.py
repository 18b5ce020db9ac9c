"""LARS (You et al., "Large Batch Training of Convolutional Networks") with 8-bit block-wise momentum."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import check_range


class LARS8bitBlock(Optimizer8bitBlock):
    """SGD with momentum whose gradient is rescaled per parameter by a layer-wise trust ratio.

    ``trust = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p||)`` (1 when ``||p||`` or
    ``||g||`` is 0), norms over the whole parameter and ``g`` the raw gradient;
    ``buf = momentum * buf + trust * (g + weight_decay * p)``; ``p -= lr * buf``. State
    ``momentum_buffer`` as in torch's SGD.
    """
    rule = rules.LARS

    def __init__(self, params, lr=1e-1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3, **options):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient), **options)

    def _check_group(self, group: dict) -> None:
        check_range("momentum", group["momentum"], 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        check_range("trust_coefficient", group["trust_coefficient"], 0.0, math.inf, lo_open=True)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                    trust_coefficient=group["trust_coefficient"])
