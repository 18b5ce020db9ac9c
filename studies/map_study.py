"""How a signed map's entries per decade shape the first moment's share of the update error.

Trains GPT-2 with torch's AdamW as ``studies/fidelity.py`` does (byte vocabulary, the standard library's
source, batch 16, context 64, lr 6e-4, weight decay 0.1 on the matrices), keeps every matrix's fp32
moments at a few steps, and then, for each candidate map, codes the first moment block-wise (64, to
nearest or stochastically, with ``ds_q8.functional``, the reference the kernels equal) while the second
moment stays fp32. Per step it prints the worst and the median matrix's ``1 - cosine`` between the bias-
corrected update ``m / (sqrt(v) + eps)`` with the coded first moment and the one without, times 1e4. A
last row codes the second moment instead (on the unsigned dynamic map), the first kept fp32.

A candidate is its positive entries per decade, top decade first, summing to 127: ``64_32_16_8_4_2_1`` is
the dynamic tree map (``quantization="dynamic"``), ``72_32_14_6_2_1`` is ``"dynamic6"`` (decade ``d``
holds the midpoints of ``k + 1`` evenly spaced points in [0.1, 1], times ``10**-d``). One step's error
is a proxy: the 25-step check (``fidelity.py --decay matrices``) is what the choice rests on.

    python studies/map_study.py --width 768 --layers 4 --candidates 64_32_16_8_4_2_1 72_32_14_6_2_1
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "launch")]  # the studies, then the trainer's modules
import fidelity  # noqa: E402
import gpt_data  # noqa: E402

from ds_q8 import functional as F  # noqa: E402

BETAS, EPS = (0.9, 0.999), 1e-8


def signed_map(counts: Sequence[int]) -> torch.Tensor:
    """The signed 8-bit map with ``counts[d]`` positive entries in decade ``d`` (``functional.tree_map``)."""
    if sum(counts) != 127:
        raise ValueError(f"a signed 8-bit map has 127 positive entries besides 1.0; got {counts} ({sum(counts)})")
    return F.tree_map(counts, True)


def moments(width: int, layers: int, keep: Sequence[int], seed: int = 0) -> Dict[int, Dict[str, Tuple]]:
    """{step: {matrix: (m, v)}} of torch's AdamW in the fidelity setting."""
    text, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    out = {}

    def keep_moments(step, model, opt):
        if step in keep:
            out[step] = {n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                         for n, p in model.named_parameters() if p.dim() >= 2}

    fidelity.train(lambda: fidelity.build("gpt2", width, layers, 64, seed), fidelity.make("torch", 6e-4, 0.1), text,
                   max(keep), 16, 64, seed, 0.1, "matrices", after_step=keep_moments)
    return out


def coded(x: torch.Tensor, code: torch.Tensor, stochastic: bool, gen: torch.Generator, block: int = 64) -> torch.Tensor:
    flat = x.reshape(-1).float()
    absmax = F.block_absmax(flat, block)
    bits = torch.randint(0, 2 ** 32, flat.shape, dtype=torch.int64, generator=gen) if stochastic else None
    return F.dequantize_flat(F.quantize_with_absmax(flat, absmax, code, block, bits), absmax, code, block).view(x.shape)


def update_errors(states: Dict[str, Tuple], step: int, code: torch.Tensor, stochastic: bool,
                  second: bool = False) -> Tuple[float, float]:
    """Worst and median matrix's 1 - cosine of the update with the first moment coded (``second``: the
    second moment instead, on ``code``)."""
    gen = torch.Generator().manual_seed(step)
    c1, c2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    errs = []
    for m, v in states.values():
        u = (m / c1) / ((v / c2).sqrt() + EPS)
        if second:
            uq = (m / c1) / ((coded(v, code, stochastic, gen) / c2).sqrt() + EPS)
        else:
            uq = (coded(m, code, stochastic, gen) / c1) / ((v / c2).sqrt() + EPS)
        errs.append(1 - float(torch.nn.functional.cosine_similarity(uq.reshape(-1), u.reshape(-1), dim=0)))
    errs.sort()
    return errs[-1], errs[len(errs) // 2]


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5, 10, 25], help="steps to code the moments at")
    ap.add_argument("--candidates", nargs="+", default=["64_32_16_8_4_2_1", "72_32_14_6_2_1"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    maps = {c: signed_map([int(k) for k in c.split("_")]) for c in args.candidates}
    data = moments(args.width, args.layers, args.steps)
    print(f"GPT-2 {args.width} ({args.layers} layers): 1 - cosine x 1e4 of the update with the first moment coded, "
          f"worst / median matrix")
    print("| map | rounding | " + " | ".join(f"step {t}" for t in args.steps) + " |")
    print("|---|---|" + "---:|" * len(args.steps))
    rows = [(name, code, False) for name, code in maps.items()]
    rows.append(("second moment, dynamic", F.create_dynamic_map(False), True))
    for name, code, second in rows:
        for stochastic in (False, True):
            cells = [update_errors(data[t], t, code, stochastic, second) for t in args.steps]
            print(f"| {name} | {'stochastic' if stochastic else 'nearest'} | "
                  + " | ".join(f"{w * 1e4:.2f} / {md * 1e4:.2f}" for w, md in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
