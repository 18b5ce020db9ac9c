"""The paper's ablation at small scale: which parts of 8-bit Adam keep training stable.

Small byte-level GPT-2 models are trained on CPU on the source text of Python's standard library
with four optimizers (32-bit Adam; 8-bit Adam with dynamic block-wise, linear block-wise and
dynamic tensor-wise state), each with and without StableEmbedding, over several seeds and
learning rates. For every run: the final validation perplexity (per byte) and whether it was
unstable. Writes ``ablation.md`` (the table), ``ablation.png`` (the plot) and ``ablation.json``
(every run) to ``--out``.

    python studies/ablation.py                  # default grid (64 runs), ~15-25 min on one core
    python studies/ablation.py --quick          # smoke test, well under a minute

Plain PyTorch training loop (no DeepSpeed), one intra-op thread per run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch

import ds_q8

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "launch")]  # the studies, then the trainer's modules
import gpt_data  # noqa: E402
import gpt_models  # noqa: E402

VOCAB = 256  # bytes
UNIFORM_LOSS = math.log(VOCAB)

#: name -> keyword arguments for ds_q8.Adam8bitBlock, or None for torch's 32-bit Adam
VARIANTS: Dict[str, Optional[dict]] = {
    "32-bit Adam": None,
    "8-bit dynamic block-wise": dict(quantization="dynamic", block_size=2048),
    "8-bit linear block-wise": dict(quantization="linear", block_size=2048),
    "8-bit dynamic tensor-wise": dict(quantization="dynamic", block_size=None),
}


@dataclasses.dataclass
class Config:
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    context: int = 64
    batch: int = 16
    steps: int = 200
    warmup: int = 20
    eval_every: int = 50
    eval_windows: int = 64
    lrs: tuple = (1e-3, 4e-3, 1.6e-2, 6.4e-2)
    seeds: tuple = (0, 1)
    betas: tuple = (0.9, 0.98)
    train_bytes: int = 4_000_000
    val_bytes: int = 200_000


QUICK = Config(n_layer=1, n_embd=64, n_head=2, context=32, batch=8, steps=24, warmup=4, eval_every=12,
               eval_windows=16, lrs=(4e-3,), seeds=(0,), train_bytes=200_000, val_bytes=20_000)


# ---------------------------------------------------------------- data
def stdlib_files() -> List[str]:
    """The standard library's top-level ``.py`` files, sorted by name (the trainer's default corpus)."""
    return [str(p) for p in gpt_data.default_corpus_files()]


def load_corpus(train_bytes: int, val_bytes: int):
    """(train, val) uint8 tensors. Every tenth file (by sorted name) is validation text."""
    train, val = bytearray(), bytearray()
    for i, path in enumerate(stdlib_files()):
        target, budget = (val, val_bytes) if i % 10 == 0 else (train, train_bytes)
        if len(target) < budget:
            with open(path, "rb") as f:
                target.extend(f.read()[: budget - len(target)])
        if len(train) >= train_bytes and len(val) >= val_bytes:
            break
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


# ---------------------------------------------------------------- model
def build_model(cfg: Config, stable_embedding: bool, seed: int):
    torch.manual_seed(seed)
    config = gpt_models.gpt2_config_of(cfg.n_layer, cfg.n_head, cfg.n_embd, VOCAB, cfg.context)
    model = gpt_models.build_model(config, stable_embedding)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def make_optimizer(variant: str, model, lr: float, cfg: Config):
    kwargs = VARIANTS[variant]
    params = list(model.parameters())
    if kwargs is None:
        return torch.optim.Adam(params, lr=lr, betas=cfg.betas, foreach=False)
    # the paper's 8-bit Adam: every tensor's state in 8 bits, the embeddings' too unless StableEmbedding marks them
    return ds_q8.Adam8bitBlock(params, lr=lr, betas=cfg.betas, embeddings_32bit=False, **kwargs)


def lr_at(step: int, peak: float, cfg: Config) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))


# ---------------------------------------------------------------- one run
@torch.no_grad()
def evaluate(model, val: torch.Tensor, cfg: Config) -> float:
    n = min(cfg.eval_windows, (val.numel() - 1) // (cfg.context + 1))
    windows = val[: n * (cfg.context + 1)].view(n, cfg.context + 1).long()
    total = 0.0
    for chunk in windows.split(cfg.batch):
        logits = model(chunk[:, :-1]).logits
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1),
                                                         reduction="sum"))
    return total / (n * cfg.context)


def train_one(variant: str, stable: bool, lr: float, seed: int, cfg: Config, train, val) -> dict:
    """Train one model; returns its final validation loss and whether the run was unstable.

    Unstable: a non-finite loss, a final validation loss no better than guessing bytes uniformly,
    or a final validation loss more than 0.3 nats above the best one seen earlier in the run.
    """
    torch.set_num_threads(1)
    model = build_model(cfg, stable, seed)
    opt = make_optimizer(variant, model, lr, cfg)
    batches = torch.Generator().manual_seed(10_000 + seed)
    evals, reason = [], ""
    t0 = time.time()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, cfg)
        starts = torch.randint(0, train.numel() - cfg.context - 1, (cfg.batch,), generator=batches)
        x = torch.stack([train[s: s + cfg.context + 1] for s in starts.tolist()]).long()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            reason = f"non-finite loss at step {step}"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append(evaluate(model, val, cfg))
    final = evals[-1] if evals and not reason else float("nan")
    if not reason:
        if not math.isfinite(final):
            reason = "non-finite validation loss"
        elif final >= UNIFORM_LOSS:
            reason = f"final loss {final:.2f} no better than uniform ({UNIFORM_LOSS:.2f})"
        elif len(evals) > 1 and final > min(evals[:-1]) + 0.3:
            reason = f"final loss {final:.2f} above earlier best {min(evals[:-1]):.2f}"
    return dict(variant=variant, stable_embedding=stable, lr=lr, seed=seed, evals=evals, final_loss=final,
                perplexity=math.exp(final) if math.isfinite(final) and final < 50 else float("inf"),
                unstable=bool(reason), reason=reason, seconds=round(time.time() - t0, 1))


def _run_job(job):
    return train_one(*job)


# ---------------------------------------------------------------- the grid and its report
def run_grid(cfg: Config, workers: int = 1, log=print) -> List[dict]:
    train, val = load_corpus(cfg.train_bytes, cfg.val_bytes)
    jobs = [(v, s, lr, seed, cfg, train, val) for s in (False, True) for v in VARIANTS for lr in cfg.lrs
            for seed in cfg.seeds]
    results = []
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap_unordered(_run_job, jobs):
                results.append(r)
                log(_describe(r, len(results), len(jobs)))
    else:
        for job in jobs:
            results.append(_run_job(job))
            log(_describe(results[-1], len(results), len(jobs)))
    return results


def _describe(r: dict, i: int, n: int) -> str:
    emb = "stable-emb" if r["stable_embedding"] else "plain-emb"
    status = f"UNSTABLE ({r['reason']})" if r["unstable"] else f"ppl {r['perplexity']:.3f}"
    return f"[{i}/{n}] {r['variant']:<26} {emb:<10} lr={r['lr']:<7g} seed={r['seed']} {status} {r['seconds']}s"


def summarize(results: List[dict], cfg: Config) -> List[dict]:
    """One row per (variant, embedding): mean perplexity of the stable runs per lr, unstable share."""
    rows = []
    for stable in (False, True):
        for v in VARIANTS:
            runs = [r for r in results if r["variant"] == v and r["stable_embedding"] == stable]
            if not runs:
                continue
            cells = {}
            for lr in cfg.lrs:
                at = [r for r in runs if r["lr"] == lr]
                ok = [r["perplexity"] for r in at if not r["unstable"]]
                cells[lr] = dict(ppl=sum(ok) / len(ok) if ok else None, unstable=len(at) - len(ok), runs=len(at))
            n_bad = sum(r["unstable"] for r in runs)
            rows.append(dict(variant=v, stable_embedding=stable, cells=cells, unstable=n_bad, runs=len(runs)))
    return rows


def markdown_table(rows: List[dict], cfg: Config) -> str:
    head = ["optimizer", "StableEmbedding"] + [f"ppl @ lr {lr:g}" for lr in cfg.lrs] + ["unstable runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = []
        for lr in cfg.lrs:
            c = row["cells"][lr]
            text = "all unstable" if c["ppl"] is None else f"{c['ppl']:.3f}"
            if c["unstable"] and c["ppl"] is not None:
                text += f" ({c['unstable']}/{c['runs']} unstable)"
            cells.append(text)
        share = f"{row['unstable']}/{row['runs']} ({100.0 * row['unstable'] / row['runs']:.0f}%)"
        lines.append("| " + " | ".join([row["variant"], "yes" if row["stable_embedding"] else "no"] + cells
                                       + [share]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], cfg: Config, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    finite = [c["ppl"] for r in rows for c in r["cells"].values() if c["ppl"] is not None]
    top = max(finite) * 1.05 if finite else 1.0
    for ax, stable in zip(axes, (False, True)):
        for row in (r for r in rows if r["stable_embedding"] == stable):
            xs = [lr for lr in cfg.lrs if row["cells"][lr]["ppl"] is not None]
            line, = ax.plot(xs, [row["cells"][lr]["ppl"] for lr in xs], marker="o", label=row["variant"])
            bad = [lr for lr in cfg.lrs if row["cells"][lr]["unstable"]]
            ax.plot(bad, [top] * len(bad), marker="x", linestyle="none", color=line.get_color(), markersize=10)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_title("StableEmbedding" if stable else "plain embedding")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation perplexity per byte (x: unstable run)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny grid for smoke tests")
    ap.add_argument("--out", default="runs/ablation", help="output folder")
    ap.add_argument("--steps", type=int, help="training steps per run")
    ap.add_argument("--lrs", type=float, nargs="+", help="peak learning rates")
    ap.add_argument("--seeds", type=int, nargs="+", help="seeds")
    ap.add_argument("--workers", type=int, default=1, help="runs in parallel (one thread each)")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(QUICK if args.quick else Config())
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        cfg.steps = args.steps
        cfg.warmup = min(cfg.warmup, max(1, args.steps // 10))
        cfg.eval_every = max(1, min(cfg.eval_every, args.steps))
    if args.lrs:
        if any(not (lr > 0) for lr in args.lrs):
            raise ValueError(f"--lrs must all be > 0, got {args.lrs}")
        cfg.lrs = tuple(args.lrs)
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = run_grid(cfg, args.workers)
    rows = summarize(results, cfg)
    table = markdown_table(rows, cfg)
    with open(os.path.join(args.out, "ablation.md"), "w") as f:
        f.write(f"GPT-2 {cfg.n_layer} layers, d={cfg.n_embd}, context {cfg.context}, batch {cfg.batch}, "
                f"{cfg.steps} steps, seeds {list(cfg.seeds)}; validation perplexity per byte, mean over "
                f"stable runs.\n\n")
        f.write(table)
    with open(os.path.join(args.out, "ablation.json"), "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), runs=results), f, indent=1)
    plot(rows, cfg, os.path.join(args.out, "ablation.png"))
    print(table)
    print(f"{len(results)} runs in {time.time() - t0:.0f}s; wrote {args.out}/ablation.md, .png, .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
