"""The scalar segment search (q8_quantize_fast in csrc/cpu/q8_fastmap.h) against the lookup table.

The same C++ function runs in the baseline CPU driver (isa_scalar.cpp) and in the CUDA kernels, so
these CPU tests cover the GPU's nearest-code search too. The scalar driver quantizes with it; the
AVX2 driver quantizes with the lookup table alone: every float in [-1, 1] must get the same code
from both, and values around every midpoint and at every scale the reference's code.
"""
import pytest
import torch

from ds_q8 import functional as F
from ds_q8.op_builder import Q8CPUBuilder

from helpers.probe import MAPS, load_probe, table_maps, values_around_midpoints


@pytest.fixture(scope="module")
def cpu_op():
    return Q8CPUBuilder().load()


def _needs_search(cpu_op, code):
    assert load_probe().fast_search(code), "the map should get segment tables"


def _with_unit_absmax(values: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks of `block` floats: 1.0, then block - 1 of `values` (padded with 0), so that every
    block's absmax is 1 and the scaled values are the values themselves (|values| <= 1)."""
    per = block - 1
    nblocks = -(-values.numel() // per)
    x = torch.zeros(nblocks, block)
    x[:, 0] = 1.0
    flat = torch.zeros(nblocks * per)
    flat[: values.numel()] = values
    x[:, 1:] = flat.view(nblocks, per)
    return x.reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("name", table_maps(MAPS))
def test_every_float_in_unit_range_matches_the_table(cpu_op, name):
    if "avx2" not in cpu_op.supported_isas():
        pytest.skip("the table-only driver (AVX2) is the comparison and this CPU lacks AVX2")
    code = MAPS[name]()
    _needs_search(cpu_op, code)
    lookup = cpu_op.build_lookup(code)
    block, per = 4096, 4095
    top = 0x3F800000  # the bits of 1.0: every non-negative float up to it
    rows = 4096
    chunk = per * rows
    words = torch.empty(rows, block, dtype=torch.int32)  # what _with_unit_absmax builds, written in place
    for sign in (0, -(1 << 31)):
        for first in range(0, top + 1, chunk):
            count = min(chunk, top + 1 - first)
            flat = torch.arange(first + sign, first + sign + count, dtype=torch.int32)
            full, rest = divmod(count, per)
            words[:, 0] = top  # 1.0 first in every block, then the floats, zeros after the last
            body = words[:, 1:]
            if count < chunk:
                body.zero_()
            body[:full].copy_(flat[:full * per].view(full, per))
            if rest:
                body[full, :rest].copy_(flat[full * per:])
            x = words.view(torch.float32).reshape(-1)
            fast, absmax = cpu_op.quantize("scalar", x, code, lookup, block)
            table, _ = cpu_op.quantize("avx2", x, code, lookup, block)
            assert torch.equal(absmax, torch.ones_like(absmax))
            if not torch.equal(fast, table):
                bad = (fast != table).nonzero()[0].item()
                pytest.fail(f"{name}: x={x[bad].item()!r} (bits {x[bad:bad + 1].view(torch.int32).item():#x}) "
                            f"gets code {fast[bad].item()} from the search, {table[bad].item()} from the table")


@pytest.mark.parametrize("name", sorted(MAPS))
def test_values_around_every_midpoint_match_the_reference(cpu_op, name):
    code = MAPS[name]()
    _needs_search(cpu_op, code)
    x = _with_unit_absmax(values_around_midpoints(code), 2048)
    want, _ = F.quantize_blockwise(x, code, 2048)
    got, _ = cpu_op.quantize("scalar", x, code, cpu_op.build_lookup(code), 2048)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_any_scale_and_non_finite_blocks_match_the_reference(cpu_op, name):
    # scaled values one rounding above 1, blocks with Inf or NaN (beyond the proved range: the table
    # answers), zeros and negative zeros
    code = MAPS[name]()
    _needs_search(cpu_op, code)
    g = torch.Generator().manual_seed(7)
    block = 256
    x = torch.randn(1 << 18, generator=g) * torch.logspace(-30, 30, (1 << 18) // block).repeat_interleave(block)
    x[:block] = torch.tensor([0.0, -0.0] * (block // 2))
    x[block] = float("inf")
    x[2 * block + 3] = float("-inf")
    x[3 * block + 5] = float("nan")
    x[4 * block: 5 * block] = -x[4 * block: 5 * block].abs()
    want, want_absmax = F.quantize_blockwise(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), code, block)
    got, got_absmax = cpu_op.quantize("scalar", x, code, cpu_op.build_lookup(code), block)
    finite = torch.isfinite(x).view(-1, block).all(dim=1).repeat_interleave(block)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got_absmax[finite[::block]], want_absmax[finite[::block]])
    if "avx2" in cpu_op.supported_isas():  # the blocks holding Inf or NaN: the table-only driver's codes
        table, table_absmax = cpu_op.quantize("avx2", x, code, cpu_op.build_lookup(code), block)
        assert torch.equal(got, table) and torch.equal(got_absmax.isnan(), table_absmax.isnan())
