"""gpu_check/gpu_check.sh and its helpers without a GPU: the shell parses, its dry run lists every stage
and every check, gpu_check/gpu_check.py rejects bad arguments, its correctness stage (pytest -m gpu) skips
cleanly without a GPU and runs on the CPU op, its profile summary reads ncu's table, and
gpu_check/ptxas_report.py reads ptxas's report (the speed stage, gpu_check/kernel_compare.py, has its own tests)."""
import glob
import json
import math
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gpu_check/
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import gpu_check  # noqa: E402
import kernel_compare  # noqa: E402
import ptxas_report  # noqa: E402

from helpers.cli import assert_usage_error  # noqa: E402
from helpers.ds_launch import extensions_root  # noqa: E402
from helpers.gpu_cases import BLOCK_SIZES, HUGE, sizes_for  # noqa: E402


def test_shell_script_parses():
    subprocess.run(["bash", "-n", os.path.join(HERE, "gpu_check.sh")], check=True)


def embedded_python(text):
    """The Python blocks of a shell script: python -c '...' arguments and quoted heredocs fed to python."""
    blocks = [m.group(1) for m in re.finditer(r"(?:\$PY\"?|python3?)\s+-c\s+'([^']*)'", text)]
    for m in re.finditer(r"(?:\$PY\"?|python3?)\s+-[^\n]*<<'(\w+)'\n(.*?)\n\1\n", text, re.S):
        blocks.append(m.group(2))
    return blocks


def test_embedded_python_of_every_shell_script_compiles():
    found = 0
    for path in sorted(glob.glob(os.path.join(HERE, "*.sh")) + glob.glob(os.path.join(ROOT, "launch", "*.sh"))):
        with open(path) as f:
            for i, block in enumerate(embedded_python(f.read())):
                compile(block, f"{path} block {i}", "exec")
                found += 1
    assert found >= 1  # gpu_check.sh's summary writer at least


def test_embedded_python_check_catches_the_old_preflight():
    # the line that made the first GPU run stop in its first second: \" inside a bash '...' f-string
    old = """"$PY" -c '
import os
print(f"CUDA_HOME={os.environ.get(\\"CUDA_HOME\\")}")
' || exit 1
"""
    (block,) = embedded_python(old)
    with pytest.raises(SyntaxError):
        compile(block, "old preflight", "exec")


