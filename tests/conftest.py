import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: extra intra-op threads only contend with each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
