"""In-process checks of the DeepSpeed glue: registration, params validation, engine refusals,
fp32 export/import of state. The multi-rank behaviour is in the other test_deepspeed_* files."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8 import functional as F
from ds_q8.integration import engine_checks
from ds_q8.integration.params import constructor_keys
from ds_q8.optim.base import Optimizer8bitBlock
from ds_q8.optim.rules import Rule

from helpers.requantize import ROUND_TRIP, assert_round_trip


def _params():
    return [nn.Parameter(torch.randn(64, 80))]


@pytest.mark.parametrize("name", sorted(ds_q8.OPTIMIZERS))
def test_every_registered_type_is_on_torch_optim_and_zero_supported(name):
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    ds_q8.register_with_deepspeed()  # what deepspeed.initialize does when it meets a ds_q8 optimizer

    cls = ds_q8.OPTIMIZERS[name]
    assert getattr(torch.optim, name) is cls
    assert cls in ZERO_SUPPORTED_OPTIMIZERS


@pytest.mark.parametrize("name", sorted(ds_q8.OPTIMIZERS))
def test_unknown_key_error_lists_the_constructor_keys(name):
    cls = ds_q8.OPTIMIZERS[name]
    keys = constructor_keys(cls)
    assert "lr" in keys and "block_size" in keys and "params" not in keys
    with pytest.raises(ValueError, match="unknown parameter") as e:
        getattr(torch.optim, name)(_params(), lr=1e-3, not_a_key=1)
    assert "'not_a_key'" in str(e.value) and "valid keys: " + ", ".join(keys) in str(e.value)


def test_validation_follows_the_signature_of_new_optimizers():
    class Tiny8bit(ds_q8.Momentum8bitBlock):
        def __init__(self, params, lr=1e-3, momentum=0.9, gamma=0.5):
            super().__init__(params, lr=lr, momentum=momentum)

    Tiny8bit(_params(), gamma=0.1)
    with pytest.raises(ValueError, match="valid keys: lr, momentum, gamma"):
        Tiny8bit(_params(), dampening=0.1)


def test_unfilled_auto_and_bad_values_are_named():
    with pytest.raises(ValueError, match="\"auto\""):
        ds_q8.Adam8bitBlock(_params(), lr="auto")
    with pytest.raises(ValueError, match="betas\\[1\\] must be in \\[0.0, 1.0\\)"):
        ds_q8.Adam8bitBlock(_params(), betas=[0.9, 1.5])
    # HF Trainer passes betas as a list
    assert ds_q8.Adam8bitBlock(_params(), betas=[0.8, 0.99]).param_groups[0]["betas"] == (0.8, 0.99)


def _engine(stage=2, elastic=False, device=None):
    offload = SimpleNamespace(device=device) if device else None
    return SimpleNamespace(zero_optimization_stage=lambda: stage, zero_elastic_checkpoint=lambda: elastic,
                           zero_offload_optimizer=lambda: offload)


def test_engine_checks_refuse_elastic_and_nvme_only_for_ds_q8():
    opt = ds_q8.Adam8bitBlock(_params())
    engine_checks.check_zero_config(_engine(), opt)
    engine_checks.check_zero_config(_engine(device="cpu"), opt)
    engine_checks.check_zero_config(_engine(stage=3, elastic=True), opt)  # DeepSpeed itself refuses that one
    with pytest.raises(engine_checks.UnsupportedZeroConfig, match="elastic_checkpoint"):
        engine_checks.check_zero_config(_engine(stage=1, elastic=True), opt)
    with pytest.raises(engine_checks.UnsupportedZeroConfig, match="nvme"):
        engine_checks.check_zero_config(_engine(stage=3, device="nvme"), opt)
    torch_opt = torch.optim.Adam(_params())
    engine_checks.check_zero_config(_engine(stage=1, elastic=True), torch_opt)


def test_engine_check_is_installed_once():
    from deepspeed.runtime.engine import DeepSpeedEngine

    ds_q8.register_with_deepspeed()
    before = DeepSpeedEngine._configure_zero_optimizer
    ds_q8.register_with_deepspeed()
    assert DeepSpeedEngine._configure_zero_optimizer is before
    assert before.__wrapped__ is not None


def _trained(cls, steps=3, **kw):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5000))
    opt = cls([p], block_size=256, **kw)
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()
    return p, opt


@pytest.mark.parametrize("cls", [ds_q8.Adam8bitBlock, ds_q8.Momentum8bitBlock])
@pytest.mark.parametrize("universal", [False, True])
def test_fp32_export_then_load_requantizes(cls, universal):
    p, opt = _trained(cls)
    sd = opt.state_dict()
    assert sd["ds_q8"]["optimizer"] == cls.__name__ and sd["ds_q8"]["state_names"] == list(cls.rule.state_names)
    exported = cls.export_fp32_state_dict(sd, universal=universal)
    names = cls.universal_names() if universal else cls.rule.state_names
    assert sorted(k for k in exported["state"][0] if k != "step") == sorted(names)
    for tn, n in zip(cls.rule.state_names, names):  # export is exact: codes times block maxima
        assert torch.equal(exported["state"][0][n], opt.dequantized_state(p)[tn])
    p2 = nn.Parameter(p.detach().clone())
    opt2 = cls([p2], block_size=256)
    opt2.load_state_dict(exported)
    st2 = opt2.state[p2]
    assert st2["step"] == 3 and st2["state1"].dtype == torch.uint8 and st2["absmax1"].dtype == torch.bfloat16
    # requantizing dequantized values moves them by at most half a step of the map's top binade, and
    # keeps every code of the blocks whose largest is coded as +-1.0 (helpers/requantize.py)
    for i, (tn, n) in enumerate(zip(cls.rule.state_names, names)):
        want, got = exported["state"][0][n], opt2.dequantized_state(p2)[tn]
        assert float((want - got).abs().max()) <= ROUND_TRIP * float(want.abs().max())
        code = F.state_map(opt.param_groups[0]["quantization"], cls.rule.state_signed[i], "cpu")
        assert_round_trip(opt.state[p][f"state{i + 1}"], st2[f"state{i + 1}"], code, 256, tn)


def test_state_written_by_a_universal_loader_is_adopted_on_step():
    p, opt = _trained(ds_q8.Adam8bitBlock)
    p_ref, opt_ref = copy.deepcopy((p, opt))
    fp32 = opt.dequantized_state(p)
    # what DeepSpeed's load_universal does: fp32 tensors and the step written into optimizer.state
    p2 = nn.Parameter(p.detach().clone())
    opt2 = ds_q8.Adam8bitBlock([p2], block_size=256)
    opt2.state[p2]["exp_avg"] = fp32["exp_avg"].clone()
    opt2.state[p2]["exp_avg_sq"] = fp32["exp_avg_sq"].clone()
    opt2.state[p2]["step"] = torch.tensor(3.0)
    p_fresh = nn.Parameter(p.detach().clone())
    opt_fresh = ds_q8.Adam8bitBlock([p_fresh], block_size=256)
    g = torch.randn_like(p)
    for q, o in ((p2, opt2), (p_ref, opt_ref), (p_fresh, opt_fresh)):
        q.grad = g.clone()
        o.step()
    assert sorted(opt2.state[p2]) == ["absmax1", "absmax2", "state1", "state2", "step"]
    assert opt2.state[p2]["step"] == 4
    carried = float((p2 - p_ref).detach().abs().max())
    reset = float((p_fresh - p_ref).detach().abs().max())
    assert carried < 0.05 * reset, (carried, reset)


def test_loading_with_another_block_size_is_refused_and_changes_nothing():
    p, opt = _trained(ds_q8.Adam8bitBlock)
    p2, opt2 = _trained(ds_q8.Adam8bitBlock, steps=1)
    opt2.param_groups[0]["block_size"] = 512  # as if configured differently; its own state matches 256
    before = copy.deepcopy(opt2.state[p2])
    with pytest.raises(ValueError, match="block_size=256.*block_size=512"):
        opt2.load_state_dict(opt.state_dict())
    for k, v in before.items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state[p2][k]))


def test_universal_names_refuse_more_than_two_states():
    class Three(Optimizer8bitBlock):
        rule = Rule("three", ("a", "b", "c"), (True, True, False), None, has_kernel=False)

        def __init__(self, params, lr=1e-3, **options):
            super().__init__(params, dict(lr=lr), **options)

    with pytest.raises(ValueError, match="at most 2"):
        Three.universal_names()
