"""Faults at the DeepSpeed engine level, 2 ranks, ZeRO-2 (tests/test_engine_faults.py).

Usage: deepspeed --num_gpus 2 engine_faults.py --work DIR

1. damaged checkpoints: after saving, rank 0 writes copies with rank 1's shard cut in half and with
   one byte of rank 0's shard flipped; loading either must fail on every rank and leave parameters
   and 8-bit state as they were;
2. an Inf in one gradient element of one rank (bf16, no loss scaling, DeepSpeed's own overflow check
   off so that the optimizer's ``nonfinite="skip"`` decides): the element lands in one rank's
   partition only, yet both ranks skip the step and keep parameters and state.
Rank 0 writes what it saw to DIR/result.json.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import deepspeed
import ds_q8
from ds_q8.optim import nonfinite

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import TinyLM, VOCAB, batch  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True, "check_grad_overflow": False},
          "optimizer": {"type": "Adam8bitBlock", "params": {"lr": 0.01, "block_size": 256, "min_8bit_size": 1024}},
          "zero_optimization": {"stage": 2}}


def train_step(engine, step, rank):
    x, y = batch(step, 0, rank)
    loss = torch.nn.functional.cross_entropy(engine(x).float().reshape(-1, VOCAB), y.reshape(-1))
    engine.backward(loss)
    engine.step()


def snapshot(engine):
    opt = engine.optimizer.optimizer
    params = [p.detach().clone() for p in engine.module.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for st in opt.state.values()]
    return params, state


def same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    return (len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb)) and len(sa) == len(sb)
            and all(x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
                    for x, y in zip(sa, sb)))


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def damaged_copies(ck: Path):
    good = ck / "good"
    shard = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    for tag in ("cut", "flipped"):
        shutil.rmtree(ck / tag, ignore_errors=True)  # left by an earlier attempt of this launch
        shutil.copytree(good, ck / tag)
    cut = ck / "cut" / shard.format(1)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    flipped = ck / "flipped" / shard.format(0)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    work, ck = Path(args.work), Path(args.work) / "ckpt"
    torch.manual_seed(0)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    for step in range(2):
        train_step(engine, step, rank)
    engine.save_checkpoint(str(ck), tag="good")
    train_step(engine, 2, rank)  # the state now differs from the checkpoint: a partial load would show
    if rank == 0:
        damaged_copies(ck)
    dist.barrier()
    result = {}
    for tag in ("cut", "flipped"):
        before = snapshot(engine)
        try:
            engine.load_checkpoint(str(ck), tag=tag)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        result[tag] = {"errors": gathered(error), "unchanged": gathered(same(before, snapshot(engine)))}
    engine.load_checkpoint(str(ck), tag="good")  # the check does not get in the way of a whole checkpoint
    result["good_loaded_step"] = gathered(sorted({int(st["step"]) for st in engine.optimizer.optimizer.state.values()}))

    # an Inf in one element of one rank's gradient, twice: the norm DeepSpeed computed for clipping
    # answers the check (no read of the gradients), then, as without clipping, the gradients are read
    # and the ranks agree through the all-reduce
    opt = engine.optimizer.optimizer
    seen = []
    local_check = nonfinite._any_nonfinite

    def recording(grads, use_kernel):
        flag = local_check(grads, use_kernel)
        seen.append(bool(flag))
        return flag

    nonfinite._any_nonfinite = recording

    def poisoned_step(step):
        hook = None
        if rank == 0:
            hook = engine.module.fc2.weight.register_hook(
                lambda g: g.index_put((torch.tensor([5]), torch.tensor([7])), torch.tensor(float("inf"), dtype=g.dtype)))
        train_step(engine, step, rank)
        if hook is not None:
            hook.remove()

    before = snapshot(engine)
    checks = dict(opt.nonfinite_checks)
    poisoned_step(3)
    result["inf_by_norm"] = {"reads": gathered(len(seen)), "skipped": gathered(opt.skipped_steps),
                             "by_norm": gathered(opt.nonfinite_checks["norm"] - checks.get("norm", 0)),
                             "unchanged": gathered(same(before, snapshot(engine)))}
    source, opt.grad_norm_source = opt.grad_norm_source, None
    poisoned_step(3)
    opt.grad_norm_source = source
    result["inf"] = {"local_nonfinite": gathered(seen[-1]),
                     "skipped": gathered(opt.skipped_steps),
                     "unchanged": gathered(same(before, snapshot(engine)))}
    train_step(engine, 4, rank)
    result["inf"]["next_step_updates"] = gathered(not same(before, snapshot(engine)))
    if rank == 0:
        (work / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
