"""ZeRO-Offload (``offload_optimizer: {"device": "cpu"}``): every host storage of a live engine counted once,
part by part, and compared with ``ds_q8.memory.predict_offload``'s prediction to the byte, for DeepSpeed's AdamW
(DeepSpeedCPUAdam; fp32, and bf16 masters with bf16 moments) and ds_q8 (fp32 masters; bf16 masters with
stochastic rounding; with a correction byte), ZeRO-2 and 3, two ranks, two micro-batches per step, every job
in one launch. The host copies ds_q8 removes (``integration.host_copies``) change no bit of the training;
runs save and resume bit for bit, and DeepSpeed's ``zero_to_fp32`` reads the checkpoints. Offload settings
that would step parameters outside the 8-bit state are refused on every rank, naming the field."""
import pytest
import torch

from ds_q8.memory.predict_offload import OFFLOAD_ROWS, predict_host_states
from helpers.ds_launch import config, launch

pytestmark = pytest.mark.multirank

OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
BF16 = {"enabled": True}
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
# the prediction takes bits per group, and these engines get one group (model.parameters()): the models'
# embeddings, which would keep 32-bit state by default, are asked for the group's bits
EMB8 = {"embeddings_32bit": False}
ROWS = {  # row -> (optimizer type, bf16 section, optimizer params)
    "deepspeed": ("AdamW", BF16, {}),
    "deepspeed_bf16": ("AdamW", dict(MASTERS, bf16_optimizer_states=True), {}),
    "q8": ("AdamW8bitBlock", BF16, EMB8),
    "q8_bf16": ("AdamW8bitBlock", MASTERS, EMB8),
    "q8_bf16_correction": ("AdamW8bitBlock", MASTERS, dict(EMB8, correction_byte=True)),
}
STAGES = (2, 3)
HIDDEN = 127  # 30,941 parameters: at two ranks partitions cut parameters and blocks, the last one ends in padding
SAVE_AT, MORE = 3, 2


def _row_config(row, stage, zero=None):
    optimizer, bf16, params = ROWS[row]
    return config(stage, optimizer, bf16=bf16, zero=dict(OFFLOAD, **(zero or {})), opt_params=params)


def _stage_jobs(stage, ckpt):
    """Every row at ``stage``, ds_q8's bf16 row again with DeepSpeed's own host buffers (both saving at step
    3), then a fresh engine that resumes ds_q8's from that checkpoint. Each stage's jobs run together: a ZeRO-3
    engine leaves DeepSpeed's stage-3 hooks on torch's functions for the rest of the process, which changes
    the rounding of later ZeRO-2 runs."""
    jobs = [{"name": f"{row}_s{stage}", "steps": SAVE_AT + MORE, "host_states": True, "hidden": HIDDEN,
             "config": _row_config(row, stage)} for row in ROWS]
    jobs.append({"name": f"deepspeed_layout_s{stage}", "steps": SAVE_AT + MORE, "share_masters": False,
                 "host_states": True, "hidden": HIDDEN, "config": _row_config("q8_bf16", stage)})
    for job in jobs:
        if job["name"] in (f"q8_bf16_s{stage}", f"deepspeed_layout_s{stage}"):
            job["save"] = [ckpt, job["name"], SAVE_AT]
    return jobs + [{"name": f"resumed_s{stage}", "steps": MORE, "start_step": SAVE_AT, "hidden": HIDDEN,
                    "load": [ckpt, f"q8_bf16_s{stage}"], "config": _row_config("q8_bf16", stage)}]


def _refusal(name, stage, zero):
    return {"name": name, "steps": 1, "expect_error": True, "config": config(stage, bf16=MASTERS, zero=zero)}


