"""State layouts: parameter-aligned blocks inside flat partitions, without DeepSpeed.

Ranks are simulated by threads that share a small in-memory all-reduce (``ThreadComm``), so the
geometry can be pushed where real runs rarely go: partitions shorter than a block, one block held
by three ranks, fp32 and 8-bit parameters side by side. The property throughout: stepping the
partitions gives the parameters, codes and block maxima of stepping the parameters themselves.
"""
import copy
import warnings

import pytest
import torch

import ds_q8
from ds_q8.optim.layout import Segment, StateLayout, shared_blocks
from ds_q8.optim.state_io import STATE_DICT_MARKER

from helpers.layout import KW, SIZES, run_plain, run_sharded
from helpers.requantize import ROUND_TRIP


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("name", ["Adam8bitBlock", "Lion8bitBlock", "Momentum8bitBlock", "LAMB8bitBlock"])
def test_partitions_step_like_whole_parameters(name, world, stage):
    cls = ds_q8.OPTIMIZERS[name]
    kw = dict(KW, lr=0.1 if name == "Momentum8bitBlock" else 1e-2)
    bits = [8, 8, 8, 32, 8, 8, 8, 8]  # parameter 3 marked 32-bit, like a StableEmbedding
    params, ref = run_plain(cls, SIZES, 4, kw, bits)
    got, states, opts, _, shared = run_sharded(cls, SIZES, world, stage, 4, kw, bits)
    for i, (p, q) in enumerate(zip(params, got)):
        assert torch.equal(p.detach(), q), f"parameter {i} differs"
        want = ref.dequantized_state(p)
        for k in want:
            assert torch.equal(want[k], states[i][k]), f"parameter {i} state {k} differs"
    if world > 1:
        assert any(opt.tensors.layouts[f].shared8 for opt, f in zip(opts, [o.param_groups[0]["params"][0] for o in opts]))
        assert shared["calls"][0] >= 4  # the edge maxima (and LAMB's norms) were agreed every step


def test_block_held_by_three_ranks():
    # partitions of 40 elements inside blocks of 64: ranks 1..n hold slices of blocks shared three ways
    sizes = [200, 100]
    params, ref = run_plain(ds_q8.Adam8bitBlock, sizes, 3, dict(KW, lr=1e-2))
    got, states, opts, flats, _ = run_sharded(ds_q8.Adam8bitBlock, sizes, 8, 2, 3, dict(KW, lr=1e-2))
    for p, q in zip(params, got):
        assert torch.equal(p.detach(), q)
    layouts = [opt.tensors.layouts[f] for opt, f in zip(opts, flats)]
    assert any(len(lay.shared8) == 2 and lay.segments[0].numel < 64 for lay in layouts)


def test_geometry_of_a_cut_parameter():
    # elements 100..299 of a 1000-element parameter, blocks of 64: head 100..127 and tail 256..299 shared
    seg = Segment(10, 200, 0, 100, 1000, True, "w")
    slots = {b: i for i, b in enumerate(shared_blocks([seg], 64))}
    assert sorted(slots) == [(0, 1), (0, 4)]
    lay = StateLayout((220,), [seg], 64, slots=slots, num_slots=2)
    assert [(p.start, p.end) for p in lay.shared8] == [(10, 38), (166, 210)]
    assert [(p.start, p.end, p.absmax_start, p.absmax_count) for p in lay.pieces8] == [(38, 166, 1, 2)]
    assert lay.num_codes == 200 and lay.num_blocks == 4 and not lay.whole8
    with pytest.raises(ValueError, match="no slot"):
        StateLayout((220,), [seg], 64)


def test_min_8bit_size_is_judged_on_the_whole_parameter():
    # a 5000-element parameter cut into a 100-element partition slice stays 8-bit; a 50-element one fp32
    got, states, opts, flats, _ = run_sharded(ds_q8.Adam8bitBlock, [5000, 50], 50, 2, 1,
                                              dict(block_size=64, min_8bit_size=4096))
    lay = opts[-1].tensors.layouts[flats[-1]]
    assert [s.eight_bit for s in lay.segments] == [True, False]
    assert opts[0].state[flats[0]]["state1"].numel() == 101  # rank 0: 101 elements of the big parameter


