"""Adam and AdamW with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import beta_hyper, check_adam_group


class Adam8bitBlock(Optimizer8bitBlock):
    """torch.optim.Adam (L2 weight decay added to the gradient) with 8-bit block-wise state."""
    rule = rules.ADAM

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **options):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by the 8-bit optimizers; use amsgrad=False")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **options)

    def _check_group(self, group: dict) -> None:
        check_adam_group(group)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        return dict(
            beta_hyper(group),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decay_factor=1.0 - lr * group["weight_decay"],
            step_size=lr / (1.0 - beta1 ** step),
            bias_correction2_sqrt=math.sqrt(1.0 - beta2 ** step),
        )


class AdamW8bitBlock(Adam8bitBlock):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with 8-bit block-wise state."""
    rule = rules.ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **options):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **options)
