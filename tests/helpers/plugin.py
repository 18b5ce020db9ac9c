"""The suite's pytest hooks (conftest.py imports them): time limits by marker, GPU tests skipped
without a GPU, the longest modules first, and ``--json-report PATH``, one JSON file of every test's result.

Time limits (pytest-timeout): ``timeout`` in pytest.ini (600 s) for every test; a test marked ``slow`` or
``multirank`` gets the larger limit of :data:`MARKER_TIMEOUT_S` unless it carries its own
``@pytest.mark.timeout(seconds)``. A limit covers the test's fixtures too, so a module's first test
also pays for the jobs its module-scoped fixtures start.

GPU tests: a test marked ``gpu`` is skipped when no CUDA GPU is visible, except one that takes the
``kernel_device`` fixture in a run given ``--kernel-device cpu`` (the GPU kernel checks, run on the
CPU op to try them without a GPU).
"""
from __future__ import annotations

import json
import os
import time

import pytest

#: a test's limit when it carries one of these markers (the largest applies) and no timeout of its own
MARKER_TIMEOUT_S = {"slow": 900, "multirank": 1200}
RESULT_WORDS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def pytest_addoption(parser):
    parser.addoption("--json-report", metavar="PATH", help="write every test's result to PATH as JSON, "
                     "rewritten after each test (a run cut short still leaves what it finished)")
    parser.addoption("--kernel-device", default="cuda", choices=["cuda", "cpu"],
                     help="device of the tests that take the kernel_device fixture (cpu: the CPU op)")


@pytest.fixture(scope="session")
def kernel_device(request) -> str:
    return request.config.getoption("kernel_device")


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


#: the modules whose tests take longest (a minute and more each, the longest first), run first: under
#: ``pytest -n N --dist loadfile --no-loadscope-reorder`` (make test) a worker takes a module whole, in
#: collection order, so the long ones start at once and the many short ones fill the workers' ends instead
#: of a long one trailing behind. (Without ``--no-loadscope-reorder`` xdist orders modules by their number
#: of tests instead.) test_avx512_emulated.py takes minutes only where it emulates, on a CPU without AVX-512.
FIRST_MODULES = ("test_cuda_sim.py", "test_fidelity.py", "test_zero_invariance.py", "test_cuda_build.py",
                 "test_avx512_emulated.py", "test_floor_table.py", "test_muon.py", "test_multinode.py",
                 "test_offload_memory.py", "test_deepspeed_checkpoint.py", "test_gpu_train.py",
                 "test_fast_search_scalar.py", "test_gpu_check.py", "test_minifloat_codec.py", "test_train_run.py")


def _module_rank(item) -> int:
    name = os.path.basename(str(item.fspath))
    return FIRST_MODULES.index(name) if name in FIRST_MODULES else len(FIRST_MODULES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: each module keeps its own order
    on_cpu = config.getoption("kernel_device") == "cpu"
    skip_gpu = None if _gpu() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip_gpu is not None and item.get_closest_marker("gpu"):
            if not (on_cpu and "kernel_device" in item.fixturenames):
                item.add_marker(skip_gpu)
        if item.get_closest_marker("timeout") is None:
            limits = [s for name, s in MARKER_TIMEOUT_S.items() if item.get_closest_marker(name)]
            if limits:
                item.add_marker(pytest.mark.timeout(max(limits)))


class JsonReport:
    """Every test's PASS/FAIL/SKIP with its detail and seconds, as PASS/FAIL/SKIP lines on the terminal
    and a JSON file rewritten after each test."""

    def __init__(self, config, path: str):
        self.config, self.path = config, path
        self.data = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": list(config.invocation_params.args),
                     "results": []}
        self._seconds = {}
        self.write()

    def write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def pytest_runtest_logreport(self, report):
        self._seconds[report.nodeid] = self._seconds.get(report.nodeid, 0.0) + report.duration
        # one entry per test: its call, or the setup that failed or skipped, or a teardown that failed
        if not (report.when == "call" or report.outcome != "passed"):
            return
        if report.when == "teardown" and report.outcome == "skipped":
            return
        word = RESULT_WORDS[report.outcome]
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            detail = report.longrepr[2].replace("Skipped: ", "", 1)
        elif report.outcome == "failed":
            detail = " ".join(str(report.longrepr.reprcrash.message if hasattr(report.longrepr, "reprcrash")
                                  else report.longrepr).split())[:400]
        else:
            detail = ""
        if hasattr(report, "wasxfail"):
            word, detail = "SKIP", f"expected failure: {report.wasxfail}"
        entry = dict(name=report.nodeid, result=word, detail=detail, when=report.when,
                     seconds=round(self._seconds[report.nodeid], 2))
        if report.outcome == "failed":
            entry["traceback"] = str(report.longrepr)[-3000:]
        self.data["results"].append(entry)
        self.write()
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        if writer is not None:
            # on a line of its own, after the progress character the reporter has just written
            writer.write(f"\n{word} {report.nodeid}{': ' + detail if detail else ''}\n")

    def pytest_sessionfinish(self, session, exitstatus):
        results = self.data["results"]
        for outcome, word in RESULT_WORDS.items():
            self.data[outcome] = sum(r["result"] == word for r in results)
        self.data["exitstatus"] = int(exitstatus)
        self.write()


def pytest_configure(config):
    path = config.getoption("json_report")
    if path and not hasattr(config, "workerinput"):  # under pytest-xdist the controller sees every report
        config.pluginmanager.register(JsonReport(config, path), "ds_q8_json_report")
