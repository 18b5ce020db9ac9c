"""Check optimizer keyword arguments before Python rejects them with a bare TypeError.

DeepSpeed builds an optimizer named in its JSON config as ``cls(model_parameters, **params)``, so a
misspelt key in the ``"optimizer": {"params": ...}`` section would otherwise surface as
"unexpected keyword argument" with no hint of what is accepted. The valid keys are read from the
class constructor's signature, so optimizers added later are covered without a list to maintain.
"""
from __future__ import annotations

import inspect
from typing import List


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
