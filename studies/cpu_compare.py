"""The CPU step kernel against an earlier one, and against the 32-bit steps ZeRO-Offload runs, in one process.

The earlier kernel is an earlier revision's ``ds_q8/csrc`` (``snapshot``, restricted to Adam's rules: see
``gpu_check/kernel_compare.py``), compiled as its own extension (``_q8_cpu_earlier``) with today's flags. Both ops
step the same kind of tensors through their ``step_many`` with the same arguments (AdamW, block 64, the default
minifloat maps in each revision's own layout, every state guided by its old code, rounding keys given), so a
row's difference is the kernel's. Rows are timed in interleaved rounds; compare ratios within one table.

    python studies/cpu_compare.py snapshot --rev 047c763 --old DIR   the earlier csrc into DIR (needs git)
    python studies/cpu_compare.py speed --old DIR [--n N] [--threads T] [--isa avx512 avx2] [--json PATH]

Tables, per instruction set:
- N fp32 parameters (default 2^25) on T threads (default 2): a copy, torch's fused AdamW, DeepSpeedCPUAdam with
  fp32 states and with bf16 parameters, gradients and states (``fp32_optimizer_states=False``, what
  ``bf16_optimizer_states`` gives ZeRO-Offload), the earlier and the current kernel, and AdamW8bitBlock.step()
  with its default non-finite check (a read of the gradients), with the check answered by a given norm
  (DeepSpeed's, or ``step(grad_norm=...)``) and without it; then bf16 parameters and gradients stepped in place.
- in cache, one thread: ns a parameter, the slope between two sizes that stay in cache (16K and 64K).
- a projection to a ZeRO-Offload host of C cores and B GB/s (default 32 and 200): per parameter, the larger of
  the in-cache time over C cores and the bytes the step must move over B, at 1.5e9 parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LR, WD, BLOCK = 1e-3, 1e-2, 64
EARLIER = "_q8_cpu_earlier"
#: bytes a step must move per parameter: read p, g, states; write p, states
BYTES = {"copy": 8, "8bit": 16, "8bit-bf16": 10, "32bit": 28, "32bit-bf16": 14}


def earlier_op(old: str, verbose: bool = False):
    """The earlier revision's CPU op, compiled from ``old`` (a csrc folder) with today's flags."""
    from torch.utils.cpp_extension import load

    from ds_q8.op_builder import Q8CPUBuilder

    builder = Q8CPUBuilder()
    flags = [f for f in builder.cxx_args() if not f.startswith("-DQ8_HEADERS")]
    sources = [os.path.join(old, "cpu", f) for f in ("q8_cpu.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp")]
    return load(name=EARLIER, sources=sources, extra_include_paths=[os.path.join(old, "includes"), os.path.join(old, "cpu")],
                extra_cflags=flags, extra_ldflags=builder.extra_ldflags(), verbose=verbose)


def earlier_maps(old: str):
    """The minifloat maps as the earlier revision builds them (its functional.py, loaded by path)."""
    import importlib.util

    import torch

    path = os.path.join(os.path.dirname(old), "functional.py")
    spec = importlib.util.spec_from_file_location("earlier_functional", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return [module.create_minifloat_map(s) for s in (True, False)]
    except ImportError:  # a revision whose functional.py imports its package: today's maps (one ulp apart)
        from ds_q8 import functional as F
        return [F.create_minifloat_map(s).to(torch.float32) for s in (True, False)]


class Kernel:
    """One op's AdamW step through step_many on given tensors, every state guided by its old code."""

    def __init__(self, module, isa: str, maps, params, grads, states, absmax):
        import torch

        import ds_q8
        from ds_q8 import ops

        self.module, self.isa = module, isa
        self.params, self.grads, self.states, self.absmax = params, grads, states, absmax
        opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(torch.zeros(1))], lr=LR, weight_decay=WD)
        self.hyper = ops.kernel_hyper(module, "adamw", opt._hyper(opt.param_groups[0], 10))
        self.maps = maps
        self.lookups = [module.build_lookup(m) for m in maps]
        self.keys = [(0x9E3779B9 * (i + 1)) & 0x7FFFFFFF for i in range(len(params))]
        self.index = [0] * len(params)
        self.stochastic_params = params[0].dtype != torch.float32

    def __call__(self):
        self.module.step_many(self.isa, "adamw", self.params, self.grads, self.states, self.absmax, self.maps,
                              self.lookups, BLOCK, self.hyper, self.keys, self.index, self.stochastic_params, [3, 3])


