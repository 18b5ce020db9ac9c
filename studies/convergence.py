"""Convergence study: 8-bit AdamW against 32-bit, from a comfortable learning rate to the edge of stability.

GPT-2 tiny (2 layers, d=128, 4 heads, byte vocabulary, context 64) is trained on the source of Python's
standard library (launch/gpt_data.py: 90% of each file for training, the rest for validation; ``--data
pydoc-topics`` takes Python's documentation topics instead) with each optimizer at each peak learning
rate and seed: the same initial weights, batches and schedule (linear warmup, cosine decay to a tenth;
``--schedule constant``: the learning rate from the first step, no warmup) for every optimizer of a seed. Prints, per optimizer and learning
rate, the mean and the range of the final validation loss over the seeds, the mean against 32-bit, how
many seeds ended worse than 32-bit's worst seed, a rank-sum test of the two sets of seeds, and the wall time of a run; writes every run
(with its training loss, averaged over each 20 steps) to ``--out``/convergence.json and the table to convergence.md.

    python studies/convergence.py                      # lr 1e-3, 4e-3, 1.6e-2 x seeds 0-5 x torch, ds_q8, bnb
    python studies/convergence.py --lrs 4e-3 --seeds 0 1 2 3 --optimizers torch ds_q8 sim sim:m32 sim:sr
    python studies/convergence.py --drift --lrs 4e-3    # how the states' rounding drifts, on torch's trajectory
    python studies/convergence.py --schedule constant --context 128 --data pydoc-topics --lrs 4e-3 1.6e-2

Optimizers:
  torch        torch.optim.AdamW, 32-bit state
  ds_q8[:K+K]  ds_q8.AdamW8bitBlock (block 64, tensors under 4096 elements keep 32-bit state), with
               changes K:  nearest  state_rounding="nearest" (every state rounded to nearest)
                           srv      state_rounding="stochastic_unsigned" (first moments to nearest,
                                    second moments stochastically)
                           R        any other state_rounding R by its name (stochastic, guided, ...)
                           Q        a quantization Q by its name (dynamic, dynamic6, minifloat, linear)
                           bsN      block_size=N (64-4096)
                           emb32    32-bit state for the token and position embeddings, marked
                                    ds_q8_optim_bits = 32 (what ds_q8.param_groups gives them)
                           emb8     embeddings_32bit=False: the embeddings' state at the group's 8 bits
                                    like every other tensor's (the default before embeddings_32bit)
                           4bit     optim_bits=4: both moments in 4 bits (ds_q8/format4.py)
                           fp32     optim_bits=32: AdamW's arithmetic in ds_q8's kernels on fp32 state,
                                    a 32-bit run that differs from torch's only in rounding (how far
                                    chaos alone moves a run)
                           jitter   (torch and sim too) each initial weight times 1 + 1e-6 * N(0, 1):
                                    a start indistinguishable from the seed's, to see how far
                                    chaos alone carries a run; jitterK: draw K of that noise
                           amp      fp32 masters, forward and backward under bf16 autocast
                           bf16     bf16 parameters (masters), written with stochastic rounding;
                                    bf16rn: rounded to nearest; bf16cb: with a correction byte
                                    (correction_byte=True: 24-bit masters written to nearest)
  bnb          bitsandbytes' AdamW8bit, when bitsandbytes is installed (block 256)
  torchao4     torchao's AdamW4bit, when torchao is installed (block 128, the 4-bit paper's maps)
  q4[:...]     AdamW with 4-bit states simulated in plain PyTorch (studies/lowbit_sim.py names the variants)
  sim[:K+K]    AdamW whose states go through ds_q8.functional's block-wise quantization in plain
               PyTorch (slower), for changes the optimizer has no option for; sim alone rounds both
               states to nearest with ds_q8's zero point (= ds_q8:nearest):
                           nozp     no zero point: small second moments can become 0
                           m32      first moment in 32 bits       v32   second moment in 32 bits
                           neg1     a signed map whose most negative entry is -1.0, not -0.99297
                           sr       stochastic requantization of both states, as ds_q8 does (srm:
                                    the first moment only, srv: the second moment only, = ds_q8:srv)
                           bsN, emb32, jitter[K]  as for ds_q8
``--reference NAME`` (default torch) is the run the others are compared with, seed by seed; the
table then also gives each run's weight drift from it (the relative L2 distance of the final weights).
The masters study (fp32 against bf16 masters at a low learning rate) is one command:

    python studies/convergence.py --lrs 1e-4 --steps 2000 --seeds 0 1 2 --workers 1 --reference ds_q8:amp \
        --optimizers ds_q8:amp ds_q8:bf16 ds_q8:bf16cb --out studies/results/correction_byte/steps2000

(add ``ds_q8:bf16rn`` for bf16 masters rounded to nearest).

Every optimizer gets all of ``model.parameters()`` in one group, with AdamW's defaults (betas 0.9/0.999,
eps 1e-8, weight decay 0.01 on every parameter), one intra-op thread.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "launch")]  # the studies, then the trainer's modules
import gpt_data  # noqa: E402
import gpt_models  # noqa: E402
import lowbit_sim  # noqa: E402
from ablation import lr_at  # noqa: E402  (the ablation's schedule: linear warmup, cosine to a tenth)

VOCAB = gpt_data.BYTE_VOCAB_SIZE
SIM_CHANGES = ("nozp", "m32", "v32", "neg1", "sr", "srm", "srv", "emb32")  # and bsN, jitter[K]
DS_Q8_CHANGES = ("nearest", "srv", "emb32", "emb8", "4bit", "fp32", "amp", "bf16", "bf16rn", "bf16cb")  # and bsN, jitter[K]
BF16_MASTERS = {"bf16": {}, "bf16rn": {"stochastic_rounding": False}, "bf16cb": {"correction_byte": True}}


@dataclasses.dataclass
class Config:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    context: int = 64
    batch: int = 16
    steps: int = 300
    warmup: int = 30
    eval_windows: int = 256
    lrs: tuple = (1e-3, 4e-3, 1.6e-2)
    seeds: tuple = (0, 1, 2, 3, 4, 5)
    optimizers: tuple = ("torch", "ds_q8", "bnb")
    reference: str = "torch"         # what the others are compared with
    schedule: str = "warmup-cosine"  # or "constant": the peak from step 0
    data: Optional[str] = None       # None: the standard library's source; a path; or "pydoc-topics"


SCHEDULES = ("warmup-cosine", "constant")


def corpus(cfg: Config) -> Optional[str]:
    """The ``--data`` of gpt_data: None (the standard library's source) or a path."""
    if cfg.data == "pydoc-topics":  # Python's documentation topics, as pydoc shows them
        import pydoc_data.topics

        return pydoc_data.topics.__file__
    return cfg.data


def learning_rate(step: int, peak: float, cfg: Config) -> float:
    return peak if cfg.schedule == "constant" else lr_at(step, peak, cfg)


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


def split_name(name: str):
    """``"ds_q8:bs256+emb32"`` -> ``("ds_q8", ("bs256", "emb32"))``."""
    base, _, changes = name.partition(":")
    return base, tuple(changes.split("+")) if changes else ()


def check_optimizer_name(name: str) -> None:
    if name.startswith("q4"):
        lowbit_sim.parse(name)
        return
    if name == "torchao4":
        return
    base, changes = split_name(name)
    valid = {"torch": (), "bnb": (), "ds_q8": DS_Q8_CHANGES, "sim": SIM_CHANGES}
    if base not in valid:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}; valid: torch, bnb, ds_q8[:changes], sim[:changes]")
    for change in changes:
        if change in valid[base] or (base != "bnb" and jitter_draw((change,)) is not None):
            continue
        if base == "ds_q8" and (change in state_roundings() or change in quantizations()):
            continue
        if base in ("ds_q8", "sim") and change.startswith("bs") and change[2:].isdigit():
            from ds_q8 import functional as F
            F.check_block_size(int(change[2:]), f"{base} block size (bsN)")
            continue
        more = (("bsN",) if base in ("ds_q8", "sim") else ()) + (("jitter[K]",) if base != "bnb" else ()) + \
            (state_roundings() + quantizations() if base == "ds_q8" else ())
        raise ValueError(f"unknown change {change!r} in {name!r}: {base} takes "
                         f"{', '.join(valid[base] + more) or 'none'}")


