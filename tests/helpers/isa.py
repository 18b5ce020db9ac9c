"""The CPU op's instruction sets, and the ``isa`` fixture that runs a test under each (parametrize it
with ``indirect=True``). Importing this module builds the CPU op."""
import pytest

from ds_q8 import ops
from ds_q8.op_builder import Q8CPUBuilder


def isas():
    # evaluated at collection: build the op here too, so a build error fails loudly
    return list(Q8CPUBuilder().load().supported_isas())


ISAS = isas()


@pytest.fixture
def isa(request):
    with ops.use_cpu_isa(request.param):
        yield request.param