def tensors(n: int, dtype, seed: int, warm: int = 4):
    """A parameter of ``n`` elements in ``dtype`` with its gradient, and 8-bit states for it as training leaves
    them: ``warm`` steps of AdamW8bitBlock on fresh Gaussian gradients (the codes of random states would
    take every code with equal chance, which no state does; the kernels' fast paths follow real codes)."""
    import torch

    import ds_q8

    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
    opt = ds_q8.AdamW8bitBlock([p], lr=LR, weight_decay=WD, block_size=BLOCK, min_8bit_size=0)
    for _ in range(warm):
        p.grad = torch.randn(n, generator=g).mul_(1e-2).to(dtype)
        opt.step()
    st = opt.state[p]
    states = [[st["state1"].view(-1).clone(), st["state2"].view(-1).clone()]]
    absmax = [[st["absmax1"].view(-1).clone(), st["absmax2"].view(-1).clone()]]
    return [p.detach().clone().view(-1)], [p.grad.clone().view(-1)], states, absmax


def rows_for(n: int, isa: str, earlier, current, old_maps, new_maps, bf16: bool = False) -> List[dict]:
    """The rows of one table: (name, bytes a parameter, step)."""
    import torch

    import ds_q8

    dtype = torch.bfloat16 if bf16 else torch.float32
    rows = []

    def add(name, nbytes, make):
        try:
            rows.append(dict(name=name, bytes=nbytes, step=make()))
        except Exception as exc:  # an optional row that cannot build here
            print(f"skipped {name}: {' '.join(str(exc).split())[:160]}")

    def params(seed, d=dtype):
        g = torch.Generator().manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(n, generator=g).to(d))
        p.grad = torch.randn(n, generator=g).mul_(1e-2).to(d)
        return [p]

    def ds_cpu_adam(fp32_states: bool):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params(4), lr=LR, weight_decay=WD, adamw_mode=True,
                                fp32_optimizer_states=fp32_states).step

    def ds_q8_step(nonfinite, grad_norm=None):
        # its states as the kernels' rows have theirs (tensors()): a few steps on fresh gradients, then one
        # gradient again and again
        ps = params(0)
        opt = ds_q8.AdamW8bitBlock(ps, lr=LR, weight_decay=WD, nonfinite=nonfinite, impl="kernel")
        g, gen = ps[0].grad, torch.Generator().manual_seed(5)
        for _ in range(4):
            ps[0].grad = torch.randn(n, generator=gen).mul_(1e-2).to(dtype)
            opt.step()
        ps[0].grad = g
        return opt.step if grad_norm is None else (lambda: opt.step(grad_norm=grad_norm))

    kind = "8bit-bf16" if bf16 else "8bit"
    if not bf16:
        src = torch.randn(n)
        dst = torch.empty_like(src)
        add("copy (dst.copy_(src), fp32)", BYTES["copy"], lambda: (lambda: dst.copy_(src)))
        add("torch AdamW fused, fp32 states", BYTES["32bit"],
            lambda: torch.optim.AdamW(params(2), lr=LR, weight_decay=WD, fused=True).step)
        add("DeepSpeedCPUAdam, fp32 states", BYTES["32bit"], lambda: ds_cpu_adam(True))
    else:
        add("DeepSpeedCPUAdam, bf16 params, grads and states", BYTES["32bit-bf16"], lambda: ds_cpu_adam(False))
    if earlier is not None:
        add(f"ds_q8 kernel, earlier ({isa})", BYTES[kind], lambda: Kernel(earlier, isa, old_maps, *tensors(n, dtype, 1)))
    add(f"ds_q8 kernel, current ({isa})", BYTES[kind], lambda: Kernel(current, isa, new_maps, *tensors(n, dtype, 1)))
    if not bf16:
        add(f"AdamW8bitBlock.step(), default (non-finite check) ({isa})", BYTES[kind], lambda: ds_q8_step("skip"))
        add(f"AdamW8bitBlock.step(grad_norm=...), the check answered by a norm ({isa})", BYTES[kind],
            lambda: ds_q8_step("skip", torch.tensor(1.0)))
        add(f"AdamW8bitBlock.step(), nonfinite=off ({isa})", BYTES[kind], lambda: ds_q8_step("off"))
    return rows