#: how far ``jitter`` moves each initial weight: a relative change of this size, normally distributed
JITTER = 1e-6


def jitter_draw(changes) -> Optional[int]:
    """The draw of ``jitter`` (0) or ``jitterK`` (K) among ``changes``; None without one."""
    for c in changes:
        if c == "jitter":
            return 0
        if c.startswith("jitter") and c[6:].isdigit():
            return int(c[6:])
    return None


@torch.no_grad()
def jitter(model, draw: int) -> None:
    """Multiply each initial weight by ``1 + JITTER * N(0, 1)`` (``draw`` seeds the noise): a start that
    no run can tell from the seed's own, to see how far chaos alone carries a run from it."""
    gen = torch.Generator().manual_seed(10_000 + draw)
    for p in model.parameters():
        p.mul_(1 + JITTER * torch.randn(p.shape, generator=gen))


def state_roundings() -> tuple:
    from ds_q8.optim.group_options import STATE_ROUNDINGS

    return STATE_ROUNDINGS


def quantizations() -> tuple:
    from ds_q8.optim.group_options import QUANTIZATIONS

    return QUANTIZATIONS


def state_rounding_of(changes) -> Optional[str]:
    """The ``state_rounding`` that ``changes`` name (``nearest``, ``srv`` or a name of its own), or None."""
    if "srv" in changes:
        return "stochastic_unsigned"
    return next((c for c in changes if c in state_roundings()), None)


