"""The CUDA step kernel against an earlier one, on one GPU: speed tables, and the workload ncu profiles.

The earlier kernel comes from a copy of an earlier revision's ``ds_q8/csrc`` (``snapshot`` makes one
with git, restricted to Adam's rules so that it builds in seconds); it is compiled as its own
extension (``_q8_cuda_earlier``) with today's nvcc flags. Both kernels step the same tensors through
the ops' ``step_many`` with the same arguments, so a row's difference is the kernel's.

    python gpu_check/kernel_compare.py snapshot --rev REV --old DIR   the earlier csrc into DIR (needs git)
    python gpu_check/kernel_compare.py build --old DIR                compile the earlier op (and today's)
    python gpu_check/kernel_compare.py speed --old DIR [--n N] [--many COUNT SIZE] [--reps R] [--json PATH]
    python gpu_check/kernel_compare.py profile --old DIR [--n N]      one earlier and one current step for ncu

Speed tables (medians of --reps interleaved rounds, each timed to the device's completion; GB/s counts the
bytes each step must move): at N fp32 parameters in one tensor, copy, torch's fused AdamW, the earlier
and the current kernel, AdamW8bitBlock.step() with ``nonfinite`` off and on, bitsandbytes' AdamW8bit; at
N bf16 parameters and gradients stepped in place (10 bytes a parameter), the two kernels; over COUNT
tensors of SIZE (GPT-2 XL's count), the same rows, and for AdamW8bitBlock.step() the host's time to
return apart from the device's time to finish.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LR, WD, BLOCK = 1e-3, 1e-2, 64
DEVICE = "cuda"  # the tests run the tables' code on the CPU, through the CUDA op's CPU harness
BYTES = {"copy": 8, "8bit": 16, "8bit-bf16": 10, "32bit": 28}
EARLIER = "_q8_cuda_earlier"


def gpt2_xl_shapes(layers: int = 48, d: int = 1600, vocab: int = 50257, ctx: int = 1024) -> List[tuple]:
    """The parameter shapes of GPT-2 XL (1.56e9 parameters, 580 tensors)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def xl_count_and_size() -> tuple:
    """GPT-2 XL's tensor count and mean size: the many-tensor table's default (580 of 2.69e6)."""
    shapes = gpt2_xl_shapes()
    return len(shapes), sum(math.prod(s) for s in shapes) // len(shapes)


def snapshot(rev: str, dest: str) -> str:
    """``ds_q8/csrc`` of ``rev`` in ``dest``, its Q8_RULES cut to Adam's rules; returns the csrc folder."""
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "ds_q8/csrc"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    csrc = os.path.join(dest, "ds_q8", "csrc")
    # Q8_RULES is in q8_rules.h; revisions before that header have it in q8_common.h
    common = os.path.join(csrc, "includes", "q8_rules.h")
    if not os.path.exists(common):
        common = os.path.join(csrc, "includes", "q8_common.h")
    text = open(common).read()
    start = text.index("#define Q8_RULES(X)")
    end = text.index("}  // namespace ds_q8", start)
    text = text[:start] + '#define Q8_RULES(X) X("adam", AdamRule<false>) X("adamw", AdamRule<true>)\n\n' + text[end:]
    with open(common, "w") as f:
        f.write(text)
    with open(os.path.join(dest, "REVISION"), "w") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], capture_output=True, text=True,
                               check=True).stdout.strip() + "\n")
    return csrc


def earlier_op(old: str, verbose: bool = False):
    """The earlier revision's CUDA op, compiled from ``old`` (a csrc folder) with today's nvcc flags."""
    from torch.utils.cpp_extension import load

    from ds_q8.op_builder import Q8CUDABuilder

    builder = Q8CUDABuilder()
    builder.jit_mode = True
    try:
        nvcc = [f for f in builder.nvcc_args() if not f.startswith("-DQ8_HEADERS")]
    finally:
        builder.jit_mode = False
    sources = [os.path.join(old, "cuda", "q8_cuda.cpp"), os.path.join(old, "cuda", "q8_cuda_kernels.cu")]
    return load(name=EARLIER, sources=sources, extra_include_paths=[os.path.join(old, "includes")],
                extra_cflags=builder.cxx_args(), extra_cuda_cflags=nvcc, verbose=verbose)


def revision(old: str) -> str:
    path = os.path.join(os.path.dirname(os.path.dirname(old)), "REVISION")
    return open(path).read().strip() if os.path.exists(path) else "earlier"


