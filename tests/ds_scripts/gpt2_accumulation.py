"""GPT-2 under ZeRO-2 with gradient accumulation, for tests/test_zero_accumulation.py.

Usage: deepspeed --num_gpus N gpt2_accumulation.py --out result.pt [--steps S] [--micro_batches M]

Every step takes the same M micro-batches of real text whatever the world size: rank r of N handles
micro-batches r*M/N .. (r+1)*M/N - 1, and DeepSpeed accumulates M/N of them per rank before its
reduction. So the averaged gradient is the same sum at every world size, up to the order of its
float additions. Each optimizer (torch's Adam through DeepSpeed, then ds_q8's Adam8bitBlock) trains
a fresh model from the same weights; rank 0 saves the final parameters and the optimizer's state codes.
Gradient clipping is off: the norm's rounding would differ between world sizes on its own.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import deepspeed
import ds_q8  # noqa: F401  (registers the ds_q8 optimizer types)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
import gpt_data  # noqa: E402
import gpt_models  # noqa: E402

CONTEXT, MICRO_BATCH, VOCAB = 64, 4, gpt_data.BYTE_VOCAB_SIZE
OPTIMIZERS = {"torch_adam": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "Adam8bitBlock": {"type": "Adam8bitBlock", "params": {"lr": 1e-3}}}


def run(name, steps, micro_batches, train, rank, world):
    torch.manual_seed(0)
    model = gpt_models.build_model(gpt_models.gpt2_config_of(2, 4, 128, VOCAB, CONTEXT))
    per_rank = micro_batches // world
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": per_rank,
              "gradient_clipping": 0.0, "optimizer": OPTIMIZERS[name], "zero_optimization": {"stage": 2},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps):
        for j in range(per_rank):
            x, y = gpt_data.get_batch(train, MICRO_BATCH, CONTEXT, seed=0, rank=rank * per_rank + j, step=step)
            loss = torch.nn.functional.cross_entropy(engine(x).logits.reshape(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
            engine.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    codes = {}
    inner = engine.optimizer.optimizer
    if isinstance(inner, ds_q8.optim.Optimizer8bitBlock):
        # the second moment's codes of each parameter, as the per-parameter state API reads them
        from deepspeed.utils import safe_get_full_optimizer_state
        for n, p in model.named_parameters():
            codes[n] = safe_get_full_optimizer_state(p, "exp_avg_sq")
    return params, codes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro_batches", type=int, default=4)
    ap.add_argument("--block_size", type=int, default=None, help="Adam8bitBlock's block_size (default: its own)")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.micro_batches % world:
        raise ValueError(f"--micro_batches ({args.micro_batches}) must be a multiple of the world size ({world})")
    train, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    if args.block_size is not None:
        OPTIMIZERS["Adam8bitBlock"]["params"]["block_size"] = args.block_size
    result = {}
    for name in OPTIMIZERS:
        params, states = run(name, args.steps, args.micro_batches, train, rank, world)
        result[name] = {"params": params, "exp_avg_sq": states}
        dist.barrier()
    if rank == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