def test_flat_state_dict_roundtrip_and_refusals():
    got, states, opts, flats, _ = run_sharded(ds_q8.AdamW8bitBlock, SIZES, 1, 2, 2, dict(KW, lr=1e-2))
    opt, flat = opts[0], flats[0]
    sd = opt.state_dict()
    desc = sd[STATE_DICT_MARKER]["layouts"][0]
    assert len(desc["segments"]) == len(SIZES) and sd[STATE_DICT_MARKER]["format"] == 4
    assert torch.is_tensor(sd["state"][0]["step"])
    fresh = ds_q8.AdamW8bitBlock([flat], **dict(KW, lr=1e-2))
    fresh.register_layout(flat, opt.tensors.layouts[flat])
    fresh.load_state_dict(copy.deepcopy(sd))
    for k, v in opt.state[flat].items():
        assert torch.equal(v, fresh.state[flat][k]), k
    # written for another partitioning: refused, naming the conversion
    other = ds_q8.AdamW8bitBlock([flat], **dict(KW, lr=1e-2))  # an unregistered flat: one segment
    with pytest.raises(ValueError, match="to-universal"):
        other.load_state_dict(copy.deepcopy(sd))
    # keys nobody knows
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_typo"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown keys"):
        fresh.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["extra"] = 1
    with pytest.raises(ValueError, match="unknown top-level keys"):
        fresh.load_state_dict(bad)


def test_state_dict_without_layouts_is_refused_and_nothing_changes():
    """A state_dict of codes without the saved layouts (the format before per-parameter layouts, which
    no release wrote) is refused with an error that says so; the optimizer keeps its state."""
    got, states, opts, flats, _ = run_sharded(ds_q8.Adam8bitBlock, SIZES, 1, 2, 2, dict(KW, lr=1e-2))
    opt, flat = opts[0], flats[0]
    values = opt.dequantized_state(flat)
    old_codes = {}
    rule = opt.rule_of(flat)
    for i, name in enumerate(rule.state_names, start=1):
        signed = rule.state_signed[i - 1]
        code = ds_q8.functional.state_map(opt._state_group(flat)["quantization"], signed, "cpu")
        codes, absmax = ds_q8.functional.quantize_blockwise(values[name], code, 64)
        old_codes[f"state{i}"], old_codes[f"absmax{i}"] = codes, absmax
    old = {"state": {0: dict(old_codes, step=2)}, "param_groups": opt.state_dict()["param_groups"],
           STATE_DICT_MARKER: {"optimizer": "Adam8bitBlock"}}
    before = copy.deepcopy(opt.state[flat])
    with pytest.raises(ValueError, match="no 'ds_q8' marker of format 2"):
        opt.load_state_dict(old)
    for k, v in before.items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt.state[flat][k]))


def test_rmsprop_momentum_travels_through_export():
    """The layout comes from the saved marker, not the class: RMSprop's momentum buffer is kept."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = ds_q8.RMSprop8bitBlock([p], lr=1e-3, momentum=0.9, block_size=256)
    for s in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    exported = ds_q8.RMSprop8bitBlock.export_fp32_state_dict(sd, universal=True)
    want = opt.dequantized_state(p)
    assert torch.equal(exported["state"][0]["exp_avg"], want["square_avg"])
    assert torch.equal(exported["state"][0]["exp_avg_sq"], want["momentum_buffer"])
    assert float(want["momentum_buffer"].abs().max()) > 0
    q = torch.nn.Parameter(p.detach().clone())
    fresh = ds_q8.RMSprop8bitBlock([q], lr=1e-3, momentum=0.9, block_size=256)
    fresh.load_state_dict(exported)
    back = fresh.dequantized_state(q)
    for name in want:  # half a step of the map's top binade at most (helpers/requantize.py)
        assert float((back[name] - want[name]).abs().max()) <= ROUND_TRIP * float(want[name].abs().max()), name


def test_step_survives_torch_distributed_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    def trained(seed, steps):
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(3000))
        opt = ds_q8.Adam8bitBlock([p], lr=1e-2, block_size=256)
        for _ in range(steps):
            p.grad = torch.randn_like(p)
            opt.step()
        return p, opt

    p, opt = trained(0, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "ck"))
    q, other = trained(1, 1)
    target = {"optim": other.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "ck"))
    other.load_state_dict(target["optim"])
    assert int(other.state[q]["step"]) == 5
    for k, v in opt.state[p].items():
        assert torch.equal(v, other.state[q][k]), k
