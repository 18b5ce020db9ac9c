"""The requantization rules that no option selects, as studies/rule_study.py and studies/arith_maps.py run
them: guidance by the update (the signed states' rule before guidance by the old code) and the bracket
rule, brought into the reference step through ds_q8's one extension point
(``path_reference.set_requantize_rule``), and why the library's default is not the update's rule.
"""
import math
import sys
from pathlib import Path

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8.optim import path_reference, rounding

from helpers.averages import average_against_fp32, held_maximum

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import arith_maps  # noqa: E402
import rule_study  # noqa: E402


def _bits(key: int, n: int) -> torch.Tensor:
    return rounding.random_bits(key, torch.arange(n))


def _update_rule(x, prev, absmax, code, block_size, bits):
    return arith_maps.prev_guided_codes(x, prev, absmax, code, block_size, bits)


@pytest.mark.parametrize("signed", [True, False])
def test_guidance_by_the_update_keeps_the_nearer_entry_only_where_it_moves_with_the_update(signed):
    """Each case of the rule, element by element against its statement: the nearer entry where it and the
    new value lie on the same side of the old one; the stochastic code (the same random bits) where the
    nearer entry would stand still or step back; NaN to 255; the unsigned map's zero point."""
    code = F.create_dynamic_map(signed)
    g = torch.Generator().manual_seed(5)
    n = 4096
    y0 = torch.rand(n, generator=g) ** 3 * (torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) if signed else 1.0)
    absmax = torch.tensor([0.37], dtype=F.ABSMAX_DTYPE)
    a = float(absmax.float())
    x = y0 * a
    y = x * (1.0 / torch.tensor(a))  # the scaled values the rule codes
    near = F.quantize_scaled(y, code).long()
    # prev: the nearer entry's value nudged either way, or equal to it (a stall), or far on either side
    kind = torch.randint(0, 5, (n,), generator=g)
    moved = code[near] * a
    prev = torch.where(kind == 0, moved, torch.where(kind == 1, moved * 0.999, torch.where(
        kind == 2, moved * 1.001, torch.where(kind == 3, x - 0.5, x + 0.5))))
    bits = _bits(99, n)
    got = _update_rule(x, prev, absmax, code, n, bits).long()
    stochastic = F.quantize_scaled(y, code, bits, F.midpoints(code)).long()
    keep = (moved - prev) * (x - prev) > 0
    assert bool(keep.any()) and bool((~keep).any())
    assert torch.equal(got[~keep], stochastic[~keep])  # a stall (kind 0) or a step back: the stochastic code
    assert torch.equal(got[keep], near[keep])
    assert bool(((got - stochastic).abs() <= 1).all())
    special = torch.tensor([float("nan"), 0.0, 1e-30])
    q = _update_rule(special, torch.zeros(3), torch.ones(1, dtype=F.ABSMAX_DTYPE), code, 3, _bits(1, 3)).tolist()
    assert q[0] == 255
    if not signed:
        assert q[1:] == [0, 1]  # an exact zero stays 0; a positive value takes at least code 1


def test_a_second_moment_guided_by_its_update_drifts_where_its_block_maximum_moves():
    """Why unsigned states are guided by their old code: guided by the update, v drifts (measured 0.62
    of its fp32 value growing): where the block's maximum moves, the old value lies between the new
    entries, and the nearer entry is kept whenever it lies on the update's side."""
    steps, g_scale = 300, torch.linspace(0.05, 0.3, 2048)
    ratio = average_against_fp32(False, 0.999, (held_maximum((g_scale * (1 + t / steps)) ** 2) for t in range(steps)),
                                  prev_rule=_update_rule)
    assert abs(ratio["guided_code"] - 1.0) < 0.02, ratio
    assert abs(ratio["guided"] - 1.0) > 0.1, ratio


@pytest.mark.parametrize("growth", [1.02, 0.98, 1.05])
def test_a_first_moment_guided_by_its_update_runs_ahead_of_a_changing_gradient(growth):
    """Why no state is guided by its update: a first moment so guided runs ahead of its fp32 value
    (1.019, 0.990, 1.027 where the gradient grows 2%, shrinks 2%, grows 5% a step): an increment of more
    than half a code and less than one always goes on to the next entry, past the value."""
    g0 = torch.linspace(0.01, 0.2, 2048) * torch.where(torch.arange(2048) % 2 == 0, 1.0, -1.0)
    ratio = average_against_fp32(True, 0.9, (held_maximum(g0 * growth ** t) for t in range(60)), prev_rule=_update_rule)
    assert abs(ratio["guided_code"] - 1.0) < 0.01, ratio
    assert (ratio["guided"] - 1.0) * math.copysign(1.0, growth - 1.0) > 0.005, ratio


@pytest.mark.parametrize("rule", ["update", "bracket"])
def test_the_study_rules_reach_the_reference_step_through_the_extension_point(rule):
    """``--rule update`` and ``bracket`` reach the reference step for ``state_rounding="guided"`` groups:
    the first moment's codes differ from the library's, the second moment's (guided by its old code in
    every rule) do not until the first moments' differences reach the parameters; ``--rule code`` is the
    library's rule; removing the rule gives the library's steps back."""
    def run(installed, state_rounding="guided"):
        before = path_reference.set_requantize_rule(installed)
        try:
            torch.manual_seed(0)
            q = torch.nn.Parameter(torch.randn(3 * 256 + 7))
            opt = ds_q8.AdamW8bitBlock([q], impl="reference", block_size=256, min_8bit_size=0,
                                       state_rounding=state_rounding)
            for _ in range(3):
                q.grad = torch.randn_like(q)
                opt.step()
            return q.detach().clone()
        finally:
            assert path_reference.set_requantize_rule(before) is installed
    library = run(None)
    assert torch.equal(run(rule_study.requantize_rule("code")), library)
    assert not torch.equal(run(rule_study.requantize_rule(rule)), library)
    assert torch.equal(run(rule_study.requantize_rule(rule), "stochastic"), run(None, "stochastic"))
    assert torch.equal(run(None), library)


def test_the_stall_check_runs_through_the_study_rule():
    """``rule_study.py stall``: guided by the old code, the first moment follows its fp32 value; with the
    draws clamped far enough it stalls as rounding to nearest does."""
    assert abs(rule_study.stall(1.02, rule_study.requantize_rule("code")) - 1.0) < 0.01
    assert rule_study.stall(1.02, rule_study.requantize_rule("code", clamp=0.5)) < 0.99