def measure(rows: List[dict], reps: int, isa: str, pick=statistics.median) -> None:
    """Interleaved rounds (one call of each row a round) after one warm-up call; the median a row (or
    ``pick`` of its rounds)."""
    from ds_q8 import ops

    with ops.use_cpu_isa(isa):
        for row in rows:
            row["step"]()
        times: List[List[float]] = [[] for _ in rows]
        for _ in range(reps):
            for row, ts in zip(rows, times):
                t0 = time.perf_counter()
                row["step"]()
                ts.append(time.perf_counter() - t0)
    for row, ts in zip(rows, times):
        row["ms"] = pick(ts) * 1e3
        row.pop("step")


def in_cache(isa: str, earlier, current, old_maps, new_maps, small: int, large: int, reps: int) -> List[dict]:
    """ns a parameter on one thread, from the step times at two sizes that stay in cache."""
    import torch

    torch.set_num_threads(1)
    out = []
    for label, nbytes, maker in _in_cache_makers(isa, earlier, current, old_maps, new_maps):
        per = []
        for n in (small, large):
            rows = [dict(name=label, bytes=nbytes, step=maker(n))]
            inner = max(1, 2 ** 21 // n)
            step = rows[0]["step"]
            rows[0]["step"] = lambda step=step, inner=inner: [step() for _ in range(inner)]
            measure(rows, reps, isa, pick=min)  # in cache, a round that other work slowed is only slower
            per.append(rows[0]["ms"] * 1e-3 / inner)
        out.append(dict(name=label, bytes=nbytes, ns=(per[1] - per[0]) / (large - small) * 1e9))
    return out


def _in_cache_makers(isa, earlier, current, old_maps, new_maps):
    import torch

    def ds_cpu_adam(n):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        g = torch.Generator().manual_seed(4)
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g).mul_(1e-2)
        return DeepSpeedCPUAdam([p], lr=LR, weight_decay=WD, adamw_mode=True).step

    def torch_fused(n):
        g = torch.Generator().manual_seed(2)
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g).mul_(1e-2)
        return torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=True).step

    makers = []
    if earlier is not None:
        makers.append((f"ds_q8 kernel, earlier ({isa})", BYTES["8bit"],
                       lambda n: Kernel(earlier, isa, old_maps, *tensors(n, torch.float32, 1))))
    makers.append((f"ds_q8 kernel, current ({isa})", BYTES["8bit"],
                   lambda n: Kernel(current, isa, new_maps, *tensors(n, torch.float32, 1))))
    makers.append(("DeepSpeedCPUAdam, fp32 states", BYTES["32bit"], ds_cpu_adam))
    makers.append(("torch AdamW fused, fp32 states", BYTES["32bit"], torch_fused))
    return makers


def projection(cache: List[dict], cores: int, bandwidth: float, n: float = 1.5e9) -> List[dict]:
    """Each in-cache row on a host of ``cores`` cores and ``bandwidth`` GB/s: the larger of compute and memory."""
    out = []
    for row in cache:
        compute = row["ns"] * 1e-9 * n / cores
        memory = row["bytes"] * n / (bandwidth * 1e9)
        out.append(dict(name=row["name"], compute_ms=compute * 1e3, memory_ms=memory * 1e3,
                        ms=max(compute, memory) * 1e3, bound="memory" if memory >= compute else "compute"))
    return out


