"""The same numbers at every ZeRO stage and world size, with real DeepSpeed ranks (gloo).

tests/ds_scripts/invariance.py trains a bag of odd-sized parameters whose gradients are integers,
the same on every rank (so ZeRO's averaging reproduces them bit for bit) and dependent on the
parameters (so a one-ulp drift would grow). Gradient clipping is off: DeepSpeed clips at 1.0 by
default, and the global norm's rounding depends on how ranks sum their partial norms.

* fp32: Adam8bitBlock and Lion8bitBlock (one state) give bit-identical parameters and dequantized
  state in a plain PyTorch loop and under ZeRO-0/1/2/3 at 1, 2, 3 and 4 ranks;
* bf16 mixed precision: the fp32 masters are bit-identical across ZeRO-1/2/3 and world sizes;
* bf16 masters with a correction byte: bit-identical across ZeRO-1/2/3, ZeRO-Offload at stages 2
  and 3, and world sizes;
* LAMB8bitBlock and LARS8bitBlock (per-parameter norms) stay within 1e-3 of the plain loop after 20 steps;
* a checkpoint written at N ranks resumes at M (2->1, 1->2, 2->3, 2->4; stages 2 and 3) through
  ``python -m ds_q8.checkpoint to-universal`` and ``load_universal``, code for code: the resumed
  run ends bit-identical to the uninterrupted one; loading it directly at another world size
  fails with an error naming the conversion;
* ``deepspeed.utils.safe_get/set_full_optimizer_state`` read and write the 8-bit state of one
  parameter; an unknown state name raises the same error on every rank;
* 4-bit states (AdamW8bitBlock, ``optim_bits=4``): bit-identical to the plain loop under ZeRO-0/1/2/3
  at every world size, with bf16 masters across stages and world sizes, and through a universal
  checkpoint from 2 ranks to 3, code for code.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.ds_launch import SCRIPTS, free_port, load_script, run_checked

invariance = load_script("invariance")  # tests/ds_scripts/invariance.py: the plain loop and the bag's shapes

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1500),  # above its jobs' own 1200 s limit
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

WORLDS = (1, 2, 3, 4)
STEPS, TRUST_STEPS, SAVE_AT = 6, 20, 3
LR = {"Adam8bitBlock": 0.05, "Lion8bitBlock": 0.01, "LAMB8bitBlock": 0.01, "LARS8bitBlock": 0.1,
      "AdEMAMix8bitBlock": 0.01}
# AdEMAMix: three states, two of them signed, through the same layouts and shared blocks
ELEMENTWISE = ("Adam8bitBlock", "Lion8bitBlock", "AdEMAMix8bitBlock")
FP32 = [(o, s) for o in ELEMENTWISE for s in (0, 1, 2, 3)]
BF16 = [(o, s) for o in ("Adam8bitBlock", "Lion8bitBlock") for s in (1, 2, 3)]
TRUST = [(o, s) for o in ("LAMB8bitBlock", "LARS8bitBlock") for s in (0, 1, 2, 3)]
BF16_MASTER = [(o, s) for o in ("Adam8bitBlock", "Lion8bitBlock") for s in (1, 2, 3)]  # stochastic rounding on
CORRECTED = [("Adam8bitBlock", s) for s in (1, 2, 3)]  # bf16 masters with correction_byte=True
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}  # ZeRO-Offload: the masters and their bytes on the host
RESHARD = [(2, 1), (1, 2), (2, 3), (2, 4)]
FOUR = dict(bits=4, lr=0.05)  # AdamW8bitBlock with optim_bits=4


def _job(name, opt, stage, steps, **extra):
    return dict(name=name, optimizer=opt, stage=stage, steps=steps, lr=LR[opt], **extra)


def _plan(world, ck):
    jobs = [_job(f"fp32_{o}_s{s}", o, s, STEPS, api=s > 0) for o, s in FP32]
    jobs += [_job(f"bf16_{o}_s{s}", o, s, STEPS, bf16=True) for o, s in BF16]
    jobs += [_job(f"trust_{o}_s{s}", o, s, TRUST_STEPS) for o, s in TRUST]
    jobs += [_job(f"bf16m_{o}_s{s}", o, s, STEPS, bf16=True, bf16_master=True) for o, s in BF16_MASTER]
    jobs += [_job(f"bf16c_{o}_s{s}", o, s, STEPS, bf16=True, bf16_master=True, correction=True) for o, s in CORRECTED]
    jobs += [_job(f"bf16c_offload_{o}_s{s}", o, s, STEPS, bf16=True, bf16_master=True, correction=True, zero=OFFLOAD)
             for o, s in CORRECTED if s > 1]
    jobs += [dict(name=f"four_s{s}", optimizer="AdamW8bitBlock", stage=s, steps=STEPS, **FOUR) for s in (0, 1, 2, 3)]
    jobs += [dict(name=f"four_bf16m_s{s}", optimizer="AdamW8bitBlock", stage=s, steps=STEPS, bf16=True, bf16_master=True,
                  **FOUR) for s in (1, 2, 3)]
    if world == 2:
        jobs.append(_job("save2_bf16m_s2", "Adam8bitBlock", 2, SAVE_AT, bf16=True, bf16_master=True,
                         save=[ck, "w2_bf16m_s2"]))
        jobs.append(_job("save2_bf16c_s2", "Adam8bitBlock", 2, SAVE_AT, bf16=True, bf16_master=True,
                         correction=True, save=[ck, "w2_bf16c_s2"]))
    if world == 2:
        jobs.append(dict(name="save2_four_s2", optimizer="AdamW8bitBlock", stage=2, steps=SAVE_AT,
                         save=[ck, "w2_four_s2"], **FOUR))
    if world == 3:
        jobs.append(dict(name="resume2to3_four_s2", optimizer="AdamW8bitBlock", stage=2, steps=STEPS - SAVE_AT,
                         start_step=SAVE_AT, universal=True, load=[ck, "w2_four_s2_universal"], **FOUR))
        jobs.append(_job("resume2to3_bf16m_s2", "Adam8bitBlock", 2, STEPS - SAVE_AT, start_step=SAVE_AT,
                         bf16=True, bf16_master=True, universal=True, load=[ck, "w2_bf16m_s2_universal"]))
        jobs.append(_job("resume2to3_bf16c_s2", "Adam8bitBlock", 2, STEPS - SAVE_AT, start_step=SAVE_AT,
                         bf16=True, bf16_master=True, correction=True, universal=True,
                         load=[ck, "w2_bf16c_s2_universal"]))
    for stage in (2, 3):
        if world in (1, 2):
            jobs.append(_job(f"save{world}_s{stage}", "Adam8bitBlock", stage, SAVE_AT,
                             save=[ck, f"w{world}_s{stage}"]))
        for src, dst in RESHARD:
            if dst == world and (src, world) != (2, 1):  # 2 -> 1 runs after the 2-rank save, below
                jobs.append(_job(f"resume{src}to{dst}_s{stage}", "Adam8bitBlock", stage, STEPS - SAVE_AT,
                                 start_step=SAVE_AT, universal=True, load=[ck, f"w{src}_s{stage}_universal"]))
        if world == 3:  # the 2-rank checkpoint loaded directly: refused, naming the conversion
            jobs.append(_job(f"direct2to3_s{stage}", "Adam8bitBlock", stage, 1, load=[ck, f"w2_s{stage}"],
                             expect_error=True))
    return jobs


def _launch(plan, work, name, ranks):
    plan_file, out = work / f"{name}.plan.json", work / name
    out.mkdir(exist_ok=True)
    plan_file.write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(free_port()), str(SCRIPTS / "invariance.py"), "--plan", str(plan_file), "--out", str(out)]
    last = out / f"{plan[-1]['name']}.pt"
    run_checked(cmd, work / f"{name}.log", timeout=1200, cwd=work, result=last)
    return {job["name"]: torch.load(out / f"{job['name']}.pt", weights_only=False) for job in plan}


def _convert(ck: Path, tag: str, work: Path):
    run_checked([sys.executable, "-m", "ds_q8.checkpoint", "to-universal", str(ck / tag), str(ck / f"{tag}_universal")],
                work / f"convert_{tag}.log", timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("invariance")
    ck = work / "ckpt"
    plain_jobs = [_job(f"plain_{o}", o, None, STEPS) for o in ELEMENTWISE]
    plain_jobs += [_job(f"plain_trust_{o}", o, None, TRUST_STEPS) for o in ("LAMB8bitBlock", "LARS8bitBlock")]
    plain_jobs.append(dict(name="plain_four", optimizer="AdamW8bitBlock", stage=None, steps=STEPS, **FOUR))
    (work / "plain").mkdir()
    for job in plain_jobs:
        invariance.run_plain(job, str(work / "plain"))
    out = {"plain": {j["name"]: torch.load(work / "plain" / f"{j['name']}.pt", weights_only=False)
                     for j in plain_jobs}}
    for world in (1, 2, 3, 4):
        if world == 3:
            for tag in ("w2_s2", "w2_s3", "w2_bf16m_s2", "w2_bf16c_s2", "w2_four_s2"):
                _convert(ck, tag, work)
        out[world] = _launch(_plan(world, str(ck)), work, f"w{world}", world)
        if world == 1:
            for stage in (2, 3):
                _convert(ck, f"w1_s{stage}", work)
    out["2to1"] = _launch([_job(f"resume2to1_s{s}", "Adam8bitBlock", s, STEPS - SAVE_AT, start_step=SAVE_AT,
                                universal=True, load=[str(ck), f"w2_s{s}_universal"]) for s in (2, 3)],
                          work, "w1_resume", 1)
    out[1].update(out.pop("2to1"))
    out["ckpt"] = ck
    return out


def _differences(a, b):
    """(parameters differing anywhere, largest |difference| of parameters, of dequantized state)."""
    bad, dp, ds = [], 0.0, 0.0
    for name in a["params"]:
        x, y = a["params"][name].float(), b["params"][name].float()
        if not torch.equal(x, y):
            bad.append(name)
        dp = max(dp, float((x - y).abs().max()))
        for k in a["state"][name]:
            sx, sy = a["state"][name][k].float(), b["state"][name][k].float()
            if not torch.equal(sx, sy):
                bad.append(f"{name}.{k}")
            ds = max(ds, float((sx - sy).abs().max()))
    return bad, dp, ds


def _sharded_path_ran(record):
    return any(part["shared_pieces"] > 0 for rank in record["layouts"] for part in rank)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("opt,stage", FP32)
def test_fp32_bit_identical_to_the_plain_loop(runs, opt, stage, world):
    got = runs[world][f"fp32_{opt}_s{stage}"]
    bad, dp, ds = _differences(runs["plain"][f"plain_{opt}"], got)
    assert not bad, f"differ: {bad} (params by {dp}, state by {ds})"
    if world > 1 and stage > 0:  # partitions cut blocks, and the ranks agreed on their maxima
        assert _sharded_path_ran(got)
    for rank in got["layouts"]:  # 32-bit by mark (emb) and by size (b1, norm), whatever the partition
        for part in rank:
            assert part["fp32_segments"] <= 3


@pytest.mark.parametrize("opt", ["Adam8bitBlock", "Lion8bitBlock"])
def test_bf16_masters_identical_across_stages_and_world_sizes(runs, opt):
    ref = runs[1][f"bf16_{opt}_s1"]
    for world in WORLDS:
        for stage in (1, 2, 3):
            bad, dp, ds = _differences(ref, runs[world][f"bf16_{opt}_s{stage}"])
            assert not bad, f"{world} ranks, stage {stage}: {bad} (params by {dp}, state by {ds})"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("opt,stage", TRUST)
def test_trust_ratio_rules_follow_the_plain_loop(runs, opt, stage, world):
    ref, got = runs["plain"][f"plain_trust_{opt}"], runs[world][f"trust_{opt}_s{stage}"]
    for name, want in ref["params"].items():
        err = float((got["params"][name] - want).abs().max()) / float(want.abs().max())
        assert err <= 1e-3, f"{name}: relative deviation {err:.2e}"
    if world > 1 and stage > 0:
        assert _sharded_path_ran(got)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("src,dst", RESHARD)
def test_resharded_resume_is_bit_identical(runs, src, dst, stage):
    got = runs[dst][f"resume{src}to{dst}_s{stage}"]
    bad, dp, ds = _differences(runs["plain"]["plain_Adam8bitBlock"], got)
    assert not bad, f"differ: {bad} (params by {dp}, state by {ds})"


@pytest.mark.parametrize("stage", [2, 3])
def test_loading_at_another_world_size_names_the_conversion(runs, stage):
    errors = runs[3][f"direct2to3_s{stage}"]["errors"]
    assert len(errors) == 3 and all("to-universal" in e and "world size of 2" in e for e in errors), errors


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_per_parameter_state_api(runs, stage, world):
    api = runs[world][f"fp32_Adam8bitBlock_s{stage}"]["api"]
    assert api["set_get_w4"] == 0.0 and api["set_get_norm"] == 0.0
    assert len(api["bad_name"]) == world and len(set(api["bad_name"])) == 1
    assert "no_such_state" in api["bad_name"][0] and "'exp_avg'" in api["bad_name"][0]


def test_universal_checkpoint_carries_codes(runs):
    """The converted folder holds each parameter's state whole: 8-bit codes and block maxima, or fp32."""
    ck = runs["ckpt"]
    names = sorted(f.stem for f in (ck / "w2_s2_universal" / "ds_q8").glob("*.pt"))
    assert names == sorted(invariance.SHAPES)
    saved = torch.load(ck / "w2_s2_universal" / "ds_q8" / "w4.pt", weights_only=True)
    assert saved["codes"][0].dtype == torch.uint8 and saved["numel"] == 77 * 51 and saved["block_size"] == 64
    small = torch.load(ck / "w2_s2_universal" / "ds_q8" / "b1.pt", weights_only=True)
    assert not small["eight_bit"] and small["values"][0].dtype == torch.float32