class Kernel:
    """One op's AdamW step on given tensors, through step_many (its own lookup tensors)."""

    def __init__(self, module, params, grads, states, absmax, stochastic_params: bool):
        import torch

        import ds_q8
        from ds_q8 import functional as F

        self.module, self.params, self.grads, self.states, self.absmax = module, params, grads, states, absmax
        opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(params[0][:1].float())], lr=LR, weight_decay=WD)
        group = opt.param_groups[0]
        self.hyper = dict(opt._hyper(group, 10))
        self.maps = [F.state_map("dynamic", s, params[0].device) for s in (True, False)]
        self.lookups = [module.build_lookup(m.cpu()).to(m.device) for m in self.maps]
        self.keys = [(0x9E3779B9 * (i + 1)) & 0x7FFFFFFF for i in range(len(params))]
        self.index = [0] * len(params)
        self.stochastic_params = stochastic_params

    def __call__(self):
        self.module.step_many("adamw", self.params, self.grads, self.states, self.absmax, self.maps, self.lookups,
                              BLOCK, self.hyper, self.keys, self.index, None, self.stochastic_params, [True, True])


def tensors(n: int, count: int, dtype, seed: int):
    """``count`` parameters of ``n`` elements in ``dtype`` with gradients, and 8-bit states for them."""
    import torch

    from ds_q8 import functional as F

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    params = [torch.randn(n, generator=g, device=DEVICE).to(dtype) for _ in range(count)]
    grads = [torch.randn(n, generator=g, device=DEVICE).mul_(1e-2).to(dtype) for _ in range(count)]
    nb = -(-n // BLOCK)
    states = [[torch.randint(0, 256, (n,), generator=g, device=DEVICE, dtype=torch.uint8) for _ in range(2)]
              for _ in range(count)]
    absmax = [[torch.rand(nb, generator=g, device=DEVICE).to(F.ABSMAX_DTYPE) for _ in range(2)] for _ in range(count)]
    return params, grads, states, absmax


def clock(step: Callable[[], None]) -> Dict[str, float]:
    """One call of ``step``: the host's time to return (nothing waits for the GPU) and the device's time from
    the call to the end of its work (CUDA events; on the CPU both are the call's time)."""
    import torch

    if DEVICE != "cuda":
        t0 = time.perf_counter()
        step()
        ms = 1e3 * (time.perf_counter() - t0)
        return {"host_ms": ms, "device_ms": ms}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    step()
    host = 1e3 * (time.perf_counter() - t0)
    end.record()
    end.synchronize()
    return {"host_ms": host, "device_ms": start.elapsed_time(end)}


def timed(rows: List[dict], reps: int) -> None:
    """Median device time of each row's step over interleaved rounds (one warm-up call each)."""
    for row in rows:
        row["step"]()
    times = {id(r): [] for r in rows}
    for _ in range(reps):
        for row in rows:
            times[id(row)].append(clock(row["step"])["device_ms"])
    for row in rows:
        row["runs_ms"] = times[id(row)]
        row["ms"] = statistics.median(times[id(row)])


def host_and_device(step: Callable[[], None], reps: int) -> Dict[str, float]:
    """Medians over ``reps`` calls of :func:`clock` (after a warm-up call)."""
    step()
    runs = [clock(step) for _ in range(reps)]
    return {key: statistics.median(r[key] for r in runs) for key in ("host_ms", "device_ms")}


def optimizer_row(name, params, grads, make, bytes_per_param):
    import torch

    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    try:
        step = make(ps).step
    except Exception as exc:  # an optional peer missing here
        print(f"INFO skipped {name}: {' '.join(str(exc).split())[:200]}", flush=True)
        return None
    return dict(name=name, bytes=bytes_per_param, step=step)


def rows_for(n: int, count: int, earlier, current, with_bnb: bool) -> List[dict]:
    """The fp32 rows over ``count`` tensors of ``n`` parameters; every row steps the same parameters."""
    import torch

    import ds_q8

    params, grads, states, absmax = tensors(n, count, torch.float32, 0)
    rows = []
    if count == 1:
        dst = torch.empty_like(params[0])
        rows.append(dict(name="copy (fp32)", bytes=BYTES["copy"], step=lambda: dst.copy_(params[0])))
    rows.append(optimizer_row("torch AdamW fused (32-bit)", params, grads,
                              lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True), BYTES["32bit"]))
    if earlier is not None:
        rows.append(dict(name=f"earlier kernel ({EARLIER_REV})", bytes=BYTES["8bit"],
                         step=Kernel(earlier, params, grads, states, absmax, False)))
    rows.append(dict(name="current kernel", bytes=BYTES["8bit"],
                     step=Kernel(current, params, grads, states, absmax, False)))
    for nonfinite in ("off", "skip"):
        rows.append(optimizer_row(f"AdamW8bitBlock.step() (nonfinite={nonfinite})", params, grads,
                                  lambda ps, nf=nonfinite: ds_q8.AdamW8bitBlock(ps, lr=LR, weight_decay=WD, nonfinite=nf),
                                  BYTES["8bit"]))
    if with_bnb:
        def bnb(ps):
            import bitsandbytes

            return bitsandbytes.optim.AdamW8bit(ps, lr=LR, weight_decay=WD)
        rows.append(optimizer_row("bitsandbytes AdamW8bit", params, grads, bnb, BYTES["8bit"]))
    return [r for r in rows if r is not None]


