"""The update rules, in plain PyTorch: the specification that every kernel reproduces bit for bit.

A :class:`Rule` is what a step needs to know of an optimizer: the name under which the kernels know
it (``Q8_RULES`` in ``csrc/includes/q8_rules.h``), the names and maps of its states, and its update
on float32 tensors. The update takes ``(p, g, states, h)``: the parameter (or a chunk of it), its
gradient, the states dequantized, all float32 and changed in place (``g`` must not be), and ``h``,
the step scalars (python floats) that the optimizer computed for the group and step. Each update is
written one IEEE operation per line so that a compiled kernel can reproduce it exactly.

Rules scaled by a whole-parameter norm (LAMB, LARS) also give ``norm_terms``, the tensors whose
norms over the whole parameter the step needs (read-only: ``states`` are scratch copies), and
``norm_hyper``, the step scalars once those norms are known.

Whole-matrix rules (Muon) give ``matrix``: their element-wise ``update`` changes the states and
writes the matrix's *direction* into its ``p`` argument (an fp32 scratch shaped like the tensor,
not the parameter); ``matrix(d, h)`` maps a whole matrix's direction to its step (Newton-Schulz),
and ``apply(p, o, h)`` steps the parameter by it, element-wise (``path_matrix.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .mathops import sqrt_rn

Hyper = Dict[str, float]


@dataclass(frozen=True)
class Rule:
    """An update rule. ``name`` identifies it (in checkpoints' telemetry and errors, and, where
    ``has_kernel``, to the compiled kernels: their ``Q8_RULES``, which must list exactly the rules of
    this module that have one; ``tests/test_kernels.py`` checks it)."""
    name: str
    state_names: Tuple[str, ...]
    state_signed: Tuple[bool, ...]
    update: Callable[[torch.Tensor, torch.Tensor, List[torch.Tensor], Hyper], None]
    norm_terms: Optional[Callable] = None
    norm_hyper: Optional[Callable[[Hyper, List[float]], Hyper]] = None
    matrix: Optional[Callable[[torch.Tensor, Hyper], torch.Tensor]] = None
    apply: Optional[Callable[[torch.Tensor, torch.Tensor, Hyper], None]] = None
    #: whether the compiled kernels step this rule (under ``name``); False: the reference path steps it
    has_kernel: bool = True

    @property
    def kernel(self) -> Optional[str]:
        """The kernels' name for this rule, or None where it has no fused kernel."""
        return self.name if self.has_kernel else None

    @property
    def num_states(self) -> int:
        return len(self.state_names)

    @property
    def is_matrix(self) -> bool:
        return self.matrix is not None

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


# ---------------------------------------------------------------------------- Muon
# DeepSpeed 0.19.8's Muon (deepspeed/runtime/zero/muon/original_muon.py: muon_update and the two
# Newton-Schulz iterations), with the same coefficients, normalization, Gram restart and update
# scaling, but always in float32 (DeepSpeed casts to bf16/fp16 where the accelerator has them) and
# with torch.lerp written out one IEEE operation at a time, so that a slice of the element-wise
# part computes the same bits wherever a partition edge falls.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")


def newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """DeepSpeed's ``zeropower_via_newtonschulz5`` in float32: the quintic iteration on X."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(torch.float32)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def gram_newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """DeepSpeed's ``zeropower_via_gram_newtonschulz`` in float32: the same polynomial iterated on the
    small Gram matrix R = X X^T, restarted at iteration 2; square matrices take the standard iteration."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(torch.float32)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    n, m = X.size(-2), X.size(-1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    if m <= n:
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.mT if tall else X
    R = X @ X.mT
    Q = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at and i != 0:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and (i + 1) != restart_at:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return X.mT @ Q.mT if tall else Q @ X


def muon_scale(shape) -> float:
    """DeepSpeed's update scaling: sqrt(rows / cols) when rows > cols, else 1 (rows, cols: the last two
    dimensions of the parameter, as ``muon_update`` reads them from the gradient)."""
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _muon_momentum(d, g, states, h):
    (m,) = states
    # momentum.lerp_(grad, 1 - beta): torch's lerp below weight 0.5 is self + w * (end - self)
    m.add_((g - m) * h["one_minus_beta"])
    if h["nesterov"]:
        # grad.lerp(momentum, beta): at weight >= 0.5 torch computes end - (end - self) * (1 - w)
        d.copy_(m - (m - g) * h["one_minus_beta"])
    else:
        d.copy_(m)
    d.add_(0.0)  # -0.0 -> +0.0: the sharded exchange sums slices with zeros, which does the same


def _muon_matrix(d: torch.Tensor, h) -> torch.Tensor:
    shape = d.shape
    x = d.reshape(shape[0], -1) if d.ndim > 2 else d  # conv filters as DeepSpeed views them
    ns = gram_newton_schulz if h["ns_gram"] else newton_schulz
    o = ns(x, int(h["ns_steps"]))
    o.mul_(muon_scale(shape))
    return o.reshape(shape)


def _muon_apply(p, o, h):
    # p.mul_(1 - lr * wd); p.add_(update, alpha=-lr), as a multiply and a subtraction (no fused
    # multiply-add, whose rounding would depend on where a vectorized loop starts)
    if h["weight_decay"] != 0.0:
        p.mul_(h["decay_factor"])
    p.sub_(o * h["lr"])


#: Muon's rule: one signed state named as DeepSpeed names it; the momentum part is element-wise with no
#: fused kernel (the reference path, whose block codec may be the compiled one), Newton-Schulz runs per
#: whole matrix (``path_matrix.py``)
MUON = Rule("muon", ("momentum_buffer",), (True,), _muon_momentum, matrix=_muon_matrix, apply=_muon_apply,
            has_kernel=False)


__all__ = ["Rule", "MUON", "newton_schulz", "gram_newton_schulz", "muon_scale", "NS_COEFFICIENTS", "NS_METHODS",
           "ADEMAMIX", "ADAM", "ADAMW", "MOMENTUM", "RMSPROP", "RMSPROP_MOMENTUM", "ADAGRAD", "LAMB", "LARS", "LION"]
