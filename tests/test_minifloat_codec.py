"""The minifloat codec of the default maps (``ds_q8.functional``, "The minifloat codec") in the kernels: the
scalar form that the scalar driver and the CUDA step share (csrc/includes/q8_minifloat.h) against the
reference, and the AVX-512 and AVX2 encoders against the scalar form over every float a block's scaled values
can be, each rounding, signed and unsigned. The step tests (tests/test_kernels.py, tests/test_cuda_sim.py)
compare whole steps; these cover every float, where a step only meets some."""
import pytest
import torch

from ds_q8 import functional as F

from helpers.isa import ISAS
from helpers.probe import load_probe, sweep_stride

#: the modes of rounding as the kernels take them (group_options.ROUND_*): nearest, stochastic, guided
MODES = {"nearest": 0, "stochastic": 1, "guided": 3}
#: the largest value of the format (1.9375) and two floats beyond: a block's values times 1.9375 / A reach
#: it within a rounding (A is the maximum rounded up)
LIMIT = float(torch.tensor(1.9375).view(torch.int32).add(2).view(torch.float32))


@pytest.fixture(scope="module")
def probe():
    return load_probe()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("signed", [True, False])
def test_the_scalar_codec_is_the_reference(probe, signed, mode):
    """Every 241st float in [-LIMIT, LIMIT] (all exponents, mantissas of every residue class), every float
    next to each code's value and midpoint, zeros, the subnormals' end, NaN and infinities."""
    codec = F.minifloat_codec(signed)
    top = int(torch.tensor(LIMIT).view(torch.int32))
    sweep = torch.arange(0, top + 1, 241, dtype=torch.int64)
    units = F.minifloat_units(*F.MINIFLOAT_BITS[signed]) / 2.0 ** codec.bias
    points = torch.cat([units, (units[1:] + units[:-1]) / 2]).to(torch.float32).view(torch.int32).to(torch.int64)
    near = (points[:, None] + torch.arange(-3, 4)[None, :]).reshape(-1).clamp(0, top)
    special = torch.tensor([0, 0x7F800000, 0x7FC00000, int(torch.tensor(2.0 ** (1 - codec.bias)).view(torch.int32))])
    u = torch.cat([sweep, near, special])
    z = torch.cat([u, u | (1 << 31)]).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 2 ** 32, (z.numel(),), generator=g, dtype=torch.int64)
    ref_codes = F.minifloat_codes(z, codec).long()
    old = torch.where(torch.rand(z.numel(), generator=g) < 0.5, ref_codes + torch.randint(-1, 2, (z.numel(),), generator=g),
                      torch.randint(0, 256, (z.numel(),), generator=g)).clamp(0, 255)
    m = MODES[mode]
    want = F.minifloat_codes(z, codec, None if m == 0 else bits, old if m == 3 else None).long()
    got = probe.minifloat_codes_scalar(z, signed, m, bits, old)
    assert int((got != want).sum()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("signed", [True, False])
def test_every_float_codes_as_the_scalar_codec(probe, signed, mode, isa):
    """About 2.1e9 floats a case, each with its own old code and random bits. A CPU without AVX-512 runs the
    AVX-512 cases emulated (tests/test_avx512_emulated.py), on every seventh run of 64 floats."""
    if isa not in ISAS:
        pytest.skip(f"this CPU has no {isa}" + (" (tests/test_avx512_emulated.py runs these cases emulated)"
                                               if isa == "avx512" else ""))
    assert probe.minifloat_mismatches(isa, signed, MODES[mode], LIMIT, sweep_stride(isa)) == 0
