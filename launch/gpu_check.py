"""The correctness and speed stages of launch/gpu_check.sh, on one CUDA GPU.

    python launch/gpu_check.py preflight                 imports, a visible GPU (STOP line, exit 2, if none)
    python launch/gpu_check.py build                     the CUDA op and the CPU op, at the same time
    python launch/gpu_check.py correctness --out DIR     pytest -m gpu: the GPU tests of tests/, among them
                                                         the kernels against the pure-PyTorch reference
    python launch/gpu_check.py speed --out DIR [--n N]   python -m ds_q8.bench on the GPU: timings against
                                                         copy, bitsandbytes, torch; targets as TARGET lines
    python launch/gpu_check.py sanitize                  a small run for compute-sanitizer
    python launch/gpu_check.py profile [--n N]           the workload Nsight Compute profiles (ncu)
    python launch/gpu_check.py ncu-summary LOG           ncu's CSV output as one INFO line per kernel
    python launch/gpu_check.py STAGE --dry-run           the plan only (no GPU needed)

Every check prints one ``PASS name ...``, ``FAIL name ...`` (or ``SKIP``) line and is added to
DIR/gpu_check_<stage>.json as soon as it finishes (the file is rewritten after each result, so a
run cut short still leaves what it measured). Exit status 1 when a check failed. This script imports
nothing from tests/: the correctness stage runs pytest on them, whose ``--json-report`` writes the file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICE = "cuda"  # --device cpu runs the same checks on the CPU op, to try this script without a GPU
#: the GPU tests the correctness stage runs (the multi-rank ones run in gpu_check.sh's deepspeed-gpu stage)
GPU_TESTS = "gpu and not multirank"


def gpt2_xl_shapes(layers: int = 48, d: int = 1600, vocab: int = 50257, ctx: int = 1024) -> List[tuple]:
    """The parameter shapes of GPT-2 XL (1.56e9 parameters, 580 tensors); smaller when asked."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


class Report:
    """PASS/FAIL lines and a JSON file rewritten after every result."""

    def __init__(self, path: Optional[str], stage: str):
        self.path, self.failed = path, 0
        self.data: Dict = {"stage": stage, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": []}
        self._write()

    def _write(self):
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)

    def add(self, name: str, ok: Optional[bool], detail: str = "", **values):
        word = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        self.failed += ok is False
        print(f"{word} {name}{': ' + detail if detail else ''}", flush=True)
        self.data["results"].append(dict(name=name, result=word, detail=detail, **values))
        self._write()

    def target(self, name: str, met: bool, detail: str, **values):
        """A speed target: the measured figure against it, reported, never a failure (FAIL is for wrong results)."""
        print(f"TARGET {name}: {'met' if met else 'missed'}, {detail}", flush=True)
        self.data["results"].append(dict(name=name, result="TARGET", met=bool(met), detail=detail, **values))
        self._write()

    def info(self, key: str, value):
        self.data[key] = value
        self._write()

    def run(self, name: str, check: Callable[[], Optional[str]]):
        """check() returns a detail string, or raises (AssertionError: FAIL with its message)."""
        t0 = time.time()
        try:
            detail = check() or ""
            self.add(name, True, detail, seconds=round(time.time() - t0, 2))
        except Exception as exc:  # one failed check must not stop the others
            msg = " ".join(str(exc).split())[:400] or type(exc).__name__
            self.add(name, False, msg, seconds=round(time.time() - t0, 2),
                     traceback=traceback.format_exc()[-3000:])


# ---------------------------------------------------------------------------------------------- correctness
def pytest_command(json_path: Optional[str], quick: bool, collect_only: bool = False) -> List[str]:
    """``pytest -m gpu`` over tests/ (the multi-rank GPU tests aside) on one pytest-xdist worker, its report
    as JSON in ``json_path``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", GPU_TESTS,
           os.path.join(ROOT, "tests")]
    if quick:
        cmd += ["-k", "not test_huge"]
    if DEVICE != "cuda":
        cmd += ["--kernel-device", DEVICE]
    if collect_only:
        cmd.append("--collect-only")
    else:
        # one pytest-xdist worker: a test that crashes the process (a kernel's fault, a segfault in the
        # binding) is reported as that test's FAIL, and a fresh worker runs the rest
        cmd += ["-n", "1"]
        if json_path:
            cmd += ["--json-report", json_path]
    return cmd


def correctness(path: Optional[str], quick: bool) -> int:
    """The GPU tests in a pytest process; its report, with the stage's name, is the stage's JSON file."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = path or os.path.join(tmp, "report.json")
        rc = subprocess.run(pytest_command(report, quick), cwd=ROOT).returncode
        data = {"results": []}
        if os.path.exists(report):
            with open(report) as f:
                data = json.load(f)
        data.update(stage="correctness", pytest_exit=rc)
        data.setdefault("failed", sum(r["result"] == "FAIL" for r in data["results"]))
        if path:
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
    if rc == 5:  # pytest's "no tests collected"
        print("FAIL correctness: pytest selected no GPU test", flush=True)
    return 0 if rc == 0 else 1


