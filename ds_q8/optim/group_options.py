"""How a group's options are read by the step, each in one place: which code steps it (``impl``), how
its 16-bit parameters are written (stochastic rounding or a correction byte) and how its states are
requantized, and its states' maps. The options' defaults are ``base.OPTIONS`` and their checks
``checks.py``."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .. import functional as F
from . import qstate
from .rules import Rule

if TYPE_CHECKING:  # pieces.py imports nothing of this module; the name is for the annotation
    from .pieces import TensorStep

def group_impl(group: dict) -> str:
    """A group's ``impl`` (groups saved before the option existed are ``"auto"``)."""
    return group.get("impl", "auto")


def corrected(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` keeps a correction byte (``correction_byte=True``, bf16 only):
    then it is written to nearest as a 24-bit value (``rounding.split_bf16``), never stochastically."""
    return dtype == torch.bfloat16 and bool(group.get("correction_byte", False))


def correction_of(t: "TensorStep") -> Optional[torch.Tensor]:
    """The flat correction bytes of a tensor step, or None."""
    if not corrected(t.group, t.param.dtype):
        return None
    c = t.state.entry.get(qstate.CORRECTION_KEY)
    if c is None:
        raise RuntimeError("correction_byte=True but the tensor's state has no correction bytes")
    return c.view(-1)


def stochastic_params(group: dict, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` is written with stochastic rounding (on by default for 16-bit,
    off where a correction byte keeps what rounding drops)."""
    if dtype not in (torch.bfloat16, torch.float16) or corrected(group, dtype):
        return False
    choice = group.get("stochastic_rounding")
    return True if choice is None else bool(choice)


def stochastic_states(group: dict, signed: Sequence[bool]) -> tuple:
    """Which states are requantized with stochastic rounding: the unsigned ones (second moments,
    Adagrad's sum) unless the group asks for ``state_rounding="nearest"``.

    Rounded to nearest, an exponential average that moves by less than half a code per step (a
    second moment with beta2=0.999 moves by 0.1%) loses those moves: it lags its fp32 value, by half
    on a GPT-2 attention matrix after 300 steps, and the steps grow by as much as 1.6x. Rounded
    stochastically it is right on average."""
    if group.get("state_rounding", "stochastic") != "stochastic":
        return (False,) * len(signed)
    return tuple(not s for s in signed)


def maps_of(rule: Rule, group: dict, device) -> List[torch.Tensor]:
    return [F.state_map(group["quantization"], s, device) for s in rule.state_signed]
