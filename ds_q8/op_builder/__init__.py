"""DeepSpeed op builders for the ds_q8 kernels: one class per op, as DeepSpeed does.

Importing this package needs DeepSpeed and torch but not the rest of ds_q8, so setup.py can use
it to prebuild the ops.
"""
import os

from .toolkit import find_cuda_home

# torch's extension builder reads CUDA_HOME once, when DeepSpeed's builders import it just below, and
# otherwise guesses (and warns about) a toolkit from the nvcc on PATH, which may be a wrapper
if not os.environ.get("CUDA_HOME") and find_cuda_home():
    os.environ["CUDA_HOME"] = find_cuda_home()

from .cpu import Q8CPUBuilder  # noqa: E402
from .cuda import Q8CUDABuilder  # noqa: E402

ALL_BUILDERS = {"cpu": Q8CPUBuilder, "cuda": Q8CUDABuilder}

__all__ = ["Q8CPUBuilder", "Q8CUDABuilder", "ALL_BUILDERS"]
