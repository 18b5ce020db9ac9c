"""Optimizer step and (de)quantization throughput: ``python -m ds_q8.tools.bench [--n N] [--device cpu|cuda]``.

Every implementation steps its own fp32 parameter of N elements. Repetitions are interleaved
(one step of each implementation per round) so that load from other processes hits all of them
alike; the table reports the median. Compare ratios within one run: absolute times on a shared
machine drift between runs.

GB/s counts the bytes a step must move at least: 16 per parameter for 8-bit state (read p, g, two
code bytes; write p, two code bytes) and 28 for 32-bit state (read p, g, m, v; write p, m, v).
(De)quantization counts 5 bytes per element (fp32 in and code out, or the reverse); dequantize
allocates its output, so its time includes the first touch of those pages.

A second table runs the same step over many small parameters (default 1000 of 4096 elements), where
per-parameter overhead rather than arithmetic decides; interleaved with it, a few rows (``PER_TENSOR_ROWS``)
also step all those elements as one tensor, and the difference over the count is each row's share per
tensor: what the host (Python, argument checks) and the launches add for every tensor. A copy of N fp32 values (8 bytes moved per
value) gives the bandwidth a memory-bound step could reach, and each ds_q8 kernel row is reported
as a fraction of it.

A partition table prices the segment machinery that ZeRO partitions take: the same N elements
stepped as one tensor, as a flat partition of ``--segments`` parameters (one kernel call over
their pieces), and as that partition cut mid-block at both ends by partition edges (the two shared
blocks take the batched reference path and an all-reduce, here within a one-rank group).

A Muon table (``--muon SHAPE ...``, default the four matrices of one GPT-2-small block) steps the same
matrices with DeepSpeed's Muon, ``muon_update`` as its ZeRO-1/2 calls it on each matrix (torch.compile'd,
Newton-Schulz in the dtype DeepSpeed picks for the accelerator) followed by its weight update, and with
Muon8bitBlock, and gives the momentum bytes each keeps. On a CPU that other processes load, run it with
``OMP_WAIT_POLICY=PASSIVE`` (torch must not have started yet): spinning OpenMP threads made both Muon steps on
three small matrices 100-130x slower on the 2-core development machine.

On CPU a third table separates arithmetic from memory traffic: each of a few implementations steps
two small parameters whose data stays in cache, on one thread, and the difference of the two times
gives its cost per parameter without the per-call overhead. Scaled to N parameters over the run's
threads, that is the time the step would take if memory cost nothing (its compute floor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import warnings
from typing import List

import torch

from ds_q8 import functional as F
from ds_q8 import ops
from ds_q8.tools.bench_rows import (GPT2_BLOCK_SHAPES, _release, block_rows, copy_rows, in_cache_table, measure,
                              muon_ns_dtype, muon_rows, optimizer_rows, parse_shape, partition_rows, print_table,
                              quantize_rows, table)

BASELINE = "torch AdamW fused"
#: the rows whose share per tensor the many-tensor table also gives (each steps one more tensor of all the
#: many-tensor elements for it)
PER_TENSOR_ROWS = ("ds_q8 AdamW8bitBlock (kernel)", "ds_q8 AdamW8bitBlock (kernel, nonfinite=off)", BASELINE,
                   "torch AdamW foreach")


def main(argv=None) -> dict:
    args = _arguments(argv)
    warnings.simplefilter("ignore", UserWarning)
    muon_table = _muon_table(args) if args.muon else []
    if args.muon_only:
        return _print_muon(args, muon_table)
    tables = _step_tables(args)
    tables.update(_layout_tables(args))
    quant = quantize_rows(args.n, args.device, not args.no_reference)
    measure(quant, args.reps, args.device)
    tables["quantization"] = table(quant, args.n, None)
    config = _print_report(args, tables)
    count, size = args.many
    result = dict(config=config, step=tables["step"], in_cache=tables["in_cache"], copy=tables["copy"],
                  many=dict(count=count, size=size, step=tables["many"], per_tensor=tables["per_tensor"]),
                  partition=tables["partition"],
                  quantization=tables["quantization"], blocks=tables["blocks"],
                  muon=_print_muon(args, muon_table)["muon"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _arguments(argv) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if min(args.many) < 0 or (min(args.many) == 0 and max(args.many) != 0):
        ap.error(f"--many needs two positive numbers (or 0 0 to skip), got {args.many}")
    small, large = args.in_cache
    if (small, large) != (0, 0) and not 0 < small < large:
        ap.error(f"--in-cache needs two sizes with 0 < SMALL < LARGE (or 0 0 to skip), got {args.in_cache}")
    if args.segments < 0 or args.segments > args.n:
        ap.error(f"--segments must be in [0, --n], got {args.segments}")
    if args.device not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a visible GPU")
    return args


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ds_q8.tools.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 25, help="parameters per optimizer (default 2^25)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median is reported)")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow pure-PyTorch reference rows")
    ap.add_argument("--many", type=int, nargs=2, default=[1000, 4096], metavar=("COUNT", "SIZE"),
                    help="second table: COUNT parameters of SIZE elements each (default 1000 4096; 0 0 skips it)")
    ap.add_argument("--skip", action="append", default=[], metavar="TEXT",
                    help="leave out the step rows whose name contains TEXT (repeatable), e.g. to fit a large "
                         "--n in GPU memory")
    ap.add_argument("--in-cache", type=int, nargs=2, default=[1 << 14, 1 << 16], metavar=("SMALL", "LARGE"),
                    help="CPU only: cost per parameter with the data in cache, one thread, from the step times "
                         "at these two sizes (default 16384 65536; 0 0 skips it)")
    ap.add_argument("--segments", type=int, default=150, metavar="COUNT",
                    help="partition table: the N elements as a flat partition of COUNT parameters (default 150; "
                         "0 skips it)")
    ap.add_argument("--muon", type=parse_shape, nargs="*", default=list(GPT2_BLOCK_SHAPES), metavar="ROWSxCOLS",
                    help="Muon table: one step over matrices of these shapes, DeepSpeed's Muon against Muon8bitBlock "
                         "(default: one GPT-2-small block, 768x2304 768x768 768x3072 3072x768; none given skips it)")
    ap.add_argument("--muon-only", action="store_true", help="only the Muon table")
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[64, 128, 256, 2048], metavar="B",
                    help="block-size table: the kernel step at each block size, ratios to the last one (default "
                         "64 128 256 2048, 2048 being 0.1's default; none given skips it)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return ap


def _muon_table(args) -> List[dict]:
    muon = muon_rows(args.muon, args.device, skip=args.skip)
    measure(muon, args.reps, args.device)
    elements = sum(r * c for r, c in args.muon)
    base = next((r["time"] for r in muon if r["name"].startswith("DeepSpeed")), None)
    out = [dict(name=r["name"], ms=1e3 * r["time"], ratio=r["time"] / base if base else None,
                momentum_bytes=r["state_bytes"], bytes_per_param=r["state_bytes"] / elements,
                runs_ms=[1e3 * t for t in r["times"]]) for r in muon]
    del muon
    _release(args.device)
    return out


def _measured(rows: List[dict], args, reps: int, baseline, paired_to=None) -> List[dict]:
    """Time ``rows`` and free their tensors (at 1.5e9 parameters on a GPU the sections would not all fit
    at once). ``paired_to``: the index of the row each row's median of per-repetition ratios is taken
    against, which cancels the machine's drift better than a ratio of medians."""
    measure(rows, reps, args.device)
    out = table(rows, args.n, baseline)
    if paired_to is not None:
        for row, r in zip(out, rows):
            row["paired_ratio"] = statistics.median(t / b for t, b in zip(r["times"], rows[paired_to]["times"]))
    del rows[:]
    _release(args.device)
    return out