@pytest.mark.parametrize("opt", ["Adam8bitBlock", "Lion8bitBlock"])
def test_bf16_master_weights_identical_across_stages_and_world_sizes(runs, opt):
    """bf16 master weights written with stochastic rounding: the random bits follow each element's
    index in its parameter, so the masters and the 8-bit state do not depend on the partitioning."""
    ref = runs[1][f"bf16m_{opt}_s1"]
    for world in WORLDS:
        for stage in (1, 2, 3):
            got = runs[world][f"bf16m_{opt}_s{stage}"]
            bad, dp, ds = _differences(ref, got)
            assert not bad, f"{world} ranks, stage {stage}: {bad} (params by {dp}, state by {ds})"
    # bf16 masters move differently from fp32 ones: the run did not silently keep fp32 masters
    assert _differences(ref, runs[1][f"bf16_{opt}_s1"])[0]


def test_bf16_master_resume_at_another_world_size_is_bit_identical(runs):
    bad, dp, ds = _differences(runs[2]["bf16m_Adam8bitBlock_s2"], runs[3]["resume2to3_bf16m_s2"])
    assert not bad, f"differ: {bad} (params by {dp}, state by {ds})"


def test_correction_bytes_identical_across_stages_and_world_sizes(runs):
    """bf16 masters with a correction byte (24-bit masters): written to nearest, element by element,
    so the masters, the bytes (which drive every later step) and the 8-bit state do not depend on
    the partitioning; and they move differently from stochastically rounded masters."""
    ref = runs[1]["bf16c_Adam8bitBlock_s1"]
    for world in WORLDS:
        for stage in (1, 2, 3):
            bad, dp, ds = _differences(ref, runs[world][f"bf16c_Adam8bitBlock_s{stage}"])
            assert not bad, f"{world} ranks, stage {stage}: {bad} (params by {dp}, state by {ds})"
            if stage > 1:  # ZeRO-Offload steps the host's masters, with their bytes, to the same bits
                run = runs[world][f"bf16c_offload_Adam8bitBlock_s{stage}"]
                bad, dp, ds = _differences(ref, run)
                assert not bad, f"{world} ranks, stage {stage}, offload: {bad} (params by {dp}, state by {ds})"
                assert run["correction_bytes"] >= sum(p.numel() for p in ref["params"].values())
    assert _differences(ref, runs[1]["bf16m_Adam8bitBlock_s1"])[0]


