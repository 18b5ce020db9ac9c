"""Run a list of small DeepSpeed training jobs in one launcher process (tests/test_deepspeed_*.py).

Usage: deepspeed --num_gpus N train.py --plan plan.json --out result.json

Each job builds a fresh tiny model and engine from its DeepSpeed config, optionally loads a
checkpoint, trains a few steps, optionally saves, and records per-step losses (mean over ranks),
per-rank optimizer-state bytes and the dtypes of the state. A job may instead expect
``deepspeed.initialize`` (or the load) to fail with a message; the message is recorded.
Rank 0 writes {job name: record} to --out. Starting DeepSpeed once for many jobs keeps the tests fast.
"""
import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
import ds_q8
from ds_q8.memory.measure_offload import measure_host_states
from ds_q8.integration import grad_norm, host_copies, shared_masters
from ds_q8.memory.measure import measure_model_states, measured_state_bytes, watch_model_states

VOCAB, DIM, HIDDEN, SEQ, MICRO_BATCH = 64, 32, 128, 8, 4
LOG_LINES = []  # what ds_q8 logged in this process (the embeddings' line), kept for each job's record


class _KeepLines(logging.Handler):
    def emit(self, record):
        LOG_LINES.append(record.getMessage())


logging.getLogger("ds_q8").addHandler(_KeepLines())


class TinyLM(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(self.emb(x)))
        h = self.norm(torch.nn.functional.gelu(self.fc2(h)))
        return self.head(h)


class GPT2Logits(nn.Module):
    """GPT-2 from transformers' config (Conv1D layers, fused c_attn) on the tiny vocabulary."""

    def __init__(self, n_layer, n_embd):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer,
                                               n_head=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, x):
        return self.gpt2(x).logits


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    return x, (x * 7 + 3) % VOCAB  # a learnable mapping


def state_summary(engine):
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and getattr(opt, "optimizer", None) is not None:
        opt = opt.optimizer
    kinds = {}
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                kinds.setdefault(k, sorted({*kinds.get(k, []), str(v.dtype).replace("torch.", "")}))
    steps = sorted({int(st["step"]) for st in opt.state.values() if "step" in st})
    entries = sorted([int(st[key].numel()), str(st[key].dtype).replace("torch.", "")]
                     for st in opt.state.values() for key in ("state1", "state1_fp32") if key in st)
    # the dtype of what the optimizer steps: fp32 master partitions, or bf16 ones with bf16 master weights
    stepped = sorted({str(t.dtype).replace("torch.", "") for t in opt.state})
    return type(opt).__name__, kinds, steps, entries, stepped


def dump_state(engine, prefix, rank):
    """Save this rank's optimizer state as fp32 (per group, in group order) right after loading."""
    opt = engine.optimizer.optimizer
    opt.adopt_loaded_state()
    groups = []
    for g in opt.param_groups:
        p = g["params"][0]
        st = opt.state.get(p, {})
        groups.append({"values": opt.dequantized_state(p), "step": st.get("step"),
                       "dtypes": {k: str(v.dtype) for k, v in st.items() if torch.is_tensor(v)}})
    torch.save(groups, f"{prefix}.rank{rank}.pt")


def _bits_digest(model) -> str:
    """A digest of every parameter's bits on this rank (after ZeRO's all-gather every rank holds all)."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        if p.numel():
            h.update(p.detach().cpu().contiguous().view(torch.uint8 if p.element_size() == 1 else torch.int16
                                                        if p.element_size() == 2 else torch.int32).numpy().tobytes())
    return h.hexdigest()


def run_job(job, rank, world):
    torch.manual_seed(job.get("seed", 0))
    model = GPT2Logits(*job["gpt2"]) if job.get("gpt2") else TinyLM(job.get("hidden", HIDDEN))
    # False: DeepSpeed's own copies of bf16 masters and of the step's gradient (the ladder's rung (d)), and
    # its host buffers under ZeRO-Offload
    shared_masters.ENABLED = host_copies.ENABLED = job.get("share_masters", True)
    params = ds_q8.param_groups(model, weight_decay=0.01) if job.get("param_groups") else model.parameters()
    rec = {}
    logged = len(LOG_LINES)
    phase = "initialize"
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=job["config"])
        if job.get("load"):
            phase = "load"
            path, tag = job["load"]
            engine.load_checkpoint(path, tag=tag)
    except Exception as e:  # a job that expects an error records it; others fail loudly
        if not job.get("expect_error"):
            raise
        rec["error"] = f"{phase}: {type(e).__name__}: {e}"
        return rec
    if job.get("expect_error"):
        raise AssertionError(f"job {job['name']} was expected to fail but did not")
    if job.get("dump_state"):
        dump_state(engine, job["dump_state"], rank)
    gas = job["config"].get("gradient_accumulation_steps", 1)
    start = job.get("start_step", 0)
    losses, lrs = [], []
    model_states = None
    for step in range(start, start + job["steps"]):
        total = 0.0

        def one_step():
            nonlocal total
            for micro in range(gas):
                x, y = batch(step, micro, rank)
                logits = engine(x)
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())

        if job.get("model_states") and model_states is None:  # measured over the first optimizer step
            model_states = measure_model_states(engine, one_step)
        elif job.get("reachable") and step == start + 1:  # every storage the engine holds, over the second
            rec["reachable"] = watch_model_states(engine, one_step)
        else:
            one_step()
        t = torch.tensor([total / gas], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        lrs.append(engine.get_lr()[0])
        if job.get("save") and job["save"][2] == step + 1:
            engine.save_checkpoint(job["save"][0], tag=job["save"][1])
    if job.get("host_states"):  # every host storage under ZeRO-Offload, part by part, on every rank
        rec["host_states"] = [None] * world
        dist.all_gather_object(rec["host_states"], measure_host_states(engine))
    name, kinds, steps, entries, stepped = state_summary(engine)
    by_rank = [None] * world
    dist.all_gather_object(by_rank, measured_state_bytes(engine))
    inner = grad_norm._ds_q8_optimizer(engine)
    rec["nonfinite_checks"] = dict(inner.nonfinite_checks) if inner is not None else None
    rec.update(losses=losses, lrs=lrs, optimizer=name, state_dtypes=kinds, state_steps=steps, state_bytes=by_rank,
               state_entries=entries, stepped_dtypes=stepped, model_states=model_states,
               param_sizes=[getattr(p, "ds_numel", p.numel()) for p in model.parameters()],  # whole under ZeRO-3
               params_bits=_bits_digest(model), ds_q8_log=LOG_LINES[logged:],
               embedding_marks=[getattr(p, "ds_q8_embedding", None) for p in model.parameters()])
    if hasattr(engine, "destroy"):
        engine.destroy()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for job in plan:
        start = time.perf_counter()
        results[job["name"]] = run_job(job, rank, world)
        dist.barrier()
        results[job["name"]]["seconds"] = round(time.perf_counter() - start, 2)  # to see where a fixture's time goes
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