def _step_tables(args) -> dict:
    """The step at N, in cache (CPU), the copy and the many-tensor step."""
    tables = dict(step=_measured(optimizer_rows(args.n, args.device, not args.no_reference, skip=args.skip),
                                 args, args.reps, BASELINE))
    small, large = args.in_cache
    tables["in_cache"] = []
    if args.device == "cpu" and large:
        torch_ms = next((r["ms"] for r in tables["step"] if r["name"] == BASELINE), None)
        tables["in_cache"] = in_cache_table((small, large), args.reps, args.n, torch.get_num_threads(), args.skip,
                                            torch_ms)
        _release(args.device)
    tables["copy"] = _measured(copy_rows(args.n, args.device), args, args.reps, None)
    count, size = args.many
    tables["many"] = []
    tables["per_tensor"] = []
    if count:
        many = optimizer_rows(size, args.device, False, count, skip=args.skip)
        # the same elements as one tensor, interleaved with the many-tensor rows, for each row's share
        # per tensor (Python, argument checks, launches): what the step costs beyond its arithmetic
        one = optimizer_rows(count * size, args.device, False, 1, skip=args.skip, only=PER_TENSOR_ROWS) \
            if count > 1 else []
        measure(many + one, args.reps, args.device)
        tables["many"] = table(many, count * size, BASELINE)
        tables["per_tensor"] = per_tensor_table(many, one, count)
        del many, one
        _release(args.device)
    return tables


def per_tensor_table(many: List[dict], one: List[dict], count: int) -> List[dict]:
    """Each implementation's time per tensor beyond one tensor of the same elements, from the medians of
    one interleaved run, and its ratio to torch's fused AdamW's."""
    alone = {r["name"]: r["time"] for r in one}
    out = [dict(name=r["name"], us=1e6 * (r["time"] - alone[r["name"]]) / (count - 1), many_ms=1e3 * r["time"],
                one_ms=1e3 * alone[r["name"]]) for r in many if r["name"] in alone]
    base = next((r["us"] for r in out if r["name"] == BASELINE), None)
    for r in out:
        r["ratio"] = r["us"] / base if base and base > 0 else None
    return out


