"""The reference path: the pure-PyTorch specification of the step, which every kernel matches bit
for bit (``tests/test_kernels.py``, ``tests/test_cuda_sim.py``), the parameter reads and writes
(rounded to nearest, stochastically, or through a correction byte) that every path shares, and the
library's one extension point for studies of requantization rules (:func:`set_requantize_rule`)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .. import functional as F
from .. import ops
from . import rounding, telemetry
from .group_options import ROUND_BY_OLD_CODE, maps_of, stochastic_params, rounding_modes
from .pieces import Item8, Item32, Rounding
from .rules import Rule
from .state_keys import CHUNK

#: a requantization rule that no option selects, installed by a study (:func:`set_requantize_rule`), or None
_REQUANTIZE_RULE: Optional[Callable] = None


def set_requantize_rule(rule: Optional[Callable]) -> Optional[Callable]:
    """Install a requantization rule for studies (``studies/rule_study.py``),
    or remove it with None; returns the rule it replaces. The library's only extension point, global to the
    process: the 8-bit reference step (``impl="reference"``, or where no kernel runs; the kernels, 4-bit
    state and the ZeRO shared-block path never consult it) calls
    ``rule(i, mode, x, old, old_absmax, absmax, code, block_size, bits)`` for each 8-bit state ``i`` of each
    chunk, with ``mode`` the state's rounding as the group asks for it (``ROUND_*``), ``x`` its float32
    values after the update, ``old`` and ``old_absmax`` its codes and block maxima before the step (the
    values before the update are ``functional.dequantize_flat(old, old_absmax, code, block_size)``),
    ``absmax`` the stored maxima of ``x`` and ``bits`` the random bits drawn for it (None where none are).
    The rule returns the uint8 codes, or None for the product's own."""
    global _REQUANTIZE_RULE
    before, _REQUANTIZE_RULE = _REQUANTIZE_RULE, rule
    return before


