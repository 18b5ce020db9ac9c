"""The AVX-512 step's gather-free nearest-code search (csrc/cpu/q8_fastmap.h) against the exact answer.

The search is proved exact for a map when its tables are built; these tests check the proof's
result independently: every float in [-1, 1] (and a little beyond) against the lookup table, and
values around every midpoint against the pure-PyTorch reference.
"""
import math

import pytest
import torch

from ds_q8 import functional as F
from ds_q8 import ops
from ds_q8.op_builder import Q8CPUBuilder

from helpers.probe import MAPS, load_probe, sweep_stride, table_maps, values_around_midpoints


@pytest.fixture(scope="module")
def cpu_op():
    return Q8CPUBuilder().load()


@pytest.fixture(scope="module")
def probe():
    return load_probe()


def has_avx512(module):
    return module.supported_isas()[0] == "avx512"


@pytest.mark.parametrize("name", sorted(MAPS))
def test_structured_maps_get_the_fast_search(probe, name):
    assert probe.fast_search(MAPS[name]())


def test_maps_without_the_structure_use_the_table(probe):
    # the signed linear map has no zero entry, so it cannot be searched by magnitude
    assert not probe.fast_search(F.create_linear_map(signed=True))
    # a sorted map without runs of equal spacing needs more segments than the search holds
    g = torch.Generator().manual_seed(0)
    odd = torch.sort(torch.rand(256, generator=g, dtype=torch.float64))[0].to(torch.float32)
    odd[0] = 0.0
    odd[-1] = 1.0
    assert not probe.fast_search(odd)


@pytest.mark.parametrize("name", table_maps(MAPS))
def test_every_float_in_range_matches_the_table(cpu_op, probe, name):
    if not has_avx512(cpu_op):
        pytest.skip("the segment search is part of the AVX-512 driver")
    code = MAPS[name]()
    lookup = cpu_op.build_lookup(code)
    limit = 1.0 + 4 * 2.0 ** -23  # a scaled value exceeds 1 by one rounding at most
    assert probe.fast_search_mismatches(code, lookup, limit, sweep_stride("avx512")) == 0


@pytest.mark.parametrize("name", sorted(MAPS))
def test_values_around_every_midpoint_match_the_reference(name):
    code = MAPS[name]()
    probes = values_around_midpoints(code)
    block = 2048
    per_block = block - 1
    nblocks = math.ceil(probes.numel() / per_block)
    x = torch.zeros(nblocks, block)
    x[:, 0] = 1.0  # absmax 1: the scaled values are the probes themselves
    flat = torch.zeros(nblocks * per_block)
    flat[: probes.numel()] = probes
    x[:, 1:] = flat.view(nblocks, per_block)
    x = x.reshape(-1)
    want_codes, want_absmax = F.quantize_blockwise(x, code, block)
    got_codes, got_absmax = ops.quantize_blockwise(x, code, block)
    assert torch.equal(got_absmax, want_absmax)
    assert torch.equal(got_codes, want_codes)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_typical_state_values_match_the_reference(name):
    # many blocks at many scales, so that every segment and the ambiguous band are exercised
    code = MAPS[name]()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 20, generator=g)
    x = x * torch.logspace(-8, 2, (1 << 20) // 2048).repeat_interleave(2048)
    if name != "dynamic signed":
        x = x * x
    want = F.quantize_blockwise(x, code, 2048)
    got = ops.quantize_blockwise(x, code, 2048)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


def test_the_shipped_op_has_no_test_entry_points(cpu_op):
    assert not hasattr(cpu_op, "fast_search") and not hasattr(cpu_op, "fast_search_mismatches")
