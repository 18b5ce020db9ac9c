"""DeepSpeed op builders for the ds_q8 kernels: one class per op, as DeepSpeed does.

Importing this package needs DeepSpeed and torch but not the rest of ds_q8, so setup.py can use
it to prebuild the ops.
"""
from .cpu import Q8CPUBuilder
from .cuda import Q8CUDABuilder

ALL_BUILDERS = {"cpu": Q8CPUBuilder, "cuda": Q8CUDABuilder}

__all__ = ["Q8CPUBuilder", "Q8CUDABuilder", "ALL_BUILDERS"]
