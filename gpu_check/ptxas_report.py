"""Registers, stack frame and spills of every CUDA kernel, as ptxas reports them.

Compiles the op's CUDA files (ds_q8/csrc/cuda/*.cu) to objects (no GPU needed) with the op's own nvcc
flags (Q8CUDABuilder.nvcc_args, torch's common flags and include paths) plus ``-Xptxas -v``, for one
architecture (default sm_90), and prints one line per kernel. Exit status 1 when any kernel has a
stack frame or spills: every kernel must keep its per-thread arrays in registers.

    python gpu_check/ptxas_report.py [--arch 90] [--log PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FUNCTION = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def device_sources(csrc_dir: Optional[str] = None) -> List[str]:
    """The op's CUDA translation units (Q8CUDABuilder.sources' .cu files), in ``csrc_dir`` if given."""
    sys.path.insert(0, ROOT)
    from ds_q8.op_builder import Q8CUDABuilder

    files = [s for s in Q8CUDABuilder().sources() if s.endswith(".cu")]
    return [os.path.join(csrc_dir, "cuda", os.path.basename(f)) for f in files] if csrc_dir else files


def nvcc_command(arch: str, obj: str, source: str, includes: Sequence[str] = (), extra: Sequence[str] = ()) -> List[str]:
    """The nvcc line of one of the op's CUDA files, compiled to ``obj`` for ``sm_<arch>`` with -Xptxas -v
    and the op's own flags (``includes`` first on the include path, then the op's)."""
    sys.path.insert(0, ROOT)
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[0]}.{arch[1:]}"
    from torch.utils import cpp_extension

    from ds_q8.op_builder import Q8CUDABuilder

    builder = Q8CUDABuilder()
    builder.jit_mode = True  # compute_capability_args() then leaves the architectures to torch: given below
    try:
        flags = builder.nvcc_args()
    finally:
        builder.jit_mode = False
    home = cpp_extension.CUDA_HOME
    if not home:
        raise SystemExit("no CUDA toolkit found (set CUDA_HOME to a directory with bin/nvcc)")
    paths = list(includes) + builder.include_paths() + cpp_extension.include_paths("cuda")
    return ([os.path.join(home, "bin", "nvcc"), "-c", source, "-o", obj, "-std=c++20", "-Xcompiler", "-fPIC",
             f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
             "-DTORCH_EXTENSION_NAME=_q8_cuda_ptxas"] + list(extra)
            + cpp_extension.COMMON_NVCC_FLAGS + flags + [f"-I{p}" for p in paths])


def compile_all(arch: str, tmp: str, sources: Sequence[str], includes: Sequence[str] = (),
                extra: Sequence[str] = ()) -> Tuple[int, str, List[str]]:
    """nvcc every source side by side; (worst exit status, the logs together, the objects)."""
    jobs = [(nvcc_command(arch, os.path.join(tmp, f"{i}.o"), src, includes, extra), os.path.join(tmp, f"{i}.o"))
            for i, src in enumerate(sources)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        procs = list(pool.map(lambda job: subprocess.run(job[0], capture_output=True, text=True), jobs))
    log = "\n".join(" ".join(cmd) + "\n" + p.stdout + p.stderr for (cmd, _), p in zip(jobs, procs))
    return max(p.returncode for p in procs), log, [obj for _, obj in jobs]


def short_name(mangled: str) -> str:
    """The demangled kernel name without namespaces and the template noise of its arguments."""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return mangled
    name = re.sub(r"ds_q8::(\(anonymous namespace\)::)?", "", name)
    name = name.replace("(anonymous namespace)::", "")
    return re.sub(r"\(.*\)$", "", name)  # the parameter list repeats the template arguments


def parse(log: str) -> List[Dict]:
    """One record per compiled kernel: name, arch, registers, stack, spill_stores, spill_loads, and smem (its
    static shared memory in bytes, 0 when ptxas names none; dynamic shared memory is the launch's)."""
    rows, current = [], None
    for line in log.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = {"kernel": short_name(m.group(1)), "mangled": m.group(1), "arch": m.group(2)}
            rows.append(current)
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["smem"] = int(s.group(1)) if s else 0
    return rows


def bad(rows: List[Dict]) -> List[Dict]:
    return [r for r in rows if r.get("stack", 1) or r.get("spill_stores", 1) or r.get("spill_loads", 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90", help="compute capability without the dot (default 90)")
    ap.add_argument("--log", help="also write the full nvcc output here")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d{2,3}a?", args.arch):
        ap.error(f"--arch must be a compute capability such as 90 or 80, got {args.arch!r}")
    with tempfile.TemporaryDirectory() as tmp:
        returncode, log, _ = compile_all(args.arch, tmp, device_sources())
    if args.log:
        with open(args.log, "w") as f:
            f.write(log)
    if returncode != 0:
        print(log[-8000:], file=sys.stderr)
        print(f"FAIL nvcc exited with {returncode}", file=sys.stderr)
        return 2
    rows = parse(log)
    if not rows:
        print("FAIL ptxas reported no kernels", file=sys.stderr)
        return 2
    width = max(len(r["kernel"]) for r in rows)
    print(f"{'kernel':<{width}}  regs  stack  spill-st  spill-ld")
    for r in sorted(rows, key=lambda r: r["kernel"]):
        print(f"{r['kernel']:<{width}}  {r.get('registers', -1):>4}  {r.get('stack', -1):>5}  "
              f"{r.get('spill_stores', -1):>8}  {r.get('spill_loads', -1):>8}")
    failing = bad(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "kernels": rows, "bad": len(failing)}, f, indent=1)
    print(f"{'FAIL' if failing else 'PASS'} ptxas: {len(rows)} kernels, {len(failing)} with a stack frame or spills")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
