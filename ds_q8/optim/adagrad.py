"""Adagrad with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from .base import Optimizer8bitBlock, check_range, get_map
from .mathops import sqrt_rn


class Adagrad8bitBlock(Optimizer8bitBlock):
    """torch.optim.Adagrad (lr_decay, L2 weight decay, initial_accumulator_value) with 8-bit state ``sum``."""
    state_names = ("sum",)
    state_signed = (False,)
    update_rule = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 block_size=2048, min_8bit_size=4096, optim_bits=8, quantization="dynamic",
                 stochastic_rounding=None, sr_seed=0, state_rounding="stochastic", impl="auto",
                 nonfinite="skip"):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps,
                                      block_size=block_size, min_8bit_size=min_8bit_size,
                                      optim_bits=optim_bits, quantization=quantization,
                                      stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
                                      state_rounding=state_rounding, impl=impl), nonfinite=nonfinite)

    def _check_group(self, group: dict) -> None:
        check_range("lr_decay", group["lr_decay"], 0.0, math.inf)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        check_range("initial_accumulator_value", group["initial_accumulator_value"], 0.0, math.inf)
        check_range("eps", group["eps"], 0.0, math.inf)

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        super()._init_state(p, group, state)
        init = float(group["initial_accumulator_value"])
        if init == 0.0:
            return
        if "state1" in state:
            # a constant is exact in every map: the code for 1.0 scaled by absmax = the constant
            one = int(torch.argmax(get_map(group["quantization"], False, "cpu")))
            state["state1"].fill_(one)
            state["absmax1"].fill_(init)
        if "state1_fp32" in state:
            state["state1_fp32"].fill_(init)

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            clr=group["lr"] / (1.0 + (step - 1) * group["lr_decay"]),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )

    def _update_fp32(self, p: torch.Tensor, g: torch.Tensor, states: List[torch.Tensor], h: Dict[str, float]) -> None:
        (s,) = states
        if h["weight_decay"] != 0.0:
            g = g + p * h["weight_decay"]
        s.add_(g * g)
        std = sqrt_rn(s).add_(h["eps"])
        p.sub_((g / std) * h["clr"])
