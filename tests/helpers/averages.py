"""Exponential averages kept in one block of codes against their fp32 values: how a requantization rule
makes a stored state follow (or lag, or run ahead of) the average it stands for. Shared by the state
rounding tests and the rule study's tests."""
import torch

from ds_q8 import functional as F
from ds_q8.optim import rounding


def average_against_fp32(signed: bool, beta: float, inputs, quantization: str = "dynamic", prev_rule=None) -> dict:
    """An exponential average of ``inputs`` (one tensor a step, its element 0 the block maximum's input,
    held still) kept in one 2048-element block on a quantization's map, requantized each way (guided by
    the old code, ``guided_code``): each one's mean ratio to the fp32 average over the other elements.
    ``prev_rule`` adds ``guided``, a rule that reads the value before the update (a study's,
    ``studies/tests/test_rule_study.py``): ``prev_rule(x, prev, absmax, code, block_size, bits)``."""
    n = bs = 2048
    code = F.state_map(quantization, signed, "cpu")
    avg32 = torch.zeros(n)
    kinds = ("nearest", "stochastic", "guided_code") + (() if prev_rule is None else ("guided",))
    stored = {kind: torch.zeros(n) for kind in kinds}
    old = F.quantize_scaled(torch.zeros(n), code).long()  # the codes of the state before each step
    for t, x in enumerate(inputs):
        avg32 = beta * avg32 + (1 - beta) * x
        for kind in stored:
            a = beta * stored[kind] + (1 - beta) * x
            am = F.block_absmax(a, bs)
            bits = rounding.random_bits(rounding.step_key(0, t + 1), torch.arange(n)) if kind != "nearest" else None
            if kind == "guided":
                q = prev_rule(a, stored[kind], am, code, bs, bits)
            else:
                q = F.quantize_with_absmax(a, am, code, bs, bits, old=old if kind == "guided_code" else None)
            if kind == "guided_code":
                old = q.long()
            stored[kind] = F.dequantize_flat(q, am, code, bs)
    return {kind: float((a / avg32)[1:].mean()) for kind, a in stored.items()}


def held_maximum(x: torch.Tensor) -> torch.Tensor:
    x[0] = 1.0
    return x
