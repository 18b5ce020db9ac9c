"""studies/memory_plan.py, model-state memory per rank under ZeRO-2 and ZeRO-Offload: its formula and printouts."""
import sys
from pathlib import Path

import pytest

from helpers.train import run

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))
import memory_plan  # noqa: E402


def test_memory_plan_matches_the_zero2_formula():
    n, emb = 1_557_611_200, 82_049_600
    rows = {r["world_size"]: r for r in memory_plan.plan(n, emb)}
    # 2 + 2 + K/N bytes per parameter: K = 12 (32-bit Adam), K = 4 + 2 + 4/64 (8-bit, bfloat16 maxima)
    assert rows[1]["adam32_gb"] == pytest.approx(n * 16 / 1e9)
    assert rows[8]["adam32_gb"] == pytest.approx(n * (4 + 12 / 8) / 1e9)
    eight = (n - emb) * (6 + 4 / 64) + emb * 12
    assert rows[64]["adam8_gb"] == pytest.approx((n * 4 + eight / 64) / 1e9)
    assert memory_plan.model_state_bytes(n, 1, 8) / 1e9 == pytest.approx(15.67, abs=0.01)
    assert rows[1]["saved_gb"] > rows[8]["saved_gb"] > rows[64]["saved_gb"] > 0
    # bf16 masters stepped in place: no master, K = 2 + 4/64 (8-bit) and 8 (the 32-bit embeddings)
    assert rows[8]["adam8_inplace_gb"] == pytest.approx((n * 4 + ((n - emb) * (2 + 4 / 64) + emb * 8) / 8) / 1e9)
    # and a correction byte per master: one byte more per parameter, sharded
    assert rows[8]["adam8_corrected_gb"] == pytest.approx((n * 4 + ((n - emb) * (3 + 4 / 64) + emb * 9) / 8) / 1e9)
    with pytest.raises(ValueError, match="world_size"):
        memory_plan.model_state_bytes(n, 0, 8)
    with pytest.raises(ValueError, match="optim_bits"):
        memory_plan.optimizer_bytes_per_param(16)


@pytest.mark.slow
def test_memory_plan_printout_counts_gpt2_xl_on_the_meta_device():
    out = run([sys.executable, STUDIES / "memory_plan.py"], timeout=120).stdout
    assert "1,557,611,200 = 1.5576e9 params" in out
    for n in ("| 1 |", "| 8 |", "| 64 |"):
        assert n in out


def test_memory_plan_offload_prints_host_and_device_for_7b_and_13b():
    """ZeRO-Offload: 7B and 13B decoders at 1 and 8 ranks, ZeRO-2 and 3, every row; at one rank with
    gradient accumulation DeepSpeed's default holds 20 host bytes a parameter, ds_q8's bf16 masters 6.06."""
    plans = memory_plan.offload_plan(grad_accum=8)
    assert set(plans) == {"7b", "13b"}
    for model, rows in plans.items():
        assert {(r["stage"], r["world_size"]) for r in rows} == {(2, 1), (2, 8), (3, 1), (3, 8)}
        one = {r["row"]: r for r in rows if (r["stage"], r["world_size"]) == (2, 1)}
        assert one["deepspeed"]["host_per_param"] == pytest.approx(20.0, abs=0.05)
        assert one["q8_bf16"]["host_per_param"] == pytest.approx(6.06, abs=0.01)
        assert one["q8_bf16"]["device"] == one["deepspeed"]["device"] > 2 * 6.7e9
    seven = memory_plan.offload_plan(models=("7b",), world_sizes=(8,), stages=(3,), grad_accum=1)["7b"]
    q8 = next(r for r in seven if r["row"] == "q8_bf16")
    assert q8["device"] == pytest.approx(2 * 6.738e9 / 8, rel=1e-3)  # each rank's bf16 part of the parameters
    text = memory_plan.format_offload_plan(plans, 8)
    assert "7b decoder (6.738e9 params" in text and "13b decoder (13.016e9 params" in text
    assert text.count("| 2 | 8 |") == 10 and text.count("| 3 | 1 |") == 10