def print_table(title: str, rows: List[dict], n: int, base: str) -> None:
    ref = next((r["ms"] for r in rows if r["name"].startswith(base)), None)
    print(f"\n{title}\n| row | ms | ratio to {base} | GB/s |\n|---|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['ms'] / ref:.2f}" if ref else "-"
        print(f"| {r['name']} | {r['ms']:.1f} | {ratio} | {r['bytes'] * n / r['ms'] / 1e6:.1f} |")


def speed(args) -> dict:
    import platform

    import torch

    from ds_q8 import functional as F
    from ds_q8 import ops

    earlier = earlier_op(args.old) if args.old else None
    current = ops.load_op("cpu", required=True)
    old_maps = earlier_maps(args.old) if args.old else None
    new_maps = [F.state_map("minifloat", s, "cpu") for s in (True, False)]
    cpu = _cpu_name()
    result = dict(cpu=cpu, machine=platform.machine(), torch=torch.__version__, n=args.n, threads=args.threads,
                  earlier=open(os.path.join(os.path.dirname(os.path.dirname(args.old)), "REVISION")).read().strip()
                  if args.old and os.path.exists(os.path.join(os.path.dirname(os.path.dirname(args.old)), "REVISION"))
                  else None, tables={})
    print(f"{cpu}; torch {torch.__version__}; N = {args.n}, {args.threads} threads; medians of {args.reps} rounds")
    for isa in args.isa:
        if isa not in current.supported_isas():
            print(f"\n{isa}: not supported by this CPU")
            continue
        torch.set_num_threads(args.threads)
        rows = rows_for(args.n, isa, earlier, current, old_maps, new_maps)
        measure(rows, args.reps, isa)
        print_table(f"{isa}: AdamW, {args.n} fp32 parameters, {args.threads} threads", rows, args.n,
                    "DeepSpeedCPUAdam, fp32")
        bf16 = rows_for(args.n, isa, earlier, current, old_maps, new_maps, bf16=True)
        measure(bf16, args.reps, isa)
        print_table(f"{isa}: AdamW, {args.n} bf16 parameters and gradients stepped in place", bf16, args.n,
                    "DeepSpeedCPUAdam, bf16")
        cache = in_cache(isa, earlier, current, old_maps, new_maps, args.small, args.large, args.reps)
        print(f"\n{isa}: in cache, one thread\n| row | ns / parameter | ratio to the earlier kernel |\n|---|---:|---:|")
        first = cache[0]["ns"]
        for r in cache:
            print(f"| {r['name']} | {r['ns']:.3f} | {r['ns'] / first:.2f} |")
        proj = projection(cache, args.cores, args.bandwidth)
        print(f"\n{isa}: projected to {args.cores} cores and {args.bandwidth:g} GB/s, 1.5e9 parameters\n"
              "| row | compute ms | memory ms | step ms | bound |\n|---|---:|---:|---:|---|")
        for r in proj:
            print(f"| {r['name']} | {r['compute_ms']:.0f} | {r['memory_ms']:.0f} | {r['ms']:.0f} | {r['bound']} |")
        result["tables"][isa] = dict(step=rows, bf16=bf16, in_cache=cache, projection=proj)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="the earlier revision's csrc into --old")
    snap.add_argument("--rev", required=True)
    snap.add_argument("--old", required=True)
    sp = sub.add_parser("speed", help="the tables")
    sp.add_argument("--old", help="an earlier csrc (snapshot); without it, the current kernel alone")
    sp.add_argument("--n", type=int, default=2 ** 25)
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--isa", nargs="+", default=["avx512", "avx2"])
    sp.add_argument("--reps", type=int, default=7)
    sp.add_argument("--small", type=int, default=16384)
    sp.add_argument("--large", type=int, default=65536)
    sp.add_argument("--cores", type=int, default=32)
    sp.add_argument("--bandwidth", type=float, default=200.0)
    sp.add_argument("--json")
    args = ap.parse_args(argv)
    if args.command == "snapshot":
        from kernel_compare import snapshot
        dest = os.path.abspath(args.old)
        csrc = snapshot(args.rev, dest)
        # the earlier functional.py beside its csrc, for its maps
        import subprocess
        text = subprocess.run(["git", "-C", ROOT, "show", f"{args.rev}:ds_q8/functional.py"], capture_output=True,
                              text=True, check=True).stdout
        with open(os.path.join(os.path.dirname(csrc), "functional.py"), "w") as f:
            f.write(text)
        print(csrc)
    else:
        speed(args)


if __name__ == "__main__":
    main()
