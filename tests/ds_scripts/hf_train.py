"""HF Trainer with a DeepSpeed config whose optimizer section selects a ds_q8 type.

Usage: deepspeed --num_gpus N hf_train.py --out result.json
Trains a tiny GPT-2 built from a config (no downloads) for a few steps with ZeRO-2; rank 0
writes the optimizer class DeepSpeed built, the state dtypes and the logged losses.
"""
import argparse
import json

import torch
import torch.distributed as dist

import ds_q8  # noqa: F401  (registers the optimizer types before the Trainer builds DeepSpeed)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

SEQ, VOCAB = 16, 128


class Copies(torch.utils.data.Dataset):
    """One short random pattern, repeated: a few steps suffice to learn it."""

    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, VOCAB, (4,), generator=g).repeat(SEQ // 4)] * n

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i], "labels": self.items[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "Adam8bitBlock",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                 "block_size": 256, "min_8bit_size": 1024}},
        "zero_optimization": {"stage": 2},
    }
    targs = TrainingArguments(output_dir=args.workdir, per_device_train_batch_size=4, max_steps=8,
                              learning_rate=2e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                              deepspeed=ds_config, disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))
    trainer = Trainer(model=model, args=targs, train_dataset=Copies())
    trainer.train()
    opt = trainer.model_wrapped.optimizer.optimizer  # ZeRO wrapper -> the optimizer DeepSpeed built
    dtypes = sorted({str(v.dtype) for st in opt.state.values() for k, v in st.items() if k.startswith("state")})
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"optimizer": type(opt).__name__, "state_dtypes": dtypes, "losses": losses,
                       "betas": list(opt.param_groups[0]["betas"]), "lr_logged": [h.get("learning_rate")
                       for h in trainer.state.log_history if "loss" in h]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
