"""Every invalid hyperparameter of every registered optimizer, as a constructor argument or as a
DeepSpeed ``"optimizer": {"params": ...}`` entry, is refused with an error naming the field and
what is valid. An optimizer added to the registry fails ``test_every_field_has_cases`` until its
fields have cases here.
"""
import math

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8.integration.params import constructor_keys

NAN, INF = float("nan"), math.inf
# field -> [(invalid value, text the error must contain)]
INVALID = {
    "lr": [(-1e-3, "lr must be in [0.0, inf)"), (INF, "lr must be in [0.0, inf)"), (NAN, "lr must be a number"),
           ("0.1", "lr must be a number"), (True, "lr must be a number")],
    "betas": [((0.9,), "betas must be a pair"), (0.9, "betas must be a pair"), ((1.0, 0.999), "betas[0] must be in [0.0, 1.0)"),
              ((0.9, -0.1), "betas[1] must be in [0.0, 1.0)"), ((0.9, NAN), "betas[1] must be a number")],
    "eps": [(-1e-8, "eps must be in [0.0, inf)"), (INF, "eps must be in [0.0, inf)"), (NAN, "eps must be a number")],
    "weight_decay": [(-0.1, "weight_decay must be in [0.0, inf)"), (INF, "weight_decay must be in [0.0, inf)")],
    "amsgrad": [(True, "amsgrad=True is not supported")],
    "block_size": [(100, "block_size must be a power of two in [64, 4096]"), (32, "[64, 4096]"), (8192, "[64, 4096]"),
                   (256.0, "block_size"), (True, "block_size")],
    "min_8bit_size": [(-1, "min_8bit_size must be an integer >= 0"), (1.5, "min_8bit_size"), (True, "min_8bit_size")],
    "optim_bits": [(16, "optim_bits must be 4, 8 or 32"), (True, "optim_bits must be 4, 8 or 32")],
    "quantization": [("log", "quantization must be one of ('dynamic', 'dynamic6', 'minifloat', 'linear')")],
    "nonfinite": [("ignore", "nonfinite must be one of ('skip', 'raise', 'off')")],
    # the valid momentum range depends on the optimizer: (0, 1] for SGD, [0, 1) for RMSprop, (0, 1) for LARS
    "momentum": [(-0.5, "momentum must be in "), (1.5, "momentum must be in "), (NAN, "momentum must be a number")],
    "alpha": [(-0.1, "alpha must be in [0.0, 1.0]"), (1.5, "alpha must be in [0.0, 1.0]"), (NAN, "alpha must be a number")],
    "centered": [(True, "centered=True is not supported")],
    "lr_decay": [(-1.0, "lr_decay must be in [0.0, inf)"), (INF, "lr_decay must be in [0.0, inf)")],
    "initial_accumulator_value": [(-1.0, "initial_accumulator_value must be in [0.0, inf)"),
                                  (NAN, "initial_accumulator_value must be a number")],
    "trust_coefficient": [(0.0, "trust_coefficient must be in (0.0, inf)"), (-1.0, "trust_coefficient must be in (0.0, inf)"),
                          (INF, "trust_coefficient must be in (0.0, inf)")],
    "dampening": [(-0.1, "dampening must be in [0.0, 1.0]"), (2.0, "dampening must be in [0.0, 1.0]")],
    "nesterov": [(1, "nesterov must be True or False")],
    "stochastic_rounding": [("yes", "stochastic_rounding must be true, false or null"),
                            (1, "stochastic_rounding must be true, false or null")],
    "correction_byte": [("yes", "correction_byte must be true or false"), (1, "correction_byte must be true or false")],
    "state_rounding": [("up", "state_rounding must be one of ('guided', 'stochastic', 'stochastic_unsigned', 'nearest')"),
                       (None, "state_rounding must be one of")],
    "impl": [("cuda", "impl must be one of ('auto', 'kernel', 'reference')"), (None, "impl must be one of")],
    "embeddings_32bit": [("yes", "embeddings_32bit must be true or false"), (1, "embeddings_32bit must be true or false"),
                         (None, "embeddings_32bit must be true or false")],
    "sr_seed": [(-1, "sr_seed must be an integer in [0, 4294967295]"), (2 ** 32, "sr_seed must be an integer"),
                (1.0, "sr_seed must be an integer"), (True, "sr_seed must be an integer")],
    "t_alpha": [(0, "t_alpha must be null (no warm-up) or an integer >= 1"), (2.5, "t_alpha must be null"),
                (True, "t_alpha must be null")],
    "t_beta3": [(0, "t_beta3 must be null (no warm-up) or an integer >= 1"), (-3, "t_beta3 must be null")],
}
# fields whose meaning is the optimizer's own: AdEMAMix has three betas and an unbounded alpha
INVALID_FOR = {
    "Muon8bitBlock": {
        "muon_lr": [(-1.0, "muon_lr must be in [0.0, inf)"), (NAN, "muon_lr must be a number")],
        "adam_lr": [(INF, "adam_lr must be in [0.0, inf)"), ("1e-3", "adam_lr must be a number")],
        "momentum": [(-0.5, "momentum must be in [0.0, 1.0)"), (1.0, "momentum must be in [0.0, 1.0)"),
                     (NAN, "momentum must be a number")],
        "ns_method": [("svd", "ns_method must be one of ('gram', 'standard')")],
        "ns_steps": [(0, "ns_steps must be an integer in [1, 100]"), (2.5, "ns_steps must be an integer")],
        "direction_bits": [(16, "direction_bits must be 8 or 32"), (True, "direction_bits must be 8 or 32")],
    },
    "AdEMAMix8bitBlock": {
        "betas": [((0.9, 0.999), "betas must be three values"), (0.9, "betas must be three values"),
                  ((1.0, 0.999, 0.9999), "betas[0] must be in [0.0, 1.0)"),
                  ((0.9, 0.999, -0.1), "betas[2] must be in [0.0, 1.0)"), ((0.9, NAN, 0.9999), "betas[1] must be a number"),
                  ((0.0, 0.999, 0.9999), "t_beta3 needs betas[0] and betas[2] in (0, 1)")],
        "alpha": [(-0.1, "alpha must be in [0.0, inf)"), (INF, "alpha must be in [0.0, inf)"),
                  (NAN, "alpha must be a number")],
    },
}


