"""The suite's pytest hooks (tests/helpers/plugin.py) and configuration (pytest.ini), on small planted
test files run in their own pytest process: time limits by marker, pytest-timeout ending a test that
runs past its limit, GPU tests skipped without a GPU, the JSON report, and unknown markers refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLANTED = '''
import time

import pytest


def test_passes():
    pass


def test_fails():
    assert 1 == 2, "one is not two"


def test_skips():
    pytest.skip("not here")


@pytest.mark.slow
def test_slow_limit(request):
    assert request.node.get_closest_marker("timeout").args == (900,)


@pytest.mark.slow
@pytest.mark.multirank
def test_multirank_limit(request):
    assert request.node.get_closest_marker("timeout").args == (1200,)


@pytest.mark.multirank
@pytest.mark.timeout(7)
def test_own_limit(request):
    assert request.node.get_closest_marker("timeout").args == (7,)


def test_default_limit(request):
    assert request.node.get_closest_marker("timeout") is None and request.config.getini("timeout") == "600"


@pytest.mark.timeout(1)
def test_runs_past_its_limit():
    time.sleep(30)


@pytest.mark.gpu
def test_needs_a_gpu():
    raise AssertionError("ran without a GPU")


@pytest.mark.gpu
def test_kernels(kernel_device):
    assert kernel_device == "cpu"
'''


def run_planted(tmp_path, *args):
    """The planted file under this repository's pytest.ini and hooks, without a visible GPU."""
    (tmp_path / "test_planted.py").write_text(PLANTED)
    (tmp_path / "conftest.py").write_text("from helpers.plugin import (  # noqa: F401\n"
                                          "    kernel_device, pytest_addoption, pytest_collection_modifyitems,\n"
                                          "    pytest_configure)\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pytest.ini"),
                           "--rootdir", str(tmp_path), str(tmp_path), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_limits_markers_and_the_json_report(tmp_path):
    path = tmp_path / "out" / "report.json"
    out = run_planted(tmp_path, "--json-report", str(path))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads(path.read_text())
    results = {r["name"].split("::")[1]: r for r in report["results"]}
    words = {name: r["result"] for name, r in results.items()}
    assert words == {"test_passes": "PASS", "test_fails": "FAIL", "test_skips": "SKIP", "test_slow_limit": "PASS",
                     "test_multirank_limit": "PASS", "test_own_limit": "PASS", "test_default_limit": "PASS",
                     "test_runs_past_its_limit": "FAIL", "test_needs_a_gpu": "SKIP", "test_kernels": "SKIP"}
    assert (report["passed"], report["failed"], report["skipped"], report["exitstatus"]) == (5, 2, 3, 1)
    assert "one is not two" in results["test_fails"]["detail"] and "traceback" in results["test_fails"]
    assert "Timeout" in results["test_runs_past_its_limit"]["detail"]
    assert results["test_runs_past_its_limit"]["seconds"] < 20  # ended at its limit, not after its sleep
    assert results["test_needs_a_gpu"]["detail"] == results["test_kernels"]["detail"] == "needs a CUDA GPU"
    assert results["test_skips"]["detail"] == "not here"
    lines = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert len(lines) == len(results) and "FAIL test_planted.py::test_fails: AssertionError: one is not two" in lines[1]


def test_kernel_device_cpu_runs_the_kernel_tests_without_a_gpu(tmp_path):
    out = run_planted(tmp_path, "-m", "gpu", "--kernel-device", "cpu", "-rs")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 passed, 1 skipped, 8 deselected" in out.stdout  # test_kernels ran; test_needs_a_gpu did not


def test_unknown_markers_are_refused(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "test_typo.py").write_text("import pytest\n\n\n@pytest.mark.gpus\ndef test_x():\n    pass\n")
    out = run_planted(tmp_path, str(tmp_path / "extra"), "-k", "test_x")
    assert out.returncode != 0 and "'gpus' not found in `markers`" in out.stdout + out.stderr


def test_the_longest_modules_run_first_under_make_test():
    """make test hands whole modules to the workers in collection order, the longest first: each module the
    ordering names exists (a renamed one would silently fall back to the end), and the Makefile keeps xdist from
    reordering modules by their number of tests, which would put the longest last."""
    from helpers.plugin import FIRST_MODULES

    modules = [p.name for d in ("tests", "gpu_check/tests", "studies/tests") for p in (ROOT / d).glob("test_*.py")]
    assert len(set(FIRST_MODULES)) == len(FIRST_MODULES)
    for name in FIRST_MODULES:
        assert modules.count(name) == 1, name
    make = (ROOT / "Makefile").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in make
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_plugin.py",
                          "tests/test_cuda_sim.py", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and ids[0].startswith("tests/test_cuda_sim.py::"), out.stdout[-2000:]