def bf16_rows(n: int, earlier, current) -> List[dict]:
    """bf16 parameters and gradients stepped in place, written with stochastic rounding (10 bytes a parameter)."""
    import torch

    params, grads, states, absmax = tensors(n, 1, torch.bfloat16, 1)
    rows = []
    if earlier is not None:
        rows.append(dict(name=f"earlier kernel ({EARLIER_REV}), bf16 in place", bytes=BYTES["8bit-bf16"],
                         step=Kernel(earlier, params, grads, states, absmax, True)))
    rows.append(dict(name="current kernel, bf16 in place", bytes=BYTES["8bit-bf16"],
                     step=Kernel(current, params, grads, states, absmax, True)))
    return rows


EARLIER_REV = "earlier"


def report(title: str, rows: List[dict], n_total: int, copy_gbps: Optional[float], out: List[dict]) -> None:
    print(f"\n{title}")
    print(f"| row | ms | GB/s | of copy |\n|---|---:|---:|---:|")
    for r in rows:
        gbps = r["bytes"] * n_total / (r["ms"] * 1e-3) / 1e9
        frac = f"{100 * gbps / copy_gbps:.0f}%" if copy_gbps else ""
        print(f"| {r['name']} | {r['ms']:.2f} | {gbps:.0f} | {frac} |", flush=True)
        out.append(dict(table=title, name=r["name"], ms=r["ms"], GBps=gbps, runs_ms=r["runs_ms"]))


def speed(args, current, earlier) -> Dict:
    import torch

    from ds_q8.tools.bench_rows import _release

    result: Dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "earlier": EARLIER_REV, "n": args.n,
                    "many": list(args.many), "rows": []}
    with_bnb = not args.no_peers
    rows = rows_for(args.n, 1, earlier, current, with_bnb)
    timed(rows, args.reps)
    copy = next((r for r in rows if r["name"].startswith("copy")), None)
    copy_gbps = copy["bytes"] * args.n / (copy["ms"] * 1e-3) / 1e9 if copy else None
    report(f"AdamW, {args.n} fp32 parameters in one tensor", rows, args.n, copy_gbps, result["rows"])
    del rows
    _release(DEVICE)
    rows = bf16_rows(args.n, earlier, current)
    timed(rows, args.reps)
    report(f"AdamW, {args.n} bf16 parameters and gradients stepped in place", rows, args.n, copy_gbps, result["rows"])
    del rows
    _release(DEVICE)
    count, size = args.many
    rows = rows_for(size, count, earlier, current, with_bnb)
    timed(rows, args.reps)
    report(f"AdamW, {count} tensors of {size} fp32 parameters", rows, count * size, copy_gbps, result["rows"])
    step = next(r["step"] for r in rows if r["name"] == "AdamW8bitBlock.step() (nonfinite=skip)")
    split = host_and_device(step, args.reps)
    torch_step = next(r["step"] for r in rows if r["name"].startswith("torch"))
    split_torch = host_and_device(torch_step, args.reps)
    print(f"\n{count} tensors, host time to return vs device time to finish (medians of {args.reps}):")
    print(f"| row | host ms | device ms | host us per tensor |\n|---|---:|---:|---:|")
    for name, s in (("AdamW8bitBlock.step()", split), ("torch AdamW fused", split_torch)):
        print(f"| {name} | {s['host_ms']:.2f} | {s['device_ms']:.2f} | {1e3 * s['host_ms'] / count:.1f} |")
    result["host_device"] = {"ds_q8": split, "torch": split_torch}
    targets(result)
    return result