def invalid_cases(name: str, field: str) -> list:
    return INVALID_FOR.get(name, {}).get(field, INVALID.get(field, []))


CASES = [(name, field, value, text) for name, cls in sorted(ds_q8.OPTIMIZERS.items())
         for field in constructor_keys(cls) for value, text in invalid_cases(name, field)]


def params():
    return [nn.Parameter(torch.zeros(8))]


def test_every_field_has_cases():
    for name, cls in ds_q8.OPTIMIZERS.items():
        missing = [k for k in constructor_keys(cls) if not invalid_cases(name, k)]
        assert not missing, f"{name}: no invalid-value cases for {missing}"


@pytest.mark.parametrize("name, field, value, text", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]!r}" for c in CASES])
def test_invalid_value_names_field_and_range(name, field, value, text):
    extra = {"t_beta3": 10} if "t_beta3 needs" in text else {}
    with pytest.raises(ValueError) as e:
        ds_q8.OPTIMIZERS[name](params(), **{field: value}, **extra)
    assert text in str(e.value)
    assert field.split("[")[0] in str(e.value)


@pytest.mark.parametrize("name", sorted(ds_q8.OPTIMIZERS))
def test_invalid_value_in_a_later_param_group_is_refused_and_not_kept(name):
    opt = ds_q8.OPTIMIZERS[name](params(), lr=1e-3)
    with pytest.raises(ValueError, match=r"lr must be in \[0.0, inf\)"):
        opt.add_param_group({"params": params(), "lr": INF})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", sorted(ds_q8.OPTIMIZERS))
def test_deepspeed_params_entries(name):
    # what DeepSpeed does with a JSON "params" section: cls(model_parameters, **params)
    cls = getattr(torch.optim, name)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['lr_max'\].*valid keys: lr,"):
        cls(params(), **{"lr": 1e-3, "lr_max": 1.0})
    with pytest.raises(ValueError, match=r"\['lr'\] are \"auto\""):
        cls(params(), **{"lr": "auto"})
    with pytest.raises(ValueError, match=r"block_size must be a power of two in \[64, 4096\].*got 1000"):
        cls(params(), **{"lr": 1e-3, "block_size": 1000})
