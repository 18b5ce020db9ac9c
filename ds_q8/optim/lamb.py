"""LAMB (You et al., "Large Batch Optimization for Deep Learning") with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import beta_hyper, check_adam_group


class LAMB8bitBlock(Optimizer8bitBlock):
    """Adam's direction plus weight decay, rescaled per parameter by the trust ratio ||p|| / ||u||.

    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` is formed from the *updated* moments;
    ``p -= lr * trust * u`` with ``trust = ||p|| / ||u||`` (1 when either norm is 0), both norms over
    the whole parameter. States ``exp_avg``/``exp_avg_sq`` as in Adam. The norms need parameter
    boundaries, which ZeRO's flat partitions keep in their layouts.
    """
    rule = rules.LAMB

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, **options):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **options)

    def _check_group(self, group: dict) -> None:
        check_adam_group(group)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        beta1, beta2 = group["betas"]
        return dict(
            beta_hyper(group),
            lr=group["lr"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction1=1.0 - beta1 ** step,
            bias_correction2_sqrt=math.sqrt(1.0 - beta2 ** step),
        )
