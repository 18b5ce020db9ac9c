"""Builds tests/csrc/q8_probe.cpp: test-only entry points into the CPU drivers, outside the shipped op.

It is compiled like the CPU op (same flags, same driver source) plus ``Q8_PROBES``, so what it
checks is the code the op runs. torch caches the build next to the op's.
"""
from __future__ import annotations

import functools
import os

import torch

from ds_q8 import functional as F

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def load_probe():
    from torch.utils.cpp_extension import load

    from ds_q8.op_builder import Q8CPUBuilder
    from ds_q8.op_builder.common import csrc

    builder = Q8CPUBuilder()
    return load(name="ds_q8_test_probe", sources=[os.path.join(TESTS, "csrc", "q8_probe.cpp"), csrc("cpu", "isa_avx512.cpp"),
                                                  csrc("cpu", "isa_avx2.cpp")],
                extra_include_paths=[csrc("includes"), csrc("cpu")],
                extra_cflags=builder.cxx_args() + ["-DQ8_PROBES"], extra_ldflags=builder.extra_ldflags())


def sweep_stride(isa: str) -> int:
    """1 (every float) for the exhaustive sweeps of an instruction set's code, or 7 (every seventh run of 64
    floats) for AVX-512 emulated in software (tests/test_avx512_emulated.py), where a sweep of every float takes
    about 30 s a case on one core. A binade holds 2^17 runs (4 mod 7), so the runs taken shift from one binade to
    the next and any seven binades in a row cover every run position once. Natively (a CPU with AVX-512) the
    sweeps take every float."""
    from ds_q8.op_builder.cpu import emulating_avx512

    return 7 if isa == "avx512" and emulating_avx512() else 1


#: the maps whose tables the fast search takes
MAPS = {
    "dynamic signed": lambda: F.create_dynamic_map(signed=True),
    "dynamic unsigned": lambda: F.create_dynamic_map(signed=False),
    "linear unsigned": lambda: F.create_linear_map(signed=False),
    "minifloat signed": lambda: F.create_minifloat_map(signed=True),
    "minifloat unsigned": lambda: F.create_minifloat_map(signed=False),
}


def table_maps(maps: dict) -> list:
    """The names in ``maps`` whose codes the kernels find through tables (segment search, floor rows and
    tables): every map but the minifloat ones, which every kernel codes from their bits (every float of
    theirs is checked in tests/test_minifloat_codec.py, so an exhaustive table check of them would check
    a path no step takes)."""
    return sorted(n for n in maps if not n.startswith("minifloat"))


def values_around_midpoints(code: torch.Tensor, ulps: int = 40) -> torch.Tensor:
    mid = ((code[:-1] + code[1:]) * 0.5).to(torch.float32)
    mid = mid[(mid.abs() <= 1.0)]
    steps = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    around = (mid.view(torch.int32)[:, None] + steps[None, :]).reshape(-1).view(torch.float32)
    around = torch.cat([around, -around, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    return around[torch.isfinite(around) & (around.abs() <= 1.0)]
