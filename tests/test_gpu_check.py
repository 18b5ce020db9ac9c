"""launch/gpu_check.sh and its helpers without a GPU: the shell parses, its dry run lists every stage
and every check, launch/gpu_check.py rejects bad arguments, and launch/ptxas_report.py reads ptxas's
report."""
import glob
import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

import gpu_check  # noqa: E402
import ptxas_report  # noqa: E402


def test_shell_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", "gpu_check.sh")], check=True)


def embedded_python(text):
    """The Python blocks of a shell script: python -c '...' arguments and quoted heredocs fed to python."""
    blocks = [m.group(1) for m in re.finditer(r"(?:\$PY\"?|python3?)\s+-c\s+'([^']*)'", text)]
    for m in re.finditer(r"(?:\$PY\"?|python3?)\s+-[^\n]*<<'(\w+)'\n(.*?)\n\1\n", text, re.S):
        blocks.append(m.group(2))
    return blocks


def test_embedded_python_of_every_launch_script_compiles():
    found = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "*.sh"))):
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
    env = dict(os.environ, OUT=str(out), TORCH_EXTENSIONS_DIR=str(ext), CUDA_VISIBLE_DEVICES="")
    env.pop("DRY_RUN", None)
    run = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_check.sh")], env=env, capture_output=True,
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
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path))
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    order = ["preflight", "build", "correctness", "gpu-tests", "speed", "sanitizer-memcheck", "sanitizer-racecheck",
             "deepspeed-gpu"]
    at = [out.stdout.find(f"stage {stage} ") for stage in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))  # answers first, the slowest to start last
    assert "stage ptxas" not in out.stdout  # CI's (tests/test_cuda_build.py)
    limits = [int(m) for m in re.findall(r"^stage \S+ \(limit (\d+)s", out.stdout, re.M)]
    assert sum(limits) - 45 <= 480 + 30, limits  # the stages fit one 600 s command, preflight aside
    assert "kns=ds_q8" in out.stdout and "PYTORCH_NO_CUDA_MEMORY_CACHING" in open(
        os.path.join(ROOT, "launch", "gpu_check.sh")).read()
    plan = json.loads((tmp_path / "gpu_check_correctness.json").read_text())["plan"]
    assert any("huge" in line for line in plan)
    assert {line.split()[1] for line in plan if line.startswith("sweep")} == {str(b) for b in gpu_check.BLOCK_SIZES}


def test_plan_covers_the_issue_sizes():
    assert gpu_check.sizes_for(256) == [1, 7, 255, 257, 3 * 256 + 7]
    assert gpu_check.HUGE == 2 ** 31 + 4099
    assert not any(c[0] == "huge" for c in gpu_check.correctness_plan(quick=True))
    shapes = gpu_check.gpt2_xl_shapes()
    total = sum(math.prod(s) for s in shapes)
    assert len(shapes) == 580 and 1.55e9 < total < 1.56e9


@pytest.mark.parametrize("argv,message", [(["speed", "--reps", "3"], "--reps must be at least 5"),
                                          (["speed", "--n", "0"], "--n must be a positive"),
                                          (["nonsense"], "invalid choice")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_ptxas_report_parses_stack_spills_and_registers():
    log = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
"""
    rows = ptxas_report.parse(log)
    assert [(r["stack"], r["spill_stores"], r["spill_loads"], r["registers"]) for r in rows] == [(16, 4, 8, 40),
                                                                                               (0, 0, 0, 12)]
    assert [r["mangled"] for r in ptxas_report.bad(rows)] == ["_Z3fooPf"]
    assert rows[0]["kernel"].startswith("foo")


@pytest.mark.parametrize("stage", ["correctness", "sanitize"])
def test_python_stages_run_on_the_cpu_op(tmp_path, stage):
    """The GPU run's checks, run here on the CPU op: the script itself has no bug to find on the GPU."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "gpu_check.py"), stage, "--device", "cpu",
                          "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "FAIL" not in out.stdout
    report = json.loads((tmp_path / f"gpu_check_{stage}.json").read_text())
    assert report["failed"] == 0 and report["results"] and all(r["result"] == "PASS" for r in report["results"])
