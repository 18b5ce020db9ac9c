"""Requantization rules for the first moment that no option selects, run through the optimizer as a user
runs it: ``studies/convergence.py``'s seed studies or ``studies/fidelity.py``'s 25-step check.

    python studies/rule_study.py --rule update --reference conv --lrs 1.6e-2 --seeds 2 --workers 1 --optimizers ds_q8
    python studies/rule_study.py --rule code --dither fid 768 4 0

Rules (``--rule``; the second moment is guided by its old code in all of them), brought into the reference
step through ds_q8's one extension point, ``ds_q8.optim.path_reference.set_requantize_rule``:
  code     every state guided by its old code: the default (``state_rounding="guided"``), for comparison
  update   a signed state guided by its update (the default before): the nearer entry where it moves
           the value the way the update did, else stochastic (the reference only: the kernels carried
           it until the element hash changed, and no longer do; ``arith_maps.prev_guided_codes``)
  bracket  a signed state stochastic where its value before the update lies between the two entries
           around the new value (its old code's interval, also where the block maximum moved), else
           the nearer entry (the reference only: ``--reference``)
``--dither``: each element's random bits are fixed across steps and advanced by the golden ratio each
step (a low-discrepancy sequence per element instead of fresh bits; the reference only). ``--clamp T``:
the old-code draws of signed states (``--clamp-states both``: every state) take their uniform clamped to
[T, 1 - T], so a value within T of a gap from an entry takes that entry (the reference only). ``--reference``
runs ``impl="reference"`` (the pure-PyTorch step, slower); ``code`` runs in the kernels too.

``conv`` passes the rest to convergence.py, one process (its ``--workers`` must be 1: the rules are
installed in this process); ``fid WIDTH LAYERS WARMUP`` runs the 25-step check (lr 6e-4, batch 16,
weight decay 0.1 on the matrices) on one thread and prints one JSON line; ``stall`` (``--rule code``) prints
the first moment's stall test of ``tests/test_state_rounding.py`` under the rule (with ``--clamp``): 2048 first
moments in one block whose maximum is held, beta1 = 0.9, 60 steps of a gradient growing 2%, shrinking 2%
and growing 5% a step, each one's mean ratio to its fp32 value (``--map``: on another signed map, named as
``studies/arith_maps.py`` names them). A study, not a product path.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "launch")]  # the studies, then the trainer's modules

import arith_maps  # noqa: E402
import ds_q8  # noqa: E402
from ds_q8 import functional as F  # noqa: E402
from ds_q8.optim import group_options as G  # noqa: E402
from ds_q8.optim import path_reference, plan, rounding  # noqa: E402

GOLDEN = 0x9E3779B9  # 2^32 / the golden ratio, rounded to odd


def requantize_rule(rule: str, clamp: Optional[float] = None, clamp_states: str = "signed"):
    """The requantization rule for ``path_reference.set_requantize_rule``: in groups with
    ``state_rounding="guided"``, signed states by ``rule`` (``code``: by the old code, as the library) and
    unsigned ones by their old code; the old-code draws' uniforms clamped to [clamp, 1 - clamp] where
    ``clamp`` is given (signed states, or ``clamp_states="both"``: every state). None elsewhere: the
    library's own rounding."""
    if rule not in ("code", "update", "bracket"):
        raise ValueError(f"unknown rule {rule!r}")
    lo_bits, hi_bits = (0, 0) if clamp is None else (int(clamp * 2**24) << 8, int((1 - clamp) * 2**24) << 8)

    def requantize(i, mode, x, old, old_absmax, absmax, code, block_size, bits):
        if mode != G.ROUND_BY_OLD_CODE or bits is None:
            return None
        signed = bool(code[0] < 0)
        if signed and rule != "code":
            prev = F.dequantize_flat(old, old_absmax, code, block_size)  # the value before the update
            return arith_maps.prev_guided_codes(x, prev, absmax, code, block_size, bits, rule=rule)
        if clamp is not None and (signed or clamp_states == "both"):
            bits = bits.clamp(lo_bits, hi_bits)
        return F.quantize_with_absmax(x, absmax, code, block_size, bits, old=old.long())

    return requantize


