import importlib.util
import os


def _find_cuda_home():
    """ds_q8's toolkit finder, loaded by path: importing ds_q8 would import torch's extension builder,
    which guesses (and warns about) CUDA_HOME the moment it is imported."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_q8", "op_builder",
                        "toolkit.py")
    spec = importlib.util.spec_from_file_location("_ds_q8_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_cuda_home()


if _find_cuda_home():
    os.environ.setdefault("CUDA_HOME", _find_cuda_home())  # inherited by every job the tests start

import pytest  # noqa: E402
import torch  # noqa: E402

from ds_q8.integration.noise import quiet  # noqa: E402

quiet()


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


@pytest.fixture(scope="session", autouse=True)
def remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves a 66 MiB /dev/shm buffer per rank per port when a process
    exits or is killed (and MPICH a 2 MiB one per mpirun job); the multi-rank tests launch dozens of
    jobs. Remove the ones this session created (only those: other jobs may own the rest)."""
    before = _deepspeed_shm_buffers()
    yield
    for name in _deepspeed_shm_buffers() - before:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
