"""Muon (Jordan et al., "Muon: MomentUm Orthogonalized by Newton-Schulz", 2024) with an auxiliary
AdamW, as DeepSpeed 0.19.8 runs it (``"type": "Muon"``: ``MuonWithAuxAdam``), with 8-bit block-wise
state: Muon's momentum is one signed 8-bit state, the AdamW groups keep two (``rules.ADAMW``).

The optimizer has a rule per parameter group (:meth:`Muon8bitBlock.rule_for`): each incoming group is
split into a Muon half and an AdamW half, as DeepSpeed's engine splits it, so that a group (and under
ZeRO its flat partition) holds one kind only.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from . import rules
from .base import OPTIM_BITS_ATTR, Optimizer8bitBlock
from .checks import beta_hyper, check_adam_group, check_range

MUON = rules.MUON  # re-exported: Muon groups' rule

#: name fragments DeepSpeed's ``set_optimizer_flags`` keeps out of Muon (embeddings, output head)
AUX_NAME_KEYS = ("embed", "lm_head")


def _shape(p: torch.Tensor) -> tuple:
    """A parameter's shape as a layer (ZeRO-3 keeps it in ``ds_shape``)."""
    ds = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds is None else tuple(ds)


def default_use_muon(p: torch.Tensor, name: Optional[str] = None) -> bool:
    """Whether ``p`` takes Muon: its ``use_muon`` tag where it has one; otherwise DeepSpeed's default,
    2-D and larger hidden matrices yes, and no for vectors (biases, norms), for parameters marked for
    32-bit state (``StableEmbedding``) and, where the name is known, for embeddings and the output
    head (a name containing ``embed`` or ``lm_head``, as DeepSpeed tests it)."""
    tag = getattr(p, "use_muon", None)
    if tag is not None:
        return bool(tag)
    if len(_shape(p)) < 2 or getattr(p, OPTIM_BITS_ATTR, None) == 32:
        return False
    return name is None or not any(k in name.lower() for k in AUX_NAME_KEYS)


