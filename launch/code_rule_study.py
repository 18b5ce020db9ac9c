"""A candidate requantization rule for first moments, decided on codes alone, measured through the
pure-PyTorch reference: stochastic rounding where the nearest code is the element's old code, the nearest
code elsewhere (second moments keep the default, guided by their old code). It is the default rule's
choice whenever a block's maximum did not move, and on a GPU it would cost what the second moment's
comparison costs instead of two shared-memory reads and a product (docs/results.md, "Guided
requantization, the default").

The rule is installed in ds_q8's reference step (``impl="reference"``) for AdamW8bitBlock through the
library's one extension point (``ds_q8.optim.path_reference.set_requantize_rule``), and
launch/fidelity.py's 25-step check is run (lr 6e-4, batch 16, weight decay 0.1 on matrices):

    python launch/code_rule_study.py WIDTH LAYERS WARMUP {code,value} [THREADS]

``value`` runs the default rule through the same reference step (it must give the kernels' figures).
Prints one JSON line. A study, not a product path. (Until the extension point, the rule was patched into
``functional.quantize_with_absmax`` and keyed on the ``prev`` argument, which the step had stopped
passing: ``code`` then measured the default rule too, and its rows equal ``value``'s.)
"""
import json
import sys

import torch

import fidelity
from ds_q8 import functional as F
from ds_q8.optim import group_options as G
from ds_q8.optim import path_reference


def main(argv):
    width, layers, warmup, variant = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    if variant not in ("code", "value"):
        raise SystemExit(f"the variant must be code or value, got {variant!r}")
    torch.set_num_threads(int(argv[4]) if len(argv) > 4 else 2)

    def code_rule(i, mode, x, old, old_absmax, absmax, code, bs, bits):
        if variant == "value" or i != 0 or mode != G.ROUND_GUIDED_CODE or bits is None:
            return None  # the library's rule: every state but the first moment, and the default variant
        near = F.quantize_with_absmax(x, absmax, code, bs).long()
        drawn = F.quantize_with_absmax(x, absmax, code, bs, bits).long()
        return torch.where(near == old.long(), drawn, near).to(torch.uint8)

    path_reference.set_requantize_rule(code_rule)
    rows = fidelity.run("gpt2", width, layers, ["ds_q8:ref"], 25, 6e-4, 0.1, 16, 64, decay="matrices", warmup=warmup)
    for r in rows:
        print(json.dumps(dict(variant=variant, width=width, layers=layers, warmup=warmup, min_cosine=r["min_cosine"],
                              worst=r["worst_matrix"], median=r["median_cosine"], m_lost=r["m_lost"],
                              seconds=r["seconds"])))


if __name__ == "__main__":
    main(sys.argv[1:])
