"""Builder of the CUDA op: fused block-wise 8-bit steps and (de)quantization kernels."""
import os
import re
import shutil
from typing import Optional

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder

from .common import PrebuiltFirstMixin, csrc, headers_define
from .toolkit import find_cuda_home


def use_cuda_home() -> Optional[str]:
    """Point torch's extension builder (and DeepSpeed's, which asks torch) at :func:`find_cuda_home`.

    torch reads CUDA_HOME once, when ``torch.utils.cpp_extension`` is imported; its guess is replaced
    here, before any build."""
    import torch.utils.cpp_extension as cpp_extension

    home = find_cuda_home()
    if home:
        cpp_extension.CUDA_HOME = home
        os.environ.setdefault("CUDA_HOME", home)
    return home


def plain_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST with each ``X.Ya``/``X.Yf`` entry written ``X.Y`` (``+PTX`` kept), duplicates
    dropped in order; ``9.0a;8.0+PTX`` -> ``9.0;8.0+PTX``. Entries it does not recognise stay as they are."""
    out = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)[a-zA-Z]?(\+PTX)?", entry)
        if m:
            entry = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}"
        if entry not in out:
            out.append(entry)
    return ";".join(out)


#: the step's translation units (kStepParts in csrc/cuda/q8_cuda_step.cuh)
STEP_PARTS = 8


class Q8CUDABuilder(PrebuiltFirstMixin, CUDAOpBuilder):
    NAME = "_q8_cuda"
    DESCRIPTION = ("ds_q8 CUDA kernels", "a few minutes")

    def __init__(self):
        use_cuda_home()
        super().__init__(name=self.NAME)

    def sources(self):
        # the rules' kernels come in several translation units, which a build compiles side by side
        return ([csrc("cuda", "q8_cuda.cpp"), csrc("cuda", "q8_cuda_kernels.cu")]
                + [csrc("cuda", f"q8_cuda_step_{n}.cu") for n in range(STEP_PARTS)])

    def cxx_args(self):
        # the host C++ file builds lookup tables: no FMA contraction there either, as in the CPU op
        return ["-O3", "-ffp-contract=off", "-fno-fast-math", headers_define()]

    def nvcc_args(self):
        # Not DeepSpeed's defaults: --use_fast_math (and nvcc's default FMA contraction) would
        # change the bits of sqrt, division and a*b+c, and the kernels must match torch exactly.
        # DS_Q8_PTXAS_VERBOSE=1: ptxas prints each kernel's registers, stack frame and spills into the
        # build log (tests/test_cuda_build.py reads them there instead of compiling the kernels again)
        threads = os.environ.get("DS_NVCC_THREADS", str(min(os.cpu_count() or 1, 8)))
        report = ["-Xptxas", "-v"] if os.environ.get("DS_Q8_PTXAS_VERBOSE") == "1" else []
        return ["-O3", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", f"--threads={threads}", headers_define()
                ] + report + self.compute_capability_args()

    def compute_capability_args(self, cross_compile_archs=None):
        """DeepSpeed's, on a TORCH_CUDA_ARCH_LIST that its parser reads.

        torch accepts architecture-specific entries such as ``9.0a`` or ``10.0f`` (CUDA images for
        Hopper often set ``9.0a``); DeepSpeed 0.19 parses each entry's minor as an integer and fails
        on them. The kernels use no architecture-specific instruction, so such an entry is built as
        its plain ``X.Y`` (the same machine code runs on the ``a``/``f`` device)."""
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if arch:
            plain = plain_arch_list(arch)
            if plain != arch:
                self.warning(f"{self.name}: TORCH_CUDA_ARCH_LIST={arch!r} is built as {plain!r} (the kernels "
                             "need no architecture-specific instruction)")
                os.environ["TORCH_CUDA_ARCH_LIST"] = plain
        return super().compute_capability_args(cross_compile_archs)

    def filter_ccs(self, ccs):
        """Compute capabilities 7.0 and up: the step kernels take their tensor lists as
        ``__grid_constant__`` parameters, which older architectures do not have."""
        kept = [cc.split(".") for cc in ccs if int(cc.split(".")[0]) >= 7]
        dropped = [cc for cc in ccs if int(cc.split(".")[0]) < 7]
        if dropped:
            self.warning(f"{self.name}: leaving out compute capabilities {dropped} (the kernels need 7.0 or later)")
        return kept

    def is_compatible(self, verbose=False):
        """Whether the op can be compiled here; ``error_log`` says why not."""
        reason = None
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU-only build"
        else:
            from torch.utils.cpp_extension import CUDA_HOME
            nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
            if nvcc is None or not (os.path.exists(nvcc) or shutil.which(nvcc)):
                reason = "no CUDA toolkit found (set CUDA_HOME to a directory with bin/nvcc)"
            elif not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() and not torch.cuda.is_available():
                reason = "no GPU is visible to choose the architecture; set TORCH_CUDA_ARCH_LIST (e.g. 9.0)"
        self.error_log = reason
        if reason and verbose:
            self.warning(f"{self.name} cannot be built: {reason}")
        return reason is None

    def jit_load(self, verbose=False):
        # DeepSpeed's jit_load compiles a CPU-only module when no GPU is visible; CI compiles this
        # op without a GPU, so compile for CUDA whenever is_compatible() allows it.
        if not self.is_compatible(verbose):
            raise RuntimeError(f"cannot build {self.name}: {self.error_log}")
        from torch.utils.cpp_extension import load
        saved_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        self.jit_mode = True
        try:
            nvcc_args = self.nvcc_args()  # in JIT mode this sets TORCH_CUDA_ARCH_LIST for torch
            return load(name=self.name, sources=self.sources(), extra_include_paths=self.include_paths(),
                        extra_cflags=self.cxx_args(), extra_cuda_cflags=nvcc_args, with_cuda=True,
                        verbose=verbose)
        finally:
            self.jit_mode = False
            if saved_arch is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch
