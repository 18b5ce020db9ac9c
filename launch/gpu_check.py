"""The correctness and speed stages of launch/gpu_check.sh, on one CUDA GPU.

    python launch/gpu_check.py preflight                 imports, a visible GPU (STOP line, exit 2, if none)
    python launch/gpu_check.py build                     the CUDA op and the CPU op, at the same time
    python launch/gpu_check.py correctness --out DIR     kernels vs the pure-PyTorch reference
    python launch/gpu_check.py speed --out DIR [--n N]   CUDA-event timings against copy, bnb, torch
    python launch/gpu_check.py sanitize                  a small run for compute-sanitizer
    python launch/gpu_check.py STAGE --dry-run           the plan only (no GPU needed)

Every check prints one ``PASS name ...`` or ``FAIL name ...`` line and is added to
DIR/gpu_check_<stage>.json as soon as it finishes (the file is rewritten after each result, so a
run cut short still leaves what it measured). Exit status 1 when a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BLOCK_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]
DTYPE_PAIRS = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float16", "float32"),
               ("bfloat16", "float32")]
HUGE = 2 ** 31 + 4099
BYTES_8BIT, BYTES_COPY = 16, 8  # per parameter: read p, g, 2 codes; write p, 2 codes / read + write
DEVICE = "cuda"  # --device cpu runs the same checks on the CPU op, to try this script without a GPU


def sizes_for(block_size: int) -> List[int]:
    return [1, 7, block_size - 1, block_size + 1, 3 * block_size + 7]


def gpt2_xl_shapes(layers: int = 48, d: int = 1600, vocab: int = 50257, ctx: int = 1024) -> List[tuple]:
    """The parameter shapes of GPT-2 XL (1.56e9 parameters, 580 tensors); smaller when asked."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


class Report:
    """PASS/FAIL lines and a JSON file rewritten after every result."""

    def __init__(self, path: Optional[str], stage: str):
        self.path, self.failed = path, 0
        self.data: Dict = {"stage": stage, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": []}
        self._write()

    def _write(self):
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)

    def add(self, name: str, ok: Optional[bool], detail: str = "", **values):
        word = "INFO" if ok is None else ("PASS" if ok else "FAIL")
        self.failed += ok is False
        print(f"{word} {name}{': ' + detail if detail else ''}", flush=True)
        self.data["results"].append(dict(name=name, result=word, detail=detail, **values))
        self._write()

    def target(self, name: str, met: bool, detail: str, **values):
        """A speed target: the measured figure against it, reported, never a failure (FAIL is for wrong results)."""
        print(f"TARGET {name}: {'met' if met else 'missed'}, {detail}", flush=True)
        self.data["results"].append(dict(name=name, result="TARGET", met=bool(met), detail=detail, **values))
        self._write()

    def info(self, key: str, value):
        self.data[key] = value
        self._write()

    def run(self, name: str, check: Callable[[], Optional[str]]):
        """check() returns a detail string, or raises (AssertionError: FAIL with its message)."""
        t0 = time.time()
        try:
            detail = check() or ""
            self.add(name, True, detail, seconds=round(time.time() - t0, 2))
        except Exception as exc:  # one failed check must not stop the others
            msg = " ".join(str(exc).split())[:400] or type(exc).__name__
            self.add(name, False, msg, seconds=round(time.time() - t0, 2),
                     traceback=traceback.format_exc()[-3000:])


# ---------------------------------------------------------------------------------------------- correctness
def correctness_plan(quick: bool) -> List[tuple]:
    plan = []
    for bs in BLOCK_SIZES:
        for pd, gd in DTYPE_PAIRS:
            plan.append(("sweep", bs, pd, gd))
    plan += [("rules", 256, "float32", "float32"), ("fp32_states", 256, "bfloat16", "bfloat16"),
             ("offsets", 256, "float32", "float32"), ("offsets", 256, "bfloat16", "bfloat16"),
             ("stream", 512, "float32", "float32"), ("skip", 256, "float32", "float32"),
             ("quantize", 2048, "float32", "float32")]
    if not quick:
        plan.append(("huge", 2048, "bfloat16", "bfloat16"))
    return plan


def correctness(report: Report, quick: bool) -> None:
    import torch

    import ds_q8
    from ds_q8 import functional as F
    from ds_q8 import ops

    def bits(t):
        return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
                       torch.uint8: torch.uint8}[t.dtype])

    def same(a, b, what):
        if a.is_floating_point():
            diff = (bits(a) != bits(b)) & ~(torch.isnan(a) & torch.isnan(b))
        else:
            diff = a != b
        bad = int(diff.sum())
        assert bad == 0, f"{what}: {bad} of {a.numel()} differ (first at {int(diff.nonzero()[0])})"

    def pair(cls, sizes, pd, gd, bs, steps=2, min_8bit_size=0, seed=0, **kw):
        """The same optimizer with kernels and on the reference; both stepped; compared bit by bit."""
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        p0 = [torch.randn(n, generator=gen, device=DEVICE).to(pd) for n in sizes]
        pk = [torch.nn.Parameter(x.clone()) for x in p0]
        pr = [torch.nn.Parameter(x.clone()) for x in p0]
        del p0
        if gd != pd:
            for a, b in zip(pk, pr):
                a.grad_dtype = b.grad_dtype = gd  # e.g. fp32 gradients of bf16 params
        ok = cls(pk, block_size=bs, min_8bit_size=min_8bit_size, impl="kernel", **kw)  # no silent fallback
        orf = cls(pr, block_size=bs, min_8bit_size=min_8bit_size, **kw)
        for s in range(steps):
            for a, b in zip(pk, pr):
                g = (torch.randn(a.numel(), generator=gen, device=DEVICE) * 10.0 ** (s % 3 - 1)).to(gd)
                a.grad, b.grad = g, g.clone()
                del g
            ok.step()
            reference_step(orf)
        for i, (a, b) in enumerate(zip(pk, pr)):
            same(a.data, b.data, f"param {i} ({a.numel()} elements)")
            for key, v in ok.state[a].items():
                if torch.is_tensor(v):
                    same(v, orf.state[b][key], f"param {i} {key}")
        return f"{len(sizes)} tensors, {steps} steps"

    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    # tests/ is on sys.path (main); optimizer_cases builds nothing (test_kernels would build the CPU op)
    from optimizer_cases import kernel_cases, reference_step
    RULES = kernel_cases()

    module = ops.load_op(DEVICE)
    assert module is not None, "the CUDA op did not load"

    def lists(sizes, pd, bs, offset=0, seed=0):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        params = [torch.randn(n + offset, generator=gen, device=DEVICE).to(pd)[offset:] for n in sizes]
        grads = [torch.randn(n + offset, generator=gen, device=DEVICE).to(pd)[offset:] for n in sizes]
        states = [[torch.randint(0, 256, (n,), generator=gen, device=DEVICE, dtype=torch.uint8) for _ in range(2)]
                  for n in sizes]
        absmax = [[torch.rand(-(-n // bs), generator=gen, device=DEVICE).to(torch.bfloat16) for _ in range(2)] for n in sizes]
        return params, grads, states, absmax

    def adamw_args(bs):
        opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(torch.zeros(1, device=DEVICE))], block_size=bs, lr=1e-2)
        maps = opt._maps(opt.param_groups[0], torch.device(DEVICE))
        return maps, [ops.lookup_table(m, module) for m in maps], dict(opt._hyper(opt.param_groups[0], 3))

    def flat(params, states, absmax):
        return list(params) + [t for s in states for t in s] + [t for a in absmax for t in a]

    for kind, bs, pdn, gdn in correctness_plan(quick):
        pd, gd = dt[pdn], dt[gdn]
        name = f"correct {kind} bs={bs} p={pdn} g={gdn}"
        if kind == "sweep":
            report.run(name, lambda: pair(ds_q8.AdamW8bitBlock, sizes_for(bs), pd, gd, bs, lr=1e-2))
        elif kind == "rules":
            for rule, (cls, kw) in RULES.items():
                report.run(f"correct rule {rule} bs={bs}", lambda: pair(cls, sizes_for(bs) + [20_000], pd, gd, bs,
                                                                        steps=3, **kw))
        elif kind == "fp32_states":
            for rule in ("adamw", "momentum", "lion", "rmsprop_momentum"):
                cls, kw = RULES[rule]
                report.run(f"correct fp32 states {rule} p={pdn}",
                           lambda: pair(cls, sizes_for(bs) + [20_000], pd, gd, bs, min_8bit_size=10 ** 9, **kw))
        elif kind == "offsets":
            def offsets():
                maps, lookups, hyper = adamw_args(bs)
                for offset in (1, 2, 3):
                    p, g, s, a = lists(sizes_for(bs), pd, bs, offset)
                    q, h = [x.clone() for x in p], [x.clone() for x in g]
                    t, b = [[c.clone() for c in st] for st in s], [[c.clone() for c in st] for st in a]
                    ops.call(module, "step_many", p[0], "adamw", p, g, s, a, maps, lookups, bs, hyper, [], [])
                    ops.call(module, "step_many", q[0], "adamw", q, h, t, b, maps, lookups, bs, hyper, [], [])
                    for x, y in zip(flat(p, s, a), flat(q, t, b)):
                        same(x, y, f"offset {offset}")
                return "views 1-3 elements in, against aligned copies"
            report.run(name, offsets)
        elif kind == "stream":
            def stream():
                if DEVICE != "cuda":
                    return "no streams on " + DEVICE
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    detail = pair(ds_q8.AdamW8bitBlock, sizes_for(bs), pd, gd, bs, lr=1e-2)
                torch.cuda.current_stream().wait_stream(side)
                return detail + " on a side stream"
            report.run(name, stream)
        elif kind == "skip":
            def skip():
                if DEVICE != "cuda":
                    return "the skip flag is CUDA's"
                maps, lookups, hyper = adamw_args(bs)
                p, g, s, a = lists(sizes_for(bs) * 8, pd, bs)  # 40 tensors: two launches
                before = [x.clone() for x in flat(p, s, a)]
                module.step_many("adamw", p, g, s, a, maps, lookups, bs, hyper, [], [],
                                 skip=torch.ones(1, dtype=torch.int32, device=DEVICE))
                for x, y in zip(flat(p, s, a), before):
                    same(x, y, "skipped step")
                module.step_many("adamw", p, g, s, a, maps, lookups, bs, hyper, [], [],
                                 skip=torch.zeros(1, dtype=torch.int32, device=DEVICE))
                assert any(not torch.equal(x, y) for x, y in zip(flat(p, s, a), before)), "flag 0 changed nothing"
                return "flag 1 writes nothing, flag 0 steps"
            report.run(name, skip)
        elif kind == "quantize":
            def quantize():
                for d in (torch.float32, torch.float16, torch.bfloat16):
                    x = (torch.randn(3 * bs + 100, device=DEVICE) * torch.logspace(-8, 3, 3 * bs + 100,
                                                                                    device=DEVICE)).to(d)
                    want = F.quantize_blockwise(x, None, bs)
                    got = ops.quantize_blockwise(x, None, bs)
                    same(got[0], want[0], f"codes {d}")
                    same(got[1], want[1], f"absmax {d}")
                    same(ops.dequantize_blockwise(*got, None, bs, d), F.dequantize_blockwise(*want, None, bs, d),
                         f"dequantize {d}")
                return "fp32/fp16/bf16"
            report.run(name, quantize)
        elif kind == "huge":
            report.run(f"correct huge n={HUGE} bs={bs} p={pdn}",
                       lambda: pair(ds_q8.AdamW8bitBlock, [HUGE], pd, gd, bs, steps=1, lr=1e-2))
            release()


# ---------------------------------------------------------------------------------------------- sanitize
def sanitize(report: Report) -> None:
    """Small steps through every launch path, for compute-sanitizer memcheck / racecheck."""
    import torch

    import ds_q8
    from ds_q8 import ops

    def run():
        for bs in (64, 512, 4096):
            for pd in (torch.float32, torch.bfloat16):
                ps = [torch.nn.Parameter(torch.randn(n, device=DEVICE).to(pd)) for n in (1, 7, bs + 1, 3 * bs + 7)]
                opt = ds_q8.AdamW8bitBlock(ps, block_size=bs, min_8bit_size=8)
                for p in ps:
                    p.grad = torch.randn_like(p)
                opt.step()
        x = torch.randn(5000, device=DEVICE)
        codes, absmax = ops.quantize_blockwise(x)
        ops.dequantize_blockwise(codes, absmax)
        sync()
        return "AdamW 8-bit and fp32-state steps, quantize, dequantize"

    report.run("sanitize workload", run)


# ---------------------------------------------------------------------------------------------- speed
def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    import gc

    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _time_cuda(step: Callable[[], None], reps: int) -> List[float]:
    """Milliseconds of each of `reps` calls by CUDA events, after one warm-up call."""
    import torch

    step()
    sync()
    out = []
    for _ in range(reps):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def speed(report: Report, n: int, reps: int, skip_peers: bool, xl_layers: int) -> None:
    import torch

    import ds_q8
    from ds_q8 import ops

    module = ops.load_op(DEVICE)
    assert module is not None, "the CUDA op did not load"
    report.info("device", torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)
    lr, wd = 1e-3, 1e-2
    results: Dict[str, float] = {}

    def timed(name, make, bytes_per_param=None, params=n):
        """Builds a step (after freeing the last one), times it, records the median."""
        release()
        try:
            step = make()
            times = _time_cuda(step, reps)
        except Exception as exc:  # a missing peer (bitsandbytes) is reported, not fatal
            report.add(f"speed {name}", None, f"unavailable: {' '.join(str(exc).split())[:200]}")
            return None
        med = statistics.median(times)
        results[name] = med
        extra = {}
        if bytes_per_param:
            extra["GBps"] = round(bytes_per_param * params / med / 1e6, 1)
        report.add(f"speed {name}", None, f"median {med:.3f} ms of {reps}" +
                   (f", {extra['GBps']} GB/s" if extra else ""), ms=med, times=times, **extra)
        del step
        return med

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    grad = torch.randn(n, generator=gen, device=DEVICE).mul_(1e-2)
    base = torch.randn(n, generator=gen, device=DEVICE)

    def copy():
        dst = torch.empty_like(base)
        return lambda: dst.copy_(base)

    def param():
        p = torch.nn.Parameter(base.clone())
        p.grad = grad
        return [p]

    def ds_kernel():  # the raw launch on AdamW8bitBlock's maps and hyperparameters: no optimizer bookkeeping
        bs = 256
        opt = ds_q8.AdamW8bitBlock(param(), lr=lr, weight_decay=wd, block_size=bs)
        group = opt.param_groups[0]
        p = group["params"][0]
        maps = opt._maps(group, p.device)
        lookups = [ops.lookup_table(m, module) for m in maps]
        hyper = dict(opt._hyper(group, 2))
        codes = [torch.full((n,), 127, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        absmax = [torch.full((-(-n // bs),), 1e-3, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        return lambda: ops.call(module, "step_many", p, "adamw", [p.data], [grad], [codes], [absmax], maps, lookups,
                                 bs, hyper, [], [])

    def against_peers(label: str, make_params: Callable[[], list], params: int, nonfinite_off: bool = False):
        """ds_q8's optimizer step against torch fused AdamW and bitsandbytes on the same tensors."""
        def bnb_step():
            import bitsandbytes as bnb
            return bnb.optim.AdamW8bit(make_params(), lr=lr, weight_decay=wd).step

        ds = timed(f"{label} ds_q8 AdamW8bitBlock.step",
                   lambda: ds_q8.AdamW8bitBlock(make_params(), lr=lr, weight_decay=wd, impl="kernel").step, BYTES_8BIT, params)
        if nonfinite_off:
            timed(f"{label} ds_q8 AdamW8bitBlock.step nonfinite=off",
                  lambda: ds_q8.AdamW8bitBlock(make_params(), lr=lr, weight_decay=wd, nonfinite="off", impl="kernel").step,
                  BYTES_8BIT, params)
        peers = {"torch fused AdamW": timed(f"{label} torch AdamW fused", lambda: torch.optim.AdamW(
            make_params(), lr=lr, weight_decay=wd, fused=True).step)}
        if not skip_peers:
            peers["bitsandbytes AdamW8bit"] = timed(f"{label} bitsandbytes AdamW8bit", bnb_step)
        for peer, ms in peers.items():
            if ds and ms:
                report.target(f"{label} ds_q8 step faster than {peer}", ds < ms, f"{ds:.2f} ms vs {ms:.2f} ms")

    copy_ms = timed("copy fp32 (dst.copy_(src))", copy, BYTES_COPY)
    kernel_ms = timed("ds_q8 step_many kernel", ds_kernel, BYTES_8BIT)
    if copy_ms and kernel_ms:
        frac = (BYTES_8BIT / kernel_ms) / (BYTES_COPY / copy_ms)
        report.target("kernel >= 80% of copy bandwidth", frac >= 0.8, f"{100 * frac:.0f}% at n={n}", fraction=frac)
    against_peers(f"n={n}", param, n, nonfinite_off=True)
    base = grad = None  # frees 2 x 4n bytes before the GPT-2 XL rows (their closures are done)
    release()

    # the GPT-2 XL tensor list: many tensors, small ones on float32 states
    shapes = gpt2_xl_shapes(xl_layers)
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    report.info("gpt2_xl", {"tensors": len(shapes), "params": total})

    def xl_params():
        g = torch.Generator(device=DEVICE).manual_seed(1)
        ps = []
        for s in shapes:
            p = torch.nn.Parameter(torch.randn(s, generator=g, device=DEVICE))
            p.grad = torch.randn(s, generator=g, device=DEVICE).mul_(1e-2)
            ps.append(p)
        return ps

    against_peers("gpt2-xl", xl_params, total)


# ---------------------------------------------------------------------------------------------- preflight, build
def preflight() -> int:
    """What every later stage needs: torch with CUDA, DeepSpeed, ds_q8 from this tree, a visible GPU.
    Builds nothing. Returns 2 (one STOP line) when a stage cannot run here."""
    import torch

    import deepspeed

    import ds_q8

    here = os.path.dirname(os.path.dirname(os.path.abspath(ds_q8.__file__)))
    if not os.path.samefile(here, ROOT):
        print(f"STOP preflight: ds_q8 is imported from {here}, not from this tree ({ROOT})", flush=True)
        return 2
    if not torch.version.cuda:
        print(f"STOP preflight: torch {torch.__version__} is a CPU-only build; the checks need a CUDA build",
              flush=True)
        return 2
    if not torch.cuda.is_available():
        print(f"STOP preflight: no CUDA GPU visible (torch {torch.__version__}, CUDA {torch.version.cuda}); "
              "nothing was built or run", flush=True)
        return 2
    print(f"PASS preflight: torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, "
          f"{torch.cuda.get_device_name()}, CUDA_HOME={os.environ.get('CUDA_HOME')}", flush=True)
    try:
        import bitsandbytes
        print(f"INFO bitsandbytes {bitsandbytes.__version__}", flush=True)
    except Exception as exc:  # an optional peer of the speed rows
        print(f"INFO bitsandbytes unavailable ({' '.join(str(exc).split())[:200]}): its speed rows are skipped",
              flush=True)
    return 0


def build() -> int:
    """The CUDA op (here) and the CPU op (a second process, at the same time) that the later stages load:
    every compile happens in this stage."""
    import subprocess

    cpu = subprocess.Popen([sys.executable, "-c", "from ds_q8.op_builder import Q8CPUBuilder; "
                            "print('CPU op ISAs:', list(Q8CPUBuilder().load().supported_isas()))"], cwd=ROOT)
    t = time.time()
    from ds_q8.op_builder import Q8CUDABuilder

    Q8CUDABuilder().load(verbose=True)
    print(f"PASS build CUDA op: loaded after {time.time() - t:.0f} s", flush=True)
    rc = cpu.wait()
    print(f"{'PASS' if rc == 0 else 'FAIL'} build CPU op: {time.time() - t:.0f} s (exit {rc})", flush=True)
    return 0 if rc == 0 else 1


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["preflight", "build", "correctness", "speed", "sanitize"])
    ap.add_argument("--out", help="directory for gpu_check_<stage>.json (default: no file)")
    ap.add_argument("--n", type=int, default=1_500_000_000, help="parameters of the single-tensor speed rows")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per row (median reported; at least 5)")
    ap.add_argument("--quick", action="store_true", help="correctness without the 2^31+4099-element tensor")
    ap.add_argument("--no-peers", action="store_true", help="speed without bitsandbytes")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same checks on the CPU op (tries this script without a GPU; use small --n)")
    ap.add_argument("--xl-layers", type=int, default=48, help="transformer layers of the GPT-2 XL list (48)")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error(f"--reps must be at least 5, got {args.reps}")
    if args.n < 1:
        ap.error(f"--n must be a positive number of parameters, got {args.n}")
    if args.stage in ("preflight", "build") and not args.dry_run:
        return preflight() if args.stage == "preflight" else build()
    path = os.path.join(args.out, f"gpu_check_{args.stage}.json") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        if args.stage in ("preflight", "build"):
            print(f"dry run of {args.stage}: " + ("imports and the GPU" if args.stage == "preflight" else
                                                  "the CUDA and CPU ops"))
            return 0
        plan = {"correctness": [" ".join(map(str, c)) for c in correctness_plan(args.quick)],
                "speed": [f"n={args.n} reps={args.reps}", f"gpt2-xl {len(gpt2_xl_shapes())} tensors"],
                "sanitize": ["small AdamW steps, quantize, dequantize"]}[args.stage]
        print(f"dry run of {args.stage}: {len(plan)} checks")
        for line in plan:
            print("  " + line)
        if path:
            with open(path, "w") as f:
                json.dump({"stage": args.stage, "dry_run": True, "plan": plan}, f, indent=1)
        return 0
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("FAIL preflight: no CUDA GPU visible", flush=True)
        return 1
    report = Report(path, args.stage)
    if args.stage == "correctness":
        correctness(report, args.quick)
    elif args.stage == "speed":
        speed(report, args.n, args.reps, args.no_peers, args.xl_layers)
    else:
        sanitize(report)
    report.info("failed", report.failed)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
