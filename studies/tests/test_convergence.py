"""studies/convergence.py, the convergence study: a tiny run prints its table, the masters study compares
with its reference, the simulated 8-bit AdamW with no change is ds_q8's nearest-rounded format, and bad
arguments name the field."""
import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.train import run

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))
import convergence  # noqa: E402


@pytest.mark.slow
def test_a_small_study_prints_every_row(tmp_path):
    out = run([sys.executable, STUDIES / "convergence.py", "--steps", "4", "--lrs", "4e-3", "--seeds", "0", "1",
               "--optimizers", "ds_q8", "ds_q8:nearest+bs256", "sim:nozp+m32", "--workers", "1", "--out", tmp_path],
              timeout=600).stdout
    for name in ("| torch | 0.004 |", "| ds_q8 | 0.004 |", "| ds_q8:nearest+bs256 | 0.004 |", "| sim:nozp+m32 |"):
        assert name in out, out[-2000:]
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert len(result["runs"]) == 8 and all(r["final_loss"] > 0 for r in result["runs"])
    assert (tmp_path / "convergence.md").read_text().count("\n|") == 6  # head, rule, 4 rows


@pytest.mark.slow
def test_the_masters_study_compares_with_its_reference(tmp_path):
    """bf16 masters (stochastic, nearest, correction byte) against fp32 masters under autocast: every
    run has a drift from the reference run of its seed, the reference's own drift is zero."""
    out = run([sys.executable, STUDIES / "convergence.py", "--steps", "3", "--lrs", "1e-4", "--seeds", "0",
               "--reference", "ds_q8:amp", "--optimizers", "ds_q8:bf16", "ds_q8:bf16rn", "ds_q8:bf16cb",
               "--workers", "1", "--out", tmp_path], timeout=600).stdout
    assert "| optimizer | peak lr | final val loss, mean | range over seeds | mean vs ds_q8:amp |" in out, out[-2000:]
    runs = {r["optimizer"]: r for r in json.loads((tmp_path / "convergence.json").read_text())["runs"]}
    assert set(runs) == {"ds_q8:amp", "ds_q8:bf16", "ds_q8:bf16rn", "ds_q8:bf16cb"}
    assert runs["ds_q8:amp"]["drift"] == 0.0
    assert all(0.0 < r["drift"] < 0.1 and r["final_loss"] > 0 for n, r in runs.items() if n != "ds_q8:amp")


def test_sim_is_the_nearest_rounded_format():
    """SimAdamW8bit without changes quantizes like ds_q8 with state_rounding="nearest" on the dynamic map
    (the codes of one step from zero state agree)."""
    import ds_q8
    torch.manual_seed(0)
    p0, g = torch.randn(5000), torch.randn(5000)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    sim = convergence.SimAdamW8bit([a], lr=1e-3)
    real = ds_q8.AdamW8bitBlock([b], lr=1e-3, state_rounding="nearest", quantization="dynamic", impl="reference")
    a.grad, b.grad = g.clone(), g.clone()
    sim.step()
    real.step()
    assert torch.equal(sim.state[a]["v"][0], real.state[b]["state2"])
    assert torch.equal(sim.state[a]["m"][0], real.state[b]["state1"])


@pytest.mark.parametrize("argv,field", [(["--optimizers", "adam9"], "unknown optimizer"),
                                        (["--optimizers", "ds_q8:m32"], "unknown change"),
                                        (["--optimizers", "sim:bs100"], "block size"),
                                        (["--optimizers", "torch:jitterx"], "unknown change"),
                                        (["--optimizers", "bnb:jitter"], "unknown change"),
                                        (["--steps", "0"], "--steps"), (["--lrs", "-1"], "--lrs"),
                                        (["--workers", "0"], "--workers"), (["--batch", "0"], "--batch"),
                                        (["--reference", "ds_q8:bf8"], "unknown change")])
def test_bad_arguments_name_the_field(argv, field, capsys):
    with pytest.raises(SystemExit):
        convergence.main(argv)
    assert field in capsys.readouterr().err


def test_rank_sum_p_matches_the_normal_approximation_by_hand():
    """[1, 2, 3] against [4, 5, 6]: U = 0 against a mean of 4.5 and a variance of 3 * 3 * 7 / 12 = 5.25, so
    z = (4.5 - 0.5) / sqrt(5.25) and p = erfc(z / sqrt 2) = 0.0809; symmetric in its arguments; one set
    against itself is no evidence (p = 1); ties take their mean rank."""
    assert convergence.rank_sum_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.080856, abs=1e-6)
    assert convergence.rank_sum_p([4, 5, 6], [1, 2, 3]) == pytest.approx(0.080856, abs=1e-6)
    assert convergence.rank_sum_p([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    tied = convergence.rank_sum_p([1, 1, 2, 5], [1, 2, 2, 6])
    assert 0.3 < tied < 1.0
    assert convergence.rank_sum_p([], [1.0]) != convergence.rank_sum_p([], [1.0])  # nan


def test_jitter_moves_each_weight_by_a_part_in_a_million_and_its_draws_differ():
    """``torch:jitter``, ``ds_q8:jitterK`` and ``sim:...+jitterK`` are accepted; the noise is relative,
    about 1e-6 of each weight, the same for one draw and different for another, and zero weights stay zero."""
    for name in ("torch:jitter", "ds_q8:jitter3", "ds_q8:fp32+jitter12", "sim:m32+srv+jitter2"):
        convergence.check_optimizer_name(name)
    assert convergence.jitter_draw(("fp32", "jitter12")) == 12 and convergence.jitter_draw(("fp32",)) is None

    def moved(draw):
        torch.manual_seed(0)
        model = torch.nn.Linear(300, 200)
        torch.nn.init.zeros_(model.bias)
        before = model.weight.detach().clone()
        convergence.jitter(model, draw)
        assert torch.equal(model.bias, torch.zeros(200))
        return model.weight.detach() / before - 1

    a, b, c = moved(0), moved(0), moved(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0.5e-6 < float(a.std()) < 2e-6 and float(a.abs().max()) < 1e-5
