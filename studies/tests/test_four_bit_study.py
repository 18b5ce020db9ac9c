"""The 4-bit state study (studies/lowbit_sim.py): its maps, its rounding, and the two properties the study
rests on, each checked so that it can fail.

* Fidelity. GPT-2 at width 128 (2 layers, 8 steps of batch 8, lr 6e-4), every weight matrix's update
  against torch's AdamW. Measured: the candidate (blocks of 64; the first moment stored as m / sqrt(v)
  on 15 evenly spaced levels with 0, bfloat16 maxima; the second moment on 16 levels geometric in
  sqrt(v) from 0.05 to 1, float32 maxima) 0.9957 at its worst matrix; the 4-bit paper's format (dynamic map
  in blocks of 128, linear second moment without zero under rank-1 normalisation) 0.9546; torchao's
  maps in blocks of 128, 0.943. The bounds: at least 0.99 for the candidate, below 0.98 for the paper's.
* Tracking a fall. With beta2 = 0.999 a second moment moves by 0.1% of itself a step, far less than the
  gap between two 4-bit levels (about 40% of the value here, 20% of its square root), so rounded to
  nearest an element's code never goes down. Its block's maximum can still carry a fall that the whole block shares, but only if
  the maximum itself can move by 0.1%: a bfloat16 maximum rounded up cannot (its step is 0.4-0.8%).
  Measured after gradients fall 100x at step 100 (64 x 128 elements), the stored second moment over
  the true one: with bfloat16 maxima 1.77 at step 300, 3.56 at 1000, 25.9 at 3000; with float32
  maxima 1.30 at each of them (the rounding error of step 100, carried down with the fall).
"""
import sys
from pathlib import Path

import pytest
import torch

from ds_q8 import format4
from ds_q8 import functional as F

from helpers.four_bit import moments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import fidelity  # noqa: E402  (it puts launch/ on sys.path)
import gpt_data  # noqa: E402
import lowbit_sim  # noqa: E402

CANDIDATE = "q4:m=lin0,vb64,n:v=log5h,b64f,n"
PAPER = "q4"


def test_the_dynamic_map_at_four_bits():
    for signed in (True, False):
        m = F.create_dynamic_map(signed, bits=4)
        assert m.numel() == 16 and bool((m[1:] > m[:-1]).all())
        assert float(m[-1]) == 1.0 and bool((m == 0).any())
        assert torch.equal(F.create_dynamic_map(signed, bits=8), F.create_dynamic_map(signed))
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 5"):
        F.create_dynamic_map(True, bits=5)


@pytest.mark.parametrize("name,signed", [(n, True) for n in ("dyn", "dyns", "nf4", "lins", "lin0")]
                         + [(n, False) for n in ("dyn", "lin", "sq", "p4", "log1", "log2", "log5", "log10")])
def test_every_map_has_sorted_levels_up_to_one_that_fit_in_four_bits(name, signed):
    m = lowbit_sim._map(name, signed)
    assert m.numel() == (15 if name == "lin0" else 16) and bool((m[1:] > m[:-1]).all()) and float(m[-1]) == 1.0
    assert float(m[0]) >= (-1.0 if signed else 0.0)
    if not signed and name != "dyn":
        assert float(m[0]) > 0  # zero-free: a second moment never decodes to 0


@pytest.mark.parametrize("bad,piece", [("q5", "q4"), ("q4:m=lin,b32,n", "'lin'"), ("q4:v=log5,b64,x", "v=log5,b64,x"),
                                       ("q4:w=lins,b32,n", "w=lins,b32,n"), ("q4:v=log5,k64,n", "v=log5,k64,n")])
def test_a_bad_variant_names_what_is_wrong(bad, piece):
    with pytest.raises(ValueError, match=piece.replace("(", r"\(")):
        lowbit_sim.parse(bad)


@pytest.mark.parametrize("norm", ["b32", "b64f", "r1", "r1f"])
def test_nearest_rounding_stays_within_half_a_step(norm):
    x = torch.randn(96, 160) * torch.logspace(-3, 0, 160)
    code = lowbit_sim._map("lins", True)
    scale = lowbit_sim._scales(x, norm)
    assert bool((scale >= x.abs()).all())
    err = (lowbit_sim.roundtrip(x, code, norm, "n", torch.Generator()) - x).abs()
    assert bool((err <= (code[1] - code[0]) / 2 * scale * (1 + 1e-6)).all())


@pytest.mark.parametrize("m_map,moves", [("lin0", False), ("lins", True)])
def test_an_element_without_gradients_never_moves(m_map, moves):
    """Stored as m / sqrt(v), a first moment of 0 must decode to 0: with a map without 0 (``lins``) an
    element that never had a gradient, in a block with others that have, takes the map's smallest
    level and steps by about the learning rate every step (the 32-bit step is 0)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = lowbit_sim.SimAdamW4([p], lr=1e-3, weight_decay=0.0,
                               spec=lowbit_sim.parse(CANDIDATE.replace("lin0", m_map)))
    for _ in range(3):
        g = torch.randn(64, 128)
        g[:, :40] = 0  # 40 silent elements at the start of every block of 64 (rows of 128)
        p.grad = g
        opt.step()
    assert bool((p.detach()[:, :40] != 0).any()) == moves
    assert bool((opt.state[p]["m"][:, :40] != 0).any()) == moves


def _after_a_fall(name: str):
    return [r["median"] for r in lowbit_sim.after_a_fall(name, at=(300, 1000))]


def test_a_second_moment_follows_a_fall_only_through_float32_maxima():
    early, late = _after_a_fall(CANDIDATE.replace("b64f", "b64"))
    assert late > 1.5 * early  # bfloat16 maxima: the stored moment stays where it was
    early, late = _after_a_fall(CANDIDATE)
    assert abs(late / early - 1) < 0.02 and 0.7 < late < 1.5  # float32 maxima: it falls with the truth


@pytest.mark.slow
def test_every_gpt2_matrix_updates_close_to_adamw_with_four_bit_states():
    text, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    rows = {r["optimizer"]: r for r in fidelity.run("gpt2", 128, 2, [CANDIDATE, PAPER], 8, 6e-4, 0.01, 8, 64,
                                                    text=text)}
    assert rows[CANDIDATE]["min_cosine"] >= 0.99, rows[CANDIDATE]["per_matrix"]
    assert rows[PAPER]["min_cosine"] < 0.98  # the paper's format, under the same check


@pytest.mark.parametrize("n", [64 * 40, 64 * 40 + 37])
def test_the_shipped_format_decodes_to_what_the_study_trained_with(n):
    """ds_q8/format4.py, the 4-bit Adam state's specification, decodes to exactly what the study's
    simulation trained with (its chosen variant)."""
    m, v = moments(n)
    m_hat, v_hat = format4.decode(format4.encode(m, v))
    spec = lowbit_sim.parse(CANDIDATE)
    sim = lowbit_sim.SimAdamW4([torch.zeros(1)], spec=spec)
    g = torch.Generator()
    sim_v = lowbit_sim.roundtrip(v, sim.codes["v"], "b64f", "n", g, sim.mids["v"])
    root = format4.sqrt_rn(sim_v)  # the spec takes correctly rounded square roots
    r = torch.where(root > 0, m / root, torch.zeros_like(root))
    sim_m = lowbit_sim.roundtrip(r, sim.codes["m"], "b64", "n", g, sim.mids["m"]) * root
    assert torch.equal(v_hat, sim_v)
    assert torch.equal(m_hat, sim_m)