def _layout_tables(args) -> dict:
    """The block-size and ZeRO-partition tables, with paired ratios."""
    tables = dict(blocks=[], partition=[])
    if args.block_sizes:
        blocks = block_rows(args.n, args.device, args.block_sizes)
        last = blocks[-1]["name"]
        tables["blocks"] = _measured(blocks, args, max(args.reps, 9), last, paired_to=len(blocks) - 1)
    if args.segments:  # cheap rows, small differences: many repetitions
        tables["partition"] = _measured(partition_rows(args.n, args.segments, args.device), args,
                                        max(args.reps, 21), "one tensor", paired_to=0)
    return tables


def _print_report(args, tables: dict) -> dict:
    isa = None
    if args.device == "cpu" and ops.load_op("cpu") is not None:
        isa = ops.cpu_isa(ops.load_op("cpu"))
    config = dict(n=args.n, device=args.device, reps=args.reps, threads=torch.get_num_threads(), cpu_isa=isa,
                  torch=torch.__version__)
    print(f"one AdamW step on {args.n} fp32 parameters, {args.device}, {config['threads']} threads"
          f"{', ISA ' + isa if isa else ''}; median of {args.reps} interleaved runs")
    print_table("optimizer step", tables["step"], BASELINE)
    if tables["in_cache"]:
        _print_in_cache(args, config, tables["in_cache"])
    print_table("memory copy, the bandwidth a step could reach", tables["copy"], None)
    copy_gbps = tables["copy"][0]["gbps"]
    for r in tables["step"]:
        if r["name"].startswith("ds_q8") and "kernel" in r["name"]:
            print(f"{r['name']}: {r['gbps']:.1f} GB/s = {100 * r['gbps'] / copy_gbps:.0f}% of the copy's "
                  f"{copy_gbps:.1f} GB/s")
    if tables["many"]:
        count, size = args.many
        print_table(f"the same step over {count} parameters of {size} elements each", tables["many"], BASELINE)
    if tables["per_tensor"]:
        print(f"\nper tensor: ({count} tensors - one tensor of the same {count * size} elements) / {count - 1}")
        _markdown(["implementation", f"{count} tensors: ms", "one tensor: ms", "us per tensor",
                   f"ratio to {BASELINE}"],
                  [[r["name"], f"{r['many_ms']:.2f}", f"{r['one_ms']:.2f}", f"{r['us']:.1f}",
                    _ratio(r["ratio"])] for r in tables["per_tensor"]])
    _print_layout_tables(args, tables)
    print_table(f"block-wise (de)quantization, block_size {F.DEFAULT_BLOCK_SIZE}", tables["quantization"], None)
    return config


def _print_in_cache(args, config: dict, in_cache: List[dict]) -> None:
    small, large = args.in_cache
    print(f"\ncost per parameter with the data in cache (one thread; slope between {small} and {large} "
          f"parameters), and the time {args.n} parameters would take on {config['threads']} threads if "
          f"memory cost nothing")
    _markdown(["implementation", "ns / parameter / core", "compute floor, ms", "floor / torch fused's step"],
              [[r["name"], f"{r['ns_per_param']:.2f}", f"{r['floor_ms']:.1f}", _ratio(r["floor_ratio"])]
               for r in in_cache])


def _ratio(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _markdown(columns: List[str], rows: List[List[str]]) -> None:
    """A markdown table: the first column text, the others numbers (right-aligned)."""
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _print_layout_tables(args, tables: dict) -> None:
    part_table, block_table = tables["partition"], tables["blocks"]
    if part_table:
        print_table(f"ZeRO partition layouts: AdamW8bitBlock over the same {args.n} elements", part_table, "one tensor")
        for r in part_table[1:]:
            print(f"segment overhead, {r['name']}: {100 * (r['paired_ratio'] - 1):+.1f}% of the one-tensor step "
                  "(median of per-repetition ratios)")
    if block_table:
        print_table(f"block sizes: AdamW8bitBlock (kernel, nonfinite=off) over {args.n} parameters", block_table,
                    block_table[-1]["name"])
        for r in block_table[:-1]:
            print(f"{r['name']}: {100 * (r['paired_ratio'] - 1):+.1f}% against {block_table[-1]['name']} "
                  "(median of per-repetition ratios)")


def _print_muon(args, muon_table: List[dict]) -> dict:
    result = dict(muon=dict(shapes=[list(s) for s in args.muon or []], ns_dtype=muon_ns_dtype(), step=muon_table))
    if muon_table:
        shapes = " ".join(f"{r}x{c}" for r, c in args.muon)
        print(f"\nMuon step over {shapes} ({sum(r * c for r, c in args.muon)} parameters), {args.device}, "
              f"{torch.get_num_threads()} threads; DeepSpeed's Gram Newton-Schulz in "
              f"{result['muon']['ns_dtype']}, Muon8bitBlock's in float32; median of {args.reps} interleaved runs")
        _markdown(["implementation", "ms / step", "ratio to DeepSpeed Muon", "momentum bytes", "bytes / parameter"],
                  [[r["name"], f"{r['ms']:.1f}", _ratio(r["ratio"]), f"{r['momentum_bytes']:,}",
                    f"{r['bytes_per_param']:.4f}"] for r in muon_table])
    if args.muon_only and args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