def test_gpu_less_run_stops_at_the_gpu_with_one_line(tmp_path):
    """The real run (no DRY_RUN) on this machine: it gets as far as it can without a GPU, then stops
    with one STOP line, having built nothing, and leaves its few files in OUT."""
    out, ext = tmp_path / "out", tmp_path / "ext"
    # WHEELS= : .whl/, when present, holds wheels for the GPU machine's Python, not this one's
    env = dict(os.environ, OUT=str(out), TORCH_EXTENSIONS_DIR=str(ext), CUDA_VISIBLE_DEVICES="", WHEELS="")
    env.pop("DRY_RUN", None)
    run = subprocess.run(["bash", os.path.join(HERE, "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    stops = [line for line in lines if line.startswith("STOP ")]
    assert len(stops) == 1 and stops[0] == lines[-1], lines[-10:]
    assert re.match(r"STOP preflight: (no CUDA GPU visible|torch .* is a CPU-only build)", stops[0]), stops[0]
    assert not any(line.startswith("FAIL") for line in lines), lines
    assert not ext.exists() or not any(ext.rglob("*.so")), "the GPU-less run built something"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "logs.tar.gz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "STOP" and [s["stage"] for s in summary["stages"]] == ["preflight"]


def test_dry_run_lists_every_stage_and_writes_the_plans(tmp_path):
    # the plan's collection imports test modules, one of which loads ds_q8's CPU op: from the suite's builds,
    # not built again in the checkout's .ext_cache/ (60 s here)
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), TORCH_EXTENSIONS_DIR=extensions_root())
    out = subprocess.run(["bash", os.path.join(HERE, "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    order = ["preflight", "build", "op-errors", "correctness", "speed", "sanitizer-memcheck", "sanitizer-racecheck",
             "profile", "deepspeed-gpu"]
    at = [out.stdout.find(f"stage {stage} ") for stage in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))  # answers first, the slowest to start last
    assert "stage ptxas" not in out.stdout  # CI's (tests/test_cuda_build.py)
    limits = dict(re.findall(r"^stage (\S+) \(limit (\d+)s", out.stdout, re.M))
    # each stage's most fits one 600 s command beside the others' least, and the budget (BUDGET_S, 540 by
    # default) cuts a stage short rather than the command; profile-sections runs only when profile failed at once
    total = sum(int(v) for k, v in limits.items() if k not in ("preflight", "profile-sections"))
    assert total <= 600 + 60 and max(int(v) for v in limits.values()) <= 180, limits
    assert "kns=ds_q8" in out.stdout and "PYTORCH_NO_CUDA_MEMORY_CACHING" in open(
        os.path.join(HERE, "gpu_check.sh")).read()
    plan = json.loads((tmp_path / "gpu_check_correctness.json").read_text())["plan"]
    assert any("test_huge" in line for line in plan)
    assert {int(m) for m in re.findall(r"test_sweep\[bs=(\d+)-", "\n".join(plan))} == set(BLOCK_SIZES)
    assert any(line.startswith("tests/test_cuda_multi.py::") for line in plan)  # every GPU test, not only the kernels'
    assert not any(line.startswith("tests/test_engine_faults.py::") for line in plan)  # multi-rank: deepspeed-gpu's
    assert re.search(r"^stage speed \(limit \d+s, log speed.log\): \S+ gpu_check/kernel_compare.py speed --n ", out.stdout,
                     re.M)
    profile = json.loads((tmp_path / "gpu_check_profile.json").read_text())["plan"]
    assert profile == [f"8-bit and 4-bit AdamW steps on {2 ** 27} elements under ncu (regex:step4?_kernel)"]


def test_profile_workload_runs_on_the_cpu_op():
    out = subprocess.run([sys.executable, os.path.join(HERE, "gpu_check.py"), "profile", "--device", "cpu",
                          "--n", "5000"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert out.stdout.count("profile workload: ") == 2


def test_plan_covers_the_issue_sizes():
    assert sizes_for(256) == [1, 7, 255, 257, 3 * 256 + 7]
    assert HUGE == 2 ** 31 + 4099
    assert not any("test_huge" in line for line in gpu_check.correctness_plan(quick=True))
    shapes = kernel_compare.gpt2_xl_shapes()
    total = sum(math.prod(s) for s in shapes)
    assert len(shapes) == 580 and 1.55e9 < total < 1.56e9
    assert kernel_compare.xl_count_and_size() == (580, total // 580)


@pytest.mark.parametrize("argv,message", [(["profile", "--n", "0"], "--n must be a positive"),
                                          (["nonsense"], "invalid choice")])
def test_bad_arguments_are_named(argv, message, capsys):
    assert_usage_error(gpu_check.main, argv, message, capsys)


def test_ptxas_report_parses_stack_spills_and_registers():
    log = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 256 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
"""
    rows = ptxas_report.parse(log)
    assert [(r["stack"], r["spill_stores"], r["spill_loads"], r["registers"]) for r in rows] == [(16, 4, 8, 40),
                                                                                               (0, 0, 0, 12)]
    assert [r["smem"] for r in rows] == [256, 0]
    assert [r["mangled"] for r in ptxas_report.bad(rows)] == ["_Z3fooPf"]
    assert rows[0]["kernel"].startswith("foo")


@pytest.mark.timeout(900)  # above its run's own 600 s limit
@pytest.mark.parametrize("stage", ["correctness", "sanitize"])
def test_python_stages_run_on_the_cpu_op(tmp_path, stage):
    """The GPU run's checks, run here on the CPU op: the script itself has no bug to find on the GPU."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "gpu_check.py"), stage, "--device", "cpu",
                          "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "FAIL" not in out.stdout
    report = json.loads((tmp_path / f"gpu_check_{stage}.json").read_text())
    assert report["stage"] == stage and report["failed"] == 0 and report["results"]
    assert all(r["result"] in ("PASS", "SKIP") for r in report["results"])
    ran = [r["name"] for r in report["results"] if r["result"] == "PASS"]
    if stage == "correctness":  # the kernel checks ran on the CPU op; the other GPU tests skipped
        assert len(ran) >= len(BLOCK_SIZES) * 5 and all("test_gpu_kernels.py::" in name for name in ran), ran
        assert "PASS tests/test_gpu_kernels.py::test_sweep[bs=64-p=float32-g=float32]" in out.stdout
    else:
        assert ran == ["sanitize workload"]


@pytest.mark.timeout(900)  # above its run's own 600 s limit
def test_gpu_tests_skip_cleanly_without_a_gpu(tmp_path):
    """pytest -m gpu where no GPU is visible: every GPU test is selected and skipped, none fails or errs,
    and the JSON report says so."""
    path = tmp_path / "report.json"
    files = ["tests/test_gpu_kernels.py", "tests/test_cuda_multi.py", "tests/test_cuda_skip.py",
             "tests/test_multi_tensor.py", "tests/test_engine_faults.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files,
                          "--json-report", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    report = json.loads(path.read_text())
    results = report["results"]
    assert report["skipped"] == len(results) > 60 and report["passed"] == report["failed"] == 0
    assert {r["detail"] for r in results} == {"needs a CUDA GPU"}
    assert {r["name"].split("::")[0] for r in results} == set(files)
    assert sum(line.startswith("SKIP tests/") for line in out.stdout.splitlines()) == len(results)


NCU_CSV = '''==PROF== Connected to process 123 (/usr/bin/python3)
profile workload: 8-bit AdamW, 134217728 elements, 2 steps
==PROF== Disconnected from process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","31.20"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","ms","1.98"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","64"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","Launch Statistics","Grid Size","","65536"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__inst_executed.sum","inst","3,145,728"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","","1.50"
"0","123","python3","127.0.0.1","step_kernel","1","7","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","","0.75"
"1","123","python3","127.0.0.1","step4_kernel","1","7","(256, 1, 1)","(32768, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","48.5"
'''


def test_ncu_summary_reads_the_kernels_figures():
    """The profile stage's summary of ncu --csv --page details: one INFO line per profiled kernel with
    the figures it names, in their order; the program's output before the table is skipped."""
    lines = gpu_check.ncu_summary(NCU_CSV)
    assert lines == ["INFO profile 0 step_kernel: Duration 1.98 ms, DRAM Throughput 31.20 %, Registers Per Thread "
                     "64 register/thread, smsp__inst_executed.sum 3,145,728 inst, stalls long_scoreboard 1.50 wait 0.75",
                     "INFO profile 1 step4_kernel: Achieved Occupancy 48.5 %"]
    assert gpu_check.ncu_summary("no table here\n") == []


def test_profile_stage_names_the_kernels_the_shell_profiles():
    script = open(os.path.join(HERE, "gpu_check.sh")).read()
    assert f'--kernel-name "{gpu_check.PROFILE_KERNELS}"' in script
