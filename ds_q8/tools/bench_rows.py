"""The rows and tables of ``python -m ds_q8.tools.bench`` (``bench.py``: the command and its report).

A row is a dict with a ``name``, the ``bytes`` per element its step must move at least and a ``step``
function; :func:`measure` times the rows of a table in interleaved rounds and :func:`table` turns the
medians into milliseconds, GB/s and ratios.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import List, Optional

import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import ops
from ds_q8.optim.layout import Comm, Segment, StateLayout, shared_blocks
from ds_q8.optim.state_keys import codes_key

BYTES_8BIT, BYTES_32BIT, BYTES_QUANT, BYTES_COPY = 16, 28, 5, 8
BYTES_4BIT = 14  # fp32 parameter read and written, gradient read, two 4-bit codes read and written
_SKIPPED: set = set()  # rows reported as unavailable
LR, WD = 1e-3, 1e-2


def _params(n: int, device: str, seed: int, count: int = 1) -> List[torch.nn.Parameter]:
    """``count`` parameters of ``n`` elements each, with gradients, generated on ``device`` (a GPU
    run at 1.5e9 parameters never holds them in host memory)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(n, generator=g, device=device))
        p.grad = torch.randn(n, generator=g, device=device).mul_(1e-2)
        out.append(p)
    return out


def copy_rows(n: int, device: str) -> List[dict]:
    """``dst.copy_(src)`` of n fp32 values: the device's copy bandwidth (8 bytes moved per value)."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return [dict(name="copy (dst.copy_(src), fp32)", bytes=BYTES_COPY, step=lambda: dst.copy_(src))]


def optimizer_rows(n: int, device: str, with_reference: bool, count: int = 1, skip=(), only=None) -> List[dict]:
    """(name, bytes per param, step function) for every implementation available here, each stepping
    ``count`` parameters of ``n`` elements; rows whose name contains a string of ``skip``, or is not
    in ``only`` when it is given, are left out (and never built)."""
    rows = []

    def _param(n, device, seed):
        return _params(n, device, seed, count)

    def add(name, bytes_per_param, make):
        if any(s and s in name for s in skip) or (only is not None and name not in only):
            return
        try:
            rows.append(dict(name=name, bytes=bytes_per_param, step=make()))
        except Exception as exc:  # an optional peer that is missing or cannot build
            if name not in _SKIPPED:  # the same row is built for several tables: say it once
                _SKIPPED.add(name)
                print(f"skipped {name}: {' '.join(str(exc).split())[:160]}")

    def ds_q8_kernel(nonfinite, engine_norm=False, **options):
        opt = ds_q8.AdamW8bitBlock(_param(n, device, 0), lr=LR, weight_decay=WD, nonfinite=nonfinite, impl="kernel",
                                   **options)
        if engine_norm:  # what the DeepSpeed integration hands over when the engine clips gradients
            norm = torch.ones((), device=device)
            opt.grad_norm_source = lambda: norm
        return opt.step

    add("ds_q8 AdamW8bitBlock (kernel)", BYTES_8BIT, lambda: ds_q8_kernel("skip"))
    # the default non-finite check is one extra read of the gradients; these rows show its cost, and
    # that under DeepSpeed with gradient clipping the engine's norm answers it instead
    add("ds_q8 AdamW8bitBlock (kernel, check answered by the clip norm)", BYTES_8BIT,
        lambda: ds_q8_kernel("skip", engine_norm=True))
    add("ds_q8 AdamW8bitBlock (kernel, nonfinite=off)", BYTES_8BIT, lambda: ds_q8_kernel("off"))
    # the default (guided requantization on the minifloat maps) against the defaults before it (the
    # dynamic6 map; every state stochastically on the dynamic map) and against every state to nearest
    add("ds_q8 AdamW8bitBlock (kernel, nonfinite=off, the previous default: dynamic, stochastic)", BYTES_8BIT,
        lambda: ds_q8_kernel("off", quantization="dynamic", state_rounding="stochastic"))
    add("ds_q8 AdamW8bitBlock (kernel, nonfinite=off, state_rounding=nearest)", BYTES_8BIT,
        lambda: ds_q8_kernel("off", state_rounding="nearest"))
    add("ds_q8 AdamW8bitBlock (kernel, nonfinite=off, quantization=dynamic6)", BYTES_8BIT,
        lambda: ds_q8_kernel("off", quantization="dynamic6"))
    add("ds_q8 AdamW8bitBlock, optim_bits=4 (kernel)", BYTES_4BIT,
        lambda: ds_q8.AdamW8bitBlock(_param(n, device, 4), lr=LR, weight_decay=WD, optim_bits=4, impl="kernel").step)
    if with_reference:
        add("ds_q8 AdamW8bitBlock (reference)", BYTES_8BIT,
            lambda: ds_q8.AdamW8bitBlock(_param(n, device, 1), lr=LR, weight_decay=WD, impl="reference").step)
    add("torch AdamW fused", BYTES_32BIT,
        lambda: torch.optim.AdamW(_param(n, device, 2), lr=LR, weight_decay=WD, fused=True).step)
    add("torch AdamW foreach", BYTES_32BIT,
        lambda: torch.optim.AdamW(_param(n, device, 3), lr=LR, weight_decay=WD, foreach=True).step)
    _add_peer_rows(add, lambda seed: _param(n, device, seed), device)
    return rows


def _add_peer_rows(add, param, device: str) -> None:
    """The other libraries' rows, each built only when asked for (``param(seed)``: its parameters)."""
    if device == "cpu":
        def deepspeed_cpu_adam():
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
            from ..op_builder.notice import announce_deepspeed_op

            announce_deepspeed_op(CPUAdamBuilder, "DeepSpeed's cpu_adam op for its row", "about a minute")
            return DeepSpeedCPUAdam(param(4), lr=LR, weight_decay=WD, adamw_mode=True).step
        add("DeepSpeedCPUAdam", BYTES_32BIT, deepspeed_cpu_adam)

    def bitsandbytes_adamw8bit():
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(param(5), lr=LR, weight_decay=WD).step
    add("bitsandbytes AdamW8bit", BYTES_8BIT, bitsandbytes_adamw8bit)

    def torchao_adamw8bit():
        from torchao.optim import AdamW8bit
        return AdamW8bit(param(6), lr=LR, weight_decay=WD).step
    add("torchao AdamW8bit", BYTES_8BIT, torchao_adamw8bit)


