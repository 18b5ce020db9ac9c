"""AdamW with 4-bit states simulated in plain PyTorch: the candidates for ``state_bits=4``, to measure.

Each state is kept as the float32 value its codes decode to (``code[index] * scale``), so a run
trains exactly as stored codes would, without packing them. What varies, per moment:

* the map, 16 (or 15) sorted values in [-1, 1] (first moment) or [0, 1] (second moment):
    ``dyn``   ds_q8's dynamic tree map at 4 bits (``functional.create_dynamic_map(signed, bits=4)``);
              signed it holds 0, seven values a side and 1.0 (so -1.0 is missing); unsigned it holds 0,
              whose zero point keeps every positive value at code 1 or more
    ``dyns``  (first moment) the signed one made symmetric: its 7 positive values and 1.0, mirrored; no 0
    ``nf4``   (first moment) QLoRA's NormalFloat levels
    ``lins``  (first moment) 16 evenly spaced values from -1 to 1 (no 0)
    ``lin0``  (first moment) k/7 for k in -7..7: even levels with 0 (the 16th code is never used)
    ``lin``   (second moment) ``(i + 1) / 16``: linear without zero (the 4-bit paper's and torchao's map)
    ``sq``    (second moment) ``((i + 1) / 16) ** 2``: linear in sqrt(v), without zero
    ``p4``    (second moment) ``((i + 1) / 16) ** 4``
    ``logK``  (second moment) sqrt(v) geometric from 1 down to 0.0K (log1, log2, log5) or 0.1 (log10):
              the same relative step for every element, without zero
    ``f32``   (either) no quantization: the moment stays float32, to see what the other one costs
* the normalisation: ``bN`` blocks of N elements of the flattened tensor, each scaled by its absmax
  (bfloat16, rounded up, as ds_q8 stores it); ``r1`` rank-1 for matrices, each element scaled by the
  smaller of its row's and its column's maximum (the 4-bit paper's), blocks of 128 for the rest. A
  trailing ``f`` keeps the maxima in float32. A first moment's ``vbN``/``vr1`` stores ``m / sqrt(v)``
  (v as it decodes) normalised so: each element's error then scales with its own gradient scale instead
  of its block's largest first moment. A second moment's ``cbN``/``cr1`` stores the bias-corrected
  ``v / (1 - beta2**t)``: a code that rounding keeps from one step to the next then holds the running
  mean of g^2 instead of letting it decay;
* the rounding: ``n`` nearest (with the zero point for maps holding 0), ``s`` stochastic (unbiased),
  ``d`` subtractive dither (uniform maps only: a random offset of up to half a step is added before
  rounding to nearest and taken off again when decoding, so that errors are unbiased and independent
  from step to step at nearest rounding's size).

Parameters with fewer than ``min_size`` elements keep float32 states, as ds_q8's ``min_8bit_size``.
A name such as ``q4:m=dyn,b128,n:v=lin,r1,s`` selects a variant (see :func:`parse`).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from ds_q8 import format4
from ds_q8 import functional as F

BITS = 4
#: QLoRA's NormalFloat4 levels (Dettmers et al. 2023): quantiles of a normal distribution scaled to
#: [-1, 1], eight positive, seven negative and 0
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]


def _map(name: str, signed: bool) -> torch.Tensor:
    if name == "f32":
        return torch.empty(0)
    if name == "dyn":
        return F.create_dynamic_map(signed, bits=BITS)
    if name == "dyns" and signed:
        pos = F.create_dynamic_map(True, bits=BITS)
        pos = pos[pos > 0]
        return torch.cat([-pos.flip(0), pos])
    if name == "nf4" and signed:
        return torch.tensor(NF4)
    if name == "lin0" and signed:  # 15 levels k/7 with 0: code 15 is never used
        return format4.M_MAP.clone()
    if name == "lins" and signed:
        return torch.linspace(-1, 1, 2 ** BITS, dtype=torch.float64).float()
    steps = torch.arange(1, 2 ** BITS + 1, dtype=torch.float64) / 2 ** BITS
    if name == "lin" and not signed:
        return steps.float()
    if name == "sq" and not signed:
        return (steps ** 2).float()
    lows = {"log1": 0.01, "log2": 0.02, "log5": 0.05, "log10": 0.1}
    if name.rstrip("h") in lows and not signed:
        return format4.root_geometric_map(lows[name.rstrip("h")])
    if name == "p4" and not signed:
        return (steps ** 4).float()
    raise ValueError(f"unknown {'signed' if signed else 'unsigned'} 4-bit map {name!r}")


def parse(name: str) -> Dict[str, Tuple[str, str, str]]:
    """``q4[:m=MAP,NORM,ROUND][:v=MAP,NORM,ROUND]`` -> {"m": (...), "v": (...)}; defaults the paper's."""
    spec = {"m": ("dyn", "b128", "n"), "v": ("lin", "r1", "n")}
    base, *parts = name.split(":")
    if base != "q4":
        raise ValueError(f"{name!r}: a 4-bit simulation is named q4[:m=...][:v=...]")
    for part in parts:
        key, _, value = part.partition("=")
        fields = value.split(",")
        if key not in spec or len(fields) != 3:
            raise ValueError(f"{name!r}: each change is m=MAP,NORM,ROUND or v=MAP,NORM,ROUND, got {part!r}")
        _map(fields[0], key == "m")
        norm = fields[1].lstrip("v" if key == "m" else "c").rstrip("f")
        if not (norm == "r1" or (norm[:1] == "b" and norm[1:].isdigit())) or fields[2] not in ("n", "s", "d"):
            raise ValueError(f"{name!r}: normalisation bN or r1, rounding n or s, got {part!r}")
        spec[key] = tuple(fields)
    return spec


