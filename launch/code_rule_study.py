"""A candidate requantization rule for first moments, decided on codes alone, measured through the
pure-PyTorch reference: stochastic rounding where the nearest code is the element's old code, the nearest
code elsewhere (second moments keep the default, guided by their old code). It is the default rule's
choice whenever a block's maximum did not move, and on a GPU it would cost what the second moment's
comparison costs instead of two shared-memory reads and a product (docs/results.md, "Guided
requantization, the default").

The rule is patched into ds_q8's reference step (``impl="reference"``) for AdamW8bitBlock, and
launch/fidelity.py's 25-step check is run (lr 6e-4, batch 16, weight decay 0.1 on matrices):

    python launch/code_rule_study.py WIDTH LAYERS WARMUP {code,value} [THREADS]

``value`` runs the default rule through the same patched path (it must give the kernels' figures).
Prints one JSON line. A study, not a product path: it leans on the reference step's call order (each
state's codes dequantized, first moment first, before the states are requantized) and checks it.
"""
import json
import sys

import torch

import fidelity
from ds_q8 import functional as F


def main(argv):
    width, layers, warmup, variant = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    if variant not in ("code", "value"):
        raise SystemExit(f"the variant must be code or value, got {variant!r}")
    torch.set_num_threads(int(argv[4]) if len(argv) > 4 else 2)
    seen = []
    dequantize, quantize = F.dequantize_flat, F.quantize_with_absmax

    def recording_dequantize(codes, absmax, code, bs):
        seen.append(codes)
        del seen[:-2]
        return dequantize(codes, absmax, code, bs)

    def code_rule_quantize(x, a, code, bs, bits=None, prev=None, old=None):
        if prev is None or variant == "value":
            return quantize(x, a, code, bs, bits, prev=prev, old=old)
        olds = seen[-2]  # the first moment's codes before the update
        assert olds.numel() == x.numel(), (olds.numel(), x.numel())
        near = quantize(x, a, code, bs, None).long()
        drawn = quantize(x, a, code, bs, bits).long()
        return torch.where(near == olds.long(), drawn, near).to(torch.uint8)

    F.dequantize_flat, F.quantize_with_absmax = recording_dequantize, code_rule_quantize
    rows = fidelity.run("gpt2", width, layers, ["ds_q8:ref"], 25, 6e-4, 0.1, 16, 64, decay="matrices", warmup=warmup)
    for r in rows:
        print(json.dumps(dict(variant=variant, width=width, layers=layers, warmup=warmup, min_cosine=r["min_cosine"],
                              worst=r["worst_matrix"], median=r["median_cosine"], m_lost=r["m_lost"],
                              seconds=r["seconds"])))


if __name__ == "__main__":
    main(sys.argv[1:])
