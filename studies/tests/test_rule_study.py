"""studies/rule_study.py: the requantization rules that no option selects reach the optimizer it patches."""
import sys
from pathlib import Path

import pytest
import torch

import ds_q8

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import rule_study  # noqa: E402


def test_the_rule_study_runs_the_update_rule_in_the_reference_and_the_kernels_refuse_it(monkeypatch):
    """studies/rule_study.py's ``--rule update`` (the default before, which no option selects) reaches the
    reference, only for ``state_rounding="guided"``; the kernels refuse it by name and write nothing."""
    from ds_q8.optim import group_options, path_kernel, path_reference, path_shared, plan, step
    for module in (group_options, path_kernel, path_reference, path_shared, plan, step):
        monkeypatch.setattr(module, "stochastic_states", module.stochastic_states)
    rule_study.patch_rule("update")
    p = torch.nn.Parameter(torch.zeros(8))
    opt = ds_q8.AdamW8bitBlock([p])
    assert opt.stochastic_states(opt.param_groups[0]) == (2, 3)
    assert plan.stochastic_states(dict(state_rounding="stochastic"), (True, False)) == (1, 1)
    torch.manual_seed(0)
    q = torch.nn.Parameter(torch.randn(3 * 256 + 7))
    start = q.detach().clone()
    reference = ds_q8.AdamW8bitBlock([q], impl="reference", block_size=256, min_8bit_size=0)
    for _ in range(3):
        q.grad = torch.randn_like(q)
        reference.step()
    assert not torch.equal(q.detach(), start)
    kernel = ds_q8.AdamW8bitBlock([p], impl="kernel", min_8bit_size=0)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="stochastic_states entries must be .* the PyTorch reference's alone"):
        kernel.step()
    assert torch.equal(p.detach(), before)
