"""Dispatch from the optimizers to compiled kernels.

``fused_step`` returns True when a compiled kernel performed the 8-bit step, False when the
caller must use the pure-PyTorch reference. No kernels are wired up yet.
"""
from __future__ import annotations


def fused_step(optimizer, p, grad, state, group, hyper) -> bool:
    return False