def _scales(x: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-element scale (each at least the element's magnitude), from bfloat16-rounded-up maxima
    (float32 maxima when ``norm`` ends in ``f``)."""
    a = x.abs()
    stored = (lambda t: t) if norm.endswith("f") else (lambda t: F.stored_absmax(t).float())
    norm = norm.rstrip("f")
    if norm == "r1" and x.dim() == 2:
        rows = stored(a.amax(dim=1))
        cols = stored(a.amax(dim=0))
        return torch.minimum(rows[:, None], cols[None, :])
    size = 128 if norm == "r1" else int(norm[1:])
    per_block = stored(F.block_max(a.reshape(-1), size))
    return per_block.repeat_interleave(size)[: x.numel()].view(x.shape)


def midpoints(name: str, code: torch.Tensor) -> torch.Tensor:
    """Decision boundaries: ds_q8's (``functional.midpoints``), or for a second-moment map named ``...h``
    the value whose 1/sqrt lies halfway between its neighbours' (rounding then leaves 1/sqrt(v), the
    factor the update takes, unbiased on average instead of v)."""
    return format4.root_midpoints(code) if name.endswith("h") else F.midpoints(code)


def roundtrip(x: torch.Tensor, code: torch.Tensor, norm: str, rounding: str, gen: torch.Generator,
              mid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The value ``x`` decodes to once stored in 4 bits."""
    scale = _scales(x, norm)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (x * inv).reshape(-1)
    bits = None
    if rounding == "d":  # subtractive dither on a uniform map: the decoder removes the same offset
        step = float(code[1] - code[0])
        d = (torch.rand(y.shape, generator=gen) - 0.5) * step
        idx = F.quantize_scaled(y + d, code).long()
        return ((code[idx] - d).view(x.shape) * scale)
    if rounding == "s":
        bits = torch.randint(0, 2 ** 32, y.shape, generator=gen, dtype=torch.int64)
    idx = F.quantize_scaled(y, code, bits, mid).long()
    return (code[idx].view(x.shape) * scale)


class SimAdamW4(torch.optim.Optimizer):
    """torch's AdamW (decoupled weight decay, bias correction) whose moments live in 4 bits."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, spec=None,
                 min_size=4096, seed=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.spec = spec or parse("q4")
        self.codes = {"m": _map(self.spec["m"][0], True), "v": _map(self.spec["v"][0], False)}
        self.mids = {k: midpoints(self.spec[k][0], c) if c.numel() else None for k, c in self.codes.items()}
        self.min_size = min_size
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(g)
                    st["v"] = torch.zeros_like(g)
                st["step"] += 1
                t = st["step"]
                m = st["m"].mul_(b1).add_(g, alpha=1 - b1)
                v = st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
                if p.numel() >= self.min_size:
                    for key in ("v", "m"):
                        name, norm, rounding = self.spec[key]
                        if name == "f32":
                            continue
                        if key == "m" and norm.startswith("v"):  # store m / sqrt(v) as v will decode
                            root = st["v"].sqrt()  # v = 0 means every gradient was 0, and m = 0 with it
                            r = torch.where(root > 0, st["m"] / root, torch.zeros_like(root))
                            st["m"] = roundtrip(r, self.codes["m"], norm[1:], rounding, self.gen) * root
                        elif key == "v" and norm.startswith("c"):  # store v / (1 - beta2^t)
                            c = 1 - b2 ** t
                            st["v"] = roundtrip(st["v"] / c, self.codes["v"], norm[1:], rounding, self.gen,
                                                self.mids["v"]) * c
                        else:
                            st[key] = roundtrip(st[key], self.codes[key], norm, rounding, self.gen, self.mids[key])
        return None


def state_bytes(spec: Dict[str, Tuple[str, str, str]], shape) -> float:
    """Bytes per element of both states of a ``shape`` parameter: half a byte of code each, plus its
    maxima (bfloat16, float32 for a normalisation ending in ``f``); float32 for an ``f32`` state."""
    n = math.prod(shape)
    total = 0.0
    for key in ("m", "v"):
        name, norm, _ = spec[key]
        if name == "f32":
            total += 4
            continue
        norm = norm.lstrip("v" if key == "m" else "c")
        width = 4 if norm.endswith("f") else 2
        norm = norm.rstrip("f")
        if norm == "r1" and len(shape) == 2:
            total += 0.5 + width * (shape[0] + shape[1]) / n
        else:
            total += 0.5 + width * F.num_blocks(n, 128 if norm == "r1" else int(norm[1:])) / n
    return total


def after_a_fall(name: str, at=(100, 300, 1000, 3000), shape=(64, 128), fall=0.01, decades=0.0, seed=0):
    """How a second moment follows gradients that fall ``1/fall``-fold after step 100 (``fall=1``: they
    do not): the median over the elements of the stored second moment over the true one, and the range
    of 90% of them, at the steps ``at``. Each element's gradients have their own scale, spread evenly
    in log over ``decades`` (0: all alike). ``name`` is a 4-bit variant, ``ds_q8`` (AdamW8bitBlock at
    its defaults) or ``ds_q8:nearest`` (its second moment rounded to nearest)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(shape))
    n = math.prod(shape)
    scale = torch.logspace(-decades, 0, n)[torch.randperm(n)].view(shape) if decades else torch.ones(shape)
    if name.startswith("ds_q8"):
        import ds_q8

        rounding = "nearest" if name == "ds_q8:nearest" else "stochastic"
        opt = ds_q8.AdamW8bitBlock([p], lr=1e-3, weight_decay=0.0, state_rounding=rounding)
        stored = lambda: opt.dequantized_state(p)["exp_avg_sq"]  # noqa: E731
    else:
        opt = SimAdamW4([p], lr=1e-3, weight_decay=0.0, spec=parse(name))
        stored = lambda: opt.state[p]["v"]  # noqa: E731
    true_v = torch.zeros(shape)
    rows = []
    for t in range(1, max(at) + 1):
        g = torch.randn(shape) * scale * (1.0 if t <= 100 else fall)
        p.grad = g.clone()
        opt.step()
        true_v.mul_(0.999).addcmul_(g, g, value=0.001)
        if t in at:
            ratio = stored().reshape(-1) / true_v.reshape(-1)
            rows.append(dict(step=t, median=float(ratio.median()), q05=float(ratio.quantile(0.05)),
                             q95=float(ratio.quantile(0.95))))
    return rows


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="How each variant's second moment follows the gradients' scale")
    ap.add_argument("names", nargs="+", help="4-bit variants (q4:...), ds_q8 or ds_q8:nearest")
    ap.add_argument("--fall", type=float, default=0.01, help="gradient scale after step 100 (default 0.01; 1: none)")
    ap.add_argument("--decades", type=float, default=0.0,
                    help="spread of the elements' gradient scales, in decades (default 0: all alike)")
    args = ap.parse_args(argv)
    for name in args.names:
        if name not in ("ds_q8", "ds_q8:nearest"):
            try:
                parse(name)
            except ValueError as e:
                ap.error(str(e))
    if not 0 < args.fall:
        ap.error(f"--fall must be > 0, got {args.fall}")
    if not 0 <= args.decades <= 6:
        ap.error(f"--decades must be in [0, 6], got {args.decades}")
    print("| variant | state bytes/param | " + " | ".join(f"step {t}" for t in (100, 300, 1000, 3000))
          + " | step 3000, 5-95% of elements |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in args.names:
        rows = after_a_fall(name, fall=args.fall, decades=args.decades)
        size = "2.062" if name.startswith("ds_q8") else f"{state_bytes(parse(name), (4096, 4096)):.3f}"
        print(f"| {name} | {size} | " + " | ".join(f"{r['median']:.2f}" for r in rows)
              + f" | {rows[-1]['q05']:.2f} - {rows[-1]['q95']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