def test_correction_bytes_travel_through_universal_checkpoints(runs):
    """Saved at 2 ranks, converted, resumed at 3 (ZeRO-2): the bytes go with each parameter (the ds_q8
    folder), and the resumed run ends where the uninterrupted one does."""
    ck = runs["ckpt"]
    saved = torch.load(ck / "w2_bf16c_s2_universal" / "ds_q8" / "w4.pt", weights_only=True)
    assert saved["correction"].dtype == torch.int8 and saved["correction"].numel() == 77 * 51
    assert bool(saved["correction"].any())
    bad, dp, ds = _differences(runs[2]["bf16c_Adam8bitBlock_s2"], runs[3]["resume2to3_bf16c_s2"])
    assert not bad, f"differ: {bad} (params by {dp}, state by {ds})"


@pytest.mark.parametrize("world", WORLDS)
def test_four_bit_state_bit_identical_to_the_plain_loop(runs, world):
    """optim_bits=4: partition edges cut blocks and bytes; the ranks agree on both moments' maxima."""
    for stage in (0, 1, 2, 3):
        got = runs[world][f"four_s{stage}"]
        bad, dp, ds = _differences(runs["plain"]["plain_four"], got)
        assert not bad, f"stage {stage}: {bad} (params by {dp}, state by {ds})"
        if world > 1 and stage > 0:
            assert _sharded_path_ran(got)
    ref = runs[1]["four_bf16m_s1"]
    for stage in (1, 2, 3):
        bad, dp, ds = _differences(ref, runs[world][f"four_bf16m_s{stage}"])
        assert not bad, f"bf16 masters, stage {stage}: {bad} (params by {dp}, state by {ds})"


def test_four_bit_state_resumes_at_another_world_size_code_for_code(runs):
    saved = torch.load(runs["ckpt"] / "w2_four_s2_universal" / "ds_q8" / "w4.pt", weights_only=True)
    assert saved["state_bits"] == 4 and saved["codes"][0].numel() == 77 * 51
    assert int(saved["codes"][1].max()) <= 15 and saved["absmax"][1].dtype == torch.float32
    bad, dp, ds = _differences(runs["plain"]["plain_four"], runs[3]["resume2to3_four_s2"])
    assert not bad, f"differ: {bad} (params by {dp}, state by {ds})"
