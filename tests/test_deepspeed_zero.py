"""Real DeepSpeed, real ranks: ds_q8 optimizers selected by JSON type under ZeRO 0/1/2/3, bf16,
CPU offload, gradient accumulation, clipping and LR schedulers, compared with DeepSpeed running
torch's fp32 Adam on the same config. One 2-rank launcher run serves every test in this file."""

import pytest

from ds_q8.memory import estimate_state_bytes

from helpers.ds_launch import config, launch

pytestmark = pytest.mark.multirank

STEPS = 5
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
VARIANTS = {  # name -> (stage, extra config)
    "s0": (0, {}), "s1": (1, {}), "s2": (2, {}), "s3": (3, {}),
    "s2_bf16": (2, {"bf16": {"enabled": True}}), "s3_bf16": (3, {"bf16": {"enabled": True}}),
    "s2_off": (2, {"zero": OFFLOAD}), "s3_off": (3, {"zero": OFFLOAD}),
}
WARMUP = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                              "total_num_steps": STEPS, "warmup_type": "linear"}}
# bf16 master weights and gradients: DeepSpeed hands the optimizer bf16 partitions
BF16_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True}
BF16_MASTER_VARIANTS = {"s1_bf16m": (1, {}), "s2_bf16m": (2, {}), "s3_bf16m": (3, {}),
                        "s2_bf16m_off": (2, {"zero": OFFLOAD}), "s3_bf16m_off": (3, {"zero": OFFLOAD})}
# parameter sizes of tests/ds_scripts/train.py's TinyLM, in ds_q8.param_groups order
ALL_PARAMS = [[2048, 4096, 128, 16384, 128, 128, 128, 8192, 64]]
# the embedding (the first) keeps 32-bit state by default (embeddings_32bit), wherever its partition falls
EMB_BITS = [[32, 8, 8, 8, 8, 8, 8, 8, 8]]
EMB8 = {"embeddings_32bit": False}


def _jobs():
    jobs = []
    for name, (stage, extra) in VARIANTS.items():
        jobs.append({"name": f"q8_{name}", "steps": STEPS, "config": config(stage, **extra)})
        jobs.append({"name": f"ref_{name}", "steps": STEPS,
                     "config": config(stage, "Adam", opt_params={"adam_w_mode": False}, **extra)})
    jobs += [
        {"name": "adamw_s2", "steps": STEPS, "config": config(2, "AdamW8bitBlock")},
        {"name": "noclip_s0", "steps": 2, "config": config(0, gradient_clipping=0.0)},
        {"name": "momentum_s2", "steps": STEPS, "config": config(2, "Momentum8bitBlock", lr=0.1)},
        {"name": "sched_s2", "steps": STEPS, "config": config(2, scheduler=WARMUP)},
        *[{"name": f"emb8_s{stage}", "steps": 2, "config": config(stage, opt_params=EMB8)} for stage in (0, 1, 2, 3)],
        *[{"name": f"emb8_s{stage}_off", "steps": 2, "config": config(stage, opt_params=EMB8, zero=OFFLOAD)}
          for stage in (2, 3)],
        {"name": "groups_s2", "steps": STEPS, "param_groups": True, "config": config(2)},
        {"name": "groups_s3", "steps": STEPS, "param_groups": True, "config": config(3)},
        *[{"name": f"q8_{name}", "steps": STEPS, "config": config(stage, bf16=BF16_MASTER, **extra)}
          for name, (stage, extra) in BF16_MASTER_VARIANTS.items()],
        {"name": "ref_s2_bf16m", "steps": STEPS,  # DeepSpeed's own bf16 master weights and bf16 Adam states
         "config": config(2, "Adam", opt_params={"adam_w_mode": False},
                          bf16=dict(BF16_MASTER, bf16_optimizer_states=True))},
        {"name": "bad_key", "steps": 1, "expect_error": True, "config": config(2, opt_params={"beta1": 0.9})},
        {"name": "bad_value", "steps": 1, "expect_error": True, "config": config(2, opt_params={"block_size": 1000})},
        {"name": "elastic", "steps": 1, "expect_error": True, "config": config(1, zero={"elastic_checkpoint": True})},
        {"name": "nvme", "steps": 1, "expect_error": True,
         "config": config(3, zero={"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/ds_q8_nvme_unused"}})},
    ]
    return jobs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(_jobs(), tmp_path_factory.mktemp("zero"), "zero", ranks=2, timeout=600)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_json_type_builds_8bit_optimizer_and_tracks_fp32_adam(results, variant):
    q8, ref = results[f"q8_{variant}"], results[f"ref_{variant}"]
    assert q8["optimizer"] == "Adam8bitBlock"
    assert q8["state_dtypes"]["state1"] == ["uint8"] and q8["state_dtypes"]["state2"] == ["uint8"]
    assert q8["state_dtypes"]["absmax1"] == ["bfloat16"]
    # 5 steps of 2 micro-batches each: the step counter counts optimizer steps, not micro-batches
    assert q8["state_steps"] == [STEPS]
    assert q8["losses"][-1] < 0.2 * q8["losses"][0]
    for a, b in zip(q8["losses"], ref["losses"]):
        assert abs(a - b) <= 0.02 * b, (q8["losses"], ref["losses"])


