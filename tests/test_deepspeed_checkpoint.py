"""Checkpoints with real DeepSpeed ranks.

* same world size: save -> fresh processes -> load continues bit-identically (ZeRO 1, 2, 3,
  offload, bf16; Adam and Momentum);
* 2 ranks -> 1 and 1 -> 2 through ``python -m ds_q8.checkpoint to-universal`` and DeepSpeed's
  ``load_universal``: the 8-bit state is carried over code for code (the same dequantized values);
* a checkpoint with another block size or other shapes is refused with a clear error;
* per-rank state bytes at 2 ranks add up to those at 1, plus one absmax per block an edge cuts.
"""
import sys
from pathlib import Path

import pytest
import torch

import ds_q8

from helpers.ds_launch import config, launch, run_checked

pytestmark = pytest.mark.multirank

SAVE_AT, MORE = 3, 3
UNIVERSAL = {"checkpoint": {"load_universal": True}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
MUON = {"muon_lr": 0.02, "adam_lr": 0.01}
SAME_SIZE = {  # tag -> config
    "s1": config(1), "s2": config(2), "s3": config(3),
    "s2_off": config(2, zero=OFFLOAD), "s2_bf16": config(2, bf16={"enabled": True}),
    "m2": config(2, "Momentum8bitBlock", lr=0.1),
    "a2": config(2, "AdEMAMix8bitBlock", opt_params={"t_alpha": 4, "t_beta3": 4}),  # three states
    "mu2": config(2, "Muon8bitBlock", lr=None, opt_params=MUON),  # a rule per group
}
MUON_CONFIG = SAME_SIZE["mu2"]
TOTAL_PARAMS = 31296  # TinyLM
# TinyLM's groups under Muon8bitBlock, as DeepSpeed tags them: the four matrices (emb, fc1, fc2, head;
# none is named embed or lm_head) take Muon, the biases and the norm the auxiliary AdamW
GROUP_SIZES = {"mu2": (30720, 576)}
BLOCK = 256


def to_universal(src: Path, dst: Path, log: Path):
    run_checked([sys.executable, "-m", "ds_q8.checkpoint", "to-universal", str(src), str(dst)], log, timeout=300)


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt")
    ck = str(work / "ckpt")
    a = launch([{"name": tag, "steps": SAVE_AT + MORE, "save": [ck, tag, SAVE_AT], "config": c}
                for tag, c in SAME_SIZE.items()] + [
        {"name": "other_block_size", "steps": 1, "load": [ck, "s2"], "expect_error": True,
         "config": config(2, opt_params={"block_size": 512})},
        {"name": "other_shapes", "steps": 1, "load": [ck, "s2"], "expect_error": True, "hidden": 64,
         "config": config(2)},
    ], work, "a_save_2ranks", ranks=2)
    b = launch([{"name": tag, "steps": MORE, "start_step": SAVE_AT, "load": [ck, tag], "config": c}
                for tag, c in SAME_SIZE.items()], work, "b_resume_2ranks", ranks=2)
    to_universal(work / "ckpt" / "s2", work / "ckpt" / "s2_uni", work / "conv_s2.log")
    to_universal(work / "ckpt" / "m2", work / "ckpt" / "m2_uni", work / "conv_m2.log")
    to_universal(work / "ckpt" / "a2", work / "ckpt" / "a2_uni", work / "conv_a2.log")
    to_universal(work / "ckpt" / "mu2", work / "ckpt" / "mu2_uni", work / "conv_mu2.log")
    c = launch([
        {"name": "s2_uni", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "s2_uni"],
         "dump_state": str(work / "dump_c_s2"), "save": [ck, "c1", SAVE_AT + MORE], "config": config(2, **UNIVERSAL)},
        {"name": "m2_uni", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "m2_uni"],
         "dump_state": str(work / "dump_c_m2"), "config": config(2, "Momentum8bitBlock", lr=0.1, **UNIVERSAL)},
        {"name": "a2_uni", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "a2_uni"],
         "dump_state": str(work / "dump_c_a2"),
         "config": config(2, "AdEMAMix8bitBlock", opt_params={"t_alpha": 4, "t_beta3": 4}, **UNIVERSAL)},
        {"name": "mu2_uni", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "mu2_uni"],
         "dump_state": str(work / "dump_c_mu2"), "config": config(2, "Muon8bitBlock", lr=None, opt_params=MUON,
                                                                  **UNIVERSAL)},
        {"name": "mu1", "steps": SAVE_AT, "save": [ck, "mu1", SAVE_AT], "config": MUON_CONFIG},
    ] + [{"name": f"bytes_s{s}", "steps": 1, "config": config(s)} for s in (1, 2, 3)], work, "c_1rank", ranks=1)
    to_universal(work / "ckpt" / "mu1", work / "ckpt" / "mu1_uni", work / "conv_mu1.log")
    to_universal(work / "ckpt" / "c1", work / "ckpt" / "c1_uni", work / "conv_c1.log")
    d = launch([{"name": "c1_uni", "steps": MORE, "start_step": SAVE_AT + MORE, "load": [ck, "c1_uni"],
                 "dump_state": str(work / "dump_d_c1"), "config": config(2, **UNIVERSAL)},
                {"name": "mu1_uni", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "mu1_uni"],
                 "dump_state": str(work / "dump_d_mu1"), "config": dict(MUON_CONFIG, **UNIVERSAL)}],
               work, "d_2ranks", ranks=2)
    return {"a": a, "b": b, "c": c, "d": d, "work": work}


