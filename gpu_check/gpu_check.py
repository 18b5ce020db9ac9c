"""The preflight, build, correctness, sanitizer and profile stages of gpu_check/gpu_check.sh, on one CUDA GPU
(its speed stage is gpu_check/kernel_compare.py).

    python gpu_check/gpu_check.py preflight                 imports, a visible GPU (STOP line, exit 2, if none)
    python gpu_check/gpu_check.py build                     the CUDA op and the CPU op, at the same time
    python gpu_check/gpu_check.py correctness --out DIR     pytest -m gpu: the GPU tests of tests/, among them
                                                         the kernels against the pure-PyTorch reference
    python gpu_check/gpu_check.py sanitize                  a small run for compute-sanitizer
    python gpu_check/gpu_check.py profile [--n N]           the workload Nsight Compute profiles (ncu)
    python gpu_check/gpu_check.py ncu-summary LOG           ncu's CSV output as one INFO line per kernel
    python gpu_check/gpu_check.py STAGE --dry-run           the plan only (no GPU needed)

Every check prints one ``PASS name ...``, ``FAIL name ...`` (or ``SKIP``) line and is added to
DIR/gpu_check_<stage>.json as soon as it finishes (the file is rewritten after each result, so a
run cut short still leaves what it measured). Exit status 1 when a check failed. This script imports
nothing from tests/: the correctness stage runs pytest on them, whose ``--json-report`` writes the file.
"""
from __future__ import annotations

import argparse
import json
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
#: counters asked for beside the sections (ncu --metrics): instructions, shared-memory wavefronts and bank
#: conflicts, DRAM bytes (each divided by the elements stepped gives a per-element figure), and the
#: warps' stall reasons per issued instruction
PROFILE_COUNTERS = ("smsp__inst_executed.sum", "smsp__thread_inst_executed.sum",
                    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
                    "dram__bytes_read.sum", "dram__bytes_write.sum")
PROFILE_STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
#: the figures of each profiled kernel printed as an INFO line: enough to tell a kernel bound by memory
#: traffic (DRAM throughput near 100%) from one bound by its arithmetic (SM throughput high) or by
#: latency (both low, warps waiting); the whole table is in the stage's log
PROFILE_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
                   "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy", "Block Limit Registers",
                   "Issue Slots Busy", "Executed Ipc Active", "Warp Cycles Per Issued Instruction") + PROFILE_COUNTERS
#: the stall reasons printed per kernel: the largest few of the warps' stall counters
STALL_PREFIX, TOP_STALLS = "smsp__average_warps_issue_stalled_", 5


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
    stalls: Dict[tuple, Dict[str, float]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        name, metric = row.get("Kernel Name", ""), row.get("Metric Name", "")
        key = (row.get("ID"), name)
        if name and metric.startswith(STALL_PREFIX):
            try:
                stalls.setdefault(key, {})[metric[len(STALL_PREFIX):].split("_per_issue")[0]] = \
                    float(row.get("Metric Value", "").replace(",", ""))
            except ValueError:
                pass
            continue
        if not name or metric not in PROFILE_METRICS:
            continue
        unit = row.get("Metric Unit", "")
        kernels.setdefault(key, {})[metric] = f"{row.get('Metric Value', '')}{' ' + unit if unit else ''}"
    out = []
    for key in list(dict.fromkeys(list(kernels) + list(stalls))):
        figures = kernels.get(key, {})
        text = ", ".join(f"{m} {figures[m]}" for m in PROFILE_METRICS if m in figures)
        top = sorted(stalls.get(key, {}).items(), key=lambda kv: -kv[1])[:TOP_STALLS]
        if top:
            text += (", " if text else "") + "stalls " + " ".join(f"{k} {v:.2f}" for k, v in top)
        out.append(f"INFO profile {key[0]} {key[1].split('(')[0]}: {text}")
    return out


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


def build(earlier: Optional[str], train_ops: bool) -> int:
    """The CUDA op (here) and, in other processes at the same time, the CPU op, the earlier kernel's op
    (gpu_check/kernel_compare.py, from the csrc folder ``earlier``) and the ops of the training stage
    (gpu_check/gpu_train.py --build-only, for a later call on this machine): every compile of the run."""
    import subprocess
    import tempfile

    others = {"CPU op": [sys.executable, "-c", "from ds_q8.op_builder import Q8CPUBuilder; "
                         "print('CPU op ISAs:', list(Q8CPUBuilder().load().supported_isas()))"]}
    if earlier:
        others["earlier kernel's op"] = [sys.executable, os.path.join(ROOT, "gpu_check", "kernel_compare.py"), "build",
                                         "--old", earlier]
    scratch = tempfile.mkdtemp()
    if train_ops:
        others["training stage's ops"] = [sys.executable, os.path.join(ROOT, "gpu_check", "gpu_train.py"),
                                          "--build-only", "--out", scratch]
    t = time.time()
    procs = {name: subprocess.Popen(cmd, cwd=ROOT) for name, cmd in others.items()}
    from ds_q8.op_builder import Q8CUDABuilder

    Q8CUDABuilder().load(verbose=True)
    print(f"PASS build CUDA op: loaded after {time.time() - t:.0f} s", flush=True)
    failed = 0
    for name, proc in procs.items():
        rc = proc.wait()
        print(f"{'PASS' if rc == 0 else 'FAIL'} build {name}: {time.time() - t:.0f} s (exit {rc})", flush=True)
        failed += rc != 0 and name == "CPU op"  # the others' stages say so themselves; they can still run
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["preflight", "build", "correctness", "sanitize", "profile", "ncu-summary"])
    ap.add_argument("log", nargs="?", help="ncu-summary: the file of ncu --csv --page details output")
    ap.add_argument("--out", help="directory for gpu_check_<stage>.json (default: no file)")
    ap.add_argument("--n", type=int, default=2 ** 27, help="parameters of the profiled steps (2^27)")
    ap.add_argument("--quick", action="store_true", help="correctness without the 2^31+4099-element tensor")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--earlier", help="build: also the earlier kernel's op from this csrc folder (kernel_compare.py)")
    ap.add_argument("--train-ops", action="store_true", help="build: also the training stage's ops")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same checks on the CPU op (tries this script without a GPU; use a small --n)")
    args = ap.parse_args(argv)
    if args.stage == "ncu-summary" and not args.log:
        ap.error("ncu-summary needs the path of ncu's output")
    if args.n < 1:
        ap.error(f"--n must be a positive number of parameters, got {args.n}")
    return args


def dry_run(args, path: Optional[str]) -> int:
    if args.stage in ("preflight", "build"):
        print(f"dry run of {args.stage}: " + ("imports and the GPU" if args.stage == "preflight" else
                                              "the CUDA and CPU ops"))
        return 0
    if args.stage == "correctness":
        plan = correctness_plan(args.quick)
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
        return preflight() if args.stage == "preflight" else build(args.earlier, args.train_ops)
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
    sanitize(report)
    report.info("failed", report.failed)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
