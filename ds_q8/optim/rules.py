"""The update rules, in plain PyTorch: the specification that every kernel reproduces bit for bit.

A :class:`Rule` is what a step needs to know of an optimizer: the name under which the kernels know
it (``Q8_RULES`` in ``csrc/includes/q8_common.h``), the names and maps of its states, and its update
on float32 tensors. The update takes ``(p, g, states, h)``: the parameter (or a chunk of it), its
gradient, the states dequantized, all float32 and changed in place (``g`` must not be), and ``h``,
the step scalars (python floats) that the optimizer computed for the group and step. Each update is
written one IEEE operation per line so that a compiled kernel can reproduce it exactly.

Rules scaled by a whole-parameter norm (LAMB, LARS) also give ``norm_terms``, the tensors whose
norms over the whole parameter the step needs (read-only: ``states`` are scratch copies), and
``norm_hyper``, the step scalars once those norms are known.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .mathops import sqrt_rn

Hyper = Dict[str, float]


@dataclass(frozen=True)
class Rule:
    name: str
    state_names: Tuple[str, ...]
    state_signed: Tuple[bool, ...]
    update: Callable[[torch.Tensor, torch.Tensor, List[torch.Tensor], Hyper], None]
    norm_terms: Optional[Callable] = None
    norm_hyper: Optional[Callable[[Hyper, List[float]], Hyper]] = None

    @property
    def num_states(self) -> int:
        return len(self.state_names)

    @property
    def needs_norms(self) -> bool:
        return self.norm_terms is not None


# ---------------------------------------------------------------------------- Adam, AdamW
def _adam_update(decoupled: bool):
    def update(p, g, states, h):
        m, v = states
        if h["weight_decay"] != 0.0:
            if decoupled:
                p.mul_(h["decay_factor"])
            else:
                g = g + p * h["weight_decay"]
        m.mul_(h["beta1"]).add_(g * h["one_minus_beta1"])
        v.mul_(h["beta2"]).add_((g * g) * h["one_minus_beta2"])
        # a multiply by the reciprocal, not a division: one division fewer per element in the kernels
        denom = (sqrt_rn(v) * (1.0 / h["bias_correction2_sqrt"])).add_(h["eps"])
        p.sub_((m / denom) * h["step_size"])
    return update


ADAM = Rule("adam", ("exp_avg", "exp_avg_sq"), (True, False), _adam_update(False))
ADAMW = Rule("adamw", ("exp_avg", "exp_avg_sq"), (True, False), _adam_update(True))


# ---------------------------------------------------------------------------- SGD with momentum
def _momentum(p, g, states, h):
    (buf,) = states
    if h["weight_decay"] != 0.0:
        g = g + p * h["weight_decay"]
    if h["first_step"]:
        buf.copy_(g)
    else:
        buf.mul_(h["momentum"]).add_(g * h["one_minus_dampening"])
    d = g + buf * h["momentum"] if h["nesterov"] else buf
    p.sub_(d * h["lr"])


MOMENTUM = Rule("momentum", ("momentum_buffer",), (True,), _momentum)


# ---------------------------------------------------------------------------- RMSprop
def _rmsprop(p, g, states, h):
    sq = states[0]
    if h["weight_decay"] != 0.0:
        g = g + p * h["weight_decay"]
    sq.mul_(h["alpha"]).add_((g * g) * h["one_minus_alpha"])
    avg = sqrt_rn(sq).add_(h["eps"])
    d = g / avg
    if len(states) == 2:
        buf = states[1]
        buf.mul_(h["momentum"]).add_(d)
        d = buf
    p.sub_(d * h["lr"])


RMSPROP = Rule("rmsprop", ("square_avg",), (False,), _rmsprop)
RMSPROP_MOMENTUM = Rule("rmsprop_momentum", ("square_avg", "momentum_buffer"), (False, True), _rmsprop)


# ---------------------------------------------------------------------------- Adagrad
def _adagrad(p, g, states, h):
    (s,) = states
    if h["weight_decay"] != 0.0:
        g = g + p * h["weight_decay"]
    s.add_(g * g)
    std = sqrt_rn(s).add_(h["eps"])
    p.sub_((g / std) * h["clr"])


ADAGRAD = Rule("adagrad", ("sum",), (False,), _adagrad)


# ---------------------------------------------------------------------------- LAMB
def _lamb_direction(p, g, states, h):
    m, v = states
    m.mul_(h["beta1"]).add_(g * h["one_minus_beta1"])
    v.mul_(h["beta2"]).add_((g * g) * h["one_minus_beta2"])
    # multiplies by reciprocals (rounded once to float32, as torch does with a python scalar)
    # rather than divisions: two divisions fewer per element in the kernels
    denom = (sqrt_rn(v) * (1.0 / h["bias_correction2_sqrt"])).add_(h["eps"])
    u = (m * (1.0 / h["bias_correction1"])) / denom
    if h["weight_decay"] != 0.0:
        u.add_(p * h["weight_decay"])
    return u


def _lamb(p, g, states, h):
    p.sub_(_lamb_direction(p, g, states, h) * h["step_size"])


def _lamb_norm_hyper(h: Hyper, norms: List[float]) -> Hyper:
    p_norm, u_norm = norms
    trust = p_norm / u_norm if p_norm > 0.0 and u_norm > 0.0 else 1.0
    return dict(h, trust_ratio=trust, step_size=h["lr"] * trust)


LAMB = Rule("lamb", ("exp_avg", "exp_avg_sq"), (True, False), _lamb,
            norm_terms=lambda p, g, states, h: (p, _lamb_direction(p, g, states, h)), norm_hyper=_lamb_norm_hyper)


# ---------------------------------------------------------------------------- LARS
def _lars(p, g, states, h):
    (buf,) = states
    if h["weight_decay"] != 0.0:
        g = g + p * h["weight_decay"]
    buf.mul_(h["momentum"]).add_(g * h["trust_ratio"])
    p.sub_(buf * h["lr"])


def _lars_norm_hyper(h: Hyper, norms: List[float]) -> Hyper:
    p_norm, g_norm = norms
    if p_norm > 0.0 and g_norm > 0.0:
        trust = h["trust_coefficient"] * p_norm / (g_norm + h["weight_decay"] * p_norm)
    else:
        trust = 1.0
    return dict(h, trust_ratio=trust)


LARS = Rule("lars", ("momentum_buffer",), (True,), _lars, norm_terms=lambda p, g, states, h: (p, g),
            norm_hyper=_lars_norm_hyper)


# ---------------------------------------------------------------------------- Lion
def _lion(p, g, states, h):
    (m,) = states
    if h["weight_decay"] != 0.0:
        p.mul_(h["decay_factor"])
    c = m * h["beta1"]
    c.add_(g * h["one_minus_beta1"])
    p.sub_(c.sign_() * h["lr"])
    m.mul_(h["beta2"]).add_(g * h["one_minus_beta2"])


LION = Rule("lion", ("exp_avg",), (True,), _lion)


# ---------------------------------------------------------------------------- AdEMAMix
def _ademamix(p, g, states, h):
    m1, m2, nu = states
    if h["weight_decay"] != 0.0:
        p.mul_(h["decay_factor"])
    m1.mul_(h["beta1"]).add_(g * h["one_minus_beta1"])
    m2.mul_(h["beta3"]).add_(g * h["one_minus_beta3"])
    nu.mul_(h["beta2"]).add_((g * g) * h["one_minus_beta2"])
    denom = (sqrt_rn(nu) * (1.0 / h["bias_correction2_sqrt"])).add_(h["eps"])
    num = m1 * (1.0 / h["bias_correction1"]) + m2 * h["alpha"]
    p.sub_((num / denom) * h["lr"])


ADEMAMIX = Rule("ademamix", ("exp_avg", "exp_avg_slow", "exp_avg_sq"), (True, True, False), _ademamix)


__all__ = ["Rule", "ADEMAMIX", "ADAM", "ADAMW", "MOMENTUM", "RMSPROP", "RMSPROP_MOMENTUM", "ADAGRAD", "LAMB", "LARS", "LION"]
