"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms") with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from .base import Optimizer8bitBlock, beta_hyper, check_betas, check_range


class Lion8bitBlock(Optimizer8bitBlock):
    """Lion: step by the sign of an interpolation of momentum and gradient; decoupled weight decay.

    ``c = beta1 * m + (1 - beta1) * g``; ``p = p * (1 - lr * weight_decay) - lr * sign(c)``;
    ``m = beta2 * m + (1 - beta2) * g``. One state, ``exp_avg``.
    """
    state_names = ("exp_avg",)
    state_signed = (True,)
    update_rule = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, block_size=block_size,
                                      min_8bit_size=min_8bit_size, optim_bits=optim_bits, quantization=quantization,
                                      stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                                      state_rounding=state_rounding, impl=impl), nonfinite=nonfinite)

    def _check_group(self, group: dict) -> None:
        check_betas(group)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            beta_hyper(group),
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            decay_factor=1.0 - group["lr"] * group["weight_decay"],
        )

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        (m,) = states
        if h["weight_decay"] != 0.0:
            p.mul_(h["decay_factor"])
        c = m * h["beta1"]
        c.add_(g * h["one_minus_beta1"])
        p.sub_(c.sign_() * h["lr"])
        m.mul_(h["beta2"]).add_(g * h["one_minus_beta2"])