@pytest.mark.parametrize("variant", [*VARIANTS, *BF16_MASTER_VARIANTS])
def test_clipping_norm_answers_the_nonfinite_check(results, variant):
    # DeepSpeed computed the global gradient norm for clipping: no second read of the gradients
    assert results[f"q8_{variant}"]["nonfinite_checks"] == {"norm": STEPS}


def test_without_clipping_the_gradients_are_read(results):
    assert results["noclip_s0"]["nonfinite_checks"] == {"pass": 2}


@pytest.mark.parametrize("variant", ["s1", "s2", "s3", "s2_off", "s3_off"])
def test_each_rank_holds_only_its_partition(results, variant):
    stage = VARIANTS[variant][0]
    q8, ref = results[f"q8_{variant}"], results[f"ref_{variant}"]
    per_rank = [b["total"] for b in q8["state_bytes"]]
    assert per_rank == [estimate_state_bytes(ALL_PARAMS, stage, 2, block_size=256, min_8bit_size=1024, rank=r,
                                             param_bits=EMB_BITS) for r in (0, 1)]
    # the two ranks together hold one copy of everything, plus a second absmax (one float per state)
    # for each block that a partition edge cuts: at most one at stages 1-2, one per parameter at stage 3
    whole = results["q8_s0"]["state_bytes"][0]["total"]
    cut = 1 if stage in (1, 2) else len(ALL_PARAMS[0])
    assert whole <= sum(per_rank) <= whole + 2 * 4 * cut
    # with every state in 8 bits, the embedding's too (embeddings_32bit=False), a rank holds under 0.3 of what
    # the fp32 reference's rank holds
    ref_bytes = ref["state_bytes"][0]["fp32"]
    assert max(b["total"] for b in results[f"emb8_{variant}"]["state_bytes"]) < 0.3 * ref_bytes


def test_stage0_keeps_small_tensors_fp32(results):
    q8 = results["q8_s0"]
    expected = estimate_state_bytes(ALL_PARAMS, 0, 2, block_size=256, min_8bit_size=1024, param_bits=EMB_BITS)
    assert [b["total"] for b in q8["state_bytes"]] == [expected, expected]
    dtypes = {numel: dt for numel, dt in q8["state_entries"]}
    assert dtypes[16384] == "uint8" and dtypes[128] == "float32" and dtypes[2048] == "float32"


@pytest.mark.parametrize("variant", ["s0", "s1", "s2", "s3", "s2_off"])
def test_embeddings_keep_32bit_state_from_model_parameters_unless_asked(results, variant):
    """model.parameters() under the JSON type: the embedding keeps 32-bit state by default and the group's 8 bits
    with embeddings_32bit=false, the same choice on both ranks at every stage (per-rank bytes as predicted)."""
    stage = VARIANTS[variant][0]
    for name, bits in ((f"q8_{variant}", EMB_BITS), (f"emb8_{variant}", None)):
        assert results[name]["embedding_marks"][0] == "emb.weight"  # deepspeed.initialize marked it by name
        assert [b["total"] for b in results[name]["state_bytes"]] == [
            estimate_state_bytes(ALL_PARAMS, stage, 2, block_size=256, min_8bit_size=1024, rank=r, param_bits=bits)
            for r in (0, 1)]
    assert results[f"q8_{variant}"]["state_bytes"] != results[f"emb8_{variant}"]["state_bytes"]


