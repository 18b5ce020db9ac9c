"""LARS (You et al., "Large Batch Training of Convolutional Networks") with 8-bit block-wise momentum."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from .base import Optimizer8bitBlock, check_range


class LARS8bitBlock(Optimizer8bitBlock):
    """SGD with momentum whose gradient is rescaled per parameter by a layer-wise trust ratio.

    ``trust = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p||)`` (1 when ``||p||`` or
    ``||g||`` is 0), norms over the whole parameter and ``g`` the raw gradient;
    ``buf = momentum * buf + trust * (g + weight_decay * p)``; ``p -= lr * buf``. State
    ``momentum_buffer`` as in torch's SGD. The norms need parameter boundaries, so the optimizer
    refuses to step on ZeRO's flat partitions.
    """
    state_names = ("momentum_buffer",)
    state_signed = (True,)
    update_rule = "lars"
    needs_norms = True

    def __init__(self, params, lr=1e-1, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, block_size=block_size,
                                      min_8bit_size=min_8bit_size, optim_bits=optim_bits, quantization=quantization,
                                      stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                                      state_rounding=state_rounding, impl=impl), nonfinite=nonfinite)

    def _check_group(self, group: dict) -> None:
        check_range("momentum", group["momentum"], 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        check_range("trust_coefficient", group["trust_coefficient"], 0.0, math.inf, lo_open=True)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            lr=group["lr"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
            trust_coefficient=group["trust_coefficient"],
        )

    def _norm_terms(self, p, g, states, h):
        return p, g

    def _norm_hyper(self, h: Dict[str, float], norms: List[float]) -> Dict[str, float]:
        p_norm, g_norm = norms
        if p_norm > 0.0 and g_norm > 0.0:
            trust = h["trust_coefficient"] * p_norm / (g_norm + h["weight_decay"] * p_norm)
        else:
            trust = 1.0
        return dict(h, trust_ratio=trust)

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        (buf,) = states
        if h["weight_decay"] != 0.0:
            g = g + p * h["weight_decay"]
        buf.mul_(h["momentum"]).add_(g * h["trust_ratio"])
        p.sub_(buf * h["lr"])