def tag_muon(model: torch.nn.Module) -> Dict[str, bool]:
    """Set ``use_muon`` on every untagged parameter of ``model`` by :func:`default_use_muon` with its
    name (what DeepSpeed's ``set_optimizer_flags`` does for ``"type": "Muon"``); returns name -> tag."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "use_muon", None) is None:
            p.use_muon = default_use_muon(p, name)
        out[name] = bool(p.use_muon)
    return out


class Muon8bitBlock(Optimizer8bitBlock):
    """Muon for hidden matrices and AdamW for the rest, with 8-bit block-wise state.

    Semantics are DeepSpeed 0.19.8's (``deepspeed/runtime/zero/muon/original_muon.py``):

    * which parameters take Muon: the ``use_muon`` tag, else :func:`default_use_muon` (2-D hidden
      matrices; embeddings, the output head, biases and norms take AdamW). A group given with a
      ``"use_muon"`` key is taken whole as that kind;
    * learning rates as DeepSpeed's engine resolves them: a group's own ``lr``, else ``muon_lr`` /
      ``adam_lr``, else the shared ``lr``, else MuonWithAuxAdam's defaults (0.02 and 3e-4);
    * Muon: ``m = m.lerp(g, 1 - momentum)``; Nesterov (default) ``u = g.lerp(m, momentum)``, else
      ``u = m``; ``O = NS(u) * sqrt(max(1, rows / cols))``; ``p = p (1 - lr wd) - lr O``. NS is
      ``ns_method="gram"`` (DeepSpeed's default: ``zeropower_via_gram_newtonschulz``, Gram iteration
      restarted at step 2, standard iteration for square matrices) or ``"standard"``
      (``zeropower_via_newtonschulz5``), ``ns_steps`` (5) quintic steps with DeepSpeed's coefficients
      (a, b, c) = (3.4445, -4.7750, 2.0315) after normalizing by the Frobenius norm + 1e-7. Unlike
      DeepSpeed (bf16/fp16 where the accelerator has them) it always runs in fp32 temporaries, freed
      after each matrix, through torch matmuls. Conv filters are viewed as (out, -1);
    * ``direction_bits`` (8, the default): the Nesterov direction that Newton-Schulz takes is first
      quantized 8-bit block-wise in the matrix's own blocks, as the momentum is, so that a matrix cut
      by ZeRO partition edges travels between its ranks as codes and block maxima (a quarter of its
      fp32 bytes) and every world size steps the same bits. ``32`` keeps the fp32 direction
      (DeepSpeed's arithmetic, up to its bf16 casts); a cut matrix then travels in fp32;
    * AdamW: ``betas`` (0.9, 0.95), ``eps`` 1e-10, decoupled ``weight_decay`` (shared, 0 by default);
    * ``quantization`` defaults to ``"dynamic6"`` here (``option_defaults``), not to the other optimizers'
      ``"minifloat"``: the momentum that Newton-Schulz orthogonalizes stayed closer to its 32-bit twin's on it
      (docs/history.md, "Minifloat maps").

    State: ``momentum_buffer`` (Muon groups), ``exp_avg`` and ``exp_avg_sq`` (AdamW groups), each
    8-bit block-wise (1 byte per element plus one bfloat16 maximum per block). Under ZeRO 1/2 each rank
    keeps its slices' codes; a matrix cut by a partition edge is formed whole from the ranks' slices of
    its Muon direction (``path_matrix.exchange``), so the step is the same bits at every world size.
    """
    rule = rules.ADAMW  # the class's default rule (the auxiliary AdamW groups); Muon groups: MUON (rule_for)
    tag_parameters = staticmethod(tag_muon)  # DeepSpeed's tagging for "type": "Muon", for this class too
    option_defaults = dict(quantization="dynamic6")

    def __init__(self, params, lr=None, muon_lr=None, adam_lr=None, momentum=0.95, nesterov=True, ns_method="gram",
                 ns_steps=5, direction_bits=8, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0, **options):
        # the arguments are checked here, whatever the groups: a model without matrices still gets its errors
        for key, value in (("lr", lr), ("muon_lr", muon_lr), ("adam_lr", adam_lr)):
            if value is not None:
                check_range(key, value, 0.0, math.inf)
        _check_muon_settings(dict(momentum=momentum, nesterov=nesterov, ns_method=ns_method, ns_steps=ns_steps,
                                  direction_bits=direction_bits))
        check_adam_group(dict(betas=betas, eps=eps, weight_decay=weight_decay))
        super().__init__(params, dict(lr=lr, muon_lr=muon_lr, adam_lr=adam_lr, momentum=momentum, nesterov=nesterov,
                                      ns_method=ns_method, ns_steps=ns_steps, direction_bits=direction_bits,
                                      betas=betas, eps=eps,
                                      weight_decay=weight_decay), **options)

    def rule_for(self, group: dict):
        return MUON if group.get("use_muon") else rules.ADAMW

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """Add a group, split into its Muon and AdamW halves (in that order, as DeepSpeed's engine
        splits them); a group with a ``"use_muon"`` key is one kind whole. All or nothing."""
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = [q if isinstance(q, tuple) else (None, q) for q in params]
        if "use_muon" in group:
            halves = [(bool(group["use_muon"]), [q for _, q in named])]
        else:
            tags = [(default_use_muon(q, n), q) for n, q in named]
            halves = [(kind, [q for t, q in tags if t is kind]) for kind in (True, False)]
            halves = [h for h in halves if h[1]] or [(False, [])]
        added = 0
        try:
            for use_muon, members in halves:
                half = dict(group, params=members, use_muon=use_muon)
                half.pop("param_names", None)
                if "lr" not in half or half["lr"] is None:
                    half["lr"] = self._resolved_lr(group, use_muon)
                super().add_param_group(half)
                added += 1
        except BaseException:
            del self.param_groups[len(self.param_groups) - added:]
            raise

    def _resolved_lr(self, group: dict, use_muon: bool):
        """DeepSpeed's order: muon_lr / adam_lr, then the shared lr, then MuonWithAuxAdam's default."""
        own = group.get("muon_lr" if use_muon else "adam_lr", self.defaults.get("muon_lr" if use_muon else "adam_lr"))
        if own is not None:
            return own
        shared = self.defaults.get("lr")
        if shared is not None:
            return shared
        return 0.02 if use_muon else 3e-4

    def _check_group(self, group: dict) -> None:
        check_adam_group(group)
        if not group["use_muon"]:
            return
        _check_muon_settings(group)
        for p in group["params"]:
            if len(_shape(p)) < 2:
                raise ValueError(f"use_muon: Muon orthogonalizes matrices, but a parameter of shape {_shape(p)} is "
                                 "tagged use_muon=True; tag it use_muon=False (it takes the auxiliary AdamW)")
        if group.get("impl", "auto") == "kernel":
            raise ValueError("impl must be 'auto' or 'reference' for a Muon group: Muon's momentum has no fused "
                             "kernel (impl='kernel' stays valid for the AdamW groups)")

    # ------------------------------------------------------------------ step scalars
    def _hyper(self, group: dict, step: int) -> Dict[str, float]:
        lr, wd = group["lr"], group["weight_decay"]
        if group["use_muon"]:
            beta = group["momentum"]
            return dict(one_minus_beta=1.0 - beta, nesterov=1.0 if group["nesterov"] else 0.0,
                        ns_gram=1.0 if group["ns_method"] == "gram" else 0.0, ns_steps=float(group["ns_steps"]),
                        direction_bits=float(group["direction_bits"]),
                        lr=lr, weight_decay=wd, decay_factor=1.0 - lr * wd)
        beta1, beta2 = group["betas"]
        return dict(beta_hyper(group), eps=group["eps"], weight_decay=wd, decay_factor=1.0 - lr * wd,
                    step_size=lr / (1.0 - beta1 ** step), bias_correction2_sqrt=math.sqrt(1.0 - beta2 ** step))


def _check_muon_settings(group: dict) -> None:
    check_range("momentum", group["momentum"], 0.0, 1.0, hi_open=True)
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
    if group["ns_method"] not in rules.NS_METHODS:
        raise ValueError(f"ns_method must be one of {rules.NS_METHODS}, got {group['ns_method']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise ValueError(f"ns_steps must be an integer in [1, 100], got {steps!r}")
    bits = group["direction_bits"]
    if isinstance(bits, bool) or bits not in (8, 32):
        raise ValueError(f"direction_bits must be 8 or 32, got {bits!r}")


__all__ = ["Muon8bitBlock", "MUON", "default_use_muon", "tag_muon"]