def block_size_of(changes, default: int) -> int:
    return next((int(c[2:]) for c in changes if c.startswith("bs")), default)


# ---------------------------------------------------------------- the simulated 8-bit AdamW
class SimAdamW8bit(torch.optim.Optimizer):
    """AdamW with each state stored block-wise in 8 bits through ds_q8.functional, changes switchable.

    With no change it keeps ds_q8's format (dynamic maps, block 64 with bfloat16 maxima, 32-bit state below 4096 elements,
    nearest rounding with the zero point); it is slower than ds_q8 but lets one thing change at a time.
    """

    def __init__(self, params, lr, changes=(), seed=0, fp32_params=(), betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, min_8bit_size=4096):
        from ds_q8 import functional as F

        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.F = F
        self.changes = set(changes)
        self.block = block_size_of(changes, F.DEFAULT_BLOCK_SIZE)
        self.min_8bit_size = min_8bit_size
        self.fp32_ids = {id(p) for p in fp32_params}
        signed = F.create_dynamic_map(True)
        if "neg1" in self.changes:
            signed[0] = -1.0
        self.maps = (signed, F.create_dynamic_map(False))
        self.gen = torch.Generator().manual_seed(1_000 + seed)

    def _quantize(self, x: torch.Tensor, code: torch.Tensor):
        F, bs = self.F, self.block
        absmax = F.block_absmax(x, bs)
        a = absmax.float()
        scale = torch.where(a > 0, 1.0 / a, torch.zeros_like(a))
        y = (torch.nn.functional.pad(x, (0, absmax.numel() * bs - x.numel())).view(-1, bs)
             * scale[:, None]).reshape(-1)[:x.numel()]
        unsigned = float(code[0]) == 0.0
        if "sr" in self.changes or ("srv" if unsigned else "srm") in self.changes:
            # the entry above with probability of the distance from the one below
            hi = torch.searchsorted(code, y).clamp(1, 255)
            lo = hi - 1
            frac = ((y - code[lo]) / (code[hi] - code[lo])).clamp(0, 1)
            idx = torch.where(torch.rand(y.shape, generator=self.gen) < frac, hi, lo)
            if unsigned and "nozp" not in self.changes:
                idx = torch.where((y > 0) & (idx == 0), torch.ones_like(idx), idx)
        else:
            mid = F.midpoints(code) if "nozp" not in self.changes else (code[:-1] + code[1:]) * 0.5
            idx = torch.searchsorted(mid, y)
        return idx.to(torch.uint8), absmax

    def _dequantize(self, stored, code):
        codes, absmax = stored
        return self.F.dequantize_flat(codes, absmax, code, self.block)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                eight = p.numel() >= self.min_8bit_size and id(p) not in self.fp32_ids
                bits = (8 if eight and "m32" not in self.changes else 32, 8 if eight and "v32" not in self.changes else 32)
                if not st:
                    st["step"] = 0
                    st["m"], st["v"] = [torch.zeros(p.numel()) if b == 32 else self._quantize(torch.zeros(p.numel()), c)
                                        for b, c in zip(bits, self.maps)]
                st["step"] += 1
                t = st["step"]
                m, v = [s if b == 32 else self._dequantize(s, c) for s, b, c in zip((st["m"], st["v"]), bits, self.maps)]
                g = p.grad.reshape(-1)
                pf = p.view(-1)
                pf.mul_(1.0 - lr * wd)
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** t)).add_(eps)
                pf.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** t))
                st["m"], st["v"] = [s if b == 32 else self._quantize(s, c) for s, b, c in zip((m, v), bits, self.maps)]


