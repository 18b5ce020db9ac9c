"""8-bit maps whose code <-> value conversion is plain arithmetic, against ds_q8's dynamic6 maps.

Every candidate is written as a sorted 256-entry float32 table (in [-1, 1] for the signed first moment,
[0, 1] for the unsigned second moment, holding 0, top entry exactly 1.0) so that ds_q8.functional's exact
rounding code (block 64, bfloat16-rounded-up maxima, guided rounding) applies unchanged; a kernel would
compute the same entries with float or integer operations instead of reading them from a table.

Signed maps (first moment), sign + 7 magnitude bits:
    ``e4m3``, ``e3m4``, ``e5m2``  float-like: magnitude ``2**(e - bias) * (1 + f / 2**M)``, ``e = 0`` the
                                subnormals ``f / 2**M * 2**(1 - bias)`` (0 included), every code finite, all
                                divided by the largest magnitude (a constant a kernel folds into the scale)
    ``ssK``                     companded even grid: ``t = i / 127`` (i in -127..127), value
                                ``t / (1 + K (1 - |t|))`` (K = 1: ``t / (2 - |t|)``, softsign normalised to
                                1 at the top); coding inverts it with one division,
                                ``t = (1 + K) y / (1 + K |y|)``
    ``dyn6``                    the shipped map, ``F.state_map("dynamic6", True, "cpu")``
A sign + magnitude code has two zeros (+0 and -0): the signed maps built here keep one (entry 127) and
put an entry one top spacing above 1.0 in place of the other (``ds_q8.functional.mirrored_map``). No
scaled value reaches it, so they code as the sign-magnitude format would, with 255 values in use.

Unsigned maps (second moment), 8 bits:
    ``e4m4``, ``e5m3``          the float-like construction without a sign bit (256 values, 0 included)
    ``sqe4m4``                  squares of the unsigned E4M4 grid (the stored code is sqrt(v) in E4M4)
    ``sqlin``                   ``(i / 255) ** 2`` (sqrt(v) on an even grid)
    ``dyn``                     the shipped map, ``F.state_map("dynamic6", False, "cpu")`` (the unsigned
                                dynamic tree map)
For the squared maps the decision boundaries here are the table's midpoints in v (ds_q8's rule), not in
sqrt(v) as an arithmetic coder that rounds sqrt(v) would place them.

``SimAdamW8`` is torch's AdamW whose moments are kept as the float32 values their codes decode to (ds_q8's
step: the update uses the new fp32 moments, then each is coded against its block's new maximum), with
guided rounding: second moments guided by their old codes (``old``), first moments by their value before
the update (``prev``; the default until the old-code rule, ``rule=update``, kept so that the results
recorded with it mean what they did) or by their old codes as well (``rule=code``, today's default), 32
random bits per element and step from a seeded generator. Parameters under 4096 elements keep float32
states (``min_8bit_size``). A variant is named ``q8[:m=MAP][:v=MAP][:rule=RULE][:seed=N]`` (defaults dyn6,
dyn, update, 0); ``studies/fidelity.py`` accepts these names.

    python studies/arith_maps.py table                # each map's smallest magnitude and entries per binade
    python studies/fidelity.py maps --width 768 --layers 4 --warmup 0 --out studies/results/maps/arith_768.json \\
        q8 q8:m=e4m3 q8:v=e4m4                        # the variants' per-matrix update cosines (fidelity.py)
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Dict, List, Optional

import torch

from ds_q8 import functional as F

BLOCK = 64
MIN_SIZE = 4096
SIGNED = ("dyn6", "e4m3", "e3m4", "e5m2", "e2m5", "ss1", "ss3", "ss7", "ss15")
UNSIGNED = ("dyn", "e4m4", "e5m3", "e3m5", "sqe4m4", "sqe3m5", "sqlin", "lin")


def _exponent_mantissa(name: str, bits: int):
    """``EnMk`` -> (n, k), which must sum to the magnitude's bits (7 signed, 8 unsigned)."""
    e, m = (int(x) for x in name[1:].split("m"))
    if e + m != bits:
        raise ValueError(f"{'signed' if bits == 7 else 'unsigned'} float map {name!r}: E + M must be {bits}")
    return e, m


