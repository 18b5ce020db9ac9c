"""The memory ladder at ZeRO-2 on one rank: ds_q8.memory's prediction of every part of the model
states, checked against live DeepSpeed engines, and the order of the rungs."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "ds_scripts"))
from ds_launch import config, launch  # noqa: E402

from ds_q8.memory import LADDER, gpt2_param_groups, ladder_table, predict_model_states  # noqa: E402

pytestmark = pytest.mark.multirank

BF16 = {"enabled": True}
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
RUNGS = {  # rung -> DeepSpeed config of the tiny model
    "a": config(2, "Adam", opt_params={"adam_w_mode": False}, bf16=BF16),
    "b": config(2, "Adam", opt_params={"adam_w_mode": False}, bf16=dict(MASTERS, bf16_optimizer_states=True)),
    "c": config(2, bf16=BF16),
    "d": config(2, bf16=MASTERS),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    jobs = [{"name": rung, "steps": 2, "model_states": True, "config": c} for rung, c in RUNGS.items()]
    return launch(jobs, tmp_path_factory.mktemp("ladder"), "ladder", ranks=1)


@pytest.mark.parametrize("rung", list(RUNGS))
def test_prediction_matches_the_live_engine(engines, rung):
    r = engines[rung]
    predicted = predict_model_states([r["param_sizes"]], rung, block_size=256, min_8bit_size=1024)
    assert r["model_states"] == predicted
    assert r["losses"][-1] < r["losses"][0]


def test_rungs_in_order_for_gpt2_xl():
    rows = {r["rung"]: r for r in ladder_table(gpt2_param_groups(48, 1600))}
    per = {k: round(v["per_param"], 3) for k, v in rows.items()}
    assert per == {"a": 20.0, "b": 12.0, "c": 14.064, "d": 10.064}
    assert set(rows) == set(LADDER)


def test_unknown_rung_is_named():
    with pytest.raises(ValueError, match="rung must be one of"):
        predict_model_states([[10]], "e")
