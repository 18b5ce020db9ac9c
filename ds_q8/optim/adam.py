"""Adam and AdamW with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from .base import Optimizer8bitBlock, beta_hyper, check_adam_group
from .mathops import sqrt_rn


class _AdamBase(Optimizer8bitBlock):
    state_names = ("exp_avg", "exp_avg_sq")
    state_signed = (True, False)
    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by the 8-bit optimizers; use amsgrad=False")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      block_size=block_size, min_8bit_size=min_8bit_size,
                                      optim_bits=optim_bits, quantization=quantization,
                                      stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                                      state_rounding=state_rounding, impl=impl), nonfinite=nonfinite)

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

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        m, v = states
        if h["weight_decay"] != 0.0:
            if self.decoupled:
                p.mul_(h["decay_factor"])
            else:
                g = g + p * h["weight_decay"]
        m.mul_(h["beta1"]).add_(g * h["one_minus_beta1"])
        v.mul_(h["beta2"]).add_((g * g) * h["one_minus_beta2"])
        # a multiply by the reciprocal, not a division: one division fewer per element in the kernels
        denom = (sqrt_rn(v) * (1.0 / h["bias_correction2_sqrt"])).add_(h["eps"])
        p.sub_((m / denom) * h["step_size"])


class Adam8bitBlock(_AdamBase):
    """torch.optim.Adam (L2 weight decay added to the gradient) with 8-bit block-wise state."""
    update_rule = "adam"


class AdamW8bitBlock(_AdamBase):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with 8-bit block-wise state."""
    update_rule = "adamw"
    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         block_size=block_size, min_8bit_size=min_8bit_size, optim_bits=optim_bits,
                         quantization=quantization, stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                         state_rounding=state_rounding, impl=impl,
                         nonfinite=nonfinite)
