"""Builds and loads the CUDA op's CPU execution harness (tests/cuda_sim): the CUDA op's binding and
its device code (``q8_cuda_kernels.cu`` and the step's parts, unmodified, or planted-bug copies),
compiled with g++ as host C++ over ``cuda_sim.h``. The module has the CUDA op's API and takes CPU tensors.

Builds: ``plain``; ``tsan`` (``-fsanitize=thread``); ``asan`` (``-fsanitize=address,undefined``, the
first report ends the process). A sanitizer build loads only into a process started with its runtime
in ``LD_PRELOAD`` (:func:`sanitizer_env`); :func:`run_sanitized` starts such a process.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
SIM = os.path.join(TESTS, "cuda_sim")
CU = os.path.join(ROOT, "ds_q8", "csrc", "cuda", "q8_cuda_kernels.cu")

#: the build the tests of this process use: Q8_SIM_BUILD, set by run_sanitized for its child
BUILD = os.environ.get("Q8_SIM_BUILD", "plain")

FLAGS = {
    "plain": [],
    "tsan": ["-fsanitize=thread"],
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
}
RUNTIME = {"tsan": "libtsan.so", "asan": "libasan.so"}
# preloaded after the runtime: ASan intercepts C++ throws only if libstdc++ is there when it starts
# (python itself does not link it)
PRELOAD_AFTER = {"tsan": [], "asan": ["libstdc++.so"]}

if BUILD not in FLAGS:
    raise ValueError(f"Q8_SIM_BUILD must be one of {sorted(FLAGS)}, got {BUILD!r}")
if BUILD != "plain":
    # the runtime is loaded by now; the compilers this process starts must not preload it
    os.environ.pop("LD_PRELOAD", None)


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _sim_files():
    names = ("cuda_sim.h", "fibers.h", "ptx_emulation.h", "device_checks.h", "kernels.cpp", "binding.cpp")
    return [os.path.join(SIM, n) for n in names] + [
        os.path.join(SIM, "include", "c10", "cuda", n) for n in ("CUDAGuard.h", "CUDAStream.h")]


def build_dir() -> str:
    from helpers.ds_launch import extensions_root

    return extensions_root()


def device_sources(folder: str):
    """The CUDA op's device code in ``folder``: q8_cuda_kernels.cu, the step's headers and its parts
    (every ``q8_cuda_*`` .cu and .cuh file, so that a planted-bug copy holds all that the .cu files include)."""
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.startswith("q8_cuda_") and n.endswith((".cu", ".cuh")))


def load(build: str = BUILD, kernels: str = CU, name: str = ""):
    """The harness module of ``build`` with the device code of ``kernels`` (a ``q8_cuda_kernels.cu``)."""
    if build not in FLAGS:
        raise ValueError(f"build must be one of {sorted(FLAGS)}, got {build!r}")
    if build != "plain" and not _runtime_loaded(build):
        raise RuntimeError(f"the {build} build needs {RUNTIME[build]} preloaded: run it through run_sanitized")
    return _load(build, os.path.abspath(kernels), name)


@functools.lru_cache(maxsize=None)
def _load(build, kernels, name):
    from torch.utils.cpp_extension import load as jit_load

    from ds_q8.op_builder.common import csrc, headers_define

    # torch rebuilds on changed sources and flags, not included files: their digest goes into the flags
    digest = _digest(device_sources(os.path.dirname(kernels)) + _sim_files())
    # -g1: line tables, what the sanitizers' reports print (full -g cost 17 s more of each build's 45 s here)
    flags = ["-O1", "-g1", "-ffp-contract=off", "-fno-fast-math", "-Wno-unknown-pragmas",
             headers_define(), f"-DQ8_SIM_SOURCE={digest}"] + FLAGS[build]
    return jit_load(name=f"ds_q8_cuda_sim_{build}{name}", sources=[os.path.join(SIM, "binding.cpp"),
                                                                  os.path.join(SIM, "kernels.cpp")],
                    extra_include_paths=[os.path.join(SIM, "include"), os.path.dirname(kernels), csrc("includes"),
                                         csrc("cpu"), csrc("cuda")],
                    extra_cflags=flags, extra_ldflags=FLAGS[build])


def stat(module, what: str) -> int:
    """Harness counters: "launches", "ctas", "last_grid", "last_threads"."""
    index = ["launches", "ctas", "last_grid", "last_threads"].index(what)
    lib = ctypes.CDLL(module.__file__)
    lib.q8sim_stat.restype = ctypes.c_int64
    return int(lib.q8sim_stat(index))


#: the kernels q8sim_last_kernel_is (kernels.cpp) knows: AdamW's 8-bit step, by parameter dtype and codec
STEP_KERNELS = ["adamw fp32 guided", "adamw fp32 run-time", "adamw bf16 guided", "adamw bf16 run-time",
                "adamw fp32 tables", "adamw bf16 tables"]


def last_kernel_is(module, kernel: str) -> bool:
    """Whether the harness's last launch ran ``kernel``, one of :data:`STEP_KERNELS`."""
    lib = ctypes.CDLL(module.__file__)
    lib.q8sim_last_kernel_is.restype = ctypes.c_int64
    return int(lib.q8sim_last_kernel_is(STEP_KERNELS.index(kernel))) == 1


