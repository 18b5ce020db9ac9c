import atexit
import importlib.util
import os
import shutil
import sys
import tempfile


REPO = os.path.dirname(os.path.abspath(__file__))
# the suite's helpers (tests/helpers) for every test folder: tests/, studies/tests/, gpu_check/tests/
sys.path.insert(0, os.path.join(REPO, "tests"))


def _find_cuda_home():
    """ds_q8's toolkit finder, loaded by path: importing ds_q8 would import torch's extension builder,
    which guesses (and warns about) CUDA_HOME the moment it is imported."""
    path = os.path.join(REPO, "ds_q8", "op_builder", "toolkit.py")
    spec = importlib.util.spec_from_file_location("_ds_q8_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_cuda_home()


if _find_cuda_home():
    os.environ.setdefault("CUDA_HOME", _find_cuda_home())  # inherited by every job the tests start

#: what a bare interpreter from PATH says under the tests (tests/test_interpreters.py checks it)
BARE_INTERPRETER_MESSAGE = "a bare interpreter was called from PATH; use sys.executable"
BARE_INTERPRETER_EXIT = 97


def _guard_interpreters() -> str:
    """Every job the tests start must run the interpreter of this environment (``sys.executable``), not
    whichever ``python`` a machine has on PATH: on a machine whose packages live in a virtual environment
    that one has no torch, and a test that works only where it has torch hides the bug. So the first
    ``python``, ``python3``, ``pip`` and ``pip3`` on PATH are stubs that fail with one clear line. Next on
    PATH comes this environment's own bin/ (its ninja, mpiexec, deepspeed), as activating it would put
    it, and PYTHON tells the launch scripts (launch/python.sh) which interpreter to run."""
    stubs = tempfile.mkdtemp(prefix="ds_q8_bare_python_")
    atexit.register(shutil.rmtree, stubs, True)
    for name in ("python", "python3", "pip", "pip3"):
        path = os.path.join(stubs, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\necho \"{BARE_INTERPRETER_MESSAGE} (it was: {name} $*)\" >&2\n"
                    f"exit {BARE_INTERPRETER_EXIT}\n")
        os.chmod(path, 0o755)
    env_bin = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([stubs, env_bin, os.environ.get("PATH", "")])
    os.environ["PYTHON"] = sys.executable
    return stubs


BARE_INTERPRETER_STUBS = _guard_interpreters()

import pytest  # noqa: E402
import torch  # noqa: E402

from ds_q8.integration.noise import quiet  # noqa: E402
from helpers.plugin import (  # noqa: E402,F401 (hooks and a fixture, found here by pytest)
    kernel_device, pytest_addoption, pytest_collection_modifyitems, pytest_configure)

quiet()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core (make test): each worker's torch keeps to one thread, as
    # extra intra-op threads would only contend with the other worker's
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: extra intra-op threads only contend with each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("deepspeed_allreduce_buffer_", "mpich_shm_")


def _deepspeed_shm_buffers():
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)}
    except OSError:
        return set()


def pytest_sessionstart(session):
    """Note the /dev/shm buffers that exist before the run (see :func:`pytest_sessionfinish`)."""
    session.config._ds_q8_shm_before = _deepspeed_shm_buffers()


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU all-reduce leaves a 66 MiB /dev/shm buffer per rank per port when a process
    exits or is killed (and MPICH a 2 MiB one per mpirun job); the multi-rank tests launch dozens of
    jobs. Remove the ones this run created (only those: other jobs may own the rest). Under pytest-xdist
    only the controller does it, once every worker has finished: a worker that finished first would
    otherwise remove the buffers of a job another worker is still running."""
    if hasattr(session.config, "workerinput"):
        return
    before = getattr(session.config, "_ds_q8_shm_before", None)
    if before is None:
        return
    for name in _deepspeed_shm_buffers() - before:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