def read_param(p: torch.Tensor, correction: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A parameter (or its chunk) as fp32: with its correction bytes, the 24-bit value they make."""
    if correction is None:
        return p.to(torch.float32)
    return rounding.join_bf16(p.reshape(-1), correction.reshape(-1)).view(p.shape)


def write_param(dst: torch.Tensor, p32: torch.Tensor, sr: Optional[Rounding], offset: int = 0,
                correction: Optional[torch.Tensor] = None) -> None:
    """Write fp32 values into a parameter (or its chunk): rounded to nearest, stochastically with
    ``sr = (key, index of dst's first element in its parameter)``, or split into bf16 and its
    ``correction`` bytes."""
    if correction is not None:
        b, c = rounding.split_bf16(p32.reshape(-1))
        dst.copy_(b.view(dst.shape))
        correction.copy_(c.view(correction.shape))
        return
    if sr is None or dst.dtype == torch.float32:
        dst.copy_(p32.view(dst.shape))
        return
    index = torch.arange(sr[1] + offset, sr[1] + offset + p32.numel(), device=p32.device)
    dst.copy_(rounding.round_stochastic(p32.reshape(-1), dst.dtype, sr[0], index).view(dst.shape))


def reference_step_32bit(rule: Rule, item: Item32, group: dict, h) -> None:
    p, grad, states, sr, corr = item
    if p.dtype == torch.float32:
        rule.update(p.data, grad.to(torch.float32), list(states), h)
    else:
        p32 = read_param(p.data, corr)
        rule.update(p32, grad.to(torch.float32), list(states), h)
        write_param(p.data, p32, sr, correction=corr)


class BlockCodec(NamedTuple):
    """Block-wise (de)quantization by the compiled kernels, for a rule that has no fused step
    (Muon's momentum): the same codes and values as functional.py's, which is their specification
    (``tests/test_kernels.py``). ``quantize(x, map, bs) -> (codes, absmax)`` rounds to nearest."""
    quantize: Callable
    dequantize: Callable


def block_codec(rule: Rule, group: dict) -> Optional[BlockCodec]:
    """The compiled codec where ``rule`` has no fused kernel and the group may use kernels
    (``impl`` not ``"reference"``); None: functional.py's."""
    if rule.has_kernel or group.get("impl", "auto") == "reference":
        return None
    return BlockCodec(_kernel_quantize, _kernel_dequantize)


def _kernel_quantize(x: torch.Tensor, code: torch.Tensor, bs: int):
    try:
        return ops.quantize_blockwise(x, code, bs)
    except ValueError:  # a non-finite value: the reference maps it as the step's specification says
        am = F.block_absmax(x, bs)
        return F.quantize_with_absmax(x, am, code, bs), am


def _kernel_dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, bs: int) -> torch.Tensor:
    return ops.dequantize_blockwise(codes, absmax, code, bs)


def reference_step_8bit(rule: Rule, item: Item8, group: dict, h, error_sums=None,
                        codec: Optional[BlockCodec] = None) -> None:
    """The specification of the 8-bit step, on a tensor (or piece) whose first element starts a block.

    ``item.rounding`` is None or ``(key, index of p's first element in its parameter)``: the random
    bits of stochastic rounding (``rounding.py``), for 16-bit parameter writes and for the states that
    :func:`rounding_modes` names. ``error_sums`` (telemetry) takes the requantization error.
    ``codec`` (:func:`block_codec`) dequantizes and requantizes (to nearest) in the compiled kernels."""
    p, grad, codes, absmax, sr, corr = item
    bs = F.resolve_block_size(group["block_size"], p.numel())
    maps = maps_of(rule, group, p.device)
    modes = rounding_modes(group, rule.state_signed)
    drawn = [sr is not None and bool(mode) for mode in modes]
    param_sr = sr if stochastic_params(group, p.dtype) else None
    n = p.numel()
    # a non-contiguous parameter (e.g. a transposed view) is stepped in a flat copy, written back below
    in_place = p.data.is_contiguous()
    pf = p.data.view(-1) if in_place else p.data.reshape(-1).clone()
    gf = grad.reshape(-1)
    flat_codes = [c.view(-1) for c in codes]
    chunk = max(bs, CHUNK // bs * bs)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        b0, b1 = start // bs, F.num_blocks(end, bs)
        corr_chunk = None if corr is None else corr.view(-1)[start:end]
        p32 = pf[start:end] if p.dtype == torch.float32 else read_param(pf[start:end], corr_chunk)
        g32 = gf[start:end].to(torch.float32)
        dequantize = F.dequantize_flat if codec is None else codec.dequantize
        states = [dequantize(c[start:end], a[b0:b1], m, bs) for c, a, m in zip(flat_codes, absmax, maps)]
        rule.update(p32, g32, states, h)
        for i, (c, a, m, s) in enumerate(zip(flat_codes, absmax, maps, states)):
            old = c[start:end].long() if drawn[i] and modes[i] == ROUND_BY_OLD_CODE else None
            if codec is not None and not drawn[i]:
                c[start:end], a[b0:b1] = codec.quantize(s, m, bs)
                continue
            new_absmax = F.block_absmax(s, bs)
            bits = None if not drawn[i] else rounding.state_bits(
                rounding.state_key(sr[0], i), torch.arange(sr[1] + start, sr[1] + end, device=p.device), i)
            q = None if _REQUANTIZE_RULE is None else _REQUANTIZE_RULE(
                i, modes[i], s, c[start:end], a[b0:b1], new_absmax, m, bs, bits)
            a[b0:b1] = new_absmax
            c[start:end] = F.quantize_with_absmax(s, new_absmax, m, bs, bits, old=old) if q is None else q
        if error_sums is not None:
            for i, (c, a, m, s) in enumerate(zip(flat_codes, absmax, maps, states)):
                telemetry.add_error(error_sums, i, F.dequantize_flat(c[start:end], a[b0:b1], m, bs), s)
        if p.dtype != torch.float32:
            write_param(pf[start:end], p32, param_sr, start, correction=corr_chunk)
    if not in_place:
        p.data.copy_(pf.view(p.shape))


__all__ = ["read_param", "write_param", "reference_step_32bit", "reference_step_8bit", "BlockCodec", "block_codec",
           "set_requantize_rule"]
