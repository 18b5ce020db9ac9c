"""launch/gpu_check.sh and its helpers without a GPU: the shell parses, its dry run lists every stage
and every check, launch/gpu_check.py rejects bad arguments, and launch/ptxas_report.py reads ptxas's
report."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

import gpu_check  # noqa: E402
import ptxas_report  # noqa: E402


def test_shell_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", "gpu_check.sh")], check=True)


def test_dry_run_lists_every_stage_and_writes_the_plans(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path))
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for stage in ("preflight", "build", "ptxas", "sanitizer-memcheck", "sanitizer-racecheck", "correctness",
                  "gpu-tests", "speed", "deepspeed-gpu"):
        assert f"stage {stage} " in out.stdout, stage
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
