"""Every optimizer case the tests run, in one table.

``CASES[name]`` is ``(ds_q8 class, 32-bit reference class, hyperparameters shared by both)``. The
references are torch's own optimizers where torch has one, else the plain float32 formulas below,
written from the papers and independent of ds_q8's code. The hyperparameters are away from the
defaults where a kernel could silently ignore them (betas, eps, alpha, dampening, decay), and small
enough that 8-bit state tracks the reference closely.
"""
from __future__ import annotations

import math

import torch

import ds_q8


class RefLion(torch.optim.Optimizer):
    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-g["lr"])
                m.lerp_(p.grad, 1 - b2)


class RefLAMB(torch.optim.Optimizer):
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1 ** t)
                v_hat = st["exp_avg_sq"] / (1 - b2 ** t)
                u = m_hat / (v_hat.sqrt() + g["eps"]) + g["weight_decay"] * p
                pn, un = p.norm().item(), u.norm().item()
                trust = pn / un if pn > 0 and un > 0 else 1.0
                p.add_(u, alpha=-g["lr"] * trust)


class RefLARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                pn, gn = p.norm().item(), p.grad.norm().item()
                trust = (g["trust_coefficient"] * pn / (gn + g["weight_decay"] * pn)
                         if pn > 0 and gn > 0 else 1.0)
                buf.mul_(g["momentum"]).add_((p.grad + g["weight_decay"] * p) * trust)
                p.add_(buf, alpha=-g["lr"])


class RefAdEMAMix(torch.optim.Optimizer):
    """AdEMAMix as the paper writes it (Algorithm 1, with its alpha and beta3 schedulers)."""

    def __init__(self, params, lr, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
                 weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2, b3_final = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m1=torch.zeros_like(p), m2=torch.zeros_like(p), nu=torch.zeros_like(p))
                st["step"] += 1
                t = st["step"]
                alpha, b3 = g["alpha"], b3_final
                if g["t_alpha"]:
                    alpha = min(t * g["alpha"] / g["t_alpha"], g["alpha"])
                if g["t_beta3"]:
                    f = min(t, g["t_beta3"]) / g["t_beta3"]
                    b3 = min(math.exp(math.log(b1) * math.log(b3_final)
                                      / ((1 - f) * math.log(b3_final) + f * math.log(b1))), b3_final)
                st["m1"].lerp_(p.grad, 1 - b1)
                st["m2"].lerp_(p.grad, 1 - b3)
                st["nu"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m1_hat = st["m1"] / (1 - b1 ** t)
                nu_hat = st["nu"] / (1 - b2 ** t)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_((m1_hat + alpha * st["m2"]) / (nu_hat.sqrt() + g["eps"]), alpha=-g["lr"])


CASES = {
    "adam": (ds_q8.Adam8bitBlock, torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2)),
    "adamw": (ds_q8.AdamW8bitBlock, torch.optim.AdamW, dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-1)),
    "momentum": (ds_q8.Momentum8bitBlock, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "nesterov": (ds_q8.Momentum8bitBlock, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "dampening": (ds_q8.Momentum8bitBlock, torch.optim.SGD, dict(lr=1e-2, momentum=0.8, dampening=0.3)),
    "rmsprop": (ds_q8.RMSprop8bitBlock, torch.optim.RMSprop, dict(lr=1e-3, alpha=0.99, weight_decay=1e-2)),
    "rmsprop_momentum": (ds_q8.RMSprop8bitBlock, torch.optim.RMSprop, dict(lr=1e-3, alpha=0.9, momentum=0.9)),
    "adagrad": (ds_q8.Adagrad8bitBlock, torch.optim.Adagrad,
                dict(lr=3e-2, lr_decay=1e-2, weight_decay=1e-2, initial_accumulator_value=0.1)),
    "lamb": (ds_q8.LAMB8bitBlock, RefLAMB, dict(lr=1e-2, weight_decay=1e-2)),
    "lamb_no_decay": (ds_q8.LAMB8bitBlock, RefLAMB, dict(lr=1e-2, betas=(0.8, 0.99))),
    "lars": (ds_q8.LARS8bitBlock, RefLARS, dict(lr=1.0, weight_decay=1e-3, trust_coefficient=2e-2)),
    "lion": (ds_q8.Lion8bitBlock, RefLion, dict(lr=1e-3, weight_decay=1e-1)),
    "ademamix": (ds_q8.AdEMAMix8bitBlock, RefAdEMAMix,
                 dict(lr=1e-3, betas=(0.8, 0.99, 0.999), alpha=4.0, t_alpha=20, t_beta3=20, weight_decay=1e-2)),
}


def kernel_cases():
    """``name -> (ds_q8 class, hyperparameters)``: the table without its references."""
    return {name: (ours, kw) for name, (ours, _, kw) in CASES.items()}


def reference_step(opt):
    """One step of ``opt`` forced onto the pure-PyTorch reference."""
    saved = [g["impl"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["impl"] = "reference"
    try:
        opt.step()
    finally:
        for g, impl in zip(opt.param_groups, saved):
            g["impl"] = impl