#: the checks q8sim_device_check (device_checks.h) runs, by name
DEVICE_CHECKS = ["encode signed", "encode unsigned", "decode", "scale", "division", "square root"]


def device_check(module, check: str, count: int = 0, seed: int = 0):
    """(mismatches, cases compared) of one of :data:`DEVICE_CHECKS` on the device code's arithmetic."""
    lib = ctypes.CDLL(module.__file__)
    lib.q8sim_device_check.restype = ctypes.c_int64
    lib.q8sim_device_check.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    checked = ctypes.c_int64(0)
    bad = lib.q8sim_device_check(DEVICE_CHECKS.index(check), count, seed, ctypes.byref(checked))
    return int(bad), int(checked.value)


def _runtime_loaded(build: str) -> bool:
    with open("/proc/self/maps") as f:
        return RUNTIME[build].split(".")[0] in f.read()


def sanitizer_env(build: str) -> dict:
    """The environment of a process that runs the ``build`` harness: its runtime preloaded, reports fatal."""
    libs = []
    for name in [RUNTIME[build]] + PRELOAD_AFTER[build]:
        out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
        if not os.path.isabs(out.stdout.strip()):
            raise RuntimeError(f"g++ has no {name} (the {build} build needs it)")
        libs.append(out.stdout.strip())
    env = dict(os.environ, Q8_SIM_BUILD=build, LD_PRELOAD=" ".join(libs))
    # what the harness takes from the CPU op runs on one thread: that op is not built with the sanitizer,
    # so ThreadSanitizer cannot see its OpenMP barriers and would report their hand-offs as races
    env["OMP_NUM_THREADS"] = "1"
    env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66 report_signal_unsafe=0 second_deadlock_stack=1"
    env["ASAN_OPTIONS"] = "detect_leaks=0 halt_on_error=1 exitcode=67 abort_on_error=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1 print_stacktrace=1 exitcode=68"
    return env


def run_sanitized(build: str, args, timeout: float, env=None) -> subprocess.CompletedProcess:
    """``python -m pytest <args>`` under the ``build`` harness (output captured). The child does not
    capture (-s): a sanitizer that ends the process at its first report must find a real stderr."""
    full = sanitizer_env(build)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=timeout)


class SimAsCpuOp:
    """The harness module in the CPU op's place (``ops._modules["cpu"]``): the optimizers' CPU path then
    runs the CUDA op's binding, launchers and device code. CPU entry points take an instruction set
    first, which the harness ignores; what the CUDA op lacks comes from the CPU op."""

    #: the CUDA op has no prepared call: a step that reuses its plan calls step_many, which runs the harness
    PreparedStep = None

    def __init__(self, sim, cpu):
        self.sim, self.cpu = sim, cpu

    def rules(self):
        return self.sim.rules()

    def build_lookup(self, code):
        return self.sim.build_lookup(code)

    def limits(self):
        return self.sim.limits()

    def step(self, isa, *args, **kwargs):
        return self.sim.step(*args, **kwargs)

    def step_many(self, isa, *args, **kwargs):
        return self.sim.step_many(*args, **kwargs)

    def step_fp32_many(self, isa, *args, **kwargs):
        return self.sim.step_fp32_many(*args, **kwargs)

    def step4_many(self, isa, *args, **kwargs):
        return self.sim.step4_many(*args, **kwargs)

    def quantize(self, isa, *args):
        return self.sim.quantize(*args)

    def dequantize(self, isa, *args):
        return self.sim.dequantize(*args)

    def dequantize_into(self, isa, codes, absmax, code, block_size, out):
        out.copy_(self.sim.dequantize(codes, absmax, code, block_size, out.dtype))

    def __getattr__(self, name):
        return getattr(self.cpu, name)


@contextlib.contextmanager
def as_cpu_op(sim):
    """Inside the block, CPU tensors step through the harness ``sim`` instead of the CPU op."""
    from ds_q8 import ops

    cpu = ops.load_op("cpu", required=True)
    saved = ops._modules["cpu"]
    ops._modules["cpu"] = SimAsCpuOp(sim, cpu)
    try:
        yield ops._modules["cpu"]
    finally:
        ops._modules["cpu"] = saved
