"""The shared-block path: the local parts of blocks that a ZeRO partition edge cuts, updated in one
batched pass per tensor, their block maxima agreed across ranks (one all-reduce MAX per process group
and step, run by ``step._Plan``) and only then quantized, so every rank writes the codes the
unsharded optimizer would."""
from __future__ import annotations

from typing import Dict

import torch

from .. import functional as F
from . import rounding
from .group_options import ROUND_BY_OLD_CODE, correction_of, maps_of, stochastic_params, rounding_modes
from .path_reference import read_param
from .pieces import TensorStep
from .rules import Rule

def update_shared(rule: Rule, t: TensorStep, h, which, base: int, keys):
    """Update a tensor's shared pieces (all, or those in ``which``) in fp32; returns their slots in
    the all-reduce vector, their local maxima, and the function that quantizes once they are agreed."""
    qs, layout, group, p, sums = t.state, t.state.layout, t.group, t.param, t.sums
    k = rule.num_states
    device = p.device
    maps = maps_of(rule, group, device)
    elem, code_at, absmax_at, owner, slots, in_param = layout.shared_index(device, which)
    codes, absmax = qs.codes(), qs.absmax()
    pf, gf = layout.param_views(p), t.grad.view(-1)
    corr = correction_of(t)
    p32 = read_param(pf.index_select(0, elem), None if corr is None else corr.index_select(0, elem))
    states = [maps[i].index_select(0, codes[i].index_select(0, code_at).long())
              * absmax[i].index_select(0, absmax_at).to(torch.float32).index_select(0, owner) for i in range(k)]
    modes = rounding_modes(group, rule.state_signed)
    rule.update(p32, gf.index_select(0, elem).to(torch.float32), states, h)
    element_keys = None  # each element's key is its parameter's
    pieces = layout.shared8 if which is None else [layout.shared8[j] for j in which]
    if keys is not None:
        element_keys = [keys[pc.segment] for pc in pieces]
    if corr is not None:
        b, c = rounding.split_bf16(p32)
        pf.index_copy_(0, elem, b)
        corr.index_copy_(0, elem, c)
    elif element_keys is None or not stochastic_params(group, pf.dtype) or pf.dtype == torch.float32:
        pf.index_copy_(0, elem, p32.to(pf.dtype))
    else:
        piece_keys = torch.tensor(element_keys, dtype=torch.int64, device=device)
        pf.index_copy_(0, elem, rounding.round_stochastic(p32, pf.dtype, piece_keys[owner], in_param))
    state_bits = [None] * k
    if element_keys is not None:
        for i, mode in enumerate(modes):
            if mode:
                per_piece = torch.tensor([rounding.state_key(key, i) for key in element_keys], dtype=torch.int64,
                                         device=device)
                state_bits[i] = rounding.state_bits(per_piece[owner], in_param, i)
    n = absmax_at.numel()
    if sums is not None:
        segment_of = torch.tensor([pc.segment for pc in pieces], dtype=torch.int64, device=device)
    maxima = torch.zeros(k, n, dtype=torch.float32, device=device)
    for i in range(k):
        maxima[i].scatter_reduce_(0, owner, states[i].abs(), reduce="amax", include_self=True)
    slot_index = (base + slots + layout.num_slots * torch.arange(k, device=device)[:, None]).reshape(-1)

    def finish(agreed: torch.Tensor) -> None:
        stored = F.stored_absmax(agreed.view(k, n))  # rounding up is monotone: any rank may round
        agreed = stored.to(torch.float32)
        for i in range(k):
            a = agreed[i].index_select(0, owner)
            old = codes[i].index_select(0, code_at).long() if modes[i] == ROUND_BY_OLD_CODE else None
            # a minifloat map is coded from the bits of values in its own units (F.block_scale)
            by_code = F.codec_of(maps[i]) is not None
            scale = F.block_scale(agreed[i], maps[i] if by_code else None)
            q = F.quantize_scaled(states[i] * scale.index_select(0, owner), maps[i], state_bits[i],
                                  None if by_code else _midpoints(maps[i]), old)
            codes[i].index_copy_(0, code_at, q)
            absmax[i].index_copy_(0, absmax_at, stored[i])
            if sums is not None:  # telemetry: each element's error goes to its piece's parameter
                back = maps[i][q.long()] * a
                seg = segment_of[owner]
                sums[:, i, 0].index_add_(0, seg, (back - states[i]).double().abs())
                sums[:, i, 1].index_add_(0, seg, states[i].double().abs())
                sums[:, i, 2].index_add_(0, seg, ((back == 0) & (states[i] != 0)).double())

    return slot_index, maxima.reshape(-1), finish


_MIDPOINTS: Dict[tuple, tuple] = {}


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    """``F.midpoints`` of a map, computed once per map tensor."""
    key = (code.data_ptr(), str(code.device), code._version)
    hit = _MIDPOINTS.get(key)
    if hit is None:  # the map is kept with its midpoints, so its address cannot be reused
        hit = _MIDPOINTS[key] = (code, F.midpoints(code))
    return hit[1]


__all__ = ["update_shared"]
