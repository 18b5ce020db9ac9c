"""Hyperparameter checks the optimizers share (ranges, betas, constructor keys): each error names the field
and its valid range. The options every group has are checked in ``group_options.py``."""
from __future__ import annotations

import inspect
import math
from typing import Dict, List


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_range(name: str, value, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    """Raise ValueError naming ``name`` unless ``value`` is a number in the stated interval."""
    if hi == math.inf:  # no hyperparameter may be infinite: one inf lr or eps turns every update to NaN
        hi_open = True
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    interval = f"{left}{lo}, {hi}{right}"
    if not _is_number(value) or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if bad_lo or bad_hi:
        raise ValueError(f"{name} must be in {interval}, got {value}")


def resolve_betas(betas) -> tuple:
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        return tuple(betas)
    raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")


def check_betas(group: dict) -> None:
    """Validate ``group["betas"]`` (a list from JSON becomes a tuple)."""
    beta1, beta2 = resolve_betas(group["betas"])
    group["betas"] = (beta1, beta2)
    check_range("betas[0]", beta1, 0.0, 1.0, hi_open=True)
    check_range("betas[1]", beta2, 0.0, 1.0, hi_open=True)


def check_adam_group(group: dict) -> None:
    """The checks shared by the Adam-style rules (Adam, AdamW, LAMB): betas, eps, weight_decay."""
    check_betas(group)
    check_range("eps", group["eps"], 0.0, math.inf)
    check_range("weight_decay", group["weight_decay"], 0.0, math.inf)


def beta_hyper(group: dict) -> Dict[str, float]:
    """The step scalars every two-beta rule uses."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2)


#: keys for which "auto" is a real value, not a placeholder that the HF Trainer fills in
AUTO_IS_A_VALUE = ("impl",)


def constructor_keys(cls) -> List[str]:
    """Names of the keyword arguments ``cls(params, ...)`` accepts, in signature order."""
    keys = []
    for name, prm in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params"):
            continue
        if prm.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        keys.append(name)
    return keys


def check_optimizer_kwargs(cls, kwargs: dict) -> None:
    """Raise ValueError for unknown keys, or for ``"auto"`` values nobody filled in."""
    valid = constructor_keys(cls)
    unknown = sorted(k for k in kwargs if k not in valid)
    if unknown:
        raise ValueError(
            f"{cls.__name__} got unknown parameter(s) {unknown} (in a DeepSpeed config: the "
            f"\"optimizer\": {{\"params\": ...}} section); valid keys: {', '.join(valid)}"
        )
    autos = sorted(k for k, v in kwargs.items() if isinstance(v, str) and v == "auto" and k not in AUTO_IS_A_VALUE)
    if autos:
        raise ValueError(
            f"{cls.__name__} parameter(s) {autos} are \"auto\": only the HF Trainer's DeepSpeed integration "
            "fills \"auto\" in; with plain DeepSpeed give numbers"
        )


__all__ = ["check_range", "resolve_betas", "check_betas", "check_adam_group", "beta_hyper",
           "check_optimizer_kwargs", "constructor_keys", "AUTO_IS_A_VALUE"]
