"""RMSprop with 8-bit block-wise state."""
from __future__ import annotations

import math
from typing import Dict

from . import rules
from .base import Optimizer8bitBlock
from .checks import check_range


class RMSprop8bitBlock(Optimizer8bitBlock):
    """torch.optim.RMSprop (L2 weight decay, optional momentum) with 8-bit block-wise state.

    The state is ``square_avg``, plus ``momentum_buffer`` when the optimizer is built with
    ``momentum > 0`` (in the constructor or in any initial group); the layout is fixed then, so a
    group added later cannot ask for momentum the state has no room for. ``centered=True`` is
    refused: it takes a square root of ``square_avg - grad_avg**2``, a difference of two separately
    quantized values that can turn negative.

    ``quantization`` defaults to ``"dynamic6"`` here (``option_defaults``), as for Adagrad8bitBlock: the
    update divides by the root of the quantized average, whose values sit close to their block's maximum,
    where the dynamic map is finer than "minifloat"'s E4M4 (tests/test_optim_family.py: 0.0047 against 0.012
    of the distance moved).
    """
    rule = rules.RMSPROP  # the class's default; an instance built with momentum: RMSPROP_MOMENTUM (rule_for)
    option_defaults = dict(quantization="dynamic6")

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 **options):
        if centered:
            raise ValueError("centered=True is not supported by RMSprop8bitBlock: its variance estimate "
                             "square_avg - grad_avg**2 can turn negative once both are quantized; use centered=False")
        params = list(params)
        group_momentum = [g.get("momentum", 0.0) for g in params if isinstance(g, dict)]
        #: whether the state has a momentum buffer: fixed at construction for every group
        self.momentum_state = any(_is_positive(m) for m in [momentum] + group_momentum)
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered), **options)

    def __getstate__(self):
        return dict(super().__getstate__(), momentum_state=self.momentum_state)

    def rule_for(self, group: dict) -> rules.Rule:
        return rules.RMSPROP_MOMENTUM if self.momentum_state else rules.RMSPROP

    def _check_group(self, group: dict) -> None:
        check_range("alpha", group["alpha"], 0.0, 1.0)
        check_range("eps", group["eps"], 0.0, math.inf)
        check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
        check_range("momentum", group["momentum"], 0.0, 1.0, hi_open=True)
        if group["centered"]:
            raise ValueError("centered must be False for RMSprop8bitBlock (see the class docstring)")
        if group["momentum"] > 0 and not self.momentum_state:
            raise ValueError(f"momentum must be 0 in this group, got {group['momentum']}: the optimizer was built "
                             "without momentum, so its state has no momentum buffer; build it with momentum > 0")

    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        return dict(
            lr=group["lr"],
            alpha=group["alpha"],
            one_minus_alpha=1.0 - group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
        )


def _is_positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