def block_rows(n: int, device: str, sizes) -> List[dict]:
    """The kernel's AdamW step (``nonfinite="off"``) at each block size, every row on its own parameter."""
    return [dict(name=f"block_size={bs}", bytes=BYTES_8BIT,
                 step=ds_q8.AdamW8bitBlock(_params(n, device, 7 + i), lr=LR, weight_decay=WD, nonfinite="off",
                                           impl="kernel", block_size=bs).step)
            for i, bs in enumerate(sizes)]


def quantize_rows(n: int, device: str, with_reference: bool = True) -> List[dict]:
    x = torch.randn(n, device=device)
    code = F.create_dynamic_map(True).to(device)
    codes, absmax = ops.quantize_blockwise(x, code)  # the reference's bits, without its temporaries
    out = torch.empty_like(x)
    rows = [
        dict(name="quantize_blockwise (kernel)", bytes=BYTES_QUANT, step=lambda: ops.quantize_blockwise(x, code)),
        dict(name="dequantize_blockwise (kernel)", bytes=BYTES_QUANT,
             step=lambda: ops.dequantize_blockwise(codes, absmax, code)),
        dict(name="dequantize_blockwise (kernel, out=)", bytes=BYTES_QUANT,
             step=lambda: ops.dequantize_blockwise(codes, absmax, code, out=out)),
    ]
    if with_reference:
        rows += [
            dict(name="quantize_blockwise (reference)", bytes=BYTES_QUANT, step=lambda: F.quantize_blockwise(x, code)),
            dict(name="dequantize_blockwise (reference)", bytes=BYTES_QUANT,
                 step=lambda: F.dequantize_blockwise(codes, absmax, code)),
        ]
    return rows


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure(rows: List[dict], reps: int, device: str, inner: int = 1) -> None:
    """Interleaved repetitions after one warm-up call each; stores the median seconds per call in
    row['time']. Each repetition times ``inner`` calls in a row (for steps too short to time alone)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for row in rows:
        row["step"]()
    sync()
    times: List[List[float]] = [[] for _ in rows]
    for _ in range(reps):
        for row, row_times in zip(rows, times):
            step = row["step"]
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            sync()
            row_times.append((time.perf_counter() - t0) / inner)
    for row, row_times in zip(rows, times):
        row["times"] = row_times
        row["time"] = statistics.median(row_times)


class _OneRank(Comm):
    """The all-reduce of a group of one rank: nothing to combine."""

    def all_reduce_max(self, t):
        pass

    def all_reduce_sum(self, t):
        pass


def segment_sizes(n: int, count: int, multiple: int = 64, seed: int = 0) -> List[int]:
    """``count`` parameter sizes between 0.2x and 1.8x the mean, multiples of ``multiple`` (as a
    transformer's are) but not of the block size, summing to ``n``."""
    if n < 2 * count * multiple:  # too few elements for such sizes: any positive sizes then
        multiple = 1
    g = torch.Generator().manual_seed(seed)
    weights = 0.2 + 1.6 * torch.rand(count, generator=g, dtype=torch.float64)
    units = n // multiple - count  # every size gets one multiple, the rest goes by weight
    sizes = [(1 + int(u)) * multiple for u in (weights / weights.sum() * units).tolist()]
    sizes[-1] += n - sum(sizes)
    return sizes


def partition_rows(n: int, count: int, device: str) -> List[dict]:
    """AdamW8bitBlock over n elements: one tensor, a flat partition of ``count`` parameters, the
    same partition cut mid-block at both ends, and one whose parameters start at odd offsets."""
    bs = F.DEFAULT_BLOCK_SIZE
    rows = []
    # every row steps the same parameter, gradient and code memory (each has its own block maxima):
    # where the pages of a 2^25-element buffer land moves a step by several percent, more than what
    # is measured here
    shared = _params(n, device, 0)[0]
    codes = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(2)]

    def param():
        p = torch.nn.Parameter(shared.data)
        p.grad = shared.grad
        return p

    def on_shared_codes(opt, p):
        opt.step()  # creates the state; then its codes move to the shared buffers
        entry = opt.state[p]
        for i, c in enumerate(codes):
            key = codes_key(i)
            c.copy_(entry[key].view(-1))
            entry[key] = c.view(entry[key].shape)
        return opt.step

    def flat_opt(cut: bool, sizes: List[int]):
        p = param()
        opt = ds_q8.AdamW8bitBlock([p], lr=LR, weight_decay=WD, min_8bit_size=0)
        segments, start = [], 0
        for i, size in enumerate(sizes):
            head = bs // 2 if cut and i == 0 else 0  # the parameter began on the previous rank
            tail = bs // 2 if cut and i == count - 1 else 0  # and goes on on the next one
            segments.append(Segment(start, size, i, head, head + size + tail, True, f"p{i}"))
            start += size
        slots = {b: j for j, b in enumerate(shared_blocks(segments, bs))}
        opt.register_layout(p, StateLayout(p.shape, segments, bs, comm=_OneRank() if slots else None, slots=slots,
                                           num_slots=len(slots), num_params=count))
        return on_shared_codes(opt, p)

    one = param()
    rows.append(dict(name="one tensor", bytes=BYTES_8BIT,
                     step=on_shared_codes(ds_q8.AdamW8bitBlock([one], lr=LR, weight_decay=WD, min_8bit_size=0), one)))
    sizes = segment_sizes(n, count)
    rows.append(dict(name=f"flat partition of {count} parameters", bytes=BYTES_8BIT, step=flat_opt(False, sizes)))
    rows.append(dict(name=f"flat partition of {count} parameters, cut at both ends", bytes=BYTES_8BIT,
                     step=flat_opt(True, sizes)))
    # parameters whose sizes are not multiples of 16: their pieces start off the 64-byte grid
    rows.append(dict(name=f"flat partition of {count} parameters of odd sizes", bytes=BYTES_8BIT,
                     step=flat_opt(False, segment_sizes(n, count, multiple=1))))
    return rows