GPT2 = {"gpt2": [4, 512], "steps": 2, "host_states": True,
        "config": config(2, "AdamW8bitBlock", bf16=MASTERS, zero=OFFLOAD, gradient_accumulation_steps=1,
                         opt_params=dict(EMB8, block_size=64, min_8bit_size=4096))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job on two ranks, in one launch (a launch's start costs more than most of its jobs)."""
    work = tmp_path_factory.mktemp("offload")
    ck = str(work / "ckpt")
    jobs = _stage_jobs(2, ck) + [
        dict(GPT2, name="gpt2_512_s2"),
        {"name": "unpinned_s2", "steps": 2, "host_states": True, "hidden": HIDDEN,
         "config": _row_config("q8_bf16", 2, {"offload_optimizer": {"device": "cpu", "pin_memory": False}})},
        _refusal("zenflow_s2", 2, {**OFFLOAD, "zenflow": {"topk_ratio": 0.1, "update_interval": 2,
                                                         "select_strategy": "step", "select_interval": 2}}),
        _refusal("nvme_s2", 2, {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/ds_q8_nvme_unused"}}),
        _refusal("ratio_s3", 3, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
        _refusal("super_offload_s3", 3, {"offload_optimizer": {"device": "cpu", "super_offload": True}}),
    ] + _stage_jobs(3, ck)
    return {"jobs": launch(jobs, work, "offload", ranks=2, timeout=900), "ckpt": work / "ckpt"}


def _check_prediction(results, world_size):
    for stage in STAGES:
        for row in ROWS:
            rec = results[f"{row}_s{stage}"]
            for rank, measured in enumerate(rec["host_states"]):
                measured = dict(measured)
                total = measured.pop("total")
                assert sum(measured.values()) == total, (row, stage, rank, measured, total)  # every storage named
                predicted = predict_host_states([rec["param_sizes"]], row, stage, world_size, rank=rank,
                                                block_size=256, min_8bit_size=1024, gradient_accumulation_steps=2)
                assert measured == predicted, (row, stage, rank)


def test_prediction_is_every_host_byte_on_each_rank(runs):
    _check_prediction(runs["jobs"], 2)


def _host_bytes_a_parameter(rec):
    """Host bytes of both ranks together, per parameter of the model."""
    return sum(h["total"] for h in rec["host_states"]) / sum(rec["param_sizes"])


def test_rows_keep_what_they_say(runs):
    """DeepSpeed's rows run DeepSpeedCPUAdam (fp32 or bf16 moments); ds_q8's keep uint8 codes and step the
    masters' dtype; bf16 masters cut the host bytes to about a third of DeepSpeed's default (its fp32 masters)."""
    per_param = {}
    for stage in STAGES:
        for row, (optimizer, bf16, params) in ROWS.items():
            rec = runs["jobs"][f"{row}_s{stage}"]
            per_param[row, stage] = _host_bytes_a_parameter(rec)
            masters = "bfloat16" if bf16.get("bf16_master_weights_and_grads") else "float32"
            assert rec["stepped_dtypes"] == [masters]
            if row.startswith("deepspeed"):
                assert rec["optimizer"] == "DeepSpeedCPUAdam"
                assert rec["state_dtypes"]["exp_avg"] == ["bfloat16" if row == "deepspeed_bf16" else "float32"]
            else:
                assert rec["optimizer"] == "AdamW8bitBlock" and rec["state_dtypes"]["state1"] == ["uint8"]
            assert rec["losses"][-1] < rec["losses"][0]
        assert per_param["q8_bf16", stage] < per_param["deepspeed_bf16", stage] < per_param["deepspeed", stage]
        # measured 0.28 (ZeRO-2) and 0.38 (ZeRO-3): this model's parameters below min_8bit_size keep fp32 state,
        # and at ZeRO-3 each of its nine parameters is padded on each rank
        assert per_param["q8_bf16", stage] < 0.4 * per_param["deepspeed", stage]


def test_gpt2_holds_at_most_six_point_one_host_bytes_a_parameter(runs):
    """GPT-2 (Conv1D, n_embd 512, 4 layers, 12.8M parameters), ZeRO-2, bf16 masters, block 64: masters (2),
    their gradient (2) and the 8-bit state (2 + 2/64 + fp32 state of the biases) on the host, nothing else,
    each rank for its half."""
    rec = runs["jobs"]["gpt2_512_s2"]
    assert _host_bytes_a_parameter(rec) <= 6.1, _host_bytes_a_parameter(rec)
    for rank, host in enumerate(rec["host_states"]):
        assert host["bf16_image"] == host["unused"] == host["grad_accumulation"] == 0
        predicted = predict_host_states([rec["param_sizes"]], "q8_bf16", 2, 2, rank=rank, gradient_accumulation_steps=1)
        assert {k: v for k, v in host.items() if k != "total"} == predicted


@pytest.mark.parametrize("stage", STAGES)
def test_removed_copies_change_no_bit(runs, stage):
    """DeepSpeed's own layout (its bf16 image and unused buffer at ZeRO-2, its second gradient partition at
    ZeRO-3) against ds_q8's, two ranks: the same losses and parameters, bit for bit, and the bytes that went."""
    ours, theirs = runs["jobs"][f"q8_bf16_s{stage}"], runs["jobs"][f"deepspeed_layout_s{stage}"]
    assert ours["losses"] == theirs["losses"] and ours["params_bits"] == theirs["params_bits"]
    n = sum(ours["param_sizes"])
    for rank in range(2):
        held = ours["host_states"][rank]["total"], theirs["host_states"][rank]["total"]
        predicted = predict_host_states([ours["param_sizes"]], "q8_bf16", stage, 2, rank=rank, block_size=256,
                                        min_8bit_size=1024, gradient_accumulation_steps=2, host_copies=False)
        assert held[1] == sum(predicted.values())
        assert held[1] - held[0] >= n  # 2 bytes for each of the rank's n / 2: a bf16 copy of its masters or gradient


def test_pin_memory_false_holds_the_same(runs):
    """pin_memory decides only whether DeepSpeed pins its host buffers: the same bytes, the same training."""
    unpinned, pinned = runs["jobs"]["unpinned_s2"], runs["jobs"]["q8_bf16_s2"]
    assert [h["total"] for h in unpinned["host_states"]] == [h["total"] for h in pinned["host_states"]]
    assert unpinned["losses"] == pinned["losses"][:2]


@pytest.mark.parametrize("name, field", [
    ("ratio_s3", "zero_optimization.offload_optimizer.ratio=0.5"),
    ("super_offload_s3", "zero_optimization.offload_optimizer.super_offload=true"),
    ("zenflow_s2", "zero_optimization.zenflow"),
    ("nvme_s2", "zero_optimization.offload_optimizer.device=\"nvme\""),
])
def test_offload_paths_outside_the_8bit_state_are_refused(runs, name, field):
    err = runs["jobs"][name]["error"]
    assert err.startswith("initialize: UnsupportedZeroConfig") and field in err, err


@pytest.mark.parametrize("stage", STAGES)
def test_resume_bit_for_bit(runs, stage):
    ours, resumed = runs["jobs"][f"q8_bf16_s{stage}"], runs["jobs"][f"resumed_s{stage}"]
    assert resumed["losses"] == ours["losses"][SAVE_AT:] and resumed["params_bits"] == ours["params_bits"]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_to_fp32_reads_the_offloaded_checkpoint(runs, stage):
    """DeepSpeed's converter returns the saved bf16 masters, equal to the parameters, from ds_q8's
    checkpoint and from DeepSpeed's own layout's alike."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = runs["ckpt"]
    ours = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=f"q8_bf16_s{stage}")
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=f"deepspeed_layout_s{stage}")
    assert set(ours) == set(theirs) and len(ours) == 9
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    if stage == 2:
        model = torch.load(folder / f"q8_bf16_s{stage}" / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
        for name, value in ours.items():
            assert torch.equal(value.float(), model[name].float()), name


def test_rows_are_the_documented_ones():
    assert set(ROWS) == set(OFFLOAD_ROWS)