def correctness_plan(quick: bool) -> List[str]:
    """The tests the correctness stage would run: pytest's collection, which needs no GPU."""
    import subprocess

    out = subprocess.run(pytest_command(None, quick, collect_only=True), cwd=ROOT, capture_output=True, text=True)
    tests = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode != 0 or not tests:
        raise RuntimeError(f"pytest --collect-only exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return tests


# ---------------------------------------------------------------------------------------------- sanitize
def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def sanitize(report: Report) -> None:
    """Small steps through every launch path, for compute-sanitizer memcheck / racecheck."""
    import torch

    import ds_q8
    from ds_q8 import ops

    def run():
        for bs in (64, 512, 4096):
            for pd in (torch.float32, torch.bfloat16):
                ps = [torch.nn.Parameter(torch.randn(n, device=DEVICE).to(pd)) for n in (1, 7, bs + 1, 3 * bs + 7)]
                opt = ds_q8.AdamW8bitBlock(ps, block_size=bs, min_8bit_size=8)
                for p in ps:
                    p.grad = torch.randn_like(p)
                opt.step()
        x = torch.randn(5000, device=DEVICE)
        codes, absmax = ops.quantize_blockwise(x)
        ops.dequantize_blockwise(codes, absmax)
        sync()
        return "AdamW 8-bit and fp32-state steps, quantize, dequantize"

    report.run("sanitize workload", run)


# ---------------------------------------------------------------------------------------------- profile
#: the step kernels Nsight Compute profiles (ncu --kernel-name, matched against the function's base name)
PROFILE_KERNELS = "regex:step4?_kernel"
#: the figures of each profiled kernel printed as an INFO line: enough to tell a kernel bound by memory
#: traffic (DRAM throughput near 100%) from one bound by its arithmetic (SM throughput high) or by
#: latency (both low, warps waiting); the whole table is in the stage's log
PROFILE_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
                   "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy", "Block Limit Registers",
                   "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction")


def profile_workload(n: int) -> None:
    """What the profile stage runs under ncu: two AdamW steps on one fp32 tensor of n elements with
    8-bit states, then two with 4-bit states (ncu profiles the second of each)."""
    import torch

    import ds_q8

    for bits in (8, 4):
        p = torch.nn.Parameter(torch.randn(n, device=DEVICE))
        p.grad = torch.randn_like(p)
        opt = ds_q8.AdamW8bitBlock([p], optim_bits=bits, nonfinite="off")
        for _ in range(2):
            opt.step()
        sync()
        print(f"profile workload: {bits}-bit AdamW, {n} elements, 2 steps", flush=True)
        del opt, p