def test_the_log_says_once_which_embeddings_keep_32bit_state(results):
    lines = [line for r in results.values() for line in r.get("ds_q8_log", [])]
    # rank 0 logs it once per process and optimizer class: every job of this file runs in the same two processes
    owners = sorted(line.split()[1] for line in lines)
    assert owners == ["Adam8bitBlock", "AdamW8bitBlock", "Momentum8bitBlock"], lines
    for line in lines:
        assert "keeps 32-bit state for 1 embedding parameter(s) (emb.weight [64, 32]; 2,048 elements" in line
        assert "embeddings_32bit=False" in line


@pytest.mark.parametrize("name,optimizer", [("adamw_s2", "AdamW8bitBlock"), ("momentum_s2", "Momentum8bitBlock")])
def test_other_optimizers_by_json_type(results, name, optimizer):
    r = results[name]
    assert r["optimizer"] == optimizer
    assert r["state_dtypes"]["state1"] == ["uint8"]
    assert r["losses"][-1] < 0.8 * r["losses"][0]


def test_scheduler_sets_lr_that_the_optimizer_uses(results):
    r = results["sched_s2"]
    assert r["lrs"][0] < r["lrs"][1] <= 0.01 + 1e-12  # warming up
    assert r["lrs"][-1] < r["lrs"][2]  # then decaying
    # a different lr each step changes the trajectory relative to the constant-lr run
    assert r["losses"][0] == pytest.approx(results["q8_s2"]["losses"][0])
    assert r["losses"][1] != pytest.approx(results["q8_s2"]["losses"][1], rel=1e-3)


@pytest.mark.parametrize("name", ["groups_s2", "groups_s3"])
def test_32bit_embedding_group_survives_flattening(results, name):
    r = results[name]
    # the embedding partition (1024 elements per rank) would qualify for 8-bit by size; its group says 32
    assert [1024, "float32"] in r["state_entries"]
    assert any(dt == "uint8" for _, dt in r["state_entries"])
    assert r["losses"][-1] < 0.2 * r["losses"][0]


def test_unknown_json_param_lists_valid_keys(results):
    err = results["bad_key"]["error"]
    assert "initialize" in err and "beta1" in err and "valid keys: lr, betas, eps" in err


def test_invalid_json_value_names_field_and_range(results):
    err = results["bad_value"]["error"]
    assert "block_size" in err and "1000" in err and "4096" in err


def test_elastic_checkpoint_refused(results):
    err = results["elastic"]["error"]
    assert "UnsupportedZeroConfig" in err and "elastic_checkpoint" in err and "to-universal" in err


def test_nvme_optimizer_offload_refused(results):
    err = results["nvme"]["error"]
    assert "UnsupportedZeroConfig" in err and "nvme" in err


@pytest.mark.parametrize("variant", list(BF16_MASTER_VARIANTS))
def test_bf16_master_weights_step_8bit_state(results, variant):
    """With bf16_master_weights_and_grads (and no bf16_optimizer_states, which DeepSpeed would otherwise
    demand, nor DeepSpeedCPUAdam under offload) the optimizer steps bf16 partitions with 8-bit state."""
    q8, ref = results[f"q8_{variant}"], results["ref_s2_bf16m"]
    assert q8["stepped_dtypes"] == ["bfloat16"] and ref["stepped_dtypes"] == ["bfloat16"]
    assert q8["state_dtypes"]["state1"] == ["uint8"] and q8["state_steps"] == [STEPS]
    assert q8["losses"][-1] < 0.2 * q8["losses"][0]
    for a, b in zip(q8["losses"], ref["losses"]):
        assert abs(a - b) <= 0.03 * b, (q8["losses"], ref["losses"])