@pytest.mark.parametrize("tag", list(SAME_SIZE))
def test_same_world_size_resume_is_bit_identical(flow, tag):
    a, b = flow["a"][tag], flow["b"][tag]
    assert b["losses"] == a["losses"][SAVE_AT:]
    assert b["state_dtypes"]["state1"] == ["uint8"] and b["state_dtypes"]["absmax1"] == ["bfloat16"]
    assert b["state_steps"] == [SAVE_AT + MORE]


def test_other_block_size_is_refused(flow):
    err = flow["a"]["other_block_size"]["error"]
    assert err.startswith("load:") and "block_size=256" in err and "block_size=512" in err


def test_other_shapes_are_refused(flow):
    err = flow["a"]["other_shapes"]["error"]
    assert err.startswith("load:") and "size mismatch" in err


def _saved_fp32(folder: Path, cls, ranks: int, group: int = 0, size: int = TOTAL_PARAMS) -> dict:
    """One flat group's whole state of a saved ZeRO-2 checkpoint, dequantized, padding removed."""
    parts = []
    for r in range(ranks):
        sd = torch.load(folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", map_location="cpu",
                        weights_only=False)
        inner = sd["optimizer_state_dict"]["base_optimizer_state"]
        pid = inner["param_groups"][group]["params"][0]
        parts.append(cls.export_fp32_state_dict(inner)["state"][pid])
    names = [n for n in parts[0] if n != "step"]
    return {n: torch.cat([p[n] for p in parts])[:size] for n in names}


def _dumped(prefix: Path, ranks: int, group: int = 0, size: int = TOTAL_PARAMS):
    dumps = [torch.load(f"{prefix}.rank{r}.pt", weights_only=False)[group] for r in range(ranks)]
    values = {n: torch.cat([d["values"][n] for d in dumps])[:size] for n in dumps[0]["values"]}
    return values, dumps


def _assert_carried_over(expected: dict, got: dict):
    for name, want in expected.items():
        assert float(want.abs().max()) > 0, name
        # blocks belong to parameters, so the codes moved unchanged: the same values exactly
        assert torch.equal(got[name], want), (name, float((got[name] - want).abs().max()))


@pytest.mark.parametrize("tag,cls", [("s2", ds_q8.Adam8bitBlock), ("m2", ds_q8.Momentum8bitBlock),
                                     ("a2", ds_q8.AdEMAMix8bitBlock), ("mu2", ds_q8.Muon8bitBlock)])