def make_map(name: str, signed: bool) -> torch.Tensor:
    if signed:
        if name == "dyn6":
            return F.state_map("dynamic6", True, "cpu").clone()
        if name[0] == "e" and "m" in name:
            return F.minifloat_map(*_exponent_mantissa(name, 7), True)
        if name.startswith("ss") and name[2:].isdigit():
            k = float(name[2:])
            t = torch.arange(128, dtype=torch.float64) / 127
            return F.mirrored_map(t / (1.0 + k * (1.0 - t)))
    else:
        if name == "dyn":
            return F.state_map("dynamic6", False, "cpu").clone()
        if name[0] == "e" and "m" in name:
            return F.minifloat_map(*_exponent_mantissa(name, 8), False)
        if name.startswith("sqe"):
            e, m = (int(x) for x in name[3:].split("m"))
            return (F.minifloat_magnitudes(e, m) ** 2).to(torch.float32)
        if name == "sqlin":
            return ((torch.arange(256, dtype=torch.float64) / 255) ** 2).to(torch.float32)
        if name == "lin":
            return F.create_linear_map(False)
    raise ValueError(f"unknown {'signed' if signed else 'unsigned'} map {name!r}")


def parse(name: str) -> Dict[str, str]:
    """``q8[:m=MAP][:v=MAP][:rule=RULE][:seed=N]`` -> {"m": MAP, "v": MAP, "rule": RULE, "seed": N}; the
    rule guides the first moment ("update" or "code"); the seed is the random bits' (another seed: another
    random stream, to see how much of a difference is chance)."""
    spec = {"m": "dyn6", "v": "dyn", "rule": "update", "seed": 0}
    base, *parts = name.split(":")
    if base != "q8":
        raise ValueError(f"{name!r}: an 8-bit simulation is named q8[:m=MAP][:v=MAP][:seed=N]")
    for part in parts:
        key, _, value = part.partition("=")
        if key == "seed" and value.isdigit():
            spec["seed"] = int(value)
            continue
        if key == "rule":
            if value not in ("update", "code"):
                raise ValueError(f"{name!r}: rule must be update or code, got {value!r}")
            spec["rule"] = value
            continue
        if key not in ("m", "v"):
            raise ValueError(f"{name!r}: each change is m=MAP, v=MAP, rule=RULE or seed=N, got {part!r}")
        make_map(value, key == "m")
        spec[key] = value
    return spec


def check_map(code: torch.Tensor, signed: bool) -> None:
    assert code.dtype == torch.float32 and code.numel() == 256
    assert bool((code[1:] >= code[:-1]).all()), "sorted"
    # 1.0 is an entry; a signed map in ds_q8's mirrored layout (maps.mirrored_map) holds one more above it,
    # which no scaled value reaches
    top = -2 if signed and float(code[-1]) > 1.0 else -1
    assert float(code[top]) == 1.0 and bool((code == 0).any())
    assert float(code[0]) >= -1.0 if signed else float(code[0]) == 0.0


def describe(code: torch.Tensor) -> dict:
    """Smallest positive entry, distinct values, and positive entries per binade (top binade first)."""
    pos = code[code > 0].double()
    per = []
    hi = 1.0
    for _ in range(4):
        per.append(int(((pos > hi / 2) & (pos <= hi)).sum()))
        hi /= 2
    return dict(smallest=float(pos.min()), distinct=int(torch.unique(code).numel()),
                per_binade_top4=per, decades=round(math.log10(1.0 / float(pos.min())), 2))


def _entries_around(y: torch.Tensor, code: torch.Tensor, mid: torch.Tensor):
    """The two entries around each scaled value ``y`` (indices ``lo <= hi``) and the nearer of them."""
    top = code.numel() - 1
    near = torch.searchsorted(mid, y).clamp(max=top)
    other = torch.where(y >= code[near], near + 1, near - 1).clamp(0, top)
    lo, hi = torch.minimum(near, other), torch.maximum(near, other)
    return lo, hi, torch.where((code[hi] - code[lo]) * 0.5 < y - code[lo], hi, lo)


