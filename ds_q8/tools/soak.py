"""Soak test: many small optimizer steps, watching memory and kernel-vs-reference drift.

  python -m ds_q8.tools.soak --steps 5000 --out soak.json

Two Adam8bitBlock optimizers train identical copies of a small MLP on identical gradients: one
dispatches to the compiled kernel (``ds_q8.ops``) and one is forced onto the pure-PyTorch
reference. Every ``--every`` steps it records the process RSS and the largest difference between
the two copies' parameters and dequantized state. Memory must be flat after warm-up (RSS growth
under ``--max_rss_growth``) and the two copies must stay identical. When no kernel is built both
copies run the reference, which still checks memory and determinism. Prints a table, writes JSON,
and exits 1 when a limit is broken.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from torch import nn

from ..optim import Adam8bitBlock


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(width: int, seed: int, impl: str = "auto"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    opt = Adam8bitBlock(model.parameters(), lr=1e-3, weight_decay=1e-4, block_size=256, min_8bit_size=1024,
                        impl=impl)
    return model, opt


@torch.no_grad()
def drift(a: nn.Module, oa, b: nn.Module, ob) -> float:
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        worst = max(worst, float((pa - pb).abs().max()))
        sa, sb = oa.dequantized_state(pa), ob.dequantized_state(pb)
        for name in sa:
            worst = max(worst, float((sa[name] - sb[name]).abs().max()))
    return worst


def kernel_available(model, opt) -> bool:
    """Whether the fused kernels take the 8-bit step for this optimizer (probed on a throwaway copy)."""
    from ..optim import step as S

    p = next(q for q in model.parameters() if q.numel() >= opt.param_groups[0]["min_8bit_size"])
    probe = nn.Parameter(p.detach().clone())
    probe_opt = Adam8bitBlock([probe], block_size=256, min_8bit_size=1024)
    group = probe_opt.param_groups[0]
    qs = probe_opt.quantized_state(probe, group)
    item = S.Item8(probe, torch.zeros_like(probe), tuple(qs.codes()), tuple(qs.absmax()), None)
    return not S.fused_step_many(probe_opt.rule_for(group), [item], group, probe_opt._hyper(group, 1))


def run(steps: int, warmup: int, every: int, width: int, batch: int, seed: int, log=print) -> dict:
    torch.set_num_threads(1)
    kernel_model, kernel_opt = build(width, seed)
    ref_model, ref_opt = build(width, seed, impl="reference")
    has_kernel = kernel_available(kernel_model, kernel_opt)
    gen = torch.Generator().manual_seed(seed + 1)
    rows, rss0 = [], None
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(batch, width, generator=gen)
        y = torch.randn(batch, width, generator=gen)
        kernel_model.zero_grad(set_to_none=False)
        nn.functional.mse_loss(kernel_model(x), y).backward()
        for pk, pr in zip(kernel_model.parameters(), ref_model.parameters()):
            pr.grad = pk.grad.clone() if pr.grad is None else pr.grad.copy_(pk.grad)
        kernel_opt.step()
        ref_opt.step()
        if step == warmup:
            rss0 = rss_bytes()
        if step % every == 0 or step == steps:
            row = dict(step=step, rss_mib=rss_bytes() / 2**20, max_abs_diff=drift(kernel_model, kernel_opt,
                                                                                  ref_model, ref_opt),
                       elapsed_s=time.perf_counter() - t0)
            rows.append(row)
            log(f"{row['step']:>8} {row['rss_mib']:>10.2f} {row['max_abs_diff']:>14.3e} {row['elapsed_s']:>9.1f}")
    rss_end = rss_bytes()
    return dict(steps=steps, warmup=warmup, width=width, batch=batch, seed=seed, kernel=has_kernel,
                params=sum(p.numel() for p in kernel_model.parameters()),
                rss_after_warmup_bytes=rss0, rss_end_bytes=rss_end,
                rss_growth=(rss_end - rss0) / rss0 if rss0 else None,
                max_abs_diff=max(r["max_abs_diff"] for r in rows), rows=rows,
                torch=torch.__version__, python=platform.python_version())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_q8.tools.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200, help="steps before the RSS baseline is taken")
    ap.add_argument("--every", type=int, default=500, help="record a row every this many steps")
    ap.add_argument("--width", type=int, default=64, help="MLP width (params: 8*width^2 + 5*width)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_rss_growth", type=float, default=0.01, help="allowed RSS growth after warm-up")
    ap.add_argument("--out", default="soak.json", help="JSON result file")
    args = ap.parse_args(argv)
    for name in ("steps", "every", "width", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
    if not 1 <= args.warmup < args.steps:
        ap.error(f"--warmup must be in [1, --steps), got {args.warmup}")
    if not args.max_rss_growth >= 0:
        ap.error(f"--max_rss_growth must be >= 0, got {args.max_rss_growth}")
    print(f"{'step':>8} {'rss MiB':>10} {'max |diff|':>14} {'time s':>9}")
    result = run(args.steps, args.warmup, args.every, args.width, args.batch, args.seed)
    result["max_rss_growth"] = args.max_rss_growth
    result["ok"] = result["rss_growth"] < args.max_rss_growth and result["max_abs_diff"] == 0.0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    side = "compiled kernel" if result["kernel"] else "reference (no kernel built)"
    print(f"{result['steps']} steps, {result['params']} params, one side on the {side}: RSS growth after step "
          f"{result['warmup']} {100 * result['rss_growth']:+.3f}%, max |kernel - reference| "
          f"{result['max_abs_diff']:.3e} -> {'OK' if result['ok'] else 'FAIL'} ({args.out})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