def test_two_ranks_to_one_carries_state_over(flow, tag, cls):
    for group, size in enumerate(GROUP_SIZES.get(tag, (TOTAL_PARAMS,))):
        expected = _saved_fp32(flow["work"] / "ckpt" / tag, cls, ranks=2, group=group, size=size)
        got, dumps = _dumped(flow["work"] / f"dump_c_{tag}", ranks=1, group=group, size=size)
        assert sorted(got) == sorted(expected), group
        assert dumps[0]["step"] == SAVE_AT
        _assert_carried_over(expected, got)
    assert _dumped(flow["work"] / f"dump_c_{tag}", ranks=1)[1][0]["dtypes"]["state1"] == "torch.uint8"
    run = flow["c"][f"{tag}_uni"]
    assert run["state_steps"] == [SAVE_AT + MORE] and run["state_dtypes"]["state1"] == ["uint8"]
    # training continues from where the 2-rank run was, not from scratch
    assert run["losses"][0] < flow["a"][tag]["losses"][1]


def test_one_rank_to_two_carries_state_over(flow):
    expected = _saved_fp32(flow["work"] / "ckpt" / "c1", ds_q8.Adam8bitBlock, ranks=1)
    got, dumps = _dumped(flow["work"] / "dump_d_c1", ranks=2)
    assert [d["step"] for d in dumps] == [SAVE_AT + MORE] * 2
    _assert_carried_over(expected, got)
    run = flow["d"]["c1_uni"]
    assert run["state_steps"] == [SAVE_AT + 2 * MORE]
    assert run["losses"][0] < flow["a"]["s2"]["losses"][1]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_hold_half_the_state_of_one(flow, stage):
    one = flow["c"][f"bytes_s{stage}"]["state_bytes"][0]["total"]
    two = [r["total"] for r in flow["a"][f"s{stage}"]["state_bytes"]]
    # together one copy of everything plus one more absmax per state for each block an edge cuts
    cut = 1 if stage in (1, 2) else 9  # stage 3 cuts each of TinyLM's 9 parameters
    assert one <= sum(two) <= one + 2 * 4 * cut
    for t in two:  # each rank about half: small fp32 parameters may sit on either side
        assert abs(t - one / 2) <= 2 * 4 * 1024


def test_latest_universal_names_the_converted_folder(flow):
    # DeepSpeed's converter writes the folder it converted into (a temporary one) into latest_universal;
    # loading with tag=None under load_universal must find the folder the conversion produced
    assert (flow["work"] / "ckpt" / "latest_universal").read_text().strip() == "c1_uni"


def test_muon_one_rank_to_two_carries_each_groups_state_over(flow):
    for group, size in enumerate(GROUP_SIZES["mu2"]):
        expected = _saved_fp32(flow["work"] / "ckpt" / "mu1", ds_q8.Muon8bitBlock, ranks=1, group=group, size=size)
        got, dumps = _dumped(flow["work"] / "dump_d_mu1", ranks=2, group=group, size=size)
        assert sorted(got) == sorted(expected) == (["momentum_buffer"] if group == 0 else ["exp_avg", "exp_avg_sq"])
        assert [d["step"] for d in dumps] == [SAVE_AT] * 2
        _assert_carried_over(expected, got)
    assert flow["d"]["mu1_uni"]["state_steps"] == [SAVE_AT + MORE]


def test_muon_state_bytes_are_the_estimate_per_rank(flow):
    from ds_q8.memory import estimate_state_bytes

    # TinyLM's groups in flat order as Muon8bitBlock splits them: matrices (one state), the rest (two)
    groups = [[64 * 32, 32 * 128, 128 * 128, 128 * 64], [128, 128, 128, 128, 64]]
    assert tuple(map(sum, groups)) == GROUP_SIZES["mu2"]
    measured = [r["total"] for r in flow["a"]["mu2"]["state_bytes"]]
    # the embedding (the first matrix) keeps 32-bit state: embeddings_32bit, the default, in a Muon group too
    predicted = [estimate_state_bytes(groups, 2, 2, "Muon8bitBlock", block_size=BLOCK, min_8bit_size=1024, rank=r,
                                      group_states=[1, 2], param_bits=[[32, 8, 8, 8], [8] * 5]) for r in (0, 1)]
    assert measured == predicted
