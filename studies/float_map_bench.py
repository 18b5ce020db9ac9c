"""How fast a CPU AdamW step with 8-bit states could be on float-coded maps (a projection's evidence).

``studies/float_map_step/step.cpp`` is a probe, not a kernel of the op: the AdamW step on maps whose codes
are small floats (E3M4 first moments, E4M4 second moments), which need no table read either way. Its
module doc says what it computes. This script builds it (g++, AVX2) and times it beside ds_q8's
AdamW8bitBlock kernel at its defaults (``nonfinite="off"``) and DeepSpeedCPUAdam, interleaved, medians:

* in cache: one thread, parameters of 16384 and 65536 values, the cost per parameter from the
  difference (as ``python -m ds_q8.tools.bench``'s in-cache table);
* the step an offload user runs: 2^25 fp32 parameters on 2 threads.

The probe rounds as the op's default does (guided), or stochastically; besides, four variants of it that leave parts out (``VARIANTS``) show what each
costs: the second path of the evenly spaced low codes (when coding, then also when decoding), one of the
two hashes, and both hashes.

    python studies/float_map_bench.py [--n 33554432] [--threads 2] [--reps 7] [--json out.json]

It does not say whether such maps train as well as ``dynamic6``: that is the fidelity study's question.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "float_map_step", "step.cpp")
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def build() -> ctypes.CDLL:
    out = os.path.join(tempfile.mkdtemp(prefix="float_map_step_"), "step.so")
    subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC",
                    "-o", out, SOURCE], check=True)
    lib = ctypes.CDLL(out)
    lib.float_map_step.restype = None
    lib.float_map_step.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_float] * 5 + [ctypes.c_int] * 3
    lib.float_map_value.restype = ctypes.c_float
    lib.float_map_value.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def check_maps(lib) -> dict:
    """Both maps are sorted with top entry 1.0: the probe's codes are what the doc says."""
    signed = [lib.float_map_value(c, 1) for c in range(128)]
    unsigned = [lib.float_map_value(c, 0) for c in range(256)]
    assert signed == sorted(signed) and signed[0] == 0.0 and signed[-1] == 1.0, signed[:4]
    assert unsigned == sorted(unsigned) and unsigned[0] == 0.0 and unsigned[-1] == 1.0, unsigned[:4]
    assert all(lib.float_map_value(c | 128, 1) == -signed[c] for c in range(128))
    return dict(smallest_signed=signed[1], smallest_unsigned=unsigned[1])


#: the probe's variants (step.cpp's step_block): what each part of its requantization costs
VARIANTS = {16: "float-coded probe (E3M4 / E4M4, guided: the default rule)",
            0: "float-coded probe (E3M4 / E4M4, stochastic)",
            1: "  the same, low codes flushed (no second path)",
            3: "  the same, flushed, one hash for both states",
            5: "  the same, flushed, rounded to nearest (no hash)",
            13: "  the same, and decoded without the low codes' path"}


def probe_step(lib, n: int, threads: int, variant: int = 0):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.zeros(n, dtype=torch.uint8)
    v = torch.zeros(n, dtype=torch.uint8)
    blocks = (n + 63) // 64
    m_max = torch.zeros(blocks, dtype=torch.int16)
    v_max = torch.zeros(blocks, dtype=torch.int16)
    count = [0]

    def step():
        count[0] += 1
        lib.float_map_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), m_max.data_ptr(), v_max.data_ptr(),
                           n, LR, BETAS[0], BETAS[1], EPS, WD, count[0], threads, variant)
    return step, (p, g)


def agreement(lib, n: int = 1 << 16, steps: int = 20, variant: int = 16) -> dict:
    """The probe's update against torch's AdamW on one parameter, the same gradient every step: the
    cosine of the two updates and the ratio of their norms (a check that it computes AdamW)."""
    step, (p, g) = probe_step(lib, n, 1, variant)
    p0 = p.clone()
    q = torch.nn.Parameter(p0.clone())
    q.grad = g.clone()
    opt = torch.optim.AdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for _ in range(steps):
        step()
        opt.step()
    ours, theirs = p - p0, q.detach() - p0
    return dict(cosine=float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0)),
                norm_ratio=float(ours.norm() / theirs.norm()))


def ds_q8_step(n: int):
    import ds_q8

    p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.randn(n) * 1e-2
    opt = ds_q8.AdamW8bitBlock([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, nonfinite="off", impl="kernel")
    return opt.step


def deepspeed_step(n: int):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.randn(n) * 1e-2
    return DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True).step


def time_rows(makers: dict, reps: int, inner: int) -> dict:
    """Median seconds of one step per row, the rows interleaved in each repetition."""
    steps = {name: make() for name, make in makers.items()}
    for step in steps.values():
        step()  # warm: first-step state creation, builds
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lib = build()
    out = dict(maps=check_maps(lib), agreement=agreement(lib), cpu=_cpu_name())

    def makers(n, threads):
        rows = {name: (lambda v=v: probe_step(lib, n, threads, v)[0]) for v, name in VARIANTS.items()}
        rows["ds_q8 AdamW8bitBlock (kernel, nonfinite=off)"] = lambda: ds_q8_step(n)
        rows["DeepSpeedCPUAdam (32-bit)"] = lambda: deepspeed_step(n)
        return rows

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    small, large = 16384, 65536
    t_small = time_rows(makers(small, 1), max(args.reps, 9), 64)
    t_large = time_rows(makers(large, 1), max(args.reps, 9), 16)
    out["in_cache_ns_per_param"] = {k: 1e9 * (t_large[k] - t_small[k]) / (large - small) for k in t_large}
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    t_big = time_rows(makers(args.n, args.threads), args.reps, 1)
    torch.set_num_threads(saved)
    out["n"], out["threads"] = args.n, args.threads
    out["ms_per_step"] = {k: 1e3 * t for k, t in t_big.items()}
    base = out["ms_per_step"]["DeepSpeedCPUAdam (32-bit)"]
    print(f"{'':50s} {'in cache ns/param/core':>24s} {'ms/step at n':>14s} {'ratio':>7s}")
    for k in t_big:
        print(f"{k:50s} {out['in_cache_ns_per_param'][k]:24.2f} {out['ms_per_step'][k]:14.1f} "
              f"{out['ms_per_step'][k] / base:7.2f}")
    print(f"n = {args.n}, {args.threads} threads, {out['cpu']}; the probe against torch's AdamW over 20 steps: "
          f"cosine {out['agreement']['cosine']:.5f}, norm ratio {out['agreement']['norm_ratio']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
