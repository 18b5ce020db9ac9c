"""Damaged checkpoints and non-finite gradients: nothing is half-loaded, no poisoned state.

* a bare ``optimizer.load_state_dict`` refuses a damaged state dict before replacing anything;
* ``engine.load_checkpoint`` with a truncated or bit-flipped shard fails on every rank, naming the
  file, and leaves parameters and 8-bit state as they were (2 ranks, tests/ds_scripts/engine_faults.py);
* an Inf in one rank's gradient makes both ranks skip (bf16, CPU), and DeepSpeed's fp16 overflow
  skip leaves parameters and 8-bit state untouched (GPU only; skipped without one).
"""
import copy
import json
import struct
import sys
import zipfile

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8.integration.checkpoint_files import CorruptCheckpointError, verify_file

from helpers.ds_launch import SCRIPTS, free_port, run_checked

pytestmark = pytest.mark.multirank


def trained(steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = ds_q8.Adam8bitBlock(model.parameters(), block_size=256, min_8bit_size=1024)
    for _ in range(steps):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def assert_same_state(a: dict, b: dict):
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][pid][k])), (pid, k)


def test_truncated_file_fails_to_load_and_the_optimizer_keeps_its_state(tmp_path):
    _, opt = trained()
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    _, other = trained(steps=5)
    before = copy.deepcopy(other.state_dict())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="opt.pt is truncated"):
        verify_file(path)
    with pytest.raises(Exception):
        other.load_state_dict(torch.load(path, weights_only=False))
    assert_same_state(before, other.state_dict())


def test_flipped_byte_is_found_by_the_file_check(tmp_path):
    _, opt = trained()
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    verify_file(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:  # a byte in the middle of the largest record: tensor data
        big = max(z.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[big.header_offset + 26:big.header_offset + 30])
    data[big.header_offset + 30 + name_len + extra_len + big.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="fails its CRC-32 check"):
        verify_file(path)


@pytest.mark.parametrize("damage", ["nan_absmax", "negative_absmax", "short_codes", "missing_state2"])
def test_damaged_second_entry_leaves_the_first_unloaded(damage):
    # the bad entry comes after a good one: a loader that applied entries one by one would half-load
    _, opt = trained()
    sd = copy.deepcopy(opt.state_dict())
    model, other = trained(steps=5)
    before = copy.deepcopy(other.state_dict())
    eight_bit = [pid for pid, st in sd["state"].items() if "state1" in st]
    assert len(eight_bit) == 2
    st = sd["state"][max(eight_bit)]
    if damage == "nan_absmax":
        st["absmax1"][0] = float("nan")
    elif damage == "negative_absmax":
        st["absmax2"][0] = -1.0
    elif damage == "short_codes":
        st["state1"] = st["state1"].reshape(-1)[:-1]
    else:
        del st["state2"]
    with pytest.raises(ValueError, match="checkpoint"):
        other.load_state_dict(sd)
    assert_same_state(before, other.state_dict())
    for p in model.parameters():  # the optimizer still steps with its old state
        p.grad = torch.ones_like(p)
    other.step()


@pytest.fixture(scope="module")
def engine_faults(tmp_path_factory):
    work = tmp_path_factory.mktemp("engine_faults")
    result = work / "result.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(SCRIPTS / "engine_faults.py"), "--work", str(work)]
    run_checked(cmd, work / "log.txt", timeout=300, cwd=work, result=result)
    return json.loads(result.read_text())


@pytest.mark.parametrize("tag, bad_rank, message", [
    ("cut", 1, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated"),
    ("flipped", 0, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is corrupted"),
])
def test_engine_refuses_a_damaged_shard_on_every_rank(engine_faults, tag, bad_rank, message):
    r = engine_faults[tag]
    assert message in r["errors"][bad_rank]
    assert "another rank found a damaged file" in r["errors"][1 - bad_rank]
    assert r["unchanged"] == [True, True]
    assert engine_faults["good_loaded_step"] == [[2], [2]]


def test_inf_on_one_rank_skips_by_the_clip_norm_without_reading_gradients(engine_faults):
    # bf16 ZeRO-2 with check_grad_overflow off: DeepSpeed steps on; its (global) norm is Inf on both ranks
    r = engine_faults["inf_by_norm"]
    assert r["reads"] == [0, 0] and r["by_norm"] == [1, 1]
    assert r["skipped"] == [1, 1] and r["unchanged"] == [True, True]


def test_inf_on_one_rank_makes_both_ranks_skip(engine_faults):
    # the same without a norm from the engine: each rank reads its gradients, the all-reduce agrees
    r = engine_faults["inf"]
    assert sorted(r["local_nonfinite"]) == [False, True]  # only one rank's partition held the Inf
    assert r["skipped"] == [2, 2] and r["unchanged"] == [True, True]
    assert r["next_step_updates"] == [True, True]


@pytest.mark.gpu  # DeepSpeed's fp16 loss scaling needs a GPU
def test_fp16_overflow_skip_leaves_params_and_state_untouched(monkeypatch):
    import deepspeed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    # hysteresis 1: the first overflow lowers the scale (DeepSpeed's default, 2, lowers it on the second)
    cfg = {"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
           "optimizer": {"type": "Adam8bitBlock", "params": {"lr": 1e-2, "block_size": 256, "min_8bit_size": 1024}},
           "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    inner = engine.optimizer.optimizer

    def step(poison=False):
        x = torch.randn(8, 64, device=engine.device, dtype=torch.half)
        hook = model[2].weight.register_hook(lambda g: g * float("inf")) if poison else None
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        if hook is not None:
            hook.remove()

    for _ in range(3):
        step()
    assert any(inner.is_8bit_state(st) for st in inner.state.values())
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(inner.state_dict())
    scale, skipped = engine.optimizer.loss_scale, engine.skipped_steps
    step(poison=True)
    assert engine.skipped_steps == skipped + 1  # DeepSpeed saw the overflow, skipped the step
    assert engine.optimizer.loss_scale < scale  # and lowered the scale
    for a, p in zip(params, model.parameters()):
        assert torch.equal(a, p.detach())
    assert_same_state(state, inner.state_dict())
    step()
    assert not all(torch.equal(a, p.detach()) for a, p in zip(params, model.parameters()))
