"""studies/float_map_bench.py's probe (studies/float_map_step/step.cpp) computes what its doc says: both
float-coded maps sorted from 0 to a top entry of 1.0 with negatives mirrored, and AdamW's update."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # studies/
import arith_maps  # noqa: E402
import float_map_bench  # noqa: E402


def _has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx2 " in f.read().replace("\n", " ")


@pytest.mark.skipif(shutil.which("g++") is None or not _has_avx2(), reason="the probe needs g++ and an AVX2 CPU")
def test_the_probe_codes_its_maps_and_steps_adamw():
    lib = float_map_bench.build()
    maps = float_map_bench.check_maps(lib)
    top = 2 - 1 / 16  # both maps' largest code, 1.1111b, which they divide by
    assert maps["smallest_signed"] == pytest.approx(2.0 ** (1 - 7) / 16 / top)  # E3M4: f / 16 x 2^(1 - 7) at f = 1
    assert maps["smallest_unsigned"] == pytest.approx(2.0 ** (1 - 15) / 16 / top)  # E4M4
    agree = float_map_bench.agreement(lib)
    assert agree["cosine"] > 0.998 and abs(agree["norm_ratio"] - 1.0) < 0.01, agree


@pytest.mark.skipif(shutil.which("g++") is None or not _has_avx2(), reason="the probe needs g++ and an AVX2 CPU")
def test_the_probe_steps_on_the_maps_the_fidelity_study_measured():
    """The probe decodes its codes by shifting bits; studies/arith_maps.py builds the same maps as tables
    (the signed table's entry above 1.0, in place of the second zero, is one no scaled value takes)."""
    lib = float_map_bench.build()
    for name, signed, codes in (("e3m4", True, 256), ("e4m4", False, 256)):
        probe = sorted({lib.float_map_value(c, int(signed)) for c in range(codes)})
        table = sorted(set(arith_maps.make_map(name, signed).tolist()))
        if signed:
            assert table[-1] > 1.0 and table[-2] == 1.0 and len(table) == 256
            table = table[:-1]
        assert probe == table, name
