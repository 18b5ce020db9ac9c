"""bf16 masters without copies (``integration.shared_masters``) through checkpoints: ZeRO-2 at two ranks
saves what DeepSpeed's copying layout saves (same files, same bytes), resumes bit for bit, reshards
2 -> 3 ranks through ``to-universal`` code for code, and DeepSpeed's ``zero_to_fp32`` recovers the
parameters."""
import sys

import pytest
import torch

from helpers.ds_launch import config, launch, run_checked

pytestmark = pytest.mark.multirank

MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
SAVE_AT, MORE = 3, 2
HIDDEN = 127  # 30,941 parameters: the last rank's partition ends in padding
OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"  # DeepSpeed names bf16 ZeRO files so


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    work = tmp_path_factory.mktemp("shared")
    ck = str(work / "ckpt")
    c = config(2, bf16=MASTERS)
    a = launch([{"name": tag, "steps": SAVE_AT + MORE, "save": [ck, tag, SAVE_AT], "config": c, "hidden": HIDDEN,
                 "share_masters": tag == "e", "model_states": True} for tag in ("e", "d")], work, "a_save", ranks=2)
    b = launch([{"name": "e", "steps": MORE, "start_step": SAVE_AT, "load": [ck, "e"], "config": c, "hidden": HIDDEN}],
               work, "b_resume", ranks=2)
    run_checked([sys.executable, "-m", "ds_q8.checkpoint", "to-universal", str(work / "ckpt" / "e"),
                 str(work / "ckpt" / "e_uni")], work / "conv.log", timeout=300)
    u = launch([{"name": "e_uni", "steps": 1, "start_step": SAVE_AT, "load": [ck, "e_uni"], "hidden": HIDDEN,
                 "dump_state": str(work / "dump_uni"), "config": config(2, bf16=MASTERS,
                                                                        checkpoint={"load_universal": True})}],
               work, "c_universal_3ranks", ranks=3)
    return {"a": a, "b": b, "u": u, "work": work}


def test_checkpoints_hold_what_the_copying_layout_saves(flow):
    folder = flow["work"] / "ckpt"
    for r in range(2):
        e = torch.load(folder / "e" / OPTIM.format(r), map_location="cpu", weights_only=False)
        d = torch.load(folder / "d" / OPTIM.format(r), map_location="cpu", weights_only=False)
        me = e["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        md = d["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        assert [t.dtype for t in me] == [torch.bfloat16] and all(torch.equal(x, y) for x, y in zip(me, md))
        # each rank's file holds its own partition, not a view of the whole flat group
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in me)
        se = e["optimizer_state_dict"]["base_optimizer_state"]["state"]
        sd = d["optimizer_state_dict"]["base_optimizer_state"]["state"]
        for k in se:
            for name, v in se[k].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd[k][name])), name
    sizes = {t: sum((folder / t / OPTIM.format(r)).stat().st_size for r in range(2)) for t in ("e", "d")}
    assert abs(sizes["e"] - sizes["d"]) < 4096, sizes


def test_the_two_layouts_really_differ(flow):
    e, d = flow["a"]["e"]["model_states"], flow["a"]["d"]["model_states"]
    assert e["masters"] == 0 and e["master_grads"] == 0  # saved from shared masters, gradient not copied
    assert d["masters"] > 0 and d["master_grads"] > 0  # saved from DeepSpeed's copies


def test_resume_is_bit_identical(flow):
    assert flow["b"]["e"]["losses"] == flow["a"]["e"]["losses"][SAVE_AT:]
    assert flow["a"]["e"]["losses"] == flow["a"]["d"]["losses"]


def test_universal_reshards_two_ranks_to_three(flow):
    from ds_q8.optim import Adam8bitBlock

    work = flow["work"]
    dumps = [torch.load(work / f"dump_uni.rank{r}.pt", weights_only=False)[0] for r in range(3)]
    loaded = {n: torch.cat([d["values"][n] for d in dumps]) for n in dumps[0]["values"]}
    parts = []
    for r in range(2):
        sd = torch.load(work / "ckpt" / "e" / OPTIM.format(r), map_location="cpu", weights_only=False)
        inner = sd["optimizer_state_dict"]["base_optimizer_state"]
        parts.append(Adam8bitBlock.export_fp32_state_dict(inner)["state"][inner["param_groups"][0]["params"][0]])
    n = 30941
    for name in ("exp_avg", "exp_avg_sq"):
        saved = torch.cat([p[name] for p in parts])[:n]
        assert torch.equal(loaded[name][:n], saved), name
    assert all(d["values"]["exp_avg"].dtype == torch.float32 for d in dumps)
    assert flow["u"]["e_uni"]["stepped_dtypes"] == ["bfloat16"]


def test_zero_to_fp32_recovers_the_parameters(flow):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = flow["work"] / "ckpt"
    model = torch.load(folder / "e" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    for tag in ("e", "d"):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
        assert set(fp32) == set(model)
        for name, value in fp32.items():
            # it returns the masters as they were saved: bf16 here, equal to the parameters
            assert torch.equal(value.float(), model[name].float()), (tag, name)