#: the matrices of one GPT-2-small block, as HF's Conv1D stores them: attention in, attention out, MLP in, MLP out
GPT2_BLOCK_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))
MUON_LR, MUON_BETA = 0.02, 0.95


def parse_shape(text: str) -> tuple:
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise argparse.ArgumentTypeError(f"a matrix shape is ROWSxCOLS with positive integers, got {text!r}")
    return int(rows), int(cols)


def _matrices(shapes, device: str, seed: int) -> List[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, device=device).mul_(0.02))
        p.grad = torch.randn(shape, generator=g, device=device).mul_(1e-2)
        out.append(p)
    return out


def muon_rows(shapes, device: str, skip=()) -> List[dict]:
    """One Muon step over matrices of ``shapes``: DeepSpeed's (``muon_update`` per matrix, then its decay and
    step as ZeRO-1/2 and MuonWithAuxAdam apply them) and Muon8bitBlock's. Each row also carries
    ``state_bytes``, the momentum it keeps (DeepSpeed: its fp32 buffer in the optimizer state)."""
    rows = []

    def add(name, make):
        if any(s and s in name for s in skip):
            return
        try:
            step, state_bytes = make()
        except Exception as exc:  # DeepSpeed missing or its compile failing
            print(f"skipped {name}: {' '.join(str(exc).split())[:160]}")
            return
        step()  # the first step makes the state (and compiles DeepSpeed's muon_update)
        rows.append(dict(name=name, bytes=0, step=step, state_bytes=state_bytes()))

    def deepspeed_muon():
        from deepspeed.runtime.zero.muon.original_muon import muon_update

        params = _matrices(shapes, device, 0)
        momenta = [torch.zeros_like(p) for p in params]

        @torch.no_grad()
        def step():
            for p, m in zip(params, momenta):
                # ZeRO-1/2 hands muon_update the reduced gradient, which it overwrites (Nesterov) as it does here
                update = muon_update(p.grad, m, MUON_BETA, ns_method="gram")
                p.mul_(1 - MUON_LR * 0.0)
                p.add_(update.reshape(p.shape), alpha=-MUON_LR)
        return step, lambda: sum(m.numel() * m.element_size() for m in momenta)

    def ours(bits=8):
        params = _matrices(shapes, device, 0)
        opt = ds_q8.Muon8bitBlock([dict(params=params, use_muon=True)], muon_lr=MUON_LR, momentum=MUON_BETA,
                                  optim_bits=bits)
        return opt.step, lambda: sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
                                     if torch.is_tensor(t) and k != "step")

    add("DeepSpeed Muon (muon_update, fp32 momentum)", deepspeed_muon)
    add("ds_q8 Muon8bitBlock (8-bit momentum)", ours)
    # the same step with fp32 momentum: what the 8-bit state costs, apart from the Newton-Schulz iteration
    add("ds_q8 Muon8bitBlock (optim_bits=32)", lambda: ours(32))
    return rows


