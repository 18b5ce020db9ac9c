"""ds_q8/format4.py, the 4-bit Adam state's specification: it packs two codes a byte from any edge, keeps a
silent element's first moment at 0, and costs 1.094 bytes per parameter (that it decodes to exactly what
the study's simulation trained with is checked beside the study, studies/tests/test_four_bit_study.py)."""
import pytest
import torch

from ds_q8 import format4
from ds_q8 import functional as F

from helpers.four_bit import moments


def test_the_maps():
    assert F.create_dynamic_map(True, bits=4).numel() == 16  # the peers' map, for comparison
    v = format4.V_MAP
    assert v.numel() == 16 and bool((v[1:] > v[:-1]).all()) and float(v[-1]) == 1.0
    assert float(v[0]) == pytest.approx(format4.V_LOW ** 2) and float(v[0]) > 0
    assert bool(((format4.V_MIDPOINTS > v[:-1]) & (format4.V_MIDPOINTS < v[1:])).all())
    m = format4.M_MAP
    assert m.numel() == 15 and float(m[7]) == 0.0 and float(m[0]) == -1.0 and float(m[-1]) == 1.0


def test_a_silent_element_keeps_a_first_moment_of_zero():
    m, v = moments(64 * 8)
    m_hat, v_hat = format4.decode(format4.encode(m, v))
    assert bool((m_hat[5:40] == 0).all()) and bool((v_hat[5:40] > 0).all())  # v: no 0 in its map
    assert bool((m_hat[128:192] == 0).all()) and bool((v_hat[128:192] == 0).all())
    state = format4.encode(m, v)
    assert int(format4.unpack(state.m_codes, state.numel).max()) <= 14  # code 15 is never written


def test_the_error_is_a_fraction_of_each_element():
    m, v = moments(64 * 64, seed=1)
    m_hat, v_hat = format4.decode(format4.encode(m, v))
    live = v > 0
    step = float(format4.V_MAP[1] / format4.V_MAP[0])  # neighbouring levels' ratio
    ratio = v_hat[live] / v[live]
    big = v[live] >= float(format4.V_MAP[0]) * v.max()  # above the map's smallest level of any block
    assert bool((ratio[big] < step).all()) and bool((ratio[big] > 1 / step).all())


def test_packing_two_codes_a_byte_from_any_edge():
    codes = torch.randint(0, 16, (101,), dtype=torch.uint8)
    packed = format4.pack(codes)
    assert packed.numel() == 51 and int(packed[0]) == int(codes[0]) | int(codes[1]) << 4
    assert int(packed[-1]) >> 4 == 0
    for edge in (0, 1, 37, 64):
        assert torch.equal(format4.unpack(format4.pack(codes[edge:]), 101 - edge), codes[edge:])


def test_a_slice_that_starts_a_block_holds_the_whole_parameters_codes():
    m, v = moments(64 * 20 + 11)
    whole = format4.encode(m, v)
    part = format4.encode(m[64 * 7:], v[64 * 7:])
    assert torch.equal(format4.unpack(part.v_codes, part.numel),
                       format4.unpack(whole.v_codes, whole.numel)[64 * 7:])
    assert torch.equal(format4.unpack(part.m_codes, part.numel),
                       format4.unpack(whole.m_codes, whole.numel)[64 * 7:])
    assert torch.equal(part.v_max, whole.v_max[7:]) and torch.equal(part.m_absmax, whole.m_absmax[7:])


def test_bytes_per_parameter():
    assert format4.state_bytes_per_param(4096 * 4096) == pytest.approx(1.09375)
    state = format4.encode(*moments(64 * 16))
    total = sum(t.numel() * t.element_size() for t in state[:4])
    assert total == format4.state_bytes_per_param(64 * 16) * 64 * 16


def test_moments_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="m and v must have as many elements, got 64 and 63"):
        format4.encode(torch.zeros(64), torch.zeros(63))
