"""The memory ladder at ZeRO-2 on one rank: ds_q8.memory's prediction of every part of the model
states, checked against live DeepSpeed engines, and the order of the rungs; bf16 masters without
copies (rung (e), ``integration.shared_masters``): every storage a live engine holds counted, and the
same bits as DeepSpeed's copying layout (rung (d)) at ZeRO-1 and 2, one and two ranks."""
import math

import pytest

from ds_q8.memory import LADDER, gpt2_param_groups, ladder_table, predict_model_states

from helpers.ds_launch import config, launch

pytestmark = pytest.mark.multirank

BF16 = {"enabled": True}
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
# the prediction takes bits per group, and these engines get one group (model.parameters()): the tiny model's
# embedding, which would keep 32-bit state by default, is asked for the group's bits
EMB8 = {"embeddings_32bit": False}
RUNGS = {  # rung -> DeepSpeed config of the tiny model
    "a": config(2, "Adam", opt_params={"adam_w_mode": False}, bf16=BF16),
    "b": config(2, "Adam", opt_params={"adam_w_mode": False}, bf16=dict(MASTERS, bf16_optimizer_states=True)),
    "c": config(2, bf16=BF16, opt_params=EMB8),
    "d": config(2, bf16=MASTERS, opt_params=EMB8),  # run with DeepSpeed's copies (share_masters: False)
    "e": config(2, bf16=MASTERS, opt_params=EMB8),  # the same config as users write it
    "f": config(2, bf16=MASTERS, opt_params=dict(EMB8, correction_byte=True)),  # and a correction byte per master
    "g": config(2, bf16=MASTERS, opt_params=dict(EMB8, optim_bits=4)),  # and 4-bit moments
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    jobs = [{"name": rung, "steps": 3, "model_states": True, "config": c, "share_masters": rung != "d"}
            for rung, c in RUNGS.items()]
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
    assert per == {"a": 20.0, "b": 12.0, "c": 14.064, "d": 10.064, "e": 6.064, "f": 7.064, "g": 5.096}
    assert set(rows) == set(LADDER)


def test_unknown_rung_is_named():
    with pytest.raises(ValueError, match="rung must be one of"):
        predict_model_states([[10]], "z")


def test_shared_masters_step_the_same_bits(engines):
    d, e = engines["d"], engines["e"]
    assert e["model_states"]["masters"] == 0 and e["model_states"]["master_grads"] == 0  # nothing copied
    assert d["model_states"]["masters"] > 0 and d["model_states"]["master_grads"] > 0  # (d) really copied
    assert e["losses"] == d["losses"] and e["params_bits"] == d["params_bits"]
    assert e["stepped_dtypes"] == d["stepped_dtypes"] == ["bfloat16"]


GPT2_512 = config(2, bf16=MASTERS, gradient_accumulation_steps=1,
                  opt_params={"block_size": 64, "min_8bit_size": 4096})


@pytest.fixture(scope="module")
def gpt2_engines(tmp_path_factory):
    jobs = [{"name": name, "steps": 3, "reachable": True, "gpt2": [4, 512], "config": GPT2_512,
             "share_masters": name == "e"} for name in ("e", "d")]
    jobs.append({"name": "f", "steps": 3, "reachable": True, "gpt2": [4, 512],
                 "config": config(2, bf16=MASTERS, gradient_accumulation_steps=1,
                                  opt_params={"block_size": 64, "min_8bit_size": 4096, "correction_byte": True})})
    return launch(jobs, tmp_path_factory.mktemp("gpt2_512"), "gpt2_512", ranks=1, timeout=600)


def test_gpt2_model_states_peak_at_six_bytes_per_parameter(gpt2_engines):
    """GPT-2 (n_embd 512, 4 layers, Conv1D), ZeRO-2, one rank, bf16 masters: every storage reachable
    from the engine, counted once, right after backward and while the optimizer steps. The floor is
    the bf16 parameters (2), one gradient partition (2) and the 8-bit state (2 + 2/64 + fp32 state of
    the small tensors): about 6.04; DeepSpeed's copies add a master partition (2)."""
    e, d = gpt2_engines["e"], gpt2_engines["d"]
    n = sum(e["param_sizes"])
    for when in ("after_backward", "during_step"):
        assert e["reachable"][when] / n <= 6.1, (when, e["reachable"][when] / n)
        assert d["reachable"][when] / n >= 8.0, (when, d["reachable"][when] / n)  # the count sees a copy
    assert e["losses"] == d["losses"] and e["params_bits"] == d["params_bits"]


def test_gpt2_model_states_with_a_correction_byte_peak_at_seven(gpt2_engines):
    """Rung (f): the same engine with ``correction_byte=True`` holds one byte more per parameter (the
    masters' correction, kept as optimizer state), and trains differently from stochastic rounding."""
    e, f = gpt2_engines["e"], gpt2_engines["f"]
    n = sum(f["param_sizes"])
    for when in ("after_backward", "during_step"):
        assert 6.9 <= f["reachable"][when] / n <= 7.1, (when, f["reachable"][when] / n)
        assert abs((f["reachable"][when] - e["reachable"][when]) / n - 1.0) < 0.01
    assert f["state_dtypes"]["correction"] == ["int8"]
    assert f["params_bits"] != e["params_bits"] and all(math.isfinite(x) for x in f["losses"])


@pytest.mark.parametrize("stage", [1, 2])
def test_shared_masters_same_bits_at_two_ranks(tmp_path, stage):
    """Two ranks, two accumulated micro-batches per step, clipping on: the partitions cut parameters, the
    last rank holds padding (30,941 parameters), and the step's gradient sits in the first micro-batch's
    buffer."""
    c = config(stage, bf16=MASTERS)
    jobs = [{"name": name, "steps": 3, "model_states": True, "config": c, "share_masters": name == "e",
             "hidden": 127} for name in ("e", "d")]
    r = launch(jobs, tmp_path, f"shared_{stage}", ranks=2)
    assert r["e"]["model_states"]["masters"] == 0 and r["e"]["model_states"]["master_grads"] == 0
    assert r["d"]["model_states"]["masters"] > 0
    assert r["e"]["losses"] == r["d"]["losses"] and r["e"]["params_bits"] == r["d"]["params_bits"]