def muon_ns_dtype() -> Optional[str]:
    """The dtype DeepSpeed's Gram Newton-Schulz runs in on this machine's accelerator."""
    try:
        from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    except Exception:  # noqa: BLE001
        return None
    return str(ns_compute_dtype("gram")).replace("torch.", "")


# The rows whose arithmetic cost is worth knowing apart from memory traffic.
IN_CACHE_ROWS = ("ds_q8 AdamW8bitBlock (kernel, nonfinite=off)", "torch AdamW fused", "DeepSpeedCPUAdam")


def in_cache_table(sizes, reps: int, n: int, threads: int, skip=(), torch_ms: Optional[float] = None) -> List[dict]:
    """Arithmetic cost per parameter with the data in cache, on one thread (CPU only).

    Each implementation steps a parameter of each of the two small ``sizes``; the difference of the
    two step times over the difference of the sizes is the cost per parameter, without the fixed
    per-call cost. ``floor_ms`` is that cost for ``n`` parameters spread over ``threads`` cores: the
    time a step would take if memory cost nothing. ``floor_ratio`` divides it by torch fused AdamW's
    measured step (``torch_ms``)."""
    small, large = sizes
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for size in (small, large):
            for row in optimizer_rows(size, "cpu", False, skip=skip, only=IN_CACHE_ROWS):
                row["size"] = size
                rows.append(row)
        # about 2 ms per timed repetition, so that timer resolution and scheduling noise stay small
        inner = max(1, (2 << 20) // large)
        measure(rows, max(reps, 9), "cpu", inner=inner)
    finally:
        torch.set_num_threads(saved)
    out = []
    for name in IN_CACHE_ROWS:
        t = {r["size"]: r["time"] for r in rows if r["name"] == name}
        if len(t) != 2:
            continue
        per_param = max(t[large] - t[small], 0.0) / (large - small)
        floor_ms = 1e3 * per_param * n / threads
        out.append(dict(name=name, ns_per_param=1e9 * per_param, floor_ms=floor_ms,
                        floor_ratio=floor_ms / torch_ms if torch_ms else None,
                        small_us=1e6 * t[small], large_us=1e6 * t[large]))
    return out


def table(rows: List[dict], n: int, baseline: Optional[str]) -> List[dict]:
    base = next((r["time"] for r in rows if r["name"] == baseline), None)
    out = []
    for r in rows:
        out.append(dict(name=r["name"], ms=1e3 * r["time"], ratio=(r["time"] / base) if base else None,
                        gbps=r["bytes"] * n / r["time"] / 1e9, runs_ms=[1e3 * t for t in r["times"]]))
    return out


def print_table(title: str, rows: List[dict], ratio_to: Optional[str]) -> None:
    print(f"\n{title}")
    head = f"| implementation | ms / step | ratio to {ratio_to} | GB/s |" if ratio_to else "| kernel | ms | GB/s |"
    print(head)
    print("|---|---:|---:|---:|" if ratio_to else "|---|---:|---:|")
    for r in rows:
        if ratio_to:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            print(f"| {r['name']} | {r['ms']:.1f} | {ratio} | {r['gbps']:.1f} |")
        else:
            print(f"| {r['name']} | {r['ms']:.1f} | {r['gbps']:.1f} |")
