"""What happens when the CUDA op raises, on a GPU machine: the facts an exception's path from the binding to
Python depends on, each raising call in a process of its own, and a backtrace of any that dies.

    python gpu_check/op_errors.py            the facts, the calls, and cuda-gdb's backtrace of a call that crashes
    python gpu_check/op_errors.py --call NAME   one call (what each child process runs)

Facts: torch's build (compiler, C++ ABI, the pybind11 ABI tags it was built with), the op's shared object
(the compiler versions recorded in it, the pybind11 internals it names, the libstdc++ it resolves to), and
the libstdc++ a process that loaded both actually maps. A C++ exception thrown in the op crosses pybind11's
translation into a Python exception; when the op and torch disagree on the internals or on the C++ runtime,
that translation is where a process would die.

Lines: ``PASS``/``FAIL`` per call (FAIL when the call kills its process instead of raising the expected
error), ``INFO`` for the facts and the backtrace.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: each call the op must refuse with a ValueError, by name: (what it passes, the text of the message)
CALLS = {
    "skip_int64": ("a skip flag of int64", "skip"),
    "skip_two_values": ("a skip flag of two values", "skip"),
    "skip_on_cpu": ("a skip flag on the CPU", "skip"),
    "param_on_cpu": ("a parameter on the CPU", "param must be on"),
    "unknown_rule": ("a rule the op does not know", "update rule"),
    "unknown_hyperparameter": ("a hyperparameter the rule does not read", "has no hyperparameter 'lr_'"),
}


def _arguments():
    """A valid AdamW step_many call on one tensor of 100 elements (positional arguments)."""
    import torch

    import ds_q8
    from ds_q8 import ops

    module = ops.load_op("cuda", required=True)
    p = torch.randn(100, device="cuda")
    opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(p.clone())], min_8bit_size=0, block_size=64)
    group = opt.param_groups[0]
    maps = opt._maps(group, torch.device("cuda"))
    lookups = [ops.lookup_table(m, module) for m in maps]
    states = [[torch.zeros(100, dtype=torch.uint8, device="cuda") for _ in range(2)]]
    absmax = [[torch.ones(2, dtype=torch.bfloat16, device="cuda") for _ in range(2)]]
    args = ["adamw", [p], [torch.randn(100, device="cuda")], states, absmax, maps, lookups, 64,
            dict(opt._hyper(group, 1)), [], []]
    return module, args


def call(name: str) -> int:
    """One refused call in this process: 0 when it raised the expected ValueError."""
    import torch

    module, args = _arguments()
    kwargs = {}
    if name.startswith("skip_"):
        spec = {"skip_int64": dict(dtype=torch.int64, device="cuda"), "skip_two_values": dict(size=2, device="cuda"),
                "skip_on_cpu": dict(device="cpu")}[name]
        kwargs["skip"] = torch.zeros(spec.pop("size", 1), dtype=spec.pop("dtype", torch.int32), **spec)
    elif name == "param_on_cpu":
        args[1] = [args[1][0].cpu()]
    elif name == "unknown_rule":
        args[0] = "no_such_rule"
    elif name == "unknown_hyperparameter":
        args[8] = dict(args[8], lr_=1.0)
    try:
        module.step_many(*args, **kwargs)
    except ValueError as exc:
        ok = CALLS[name][1] in str(exc)
        print(f"{'PASS' if ok else 'FAIL'} call {name}: ValueError: {' '.join(str(exc).split())[:200]}", flush=True)
        return 0 if ok else 1
    except Exception as exc:  # raised, but not as the ValueError the binding means
        print(f"FAIL call {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", flush=True)
        return 1
    print(f"FAIL call {name}: returned without an error", flush=True)
    return 1


def _strings(path: str, pattern: str) -> List[str]:
    try:
        out = subprocess.run(["strings", "-a", path], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({s for s in out.splitlines() if re.search(pattern, s)})[:6]


def facts() -> Dict[str, str]:
    import torch

    from ds_q8 import ops

    module = ops.load_op("cuda", required=True)
    so = module.__file__
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_python.so")
    out = {
        "torch": f"{torch.__version__}, CXX11 ABI {torch.compiled_with_cxx11_abi()}, "
                 + "; ".join(line.strip() for line in torch.__config__.show().splitlines()
                             if line.strip().startswith(("- GCC", "- C++ Version", "- clang"))),
        "torch pybind11 tags": " ".join(str(getattr(torch._C, k, "?")) for k in
                                        ("_PYBIND11_COMPILER_TYPE", "_PYBIND11_STDLIB", "_PYBIND11_BUILD_ABI")),
        "op": so,
        "op compilers": " | ".join(_strings(so, r"^GCC: |clang version")) or "?",
        "op pybind11 internals": " ".join(_strings(so, r"pybind11_internals")) or "?",
        "torch pybind11 internals": " ".join(_strings(lib, r"pybind11_internals")) or "?",
    }
    try:
        ldd = subprocess.run(["ldd", so], capture_output=True, text=True, timeout=30).stdout
        out["op libstdc++"] = " ".join(line.split("=>")[-1].split("(")[0].strip() for line in ldd.splitlines()
                                       if "libstdc++" in line or "libgcc_s" in line) or "not linked"
    except (OSError, subprocess.SubprocessError):
        pass
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if "libstdc++" in line or "libgcc_s" in line})
    out["libstdc++ mapped"] = " ".join(mapped)
    return out


def backtrace(name: str) -> List[str]:
    """cuda-gdb's backtrace of the call ``name`` (which kills its process), or why there is none."""
    gdb = shutil.which("cuda-gdb") or ("/usr/local/cuda/bin/cuda-gdb" if os.path.exists("/usr/local/cuda/bin/cuda-gdb")
                                       else None)
    if gdb is None:
        return ["no cuda-gdb on this machine: no backtrace"]
    cmd = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "set confirm off", "-ex", "run", "-ex", "bt 30",
           "-ex", "info sharedlibrary", "--args", sys.executable, os.path.abspath(__file__), "--call", name]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return ["cuda-gdb did not finish in 180 s"]
    text = run.stdout + run.stderr
    frames = [line for line in text.splitlines() if re.match(r"#\d+ ", line) or "signal" in line.lower()]
    libs = [line for line in text.splitlines() if "libstdc++" in line or "libgcc_s" in line or "_q8_cuda" in line]
    return frames[:40] + libs[:10] or text.splitlines()[-30:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", choices=sorted(CALLS), help="run one call in this process")
    args = ap.parse_args(argv)
    if args.call:
        return call(args.call)
    for key, value in facts().items():
        print(f"INFO {key}: {value}", flush=True)
    failed = 0
    for name, (what, _) in CALLS.items():
        child = subprocess.run([sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--call", name],
                               capture_output=True, text=True, cwd=ROOT, timeout=300)
        lines = [line for line in child.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
        if child.returncode < 0:
            sig = signal.Signals(-child.returncode).name
            print(f"FAIL call {name} ({what}): the process died with {sig}", flush=True)
            for line in child.stderr.splitlines()[-25:]:
                print(f"INFO   {line}", flush=True)
            for line in backtrace(name):
                print(f"INFO   gdb: {line}", flush=True)
            failed += 1
        else:
            print("\n".join(lines) if lines else f"FAIL call {name}: exit {child.returncode}\n{child.stderr[-2000:]}",
                  flush=True)
            failed += child.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