def ncu_summary(text: str) -> List[str]:
    """INFO lines from ``ncu --csv --page details`` output: one per profiled kernel, with the figures
    of :data:`PROFILE_METRICS` that it reports. Lines before the CSV header (the program's own output,
    ``==PROF==`` lines) are skipped."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: Dict[tuple, Dict[str, str]] = {}  # (launch ID, kernel name) -> metric -> value and unit
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        name, metric = row.get("Kernel Name", ""), row.get("Metric Name", "")
        if not name or metric not in PROFILE_METRICS:
            continue
        unit = row.get("Metric Unit", "")
        kernels.setdefault((row.get("ID"), name), {})[metric] = f"{row.get('Metric Value', '')}{' ' + unit if unit else ''}"
    return [f"INFO profile {name.split('(')[0]}: " + ", ".join(f"{m} {figures[m]}" for m in PROFILE_METRICS if m in figures)
            for (_, name), figures in kernels.items()]


# ---------------------------------------------------------------------------------------------- speed
#: step rows that answer other questions than the targets (python -m ds_q8.bench has them); each row of a
#: table holds its own parameters at once, so at 1.5e9 parameters fewer rows also fit the GPU
SPEED_SKIP = ["clip norm", "state_rounding=nearest", "foreach", "torchao", "DeepSpeedCPUAdam"]
KERNEL_ROW = "ds_q8 AdamW8bitBlock (kernel, nonfinite=off)"  # against the copy bandwidth
STEP_ROW = "ds_q8 AdamW8bitBlock (kernel)"  # against the peers
PEERS = {"torch fused AdamW": "torch AdamW fused", "bitsandbytes AdamW8bit": "bitsandbytes AdamW8bit"}


def bench_argv(n: int, reps: int, skip_peers: bool, many: Tuple[int, int]) -> List[str]:
    """``python -m ds_q8.bench`` arguments: the step, copy, many-tensor and quantization tables only."""
    argv = ["--device", DEVICE, "--n", str(n), "--reps", str(reps), "--no-reference", "--many", str(many[0]),
            str(many[1]), "--in-cache", "0", "0", "--segments", "0", "--muon", "--block-sizes"]
    for text in SPEED_SKIP + (["bitsandbytes"] if skip_peers else []):
        argv += ["--skip", text]
    return argv


def speed(report: Report, n: int, reps: int, skip_peers: bool, many: Tuple[int, int]) -> None:
    import torch

    from ds_q8 import bench

    report.info("device", torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)
    argv = bench_argv(n, reps, skip_peers, many)
    report.info("bench", {"argv": argv})
    result = bench.main(argv)
    report.info("bench", {"argv": argv, "result": result})
    speed_rows(report, result, n, reps, many)


def speed_rows(report: Report, result: dict, n: int, reps: int, many: Tuple[int, int]) -> None:
    """ds_q8.bench's tables as INFO rows, and the speed targets as TARGET lines (never a failure)."""
    step, xl = result["step"], result["many"]["step"]
    tables = [(f"n={n}", step), ("copy", result["copy"]), (f"gpt2-xl-sized {many[0]}x{many[1]}", xl),
              ("quantization", result["quantization"])]
    for label, rows in tables:
        for r in rows:
            report.add(f"speed {label} {r['name']}", None, f"median {r['ms']:.3f} ms of {reps}, {r['gbps']:.1f} GB/s",
                       ms=r["ms"], GBps=round(r["gbps"], 1), times=r["runs_ms"])
    named = {r["name"]: r for r in step}
    if KERNEL_ROW in named and result["copy"]:
        frac = named[KERNEL_ROW]["gbps"] / result["copy"][0]["gbps"]
        report.target("kernel >= 80% of copy bandwidth", frac >= 0.8, f"{100 * frac:.0f}% at n={n}", fraction=frac)
    for label, rows in ((f"n={n}", step), ("gpt2-xl", xl)):
        named = {r["name"]: r for r in rows}
        ds = named.get(STEP_ROW)
        for peer, row in PEERS.items():
            if row not in named:
                report.add(f"speed {label} {row}", None, "unavailable (the log says why)")
            elif ds:
                ms = named[row]["ms"]
                report.target(f"{label} ds_q8 step faster than {peer}", ds["ms"] < ms, f"{ds['ms']:.2f} ms vs {ms:.2f} ms")

# ---------------------------------------------------------------------------------------------- preflight, build
def compilers() -> str:
    """The host compiler torch's extension builder will use (CXX, else c++), its version, the
    TORCH_CUDA_ARCH_LIST it is given, and the compiler torch itself was built with: the facts an
    ABI mismatch between an extension and torch comes down to."""
    import shutil
    import subprocess

    import torch

    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as exc:
        version = f"not runnable ({exc})"
    built = [line.strip() for line in torch.__config__.show().splitlines()
             if line.strip().startswith(("- GCC", "- C++ Version", "- clang"))]
    return (f"CXX={cxx} ({shutil.which(cxx)}: {version}); TORCH_CUDA_ARCH_LIST="
            f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}; torch built with {'; '.join(built) or '?'}")


def preflight() -> int:
    """What every later stage needs: torch with CUDA, DeepSpeed, ds_q8 from this tree, a visible GPU.
    Builds nothing. Returns 2 (one STOP line) when a stage cannot run here."""
    import torch

    import deepspeed

    import ds_q8

    here = os.path.dirname(os.path.dirname(os.path.abspath(ds_q8.__file__)))
    if not os.path.samefile(here, ROOT):
        print(f"STOP preflight: ds_q8 is imported from {here}, not from this tree ({ROOT})", flush=True)
        return 2
    if not torch.version.cuda:
        print(f"STOP preflight: torch {torch.__version__} is a CPU-only build; the checks need a CUDA build",
              flush=True)
        return 2
    if not torch.cuda.is_available():
        print(f"STOP preflight: no CUDA GPU visible (torch {torch.__version__}, CUDA {torch.version.cuda}); "
              "nothing was built or run", flush=True)
        return 2
    print(f"PASS preflight: torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, "
          f"{torch.cuda.get_device_name()}, CUDA_HOME={os.environ.get('CUDA_HOME')}", flush=True)
    print(f"INFO compilers: {compilers()}", flush=True)
    try:
        import bitsandbytes
        print(f"INFO bitsandbytes {bitsandbytes.__version__}", flush=True)
    except Exception as exc:  # an optional peer of the speed rows
        print(f"INFO bitsandbytes unavailable ({' '.join(str(exc).split())[:200]}): its speed rows are skipped",
              flush=True)
    return 0