def make_optimizer(name: str, model, lr: float, seed: int):
    params = list(model.parameters())
    embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
    if name.startswith("q4"):
        return lowbit_sim.SimAdamW4(params, lr=lr, spec=lowbit_sim.parse(name), seed=1_000 + seed)
    if name == "torchao4":
        import torchao.optim
        return torchao.optim.AdamW4bit(params, lr=lr)
    base, changes = split_name(name)
    if base == "torch":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if base == "bnb":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=lr)
    if base == "ds_q8":
        import ds_q8
        from ds_q8 import functional as F
        from ds_q8.optim.base import OPTIM_BITS_ATTR
        if "emb32" in changes:
            for p in embeddings:
                setattr(p, OPTIM_BITS_ATTR, 32)
        masters = next((BF16_MASTERS[c] for c in changes if c in BF16_MASTERS), {})
        rounding = state_rounding_of(changes)
        if rounding is not None:
            masters["state_rounding"] = rounding
        masters.update({"quantization": c for c in changes if c in quantizations()})
        if "emb8" in changes:
            masters["embeddings_32bit"] = False
        return ds_q8.AdamW8bitBlock(params, lr=lr, block_size=block_size_of(changes, F.DEFAULT_BLOCK_SIZE),
                                    optim_bits=32 if "fp32" in changes else 4 if "4bit" in changes else 8,
                                    **masters)
    return SimAdamW8bit(params, lr, changes, seed, fp32_params=embeddings if "emb32" in changes else ())


# ---------------------------------------------------------------- one run
def set_lr(group: dict, value: float) -> None:
    """torchao's optimizers keep the learning rate as a tensor and refuse a float in its place."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def forward(model, x: torch.Tensor, amp: bool) -> torch.Tensor:
    """fp32 logits; ``amp``: the model's matrix products in bf16 (autocast)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return model(x).logits.float()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, cfg: Config, amp: bool = False) -> float:
    total = 0.0
    for chunk in windows.split(64):
        logits = forward(model, chunk[:, :-1], amp)
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1),
                                                         reduction="sum"))
    return total / (windows.shape[0] * cfg.context)


#: the run's training-loss curve in convergence.json: the mean of every this many steps
CURVE_EVERY = 20


