"""The step of 4-bit state (``optim_bits=4``, ``four_bit.py``): the reference, in plain PyTorch.

Per range of whole blocks: dequantize both moments (the second first: the first is stored against it),
run the rule's update in fp32, then requantize the second moment, decode it, and code the first
moment as ``m / sqrt(v)`` against it: two passes over each block. The parts of blocks that partition
edges cut are updated the same way, and their maxima agreed across ranks before they are coded
(``four_bit.agreed_write``), so a parameter's codes are those of the unsharded optimizer at every ZeRO
stage and world size. Parameters are read and written as every path does (``path_reference.py``).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from . import four_bit, qstate
from .path_reference import read_param, write_param
from .pieces import TensorStep
from .rules import Rule


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
    shared: Dict[int, tuple] = {}  # id(comm) -> (comm, [items], [slots per tensor])
    for t, h, keys, corr in tensors:
        layout = t.state.layout
        for piece in layout.pieces8:
            for sp in four_bit.spans(layout, piece, qstate.CHUNK):
                m, v = _update(rule, t, h, sp, piece.segment, keys, corr)
                four_bit.write(t.state, sp, m, v)
        if layout.sharded:
            comm, items, slots = shared.setdefault(id(layout.comm), (layout.comm, [], []))
            base = sum(slots)
            for piece in layout.shared8:
                sp = four_bit.span(layout, piece)
                m, v = _update(rule, t, h, sp, piece.segment, keys, corr)
                items.append((t.state, sp, base + piece.slot, m, v))
            slots.append(layout.num_slots)
    for comm, items, slots in shared.values():
        four_bit.agreed_write(items, comm, slots)


__all__ = ["step_four"]
