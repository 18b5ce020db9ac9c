"""Builds tests/csrc/q8_probe.cpp: test-only entry points into the CPU drivers, outside the shipped op.

It is compiled like the CPU op (same flags, same driver source) plus ``Q8_PROBES``, so what it
checks is the code the op runs. torch caches the build next to the op's.
"""
from __future__ import annotations

import functools
import os

TESTS = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def load_probe():
    from torch.utils.cpp_extension import load

    from ds_q8.op_builder import Q8CPUBuilder
    from ds_q8.op_builder.common import csrc

    builder = Q8CPUBuilder()
    return load(name="ds_q8_test_probe", sources=[os.path.join(TESTS, "csrc", "q8_probe.cpp"),
                                                 csrc("cpu", "isa_avx512.cpp")],
                extra_include_paths=[csrc("includes"), csrc("cpu")],
                extra_cflags=builder.cxx_args() + ["-DQ8_PROBES"], extra_ldflags=builder.extra_ldflags())
