"""The AVX-512 kernels' bits on a CPU without AVX-512: the CPU op built with ``DS_Q8_EMULATE_AVX512=1``
runs isa_avx512.cpp on SIMDe's emulation of its instructions (``csrc/cpu/q8_avx512_emulation.h``), and
the tests that compare every instruction set with the reference run again in a child process, where
"avx512" is one of them. Needs SIMDe's headers (``apt install libsimde-dev``); a CPU with AVX-512 runs
those tests natively instead."""
import os
import subprocess
import sys

import pytest

from helpers.isa import ISAS

TESTS = os.path.dirname(os.path.abspath(__file__))
SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"

#: the tests whose avx512 cases run emulated: the step (every rule, dtype and state rounding, the guided
#: default included, at the maps' edges), quantize/dequantize, the segment search of the nearest codes, and
#: the minifloat encoder (the sweeps over every float take every seventh run of 64: helpers/probe.py)
SELECTED = ["test_state_rounding.py", "test_kernels.py", "test_fast_search.py", "test_minifloat_codec.py"]


@pytest.mark.slow
@pytest.mark.skipif("avx512" in ISAS, reason="this CPU runs the AVX-512 kernels natively in the other tests")
@pytest.mark.skipif(not os.path.exists(SIMDE_HEADER), reason=f"SIMDe's headers ({SIMDE_HEADER}) are not installed")
def test_avx512_kernels_match_the_reference_under_emulation():
    env = dict(os.environ, DS_Q8_EMULATE_AVX512="1", OMP_NUM_THREADS="1")
    # the child's limit is inside this test's own (the slow marker's 900 s), so that a child cut short says
    # where it was; it took 200-240 s with its -O3 build on a 2-core AMD EPYC (AVX2), 93 s with the -O1 build
    # alone on the 2-core Intel Xeon (its sweeps over every seventh run of 64 floats), 267 s beside the other
    # worker of make test when they took every float
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "avx512 or fast_search",
           *[os.path.join(TESTS, f) for f in SELECTED]]
    out = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=840)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, tail


@pytest.mark.skipif(not os.path.exists(SIMDE_HEADER), reason=f"SIMDe's headers ({SIMDE_HEADER}) are not installed")
def test_the_emulated_avx512_kernels_compile_on_every_cpu(monkeypatch):
    """Every intrinsic the AVX-512 kernels use has an emulation (SIMDe's or q8_avx512_emulation.h's), checked
    on every machine, a CPU with AVX-512 included (where the test above skips): an intrinsic added without one
    would otherwise fail only on CPUs without AVX-512. A second of the compiler's front end, no build."""
    from ds_q8.op_builder import Q8CPUBuilder
    from ds_q8.op_builder.common import csrc

    monkeypatch.setenv("DS_Q8_EMULATE_AVX512", "1")
    flags = Q8CPUBuilder().cxx_args()
    assert "-DQ8_EMULATE_AVX512" in flags
    cmd = [os.environ.get("CXX", "c++"), "-std=c++20", f"-I{csrc('includes')}", *flags, "-fsyntax-only",
           csrc("cpu", "isa_avx512.cpp")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