def train_one(name: str, lr: float, seed: int, cfg: Config) -> dict:
    torch.set_num_threads(1)
    train, val = gpt_data.load_splits(corpus(cfg), gpt_data.ByteTokenizer())
    stride = (val.numel() - cfg.context - 1) // cfg.eval_windows
    windows = torch.stack([val[i * stride:i * stride + cfg.context + 1] for i in range(cfg.eval_windows)])
    torch.manual_seed(seed)
    model = gpt_models.build_model(gpt_models.gpt2_config_of(cfg.n_layer, cfg.n_head, cfg.n_embd, VOCAB,
                                                             cfg.context))
    changes = split_name(name)[1]
    if jitter_draw(changes) is not None:
        jitter(model, jitter_draw(changes))
    if any(c in BF16_MASTERS for c in changes):
        model.to(torch.bfloat16)
    amp = "amp" in changes
    opt = make_optimizer(name, model, lr, seed)
    t0 = time.time()
    losses, reason = [], ""
    for step in range(cfg.steps):
        for g in opt.param_groups:
            set_lr(g, learning_rate(step, lr, cfg))
        x, y = gpt_data.get_batch(train, cfg.batch, cfg.context, seed, 0, step)
        loss = torch.nn.functional.cross_entropy(forward(model, x, amp).reshape(-1, VOCAB), y.reshape(-1))
        if not torch.isfinite(loss):
            reason = f"non-finite loss at step {step}"
            break
        losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    final = float("nan") if reason else evaluate(model, windows, cfg, amp)
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return dict(optimizer=name, lr=lr, seed=seed, final_loss=final, reason=reason, weights=weights,
                train_loss_last10=sum(losses[-10:]) / max(1, len(losses[-10:])), seconds=round(time.time() - t0, 1),
                loss_curve=[sum(losses[i:i + CURVE_EVERY]) / len(losses[i:i + CURVE_EVERY])
                            for i in range(0, len(losses), CURVE_EVERY)])


def _run(job):
    return train_one(*job)


# ---------------------------------------------------------------- state drift
def drift(lr: float, cfg: Config, seed: int = 0) -> List[dict]:
    """Train with torch's AdamW and feed every step's gradients into shadow copies of its two states kept
    in ds_q8's format, rounded to nearest and stochastically as ds_q8:srv does (second moment only): per
    weight matrix, the shadows' second moment against torch's (median ratio) and the update direction
    m / sqrt(v) they give against torch's (norm ratio, cosine), at the last step. The model follows
    torch's trajectory, so only the states' rounding differs."""
    from ds_q8 import functional as F
    from ds_q8.optim import rounding

    torch.set_num_threads(1)
    train, _ = gpt_data.load_splits(corpus(cfg), gpt_data.ByteTokenizer())
    torch.manual_seed(seed)
    model = gpt_models.build_model(gpt_models.gpt2_config_of(cfg.n_layer, cfg.n_head, cfg.n_embd, VOCAB,
                                                             cfg.context))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    named = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    signed, unsigned, bs = F.create_dynamic_map(True), F.create_dynamic_map(False), F.DEFAULT_BLOCK_SIZE
    b1, b2 = 0.9, 0.999

    def requantize(x, code, bits=None):
        am = F.block_absmax(x, bs)
        return F.dequantize_flat(F.quantize_with_absmax(x, am, code, bs, bits), am, code, bs)

    shadows = {n: {k: torch.zeros(p.numel()) for k in ("m", "v", "m_near", "v_near", "m_sr", "v_sr")}
               for n, p in named.items()}
    for step in range(cfg.steps):
        for g in opt.param_groups:
            set_lr(g, learning_rate(step, lr, cfg))
        x, y = gpt_data.get_batch(train, cfg.batch, cfg.context, seed, 0, step)
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        key = rounding.state_key(rounding.step_key(seed, step + 1), 1)
        for i, (n, p) in enumerate(named.items()):
            g, s = p.grad.reshape(-1), shadows[n]
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            bits = rounding.random_bits(rounding.mix32(key ^ i), torch.arange(g.numel()))
            for kind, v_bits in (("near", None), ("sr", bits)):
                s["m_" + kind] = requantize(b1 * s["m_" + kind] + (1 - b1) * g, signed)
                s["v_" + kind] = requantize(b2 * s["v_" + kind] + (1 - b2) * g * g, unsigned, v_bits)
        opt.step()
    rows = []
    for n, s in shadows.items():
        u = s["m"] / (s["v"].sqrt() + 1e-8)
        row = {"matrix": n.replace("transformer.", "")}
        for kind in ("near", "sr"):
            uq = s["m_" + kind] / (s["v_" + kind].sqrt() + 1e-8)
            ratio = (s["v_" + kind] / s["v"])[s["v"] > 0]
            row[kind] = dict(v_ratio_median=float(ratio.median()), update_norm_ratio=float(uq.norm() / u.norm()),
                             update_cosine=float(torch.nn.functional.cosine_similarity(uq, u, dim=0)))
        rows.append(row)
    return rows


