"""Builder of the C++ CPU op: SIMD (AVX-512 / AVX2 / scalar, chosen at run time) + OpenMP."""
import os
import platform

from deepspeed.ops.op_builder.builder import OpBuilder

from .common import PrebuiltFirstMixin, csrc, headers_define


#: set to 1, the CPU op is built as ``_q8_cpu_avx512emu``, its AVX-512 kernels on SIMDe's emulation of the
#: instructions (``csrc/cpu/q8_avx512_emulation.h``; headers from libsimde-dev), and offers "avx512" on any
#: x86-64 CPU: for tests that check those kernels' bits on a machine without AVX-512. Never for training.
EMULATE_AVX512 = "DS_Q8_EMULATE_AVX512"


def emulating_avx512() -> bool:
    return os.environ.get(EMULATE_AVX512, "0") not in ("", "0")


class Q8CPUBuilder(PrebuiltFirstMixin, OpBuilder):
    NAME = "_q8_cpu"
    DESCRIPTION = ("ds_q8 CPU kernels", "about a minute")

    def __init__(self):
        super().__init__(name=self.NAME + ("_avx512emu" if emulating_avx512() else ""))

    def sources(self):
        return [csrc("cpu", f) for f in ("q8_cpu.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp")]

    def cxx_args(self):
        # No -march=native: each isa_*.cpp selects its own instruction set, and the binding picks
        # the best one the running CPU supports, so a prebuilt module runs on any x86-64.
        # -ffp-contract=off keeps a*b+c from becoming an FMA, which would change the bits.
        # -fno-math-errno lets sqrtf be the instruction (the same correctly rounded value) inside loops
        # the compiler vectorizes: the 4-bit step's decode and requantization.
        emulated = ["-DQ8_EMULATE_AVX512"] if emulating_avx512() else []
        # The emulated build serves tests only: at -O1 SIMDe's emulation compiles three times faster (isa_avx512.cpp
        # 50 -> 17 s), its tests' child run takes 154 s instead of 199, and the bits are the source's at any level
        level = "-O1" if emulated else "-O3"
        return [level, "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-Wno-unknown-pragmas",
                headers_define()] + emulated

    def extra_ldflags(self):
        return ["-fopenmp"]

    def is_compatible(self, verbose=False):
        machine = platform.machine().lower()
        if machine not in ("x86_64", "amd64"):
            self.error_log = f"the CPU kernels need an x86-64 CPU, this is {machine}"
            return False
        return super().is_compatible(verbose)
