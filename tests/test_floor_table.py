"""The CUDA step's requantization tables (csrc/includes/q8_floortable.h) against the reference.

The step finds the two map entries around a scaled value from its sign, exponent and top mantissa bits
in one row read, and rounds between them. These tests check the tables as the kernel reads them (the
same header, compiled for the CPU into the test probe): every float in [-1 - 2 ulp, 1 + 2 ulp] of each
map against the reference's rule, and values around every entry and midpoint against
``ds_q8.functional.quantize_scaled`` itself, to nearest and with random bits.
"""
import pytest
import torch

from ds_q8 import functional as F

from helpers.probe import load_probe, table_maps

MAPS = {
    "dynamic signed": lambda: F.create_dynamic_map(signed=True),
    "dynamic unsigned": lambda: F.create_dynamic_map(signed=False),
    "linear signed": lambda: F.create_linear_map(signed=True),
    "linear unsigned": lambda: F.create_linear_map(signed=False),
    "minifloat signed": lambda: F.create_minifloat_map(signed=True),
    "minifloat unsigned": lambda: F.create_minifloat_map(signed=False),
}
#: one rounding above 1 and one more (the largest scaled value of a finite block, and a step beyond)
LIMIT = 1.0 + 2 * 2.0 ** -23


@pytest.fixture(scope="module")
def probe():
    return load_probe()


@pytest.mark.parametrize("name", sorted(MAPS))
def test_the_maps_of_the_optimizers_get_tables(probe, name):
    assert probe.floor_table(MAPS[name]())


@pytest.mark.parametrize("quantization", ["dynamic", "dynamic6", "minifloat"])
@pytest.mark.parametrize("signed", [True, False])
def test_every_map_of_a_quantization_gets_every_fast_path(probe, quantization, signed):
    """The AVX2 floor rows, the CUDA step's floor tables and the AVX-512 segment search all take the
    maps of these quantizations, so no state of theirs is coded by the exact search. The signed
    minifloat map has one zero (a sign-magnitude format's -0 gives way to an entry above 1.0, which no
    scaled value reaches) for this: with two equal zeros it would get none of the three."""
    code = F.state_map(quantization, signed, "cpu")
    assert probe.floor_map(code) and probe.floor_table(code) and probe.fast_search(code)
    twin_zeros = torch.cat([code[:128], torch.zeros(1), code[128:255]])
    assert not probe.floor_map(twin_zeros) and not probe.floor_table(twin_zeros)


def test_maps_without_the_structure_get_none(probe):
    tiny = F.create_dynamic_map(signed=True)
    tiny[128] = 1e-9  # an entry near zero: its row would hold the tiny magnitudes' clamped row
    tiny = torch.sort(tiny)[0]
    assert not probe.floor_table(tiny)
    dense = torch.linspace(0.5, 0.6, 256)  # two entries in one row
    dense[0] = 0.0
    assert not probe.floor_table(dense)


@pytest.mark.slow
@pytest.mark.parametrize("name", table_maps(MAPS))
def test_every_float_in_range_matches_the_reference_rule(probe, name):
    assert probe.floor_table_mismatches(MAPS[name](), LIMIT) == 0


def _around(code: torch.Tensor, ulps: int = 24) -> torch.Tensor:
    mid = (code[:-1] + code[1:]) * 0.5
    points = torch.cat([code, mid, torch.tensor([0.0, 1.0, -1.0])]).to(torch.float32)
    steps = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    y = (points.view(torch.int32)[:, None] + steps[None, :]).reshape(-1).view(torch.float32)
    y = torch.cat([y, -y])
    return y[torch.isfinite(y) & (y.abs() <= LIMIT)] + 0.0  # the kernel's -0.0 is +0.0


@pytest.mark.parametrize("name", sorted(MAPS))
def test_values_around_entries_and_midpoints_match_quantize_scaled(probe, name):
    code = MAPS[name]()
    y = _around(code)
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2 ** 32, (y.numel(),), generator=g, dtype=torch.int64)
    bits[::7] = 0
    bits[1::7] = 2 ** 32 - 1
    # the table's rule (its midpoints given): the minifloat maps are coded from bits instead (F.codec_of), but
    # the tables hold for them too
    mid = F.midpoints(code)
    assert torch.equal(probe.floor_round(code, y, bits, False), F.quantize_scaled(y, code, mid=mid))
    assert torch.equal(probe.floor_round(code, y, bits, True), F.quantize_scaled(y, code, bits, mid=mid))
