"""The step of 4-bit state (``optim_bits=4``, ``four_bit.py``).

Per range of whole blocks: dequantize both moments (the second first: the first is stored against it),
run the rule's update in fp32, then requantize the second moment, decode it, and code the first
moment as ``m / sqrt(v)`` against it: two passes over each block. The whole blocks go to the compiled
CPU or CUDA kernel (``step4_many``, one call per group, step scalars, device and dtypes), or, where
none can run (``impl="reference"``, an op that cannot be built), to the pure-PyTorch reference here,
which is their specification bit for bit. The parts of blocks that partition edges cut are updated
by the reference, and their maxima agreed across ranks before they are coded
(``four_bit.agreed_write``), so a parameter's codes are those of the unsharded optimizer at every ZeRO
stage and world size. A tensor whose requantization error telemetry measures at this step
(``optim/telemetry.py``) takes the reference, which adds it up as it codes. Parameters are read and
written as every path does (``path_reference.py``).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from .. import format4 as Q4
from .. import ops
from . import four_bit
from .path_kernel import kernel_rule, unsupported
from .path_reference import read_param, write_param
from .pieces import TensorStep
from .rules import Rule
from .telemetry import add_error
from .state_keys import CHUNK

_MAPS: Dict[str, list] = {}  # device -> format4's maps and midpoints there, copied once


def _maps(device: torch.device) -> list:
    key = str(device)
    if key not in _MAPS:
        _MAPS[key] = [m.to(device) for m in (Q4.M_MAP, Q4.M_MIDPOINTS, Q4.V_MAP, Q4.V_MIDPOINTS)]
    return _MAPS[key]


def _update(rule: Rule, t: TensorStep, h, sp: four_bit.Span, si: int, keys, corr):
    """Update one span of segment ``si``: the parameter written back (stochastically rounded with
    ``keys``, one per segment, where not None), the new ``(m, v)`` in fp32 returned."""
    layout = t.state.layout
    pf = layout.param_views(t.param)
    p = pf[sp.start:sp.end]
    c = None if corr is None else corr[sp.start:sp.end]
    p32 = p.clone() if p.dtype == torch.float32 else read_param(p, c)
    g32 = t.grad.reshape(-1)[sp.start:sp.end].to(torch.float32)
    m, v = four_bit.read(t.state, sp)
    rule.update(p32, g32, [m, v], h)
    if p.dtype == torch.float32:
        p.copy_(p32)
    else:
        write_param(p, p32, None if keys is None else (keys[si], sp.first), correction=c)
    return m, v


def step_four(rule: Rule, tensors: Sequence[tuple]) -> None:
    """Step the quantized pieces of 4-bit tensors: ``tensors`` lists ``(TensorStep, step scalars,
    rounding keys per segment or None, correction bytes or None)``; their fp32 pieces take the fp32
    path. Every rank calls this with the same tensors (the cut blocks' maxima are agreed)."""
    shared: Dict[int, tuple] = {}  # id(comm) -> (comm, [items], [slots per tensor], [measured])
    batches: Dict[tuple, list] = {}  # (group, step scalars, device, dtypes) -> whole pieces for one kernel call
    measured = []  # the whole pieces of tensors whose requantization error telemetry measures this step
    for t, h, keys, corr in tensors:
        layout = t.state.layout
        for piece in layout.pieces8:
            if t.sums is not None:
                measured.append((t, h, piece, keys, corr))
                continue
            batches.setdefault((id(t.group), id(h), str(t.param.device), t.param.dtype, t.grad.dtype), []).append(
                (t, h, piece, keys, corr))
    for batch in [_kernel_step(rule, b) for b in batches.values()] + [measured]:
        for t, h, piece, keys, corr in batch:
            layout = t.state.layout
            for sp in four_bit.spans(layout, piece, CHUNK):
                m, v = _update(rule, t, h, sp, piece.segment, keys, corr)
                four_bit.write(t.state, sp, m, v)
                _measure(t, piece.segment, sp, m, v)
    for t, h, keys, corr in tensors:
        layout = t.state.layout
        if layout.sharded:
            comm, items, slots, done = shared.setdefault(id(layout.comm), (layout.comm, [], [], []))
            base = sum(slots)
            for piece in layout.shared8:
                sp = four_bit.span(layout, piece)
                m, v = _update(rule, t, h, sp, piece.segment, keys, corr)
                items.append((t.state, sp, base + piece.slot, m, v))
                done.append((t, piece.segment, sp, m, v))
            slots.append(layout.num_slots)
    for comm, items, slots, done in shared.values():
        four_bit.agreed_write(items, comm, slots)
        for args in done:
            _measure(*args)


def _measure(t: TensorStep, si: int, sp: four_bit.Span, m: torch.Tensor, v: torch.Tensor) -> None:
    """Telemetry: add what requantizing a span of segment ``si`` lost to the tensor's error sums."""
    if t.sums is None:
        return
    for k, (stored, x) in enumerate(zip(four_bit.read(t.state, sp), (m, v))):
        add_error(t.sums[si], k, stored, x)


def _kernel_step(rule: Rule, batch: list) -> list:
    """Step a batch of whole pieces (one group, step scalars, device and dtypes) in the compiled kernel;
    returns the batch if it did not step it (the caller's reference), or raises under ``impl="kernel"``."""
    t0, h = batch[0][0], batch[0][1]
    name, strict = kernel_rule(rule, t0.group, batch)
    if name is None:
        return batch
    p0, g0 = t0.param, t0.grad
    kind = p0.device.type
    why = unsupported(p0, g0)
    if why is None and t0.group["block_size"] is None:
        why = "block_size=None (one block per tensor) has no kernel"
    module = ops.load_op(kind, required=strict) if why is None else None
    if why is None and module is not None and not hasattr(module, "step4_many"):
        why = f"the loaded {kind.upper()} op predates 4-bit state"
    if why is not None or module is None:
        if strict and why is not None:
            raise ValueError(f"impl='kernel': {why}; use impl='auto' to step such tensors with the reference")
        if why is not None:
            ops.warn_once(f"four-{why}", f"ds_q8: {why}; 4-bit state takes the reference step")
        return batch
    params, grads, m_codes, v_codes, m_absmax, v_max, keys, index, corrs = [], [], [], [], [], [], [], [], []
    for t, _, piece, sr_keys, corr in batch:
        layout = t.state.layout
        pf = layout.param_views(t.param)  # contiguous: the step hands strided parameters over as copies
        sp = four_bit.span(layout, piece)
        codes, absmax = t.state.codes(), t.state.absmax()
        params.append(pf[sp.start:sp.end])
        grads.append(t.grad.reshape(-1)[sp.start:sp.end].contiguous())
        m_codes.append(codes[four_bit.M][sp.b0:sp.b1])
        v_codes.append(codes[four_bit.V][sp.b0:sp.b1])
        m_absmax.append(absmax[four_bit.M][sp.a0:sp.a1])
        v_max.append(absmax[four_bit.V][sp.a0:sp.a1])
        keys.append(0 if sr_keys is None else sr_keys[piece.segment])
        index.append(sp.first)
        corrs.append(None if corr is None else corr[sp.start:sp.end])
    stochastic = any(k is not None for _, _, _, k, _ in batch)
    corrected = corrs[0] is not None
    ops.call(module, "step4_many", params[0], rule.kernel, params, grads, m_codes, v_codes, m_absmax, v_max,
             _maps(p0.device),
             t0.group["block_size"], ops.kernel_hyper(module, rule.kernel, h), keys if stochastic else [], index if stochastic else [],
             stochastic_params=stochastic, corrections=corrs if corrected else [])
    return []


__all__ = ["step_four"]