def build() -> int:
    """The CUDA op (here) and the CPU op (a second process, at the same time) that the later stages load:
    every compile happens in this stage."""
    import subprocess

    cpu = subprocess.Popen([sys.executable, "-c", "from ds_q8.op_builder import Q8CPUBuilder; "
                            "print('CPU op ISAs:', list(Q8CPUBuilder().load().supported_isas()))"], cwd=ROOT)
    t = time.time()
    from ds_q8.op_builder import Q8CUDABuilder

    Q8CUDABuilder().load(verbose=True)
    print(f"PASS build CUDA op: loaded after {time.time() - t:.0f} s", flush=True)
    rc = cpu.wait()
    print(f"{'PASS' if rc == 0 else 'FAIL'} build CPU op: {time.time() - t:.0f} s (exit {rc})", flush=True)
    return 0 if rc == 0 else 1


# ---------------------------------------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["preflight", "build", "correctness", "speed", "sanitize", "profile",
                                      "ncu-summary"])
    ap.add_argument("log", nargs="?", help="ncu-summary: the file of ncu --csv --page details output")
    ap.add_argument("--out", help="directory for gpu_check_<stage>.json (default: no file)")
    ap.add_argument("--n", type=int, default=None, help="parameters of the single-tensor speed rows "
                    "(1.5e9), or of the profiled steps (2^27)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per row (median reported; at least 5)")
    ap.add_argument("--quick", action="store_true", help="correctness without the 2^31+4099-element tensor")
    ap.add_argument("--no-peers", action="store_true", help="speed without bitsandbytes")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same checks on the CPU op (tries this script without a GPU; use small --n, --many)")
    ap.add_argument("--xl-layers", type=int, default=48, help="transformer layers of the GPT-2 XL list (48)")
    ap.add_argument("--many", type=int, nargs=2, metavar=("COUNT", "SIZE"),
                    help="speed's many-tensor table (default: as many tensors and parameters as the GPT-2 XL list)")
    args = ap.parse_args(argv)
    if args.n is None:
        args.n = 2 ** 27 if args.stage == "profile" else 1_500_000_000
    if args.stage == "ncu-summary" and not args.log:
        ap.error("ncu-summary needs the path of ncu's output")
    if args.reps < 5:
        ap.error(f"--reps must be at least 5, got {args.reps}")
    if args.n < 1:
        ap.error(f"--n must be a positive number of parameters, got {args.n}")
    if args.many is None:
        shapes = gpt2_xl_shapes(args.xl_layers)
        args.many = (len(shapes), sum(math.prod(s) for s in shapes) // len(shapes))
    if min(args.many) < 1:
        ap.error(f"--many needs two positive numbers, got {args.many}")
    return args


def dry_run(args, path: Optional[str]) -> int:
    if args.stage in ("preflight", "build"):
        print(f"dry run of {args.stage}: " + ("imports and the GPU" if args.stage == "preflight" else
                                              "the CUDA and CPU ops"))
        return 0
    if args.stage == "correctness":
        plan = correctness_plan(args.quick)
    elif args.stage == "speed":
        plan = ["python -m ds_q8.bench " + " ".join(bench_argv(args.n, args.reps, args.no_peers, args.many))]
    elif args.stage == "profile":
        plan = [f"8-bit and 4-bit AdamW steps on {args.n} elements under ncu ({PROFILE_KERNELS})"]
    else:
        plan = ["small AdamW steps, quantize, dequantize"]
    print(f"dry run of {args.stage}: {len(plan)} checks")
    for line in plan:
        print("  " + line)
    if path:
        with open(path, "w") as f:
            json.dump({"stage": args.stage, "dry_run": True, "plan": plan}, f, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    global DEVICE
    DEVICE = args.device
    if args.stage in ("preflight", "build") and not args.dry_run:
        return preflight() if args.stage == "preflight" else build()
    if args.stage == "ncu-summary":
        with open(args.log, errors="replace") as f:
            lines = ncu_summary(f.read())
        print("\n".join(lines) if lines else f"INFO profile: no kernel figures in {args.log}", flush=True)
        return 0
    path = os.path.join(args.out, f"gpu_check_{args.stage}.json") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        return dry_run(args, path)
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("FAIL preflight: no CUDA GPU visible", flush=True)
        return 1
    if args.stage == "correctness":
        return correctness(path, args.quick)
    if args.stage == "profile":
        profile_workload(args.n)
        return 0
    report = Report(path, args.stage)
    if args.stage == "speed":
        speed(report, args.n, args.reps, args.no_peers, args.many)
    else:
        sanitize(report)
    report.info("failed", report.failed)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