def targets(result: Dict) -> None:
    """The issue's targets as TARGET lines (met or missed; never a failure)."""
    rows = result["rows"]

    def ms(table_start: str, name: str) -> Optional[float]:
        return next((r["ms"] for r in rows if r["table"].startswith(table_start) and r["name"] == name), None)

    def gbps(table_start: str, name: str) -> Optional[float]:
        return next((r["GBps"] for r in rows if r["table"].startswith(table_start) and r["name"] == name), None)

    titles = list(dict.fromkeys(r["table"] for r in rows))
    one, bf16, many = (next((t for t in titles if test(t)), "-") for test in
                       (lambda t: "in one tensor" in t, lambda t: "stepped in place" in t, lambda t: "tensors of" in t))
    copy = next((r["GBps"] for r in rows if r["name"].startswith("copy")), None)
    lines = []
    kernel = gbps(one, "current kernel")
    if kernel and copy:
        lines.append(("current kernel >= 80% of copy bandwidth", kernel >= 0.8 * copy, f"{100 * kernel / copy:.0f}%"))
    bf = gbps(bf16, "current kernel, bf16 in place")
    if bf and copy:
        lines.append(("bf16 in place >= 80% of copy bandwidth", bf >= 0.8 * copy, f"{100 * bf / copy:.0f}%"))
    for table, label in ((one, "one tensor"), (many, "many tensors")):
        torch_ms = ms(table, "torch AdamW fused (32-bit)")
        for name in ("current kernel", "AdamW8bitBlock.step() (nonfinite=skip)"):
            mine = ms(table, name)
            if mine and torch_ms:
                lines.append((f"{label}: {name} faster than torch fused AdamW", mine < torch_ms,
                              f"{mine:.2f} ms vs {torch_ms:.2f} ms"))
        old = next((r["ms"] for r in rows if r["table"] == table and r["name"].startswith("earlier kernel")
                    and "bf16" not in r["name"]), None)
        new = ms(table, "current kernel")
        if old and new:
            lines.append((f"{label}: current kernel faster than the earlier one", new < old,
                          f"{new:.2f} ms vs {old:.2f} ms ({old / new:.2f}x)"))
    for name, met, detail in lines:
        print(f"TARGET {name}: {'met' if met else 'missed'}, {detail}", flush=True)
    result["targets"] = [dict(name=n, met=m, detail=d) for n, m, d in lines]


def profile(args, current, earlier) -> None:
    """Two steps of each kernel on the same tensors, then two of the 4-bit kernel (gpu_check/gpu_check.sh's
    profile stage has ncu profile the six launches, in this order)."""
    import torch

    params, grads, states, absmax = tensors(args.n, 1, torch.float32, 0)
    for name, module in (("earlier", earlier), ("current", current)):
        if module is None:
            continue
        k = Kernel(module, params, grads, states, absmax, False)
        k()
        k()
        torch.cuda.synchronize()
        print(f"profile workload: {name} kernel ({EARLIER_REV if name == 'earlier' else 'this tree'}), AdamW, "
              f"{args.n} fp32 parameters, 2 steps", flush=True)
    import ds_q8

    p = torch.nn.Parameter(params[0])
    p.grad = grads[0]
    opt = ds_q8.AdamW8bitBlock([p], optim_bits=4, nonfinite="off")
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    print(f"profile workload: 4-bit AdamW8bitBlock, {args.n} fp32 parameters, 2 steps", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["snapshot", "build", "speed", "profile"])
    ap.add_argument("--old", help="the earlier revision's csrc folder (snapshot writes it)")
    ap.add_argument("--rev", help="snapshot: the git revision of the earlier kernel")
    ap.add_argument("--n", type=int, default=None, help="parameters of one tensor (speed 1.5e9, profile 2^27)")
    ap.add_argument("--many", type=int, nargs=2, default=xl_count_and_size(), metavar=("COUNT", "SIZE"),
                    help="the many-tensor table: COUNT tensors of SIZE (default GPT-2 XL's count and mean size)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-peers", action="store_true", help="without bitsandbytes")
    ap.add_argument("--json", help="speed: also write the rows here")
    args = ap.parse_args(argv)
    if args.what == "snapshot":
        if not args.rev or not args.old:
            ap.error("snapshot needs --rev and --old")
        print(snapshot(args.rev, args.old))
        return 0
    if args.n is None:
        args.n = 2 ** 27 if args.what == "profile" else 1_500_000_000
    if args.n < 1 or min(args.many) < 1 or args.reps < 3:
        ap.error("--n and --many must be positive, --reps at least 3")
    old = os.path.join(args.old, "ds_q8", "csrc") if args.old and os.path.isdir(os.path.join(args.old, "ds_q8")) \
        else args.old
    global EARLIER_REV
    from ds_q8 import ops

    t0 = time.time()
    current = ops.load_op("cuda", required=True)
    earlier = None
    if old:
        EARLIER_REV = revision(old)
        earlier = earlier_op(old, verbose=args.what == "build")
    print(f"INFO ops loaded in {time.time() - t0:.0f} s (earlier: {EARLIER_REV if earlier else 'none'})", flush=True)
    if args.what == "build":
        return 0
    if args.what == "profile":
        profile(args, current, earlier)
        return 0
    result = speed(args, current, earlier)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
