"""Check optimizer keyword arguments before Python rejects them with a bare TypeError.

DeepSpeed builds an optimizer named in its JSON config as ``cls(model_parameters, **params)``, so a
misspelt key in the ``"optimizer": {"params": ...}`` section would otherwise surface as
"unexpected keyword argument" with no hint of what is accepted. The valid keys are read from the
class constructor's signature, so optimizers added later are covered without a list to maintain.
"""
from __future__ import annotations

# the check belongs to the optimizers' constructors; DeepSpeed's JSON is where its errors are met
from ..optim.checks import AUTO_IS_A_VALUE, check_optimizer_kwargs, constructor_keys

__all__ = ["AUTO_IS_A_VALUE", "check_optimizer_kwargs", "constructor_keys"]
