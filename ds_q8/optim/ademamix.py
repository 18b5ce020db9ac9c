"""AdEMAMix (Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024)
with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import check_range


class AdEMAMix8bitBlock(Optimizer8bitBlock):
    """Adam plus a slow exponential average of the gradients, mixed into the numerator.

    ``m1 = b1 m1 + (1 - b1) g``, ``m2 = b3 m2 + (1 - b3) g``, ``nu = b2 nu + (1 - b2) g^2``;
    ``p = p (1 - lr wd) - lr (m1 / (1 - b1^t) + alpha m2) / (sqrt(nu / (1 - b2^t)) + eps)``.
    With ``t_alpha`` alpha warms up linearly over that many steps, with ``t_beta3`` b3 rises from b1
    to its final value as in the paper's scheduler (both hold their final values afterwards). The
    arguments are named as bitsandbytes' AdEMAMix names them. States ``exp_avg`` (m1), ``exp_avg_slow``
    (m2) and ``exp_avg_sq`` (nu).
    """
    rule = rules.ADEMAMIX

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
                 weight_decay=1e-2, **options):
        super().__init__(params, dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                                      weight_decay=weight_decay), **options)

    def _check_group(self, group: dict) -> None:
        betas = group["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 3:
            raise ValueError(f"betas must be three values (beta1, beta2, beta3) with each in [0, 1), got {betas!r}")
        group["betas"] = tuple(betas)
        for i, b in enumerate(betas):
            check_range(f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
        check_range("alpha", group["alpha"], 0.0, math.inf)
        check_range("eps", group["eps"], 0.0, math.inf)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        for key in ("t_alpha", "t_beta3"):
            t = group[key]
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
                raise ValueError(f"{key} must be null (no warm-up) or an integer >= 1 (steps), got {t!r}")
        if group["t_beta3"] is not None and not (betas[0] > 0.0 and betas[2] > 0.0):
            raise ValueError(f"t_beta3 needs betas[0] and betas[2] in (0, 1) (its scheduler takes their logarithms), "
                             f"got {betas[0]} and {betas[2]}")

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        beta1, beta2, beta3 = group["betas"]
        alpha, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
        if t_alpha is not None:
            alpha = min(step * alpha / t_alpha, alpha)
        if t_beta3 is not None:
            frac = min(step, t_beta3) / t_beta3
            log1, log3 = math.log(beta1), math.log(beta3)
            beta3 = min(math.exp(log1 * log3 / ((1.0 - frac) * log3 + frac * log1)), beta3)
        lr = group["lr"]
        return dict(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2,
                    beta3=beta3, one_minus_beta3=1.0 - beta3, alpha=alpha, eps=group["eps"], lr=lr,
                    weight_decay=group["weight_decay"], decay_factor=1.0 - lr * group["weight_decay"],
                    bias_correction1=1.0 - beta1 ** step, bias_correction2_sqrt=math.sqrt(1.0 - beta2 ** step))
