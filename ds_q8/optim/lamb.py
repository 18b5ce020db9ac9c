"""LAMB (You et al., "Large Batch Optimization for Deep Learning") with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from .base import Optimizer8bitBlock, beta_hyper, check_adam_group
from .mathops import sqrt_rn


class LAMB8bitBlock(Optimizer8bitBlock):
    """Adam's direction plus weight decay, rescaled per parameter by the trust ratio ||p|| / ||u||.

    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` is formed from the *updated* moments;
    ``p -= lr * trust * u`` with ``trust = ||p|| / ||u||`` (1 when either norm is 0), both norms over
    the whole parameter. States ``exp_avg``/``exp_avg_sq`` as in Adam. The norms need parameter
    boundaries, so the optimizer refuses to step on ZeRO's flat partitions.
    """
    state_names = ("exp_avg", "exp_avg_sq")
    state_signed = (True, False)
    update_rule = "lamb"
    needs_norms = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                                      min_8bit_size=min_8bit_size, optim_bits=optim_bits, quantization=quantization,
                                      stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                                      state_rounding=state_rounding, impl=impl), nonfinite=nonfinite)

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

    def _direction(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]):
        m, v = states
        m.mul_(h["beta1"]).add_(g * h["one_minus_beta1"])
        v.mul_(h["beta2"]).add_((g * g) * h["one_minus_beta2"])
        # multiplies by reciprocals (rounded once to float32, as torch does with a python scalar)
        # rather than divisions: two divisions fewer per element in the kernels
        denom = (sqrt_rn(v) * (1.0 / h["bias_correction2_sqrt"])).add_(h["eps"])
        u = (m * (1.0 / h["bias_correction1"])) / denom
        if h["weight_decay"] != 0.0:
            u.add_(p * h["weight_decay"])
        return u

    def _norm_terms(self, p, g, states, h):
        return p, self._direction(p, g, states, h)

    def _norm_hyper(self, h: Dict[str, float], norms: List[float]) -> Dict[str, float]:
        p_norm, u_norm = norms
        trust = p_norm / u_norm if p_norm > 0.0 and u_norm > 0.0 else 1.0
        return dict(h, trust_ratio=trust, step_size=h["lr"] * trust)

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        u = self._direction(p, g, states, h)
        p.sub_(u * h["step_size"])