def patch_dither() -> None:
    """Step-independent keys, each element's bits advanced by GOLDEN per step (the reference's draws)."""
    step = [0]
    step_key, random_bits = rounding.step_key, rounding.random_bits

    def fixed_step_key(seed, count):
        step[0] = count
        return step_key(seed, 0)

    def dithered_bits(key, index):
        return (random_bits(key, index) + step[0] * GOLDEN) & 0xFFFFFFFF

    plan.step_key = rounding.step_key = fixed_step_key
    rounding.random_bits = dithered_bits


def stall(growth: float, requantize, steps: int = 60, n: int = 2048, code=None) -> float:
    """The mean ratio of first moments requantized by ``requantize`` (:func:`requantize_rule`'s) to their
    fp32 values, on ``code`` (the signed dynamic map unless given)."""
    code, beta = F.create_dynamic_map(True) if code is None else code, 0.9
    g0 = torch.linspace(0.01, 0.2, n) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    avg32, stored = torch.zeros(n), torch.zeros(n)
    old, old_absmax = F.quantize_scaled(stored, code), torch.zeros(1, dtype=F.ABSMAX_DTYPE)
    for t in range(steps):
        x = g0 * growth ** t
        x[0] = 1.0  # the block's maximum, held
        avg32 = beta * avg32 + (1 - beta) * x
        a = beta * stored + (1 - beta) * x
        absmax = F.block_absmax(a, n)
        bits = rounding.random_bits(plan.step_key(0, t + 1), torch.arange(n))
        old = requantize(0, G.ROUND_BY_OLD_CODE, a, old, old_absmax, absmax, code, n, bits)
        old_absmax = absmax
        stored = F.dequantize_flat(old, absmax, code, n)
    return float((stored / avg32)[1:].mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", choices=("code", "update", "bracket"), default="code")
    ap.add_argument("--dither", action="store_true")
    ap.add_argument("--clamp", type=float, help="old-code draws clamped to [CLAMP, 1 - CLAMP] (the reference only)")
    ap.add_argument("--clamp-states", choices=("signed", "both"), default="signed")
    ap.add_argument("--reference", action="store_true", help='impl="reference" (needed by bracket and --dither)')
    ap.add_argument("--map", help="stall: the signed map, a studies/arith_maps.py name (e3m4, dyn6, ...)")
    ap.add_argument("what", choices=("conv", "fid", "stall"))
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if (args.rule != "code" or args.dither or args.clamp is not None) and not args.reference:
        ap.error("--rule update and bracket, --dither and --clamp run in the reference: add --reference")
    requantize = requantize_rule(args.rule, args.clamp, args.clamp_states)
    path_reference.set_requantize_rule(requantize)
    if args.dither:
        patch_dither()
    if args.reference:
        ds_q8.AdamW8bitBlock = functools.partial(ds_q8.AdamW8bitBlock, impl="reference")
    if args.what == "conv":
        import convergence
        if "--workers" not in args.rest:
            args.rest += ["--workers", "1"]
        if args.rest[args.rest.index("--workers") + 1] != "1":
            ap.error("conv: --workers must be 1 (the rule is installed in this process)")
        return convergence.main(args.rest)
    if args.what == "stall":
        if args.rule != "code":
            ap.error("stall: --rule code only (the test itself measures the update rule)")
        code = None if args.map is None else arith_maps.make_map(args.map, True)
        print(json.dumps(dict(rule=args.rule, dither=args.dither, clamp=args.clamp, map=args.map or "dynamic",
                              ratio={str(g): round(stall(g, requantize, code=code), 4) for g in (1.02, 0.98, 1.05)})))
        return 0
    import fidelity
    width, layers, warmup = (int(v) for v in args.rest)
    torch.set_num_threads(1)
    for r in fidelity.run("gpt2", width, layers, ["ds_q8"], 25, 6e-4, 0.1, 16, 64, decay="matrices", warmup=warmup):
        print(json.dumps(dict(rule=args.rule, dither=args.dither, clamp=args.clamp, clamp_states=args.clamp_states, width=width, layers=layers, warmup=warmup,
                              min_cosine=r["min_cosine"], worst=r["worst_matrix"], median=r["median_cosine"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