def drift_table(rows: List[dict]) -> str:
    head = ["weight matrix", "v / v32 (median), nearest", "stochastic", "update norm ratio, nearest", "stochastic",
            "update cosine, nearest", "stochastic"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        n, s = r["near"], r["sr"]
        lines.append(f"| {r['matrix']} | {n['v_ratio_median']:.3f} | {s['v_ratio_median']:.3f} | "
                     f"{n['update_norm_ratio']:.3f} | {s['update_norm_ratio']:.3f} | {n['update_cosine']:.4f} | "
                     f"{s['update_cosine']:.4f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the table
def attach_drift(runs: List[dict], reference: str) -> None:
    """Each run's ``drift``: ||w - w_ref|| / ||w_ref|| of its final weights against the reference run of its
    seed and learning rate (its ``weights`` are dropped)."""
    ref = {(r["lr"], r["seed"]): r["weights"] for r in runs if r["optimizer"] == reference}
    for r in runs:
        w, w_ref = r["weights"], ref.get((r["lr"], r["seed"]))
        ok = w_ref is not None and bool(torch.isfinite(w).all())
        r["drift"] = float((w - w_ref).norm() / w_ref.norm()) if ok else float("nan")
    for r in runs:
        del r["weights"]


def rank_sum_p(a: List[float], b: List[float]) -> float:
    """Two-sided p-value of the Wilcoxon rank-sum (Mann-Whitney U) test that ``a`` and ``b`` come from one
    distribution: the normal approximation with the tie correction, fair from about eight values a side.
    A seed-by-seed count such as "seeds worse than 32-bit's worst" is no such test: with one distribution
    for both, each of m seeds ends above the worst of n with probability 1/(n+1), and with m = n at
    least one does half of the time."""
    m, n = len(a), len(b)
    if m == 0 or n == 0:
        return float("nan")
    values = sorted((v, side) for side, xs in enumerate((a, b)) for v in xs)
    ranks, ties, i = [0.0] * len(values), 0.0, 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    u = sum(r for r, (_, side) in zip(ranks, values) if side == 0) - m * (m + 1) / 2
    var = m * n / 12 * ((m + n + 1) - ties / ((m + n) * (m + n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - m * n / 2) - 0.5) / math.sqrt(var)  # with the continuity correction
    return min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def summarize(runs: List[dict], cfg: Config) -> List[dict]:
    rows = []
    reference = cfg.reference
    base: Dict[float, List[float]] = {lr: [r["final_loss"] for r in runs if r["optimizer"] == reference
                                           and r["lr"] == lr] for lr in cfg.lrs}
    for name in cfg.optimizers:
        for lr in cfg.lrs:
            at = [r for r in runs if r["optimizer"] == name and r["lr"] == lr]
            if not at:
                continue
            finals = [r["final_loss"] for r in at]
            ok = [f for f in finals if math.isfinite(f)]
            ref = [f for f in base[lr] if math.isfinite(f)]
            mean = sum(ok) / len(ok) if ok else float("nan")
            ref_mean = sum(ref) / len(ref) if ref else float("nan")
            by_seed = {r["seed"]: r["final_loss"] for r in runs if r["optimizer"] == reference and r["lr"] == lr}
            paired = [100.0 * (r["final_loss"] / by_seed[r["seed"]] - 1.0) for r in at
                      if math.isfinite(r["final_loss"]) and math.isfinite(by_seed.get(r["seed"], float("nan")))]
            rows.append(dict(optimizer=name, lr=lr, runs=len(at), diverged=len(at) - len(ok), mean=mean,
                             lo=min(ok) if ok else float("nan"), hi=max(ok) if ok else float("nan"),
                             vs_32bit=100.0 * (mean / ref_mean - 1.0) if ok and ref else float("nan"),
                             paired_sd=statistics.pstdev(paired) if len(paired) > 1 else float("nan"),
                             paired_worst=max(paired, key=abs) if paired else float("nan"),
                             worse_than_worst_32bit=sum(f > max(ref) for f in ok) + len(at) - len(ok) if ref else None,
                             rank_sum_p=rank_sum_p(ok, ref),
                             seconds=sum(r["seconds"] for r in at) / len(at),
                             drift=statistics.fmean(r["drift"] for r in at), vs_reference=mean - ref_mean))
    return rows


def markdown_table(rows: List[dict], reference: str = "torch") -> str:
    ref_name = "32-bit" if reference == "torch" else reference
    head = ["optimizer", "peak lr", "final val loss, mean", "range over seeds", f"mean vs {ref_name}",
            f"same seed vs {ref_name}: spread (sd), worst", f"seeds worse than {ref_name}'s worst",
            f"rank-sum p vs {ref_name}", "diverged", f"weight drift from {ref_name}", "s / run"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        ref = r["optimizer"] == reference
        vs = "" if ref else f"{r['vs_32bit']:+.2f}% ({r['vs_reference']:+.4f})"
        pair = "" if ref else f"{r['paired_sd']:.2f}%, {r['paired_worst']:+.2f}%"
        worse = "" if ref else f"{r['worse_than_worst_32bit']}/{r['runs']}"
        drift = "" if ref else f"{r['drift']:.2e}"
        p = "" if ref else f"{r['rank_sum_p']:.2f}"
        lines.append(f"| {r['optimizer']} | {r['lr']:g} | {r['mean']:.4f} | {r['lo']:.4f} - {r['hi']:.4f} | {vs} | "
                     f"{pair} | {worse} | {p} | {r['diverged']}/{r['runs']} | {drift} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def study_names(ap, args, cfg: Config) -> List[str]:
    """The optimizers of ``--optimizers`` (checked; bnb left out when it is missing) and the reference,
    first unless named; sets ``cfg.optimizers`` and ``cfg.reference``."""
    names = list(args.optimizers or cfg.optimizers)
    try:
        for name in names + [args.reference or cfg.reference]:
            check_optimizer_name(name)
    except ValueError as e:
        ap.error(str(e))
    if "bnb" in names and not bnb_available():
        print("bitsandbytes is not installed: its rows are left out (pip install bitsandbytes)")
        names.remove("bnb")
    cfg.reference = args.reference or cfg.reference
    if cfg.reference not in names:
        names.insert(0, cfg.reference)  # the reference of every comparison
    cfg.optimizers = tuple(names)
    return names


def argument_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", help="peak learning rates (default 1e-3 4e-3 1.6e-2)")
    ap.add_argument("--seeds", type=int, nargs="+", help="seeds (default 0-5)")
    ap.add_argument("--optimizers", nargs="+", help="optimizers (default torch ds_q8 bnb; see the module doc)")
    ap.add_argument("--steps", type=int, help="training steps per run (default 300)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 16)")
    ap.add_argument("--context", type=int, help="tokens per sequence (default 64)")
    ap.add_argument("--schedule", choices=SCHEDULES, help="warmup-cosine (default) or constant (no warmup)")
    ap.add_argument("--data", help="text to train on: a file or folder, or pydoc-topics (default: the standard "
                                   "library's source)")
    ap.add_argument("--reference", help="the run the others are compared with (default torch); added if not named")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel, one thread each")
    ap.add_argument("--out", default="out/convergence", help="output folder")
    ap.add_argument("--drift", action="store_true",
                    help="instead: how far ds_q8-format states drift from torch's along torch's own trajectory "
                         "(first --lrs value, first --seeds value), rounded to nearest and stochastically")
    return ap


def study_config(ap, args) -> Config:
    """The defaults with the command line's values; a bad value (``--workers`` too) ends the program with
    an error that names it. The optimizers are checked later, by ``study_names``."""
    cfg = Config()
    if args.steps is not None:
        if args.steps < 1:
            ap.error(f"--steps must be >= 1, got {args.steps}")
        cfg.steps, cfg.warmup = args.steps, min(cfg.warmup, max(1, args.steps // 10))
    if args.batch is not None:
        if args.batch < 1:
            ap.error(f"--batch must be >= 1, got {args.batch}")
        cfg.batch = args.batch
    if args.context is not None:
        if args.context < 8:
            ap.error(f"--context must be >= 8, got {args.context}")
        cfg.context = args.context
    if args.schedule is not None:
        cfg.schedule = args.schedule
    if args.data is not None:
        cfg.data = args.data
        try:
            gpt_data.corpus_files(corpus(cfg))
        except ValueError as e:
            ap.error(str(e))
    if args.lrs:
        if not all(lr > 0 for lr in args.lrs):
            ap.error(f"--lrs must all be > 0, got {args.lrs}")
        cfg.lrs = tuple(args.lrs)
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    return cfg


def drift_study(args, cfg: Config) -> None:
    """``--drift``: the state drift table at the first ``--lrs`` value (default 4e-3) and the first
    ``--seeds`` value (default 0), printed and written to ``--out``/drift.md."""
    lr, seed = (args.lrs or (4e-3,))[0], cfg.seeds[0] if args.seeds else 0
    t0 = time.time()
    table = drift_table(drift(lr, cfg, seed))
    header = (f"State drift along torch AdamW's trajectory: lr {lr:g}, seed {seed}, after {cfg.steps} steps "
              f"(GPT-2 {cfg.n_layer} layers, d={cfg.n_embd}, batch {cfg.batch}).\n\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "drift.md"), "w") as f:
        f.write(header + table)
    print(header + table)
    print(f"{time.time() - t0:.0f} s; wrote {args.out}/drift.md")


def finished_runs(jobs: list, workers: int):
    """Each job's run as it finishes: from a pool of ``workers`` processes, or one after the other here."""
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            yield from pool.imap_unordered(_run, jobs)
    else:
        yield from map(_run, jobs)


def run_jobs(jobs: list, workers: int) -> List[dict]:
    """Every job's run, with a line printed as each one finishes."""
    runs = []
    for r in finished_runs(jobs, workers):
        runs.append(r)
        print(f"[{len(runs)}/{len(jobs)}] {r['optimizer']} lr={r['lr']:g} seed={r['seed']}: "
              f"{r['final_loss']:.4f} {r['reason']} ({r['seconds']} s)", flush=True)
    return runs


def study_header(cfg: Config) -> str:
    """The paragraph above the table: the model, schedule, data and seeds every run shares."""
    schedule = ("constant learning rate, no warmup" if cfg.schedule == "constant"
                else f"warmup {cfg.warmup} then cosine to 10%")
    text = {None: "the standard library's source", "pydoc-topics": "Python's documentation topics"}.get(cfg.data,
                                                                                                      cfg.data)
    return (f"GPT-2 {cfg.n_layer} layers, d={cfg.n_embd}, context {cfg.context}, batch {cfg.batch}, {cfg.steps} "
            f"steps, {schedule}, {text}, seeds {list(cfg.seeds)}; final validation loss "
            f"(nats per byte) on {cfg.eval_windows} windows.\n\n")


def main(argv=None) -> int:
    ap = argument_parser()
    args = ap.parse_args(argv)
    cfg = study_config(ap, args)
    if args.drift:
        drift_study(args, cfg)
        return 0
    names = study_names(ap, args, cfg)
    jobs = [(name, lr, seed, cfg) for lr in cfg.lrs for seed in cfg.seeds for name in names]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    runs = run_jobs(jobs, args.workers)
    attach_drift(runs, cfg.reference)
    rows = summarize(runs, cfg)
    text = study_header(cfg) + markdown_table(rows, cfg.reference)
    with open(os.path.join(args.out, "convergence.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), runs=runs, rows=rows), f, indent=1)
    print(text)
    print(f"{len(runs)} runs in {time.time() - t0:.0f} s; wrote {args.out}/convergence.md and convergence.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
