"""AdamW8bitBlock's CPU step on each map and search path, interleaved in one process (ratios to dynamic6).

    python studies/step_by_map.py --threads 1 --log2n 22 --rounds 9 --isa avx512
    python studies/step_by_map.py --fixed-grad      # one gradient for every step, as ds_q8.tools.bench steps

Rows: the default maps (minifloat), the previous default (dynamic6), and two maps that the fast searches
refuse, run under ``quantization="linear"`` with the signed map swapped in: the sign-magnitude E3M4 layout
with both zeros, and dynamic6 with its most negative entry moved (no mirror, so no segment search; the
AVX2 floor rows still take it). Each optimizer steps 2^log2n parameters; by default it is given one of
four fresh gradients before each step, so that its moments keep moving as in training.
"""
import argparse
import statistics
import time

import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import ops


def two_zeros() -> torch.Tensor:
    mags = F.minifloat_magnitudes(*F.MINIFLOAT_BITS[True])
    return (torch.cat([-mags.flip(0), mags]) + 0.0).to(torch.float32)


def unmirrored(code: torch.Tensor) -> torch.Tensor:
    out = code.clone()
    out[1] = out[0] + (out[1] - out[0]) * 0.6
    return out


def build(n: int, quantization: str, signed_map=None):
    """An optimizer past its first steps; ``signed_map`` replaces the signed map of ``quantization``."""
    keys = [("linear", True, "cpu"), ("linear", False, "cpu")]
    if signed_map is not None:
        F._device_maps[keys[0]] = signed_map
        F._device_maps[keys[1]] = F.state_map(quantization, False, "cpu")
        quantization = "linear"
    try:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n) * 1e-3
        opt = ds_q8.AdamW8bitBlock([p], lr=1e-3, weight_decay=0.01, nonfinite="off", impl="kernel",
                                   quantization=quantization)
        for _ in range(3):
            opt.step()
    finally:
        for k in keys:
            F._device_maps.pop(k, None)
    return opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log2n", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=5, help="steps timed per optimizer and round (their median)")
    ap.add_argument("--isa", default=None, help="avx512, avx2 or scalar (default: the best this CPU has)")
    ap.add_argument("--fixed-grad", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = 2 ** args.log2n
    isa = args.isa or ops.cpu_isa()
    grads = [torch.randn(n) * 1e-3 for _ in range(4)]
    with ops.use_cpu_isa(isa):
        opts = {"minifloat (the default)": build(n, "minifloat"),
                "minifloat with two zeros (exact paths)": build(n, "minifloat", two_zeros()),
                "dynamic6": build(n, "dynamic6"),
                "dynamic6 unmirrored (no segment search)": build(n, "dynamic6",
                                                                 unmirrored(F.state_map("dynamic6", True, "cpu")))}
        times = {k: [] for k in opts}
        k = 0
        for _ in range(args.rounds):
            for name, opt in opts.items():
                p = opt.param_groups[0]["params"][0]
                t = []
                for _ in range(args.steps):
                    if not args.fixed_grad:
                        p.grad, k = grads[k % 4], k + 1
                    t0 = time.perf_counter()
                    opt.step()
                    t.append(time.perf_counter() - t0)
                times[name].append(statistics.median(t))
    base = statistics.median(times["dynamic6"])
    print(f"| {isa}, {args.threads} thread(s), 2^{args.log2n}{', fixed gradient' if args.fixed_grad else ''} "
          f"| ms | vs dynamic6 |\n|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1e3:.2f} | {statistics.median(t) / base:.3f} |")


if __name__ == "__main__":
    main()
