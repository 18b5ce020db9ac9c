"""ds_q8.memory: predicted per-rank optimizer-state bytes and the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8.memory import estimate_state_bytes, gpt2_muon_groups, gpt2_param_groups, main, state_tensor_sizes
from ds_q8.memory.measure import measured_state_bytes
from ds_q8.optim.codecs import codec_for
from ds_q8.optim.layout import StateLayout
from ds_q8.optim.qstate import QuantizedState
from ds_q8.memory.predict_state import tensor_state_bytes

REPO = Path(__file__).resolve().parents[1]


def test_stage0_counts_every_tensor_and_keeps_small_ones_fp32():
    model = nn.Sequential(nn.Linear(100, 60), nn.Linear(60, 10))
    opt = ds_q8.Adam8bitBlock(model.parameters(), block_size=256, min_8bit_size=1000)
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    sizes = [[p.numel() for p in model.parameters()]]
    predicted = estimate_state_bytes(sizes, 0, 1, block_size=256, min_8bit_size=1000)
    measured = measured_state_bytes(opt)
    assert measured["total"] == predicted
    assert measured["codes"] == 2 * 6000  # only the 100x60 weight reaches min_8bit_size
    assert measured["absmax"] == 2 * 2 * 24  # one bfloat16 maximum per block
    assert measured["fp32"] == 2 * 4 * (60 + 600 + 10)


def test_muon_estimate_counts_one_state_for_matrices_and_two_for_the_rest():
    model = nn.Sequential(nn.Embedding(300, 40), nn.Linear(40, 120), nn.LayerNorm(120), nn.Linear(120, 40))
    named = list(model.named_parameters())
    # ds_q8's tagging by name: the embedding ("0.weight" is not named embed) is 2-D, so tag it as DeepSpeed would
    model[0].weight.use_muon = False
    opt = ds_q8.Muon8bitBlock(model.parameters(), block_size=256, min_8bit_size=1000)
    model(torch.randint(0, 300, (2, 5))).sum().backward()
    opt.step()
    muon = [p.numel() for n, p in named if p.ndim == 2 and n != "0.weight"]
    adam = [p.numel() for n, p in named if not (p.ndim == 2 and n != "0.weight")]
    # the embedding keeps 32-bit state (embeddings_32bit, the default)
    adam_bits = [32 if n == "0.weight" else 8 for n, p in named if not (p.ndim == 2 and n != "0.weight")]
    predicted = estimate_state_bytes([muon, adam], 0, 1, "Muon8bitBlock", block_size=256, min_8bit_size=1000,
                                     group_states=[1, 2], param_bits=[[8] * len(muon), adam_bits])
    assert measured_state_bytes(opt)["total"] == predicted
    assert predicted == (40 * 120 + 2 * 19) + (120 * 40 + 2 * 19) + 2 * 4 * (300 * 40) + 2 * 4 * (120 + 240 + 40)
    eight = ds_q8.Muon8bitBlock(model.parameters(), block_size=256, min_8bit_size=1000, embeddings_32bit=False)
    model(torch.randint(0, 300, (2, 5))).sum().backward()
    eight.step()
    assert measured_state_bytes(eight)["total"] == estimate_state_bytes(
        [muon, adam], 0, 1, "Muon8bitBlock", block_size=256, min_8bit_size=1000, group_states=[1, 2]) == \
        (40 * 120 + 2 * 19) + (120 * 40 + 2 * 19) + 2 * (300 * 40 + 2 * 47) + 2 * 4 * (120 + 240 + 40)
    groups, states = gpt2_muon_groups(12, 768)
    assert sum(map(sum, groups)) == sum(map(sum, gpt2_param_groups(12, 768))) and states == [2, 1, 2]
    with pytest.raises(ValueError, match="group_states"):
        estimate_state_bytes(groups, 2, 1, "Muon8bitBlock", group_states=[1, 2])
    with pytest.raises(ValueError, match=r"group_states: .*\[1, 3\]"):
        estimate_state_bytes(groups, 2, 1, "Muon8bitBlock", group_states=[2, 0, 2])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop_estimate_counts_the_momentum_buffer_its_group_keeps(momentum):
    """RMSprop8bitBlock keeps ``square_avg``, and ``momentum_buffer`` too when built with momentum: the
    estimate asks the optimizer built with the same params, and matches what a step allocates."""
    model = nn.Sequential(nn.Linear(100, 60), nn.Linear(60, 10))
    opt = ds_q8.RMSprop8bitBlock(model.parameters(), momentum=momentum, block_size=256, min_8bit_size=1000)
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    sizes = [[p.numel() for p in model.parameters()]]
    predicted = estimate_state_bytes(sizes, 0, 1, "RMSprop8bitBlock", block_size=256, min_8bit_size=1000,
                                     optimizer_params=dict(momentum=momentum))
    states = 2 if momentum else 1
    assert measured_state_bytes(opt)["total"] == predicted
    assert predicted == states * (6000 + 2 * 24 + 4 * (60 + 600 + 10))


def test_zero_partitions_shrink_with_world_size():
    groups = [[10_000, 333]]
    assert state_tensor_sizes(groups, 2, 2) == [[5168]]  # 10333 padded to a multiple of 4, halved
    assert state_tensor_sizes(groups, 3, 2) == [[5000 + 167]]
    one = estimate_state_bytes(groups, 2, 1, block_size=256)
    per_rank = [estimate_state_bytes(groups, 2, 2, block_size=256, rank=r) for r in (0, 1)]
    # rank 0 holds weight[0:5168]; rank 1 the rest of it and the small (fp32) parameter. Block 20 of
    # the weight is cut by the edge: both ranks keep its absmax, one bfloat16 per state more in all.
    assert per_rank[0] == 2 * (5168 + 2 * 21)
    assert sum(per_rank) == one + 2 * 2
    assert estimate_state_bytes(groups, 2, 2, block_size=256) == max(per_rank)
    assert estimate_state_bytes(groups, 2, 1, bits=32) == 2 * 4 * 10_333  # padding has no state


def test_gpt2_xl_sizes_and_ratio():
    groups = gpt2_param_groups(48, 1600)
    assert sum(map(sum, groups)) == 1_557_611_200
    b32 = estimate_state_bytes(groups, 2, 1, bits=32)
    b8 = estimate_state_bytes(groups, 2, 1)
    assert b32 == 8 * 1_557_611_200
    # biases and LayerNorms (1600 to 6400 elements) below min_8bit_size keep fp32 state; a bfloat16
    # maximum per 64 elements adds 1/32 byte to each code byte: (1 + 1/32) / 4 = 0.2578
    assert 0.2578 < b8 / b32 < 0.259


@pytest.mark.parametrize("bad,match", [(dict(stage=4), "stage"), (dict(world_size=0), "world_size"),
                                       (dict(block_size=1000), "block_size"), (dict(optimizer="SGD"), "optimizer")])
def test_bad_arguments_are_named(bad, match):
    kw = dict(stage=2, world_size=2)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        estimate_state_bytes([[5000]], **kw)


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["--model", "gpt2", "--stage", "2", "--world-size", "1", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gpt2 (" in text and "32-bit" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["world_size"] for r in rows] == [1, 2]
    assert rows[1]["bytes_8bit"] < rows[0]["bytes_8bit"]


@pytest.mark.slow
def test_cli_runs_as_module_and_rejects_bad_input():
    env = {"PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "ds_q8.memory", "--params", "1e6", "--stage", "3"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "1,000,000 parameters" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ds_q8.memory", "--params", "1e6", "--block-size", "100"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "block_size" in bad.stderr


def test_offload_prediction_by_part():
    """ZeRO-Offload host bytes, one group of 1000 and 3000 elements, one rank, block 64 (ds_q8.memory.predict_offload)."""
    from ds_q8.memory.predict_offload import predict_host_states

    groups, held = [[1000, 3000]], 4000
    ds = predict_host_states(groups, "deepspeed", 2, gradient_accumulation_steps=2)
    assert ds == dict(masters=4 * held, master_grads=4 * held, optimizer_states=8 * held, bf16_image=2 * held,
                      grad_accumulation=2 * held, unused=2 * 3000, state_index=0)
    q8 = predict_host_states(groups, "q8_bf16", 2, min_8bit_size=2000, gradient_accumulation_steps=2)
    state = 2 * (3000 + 2 * 47) + 2 * 4 * 1000  # 8-bit codes and bf16 maxima; fp32 moments of the small one
    assert q8 == dict(masters=2 * held, master_grads=2 * held, optimizer_states=state, bf16_image=0,
                      grad_accumulation=0, unused=0, state_index=0)
    theirs = predict_host_states(groups, "q8_bf16", 2, min_8bit_size=2000, host_copies=False)
    assert theirs["bf16_image"] == 2 * held and theirs["unused"] == 2 * 3000
    z3 = predict_host_states(groups, "q8", 3, world_size=2, min_8bit_size=2000)
    assert z3["masters"] == 4 * 2000 and z3["grad_accumulation"] == 2 * 2000  # fp32 gradient and a bf16 one
    assert predict_host_states(groups, "q8_bf16", 3, world_size=2)["grad_accumulation"] == 0  # one buffer
    for bad, match in [(dict(row="adam"), "row must be one of"), (dict(stage=0), "stage must be 1, 2 or 3"),
                       (dict(world_size=0), "world_size"), (dict(gradient_accumulation_steps=0), "accumulation")]:
        with pytest.raises(ValueError, match=match):
            predict_host_states(groups, **{"row": "q8", **bad})


def test_offload_cli_prints_every_row(capsys):
    assert main(["--offload", "--decoder", "7b", "--stage", "2", "--world-size", "1", "8"]) == 0
    out = capsys.readouterr().out
    assert "7b decoder (6,738,415,616 parameters)" in out and out.count("DeepSpeed AdamW") == 4
    assert "ds_q8 AdamW8bitBlock, bf16 masters (stochastic rounding)" in out
    with pytest.raises(SystemExit, match="ZeRO stage of 1, 2 or 3"):
        main(["--offload", "--stage", "0"])


@pytest.mark.parametrize("bits,num_states", [(8, 1), (8, 2), (8, 3), (4, 2)])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 4097])
def test_a_codecs_bytes_are_what_a_live_state_allocates(bits, num_states, numel):
    # the estimate asks the codec of the width; QuantizedState.bytes_for counts a live layout's tensors
    layout = StateLayout.for_parameter(torch.zeros(numel), True, 64, state_bits=bits)
    live = QuantizedState.bytes_for(layout, num_states)
    assert codec_for(bits).state_bytes(numel, num_states, 64) == live["codes"] + live["absmax"]
    assert tensor_state_bytes(numel, num_states, bits, 64, 0) == live["codes"] + live["absmax"]