def prev_guided_codes(x: torch.Tensor, prev: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int,
                      bits: Optional[torch.Tensor], mid: Optional[torch.Tensor] = None,
                      rule: str = "update") -> torch.Tensor:
    """Codes of flat float32 values ``x`` (stored block maxima ``absmax``) by a rule that reads ``prev``, each
    value before the step's update, on the table's rules for any map (``mid``: its boundaries, the midpoints
    unless given); without ``bits`` to nearest. ``update`` (ds_q8's signed-state rule before the old-code
    rule): the nearer of the two entries around a value where it lies on the update's side of ``prev``
    (``(nearer * A - prev) * (x - prev) > 0``, float32), else the stochastic choice. ``bracket``: the
    stochastic choice where ``prev`` lies between the two entries (times ``A``), else the nearer one."""
    n = x.numel()
    a = absmax.to(torch.float32).repeat_interleave(block_size)[:n]
    y = x * torch.where(a > 0, torch.ones_like(a) / a, torch.zeros_like(a))
    mid = F.midpoints(code) if mid is None else mid
    drawn = F.quantize_scaled(y, code, bits, mid).long()
    if bits is None:
        return drawn.to(torch.uint8)
    lo, hi, nearer = _entries_around(y, code, mid)
    if rule == "update":
        take_near = (code[nearer] * a - prev) * (x - prev) > 0
    else:
        take_near = ~((code[lo] * a <= prev) & (prev <= code[hi] * a))
    nearer = torch.where((code[0] == 0) & (y > 0) & (nearer == 0), torch.ones_like(nearer), nearer)  # zero point
    idx = torch.where(take_near, nearer, drawn)
    return torch.where(torch.isnan(y), torch.full_like(idx, code.numel() - 1), idx).to(torch.uint8)


class SimAdamW8(torch.optim.Optimizer):
    """torch's AdamW (decoupled weight decay, bias correction) with 8-bit block-wise moments, simulated."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, spec=None,
                 min_size=MIN_SIZE, block=BLOCK, seed=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.spec = spec or parse("q8")
        self.codes = {"m": make_map(self.spec["m"], True), "v": make_map(self.spec["v"], False)}
        check_map(self.codes["m"], True)
        check_map(self.codes["v"], False)
        self.mids = {k: F.midpoints(c) for k, c in self.codes.items()}
        self.min_size, self.block = min_size, block
        self.gen = torch.Generator().manual_seed(self.spec.get("seed", seed))

    def _bits(self, n: int) -> torch.Tensor:
        return torch.randint(0, 2 ** 32, (n,), generator=self.gen, dtype=torch.int64)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                coded = p.numel() >= self.min_size
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(g)
                    st["v"] = torch.zeros_like(g)
                    if coded:  # the codes of zero states, for the guides by the old code
                        st["v_codes"] = torch.zeros(p.numel(), dtype=torch.long)
                        st["m_codes"] = F.quantize_scaled(torch.zeros(p.numel()), self.codes["m"]).long()
                st["step"] += 1
                t = st["step"]
                prev_m = st["m"].reshape(-1).clone() if coded else None
                m = st["m"].mul_(b1).add_(g, alpha=1 - b1)
                v = st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
                if not coded:
                    continue
                n, bs = p.numel(), self.block
                # first moment: guided by its value before the update, or by its old code
                mf = m.reshape(-1)
                am = F.block_absmax(mf, bs)
                if self.spec["rule"] == "code":
                    cm = F.quantize_with_absmax(mf, am, self.codes["m"], bs, self._bits(n), self.mids["m"],
                                                old=st["m_codes"]).long()
                    st["m_codes"] = cm
                else:
                    cm = prev_guided_codes(mf, prev_m, am, self.codes["m"], bs, self._bits(n), self.mids["m"])
                st["m"] = F.dequantize_flat(cm, am, self.codes["m"], bs).view(p.shape)
                # second moment: guided by its old codes
                vf = v.reshape(-1)
                av = F.block_absmax(vf, bs)
                cv = F.quantize_with_absmax(vf, av, self.codes["v"], bs, self._bits(n), self.mids["v"],
                                            old=st["v_codes"]).long()
                st["v_codes"] = cv
                st["v"] = F.dequantize_flat(cv, av, self.codes["v"], bs).view(p.shape)
        return None


def cmd_table(args) -> int:
    rows = []
    for signed, names in ((True, SIGNED), (False, UNSIGNED)):
        for name in names:
            d = describe(make_map(name, signed))
            rows.append(dict(map=name, moment="m" if signed else "v", **d))
            print(f"| {name} | {'m' if signed else 'v'} | {d['smallest']:.3g} | {d['decades']} | {d['distinct']} | "
                  + " / ".join(str(k) for k in d["per_binade_top4"]) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="each map's smallest positive entry and entries per binade")
    t.add_argument("--out")
    args = ap.parse_args(argv)
    return cmd_table(args)


if __name__ == "__main__":
    raise SystemExit(main())
