"""The training stage of the GPU check: GPT-2 XL at full depth trained on one GPU through the deepspeed
launcher, once per optimizer configuration, as a table of speed and memory.

    python gpu_check/gpu_train.py --out DIR             every row (gpu_check/gpu_train.sh runs this)
    python gpu_check/gpu_train.py --out DIR --dry-run   the rows, their command lines and the time budget

Each row is one ``deepspeed --num_gpus 1`` launch of gpu_check/gpu_train_row.py with a shipped config
(:data:`ROWS`): 3 warm-up steps, then 30 timed optimizer steps of 16 sequences of 1024 tokens (gradient
accumulation 1, not the configs' 16: 30 steps of 16 x 16 sequences would take minutes a row). The DeepSpeed
baselines are the shipped ``"type": "Adam"`` configs: FusedAdam, the kernel ``"type": "AdamW"`` selects too,
the same update at their weight decay of 0. The ops the rows need (ds_q8's kernels, DeepSpeed's FusedAdam)
are built first, side by side, into TORCH_EXTENSIONS_DIR, which every row then loads from.

Micro batch 16: on the H200 (143771 MiB) the rows must fit beside their model states, the largest of which
(DeepSpeed's Adam with fp32 masters) hold 16 bytes a parameter, 20 during the step: 25-31 GB at 1.56e9
parameters. A sequence of 1024 tokens keeps 4.9 GB of bf16 activations (98 MB a layer, measured with
saved-tensor hooks: transformers' GPT-2 keeps five 4x-wide tensors in its tanh GELU; 0.2 GB of logits),
and the loss's fp32 logits take about 0.5 GB more a sequence while backward starts: 16 sequences need
about 87 GB, 112 GB with those states, of the H200's 150.8 GB; 24 would need 156 GB.

Time: the budget (--budget_s, 540 s by default less what gpu_train.sh spent installing wheels) pays the
build (at most 180 s; the CUDA op took 110 s on the first H200 run) and then the rows, each given an equal
share of what is left, at least --row_min_s and at most --row_limit_s. A row ends its timed steps early, and
says how many it took, when the next one would pass its share; one that cannot be given --row_min_s is
skipped with a SKIP line, so the table always comes back, every row in it.

Lines: ``PASS``/``FAIL``/``SKIP`` per build and row, ``STOP`` when nothing can run, ``TARGET`` for the
comparisons (met or missed, never a failure), ``INFO`` for the rest. DIR gets train_table.md and
train.json (rewritten after every row) and train_logs.tar.gz (each build's and launch's own log).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

START = time.time()  # the budget counts from here: importing torch takes seconds of it too
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = REPO / "ds_configs"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    label: str
    config: str  # a file of ds_configs/
    rung: Optional[str] = None  # its rung of ds_q8.memory.LADDER: the model states the ladder predicts
    client: Optional[str] = None  # an optimizer object handed to deepspeed.initialize (gpu_train_row.CLIENTS)


#: the rows in the order they run: the comparisons the stage is for first
ROWS = (
    Row("deepspeed-adam", "DeepSpeed Adam (FusedAdam), fp32 masters", "gpt2_xl_32bit_zero2.json", "a"),
    Row("8bit-bf16", "Adam8bitBlock, bf16 masters stepped in place", "gpt2_xl_8bit_bf16master_zero2.json", "e"),
    Row("deepspeed-adam-bf16", "DeepSpeed Adam (FusedAdam), bf16 masters and moments",
        "gpt2_xl_bf16_states_zero2.json", "b"),
    Row("8bit", "Adam8bitBlock, fp32 masters", "gpt2_xl_8bit_zero2.json", "c"),
    Row("4bit-bf16", "Adam8bitBlock optim_bits=4, bf16 masters", "gpt2_xl_4bit_bf16master_zero2.json", "g"),
    Row("8bit-bf16-correction", "Adam8bitBlock, bf16 masters and a correction byte",
        "gpt2_xl_8bit_bf16master_correction_zero2.json", "f"),
    Row("bnb-8bit", "bitsandbytes AdamW8bit (client optimizer), fp32 masters", "gpt2_xl_client_optimizer_zero2.json",
        client="bitsandbytes"),
)
#: (row, against, a target): tokens per second and peak memory of a row against another; the targets compare
#: the same masters (the 8-bit state's cost and saving), the rest what a user of the default config gains
COMPARISONS = (("8bit-bf16", "deepspeed-adam-bf16", True), ("8bit", "deepspeed-adam", True),
               ("8bit-bf16", "deepspeed-adam", False))
#: what builds each op a row needs (argv[1]: the device), run side by side before the rows; on the CPU also
#: the communication op DeepSpeed's CPU accelerator builds when it starts
BUILDS = {
    "ds_q8": "import sys; from ds_q8 import ops; ops.load_op(sys.argv[1], required=True)",
    "FusedAdam": "from deepspeed.accelerator import get_accelerator as a; "
                 "a().create_op_builder('FusedAdamBuilder').load()",
    "ShareMemComm": "from deepspeed.accelerator import get_accelerator as a; "
                    "a().create_op_builder('ShareMemCommBuilder').load()",
}
BUILD_LIMIT_S = 180
EXIT_S = 8  # a row's timed steps end this long before its share runs out: its figures are written, it exits
RESERVE_S = 5  # left at the end for the table


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for train_table.md, train.json, train_logs.tar.gz")
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS), help="comma-separated rows to run, in order")
    ap.add_argument("--model", default="gpt2-xl", help="GPT-2 size (launch/gpt_models.py)")
    ap.add_argument("--n_layer", type=int, default=None, help="override the size's depth")
    ap.add_argument("--vocab_size", type=int, default=50257, help="GPT-2's (the text is bytes, ids below 256)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--micro_batch", type=int, default=16, help="sequences a step (the docstring says why 16)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones (at least 1)")
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps per row")
    ap.add_argument("--budget_s", type=int, default=540, help="seconds for the build and every row")
    ap.add_argument("--row_min_s", type=int, default=40, help="a row given less is skipped")
    ap.add_argument("--row_limit_s", type=int, default=120, help="the most one row may take")
    ap.add_argument("--master_port", type=int, default=29500, help="rendezvous port of the first row (+1 a row)")
    ap.add_argument("--cpu", action="store_true", help="run on DeepSpeed's CPU accelerator (small models, to try "
                    "the stage without a GPU); without it the stage stops when no GPU is visible")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    ap.add_argument("--build-only", action="store_true", help="build the ops the rows need and stop (an earlier "
                    "call on the same machine then leaves the rows their whole budget)")
    args = ap.parse_args(argv)
    known = {r.name for r in ROWS}
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in known]
    if unknown or not args.rows:
        ap.error(f"--rows must name rows among {sorted(known)}, got {unknown or 'none'}")
    for name, low in (("micro_batch", 1), ("warmup", 1), ("steps", 1), ("context", 1), ("budget_s", 1),
                      ("row_min_s", 10), ("vocab_size", 256)):
        if getattr(args, name) < low:
            ap.error(f"--{name} must be an integer >= {low}, got {getattr(args, name)}")
    if args.row_limit_s < args.row_min_s:
        ap.error(f"--row_limit_s must be at least --row_min_s={args.row_min_s}, got {args.row_limit_s}")
    return args


def op_of(row: Row) -> Optional[str]:
    """The op of :data:`BUILDS` a row's optimizer needs (None: a client optimizer, or one with its own)."""
    if row.client:
        return None
    opt = json.loads((CONFIGS / row.config).read_text()).get("optimizer", {})
    if opt.get("type") in ("Adam", "AdamW") and not opt.get("params", {}).get("torch_adam"):
        return "FusedAdam"
    return "ds_q8"


def unavailable(row: Row) -> Optional[str]:
    """Why a row cannot run here, before it is tried (None: it can)."""
    if row.client == "bitsandbytes" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed here (gpu_check/gpu_wheels.sh puts it in .whl/)"
    return None


def row_command(args, row: Row, port: int, json_path: Path, deadline: float) -> List[str]:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
           "--no_local_rank", str(HERE / "gpu_train_row.py"), "--config", str(CONFIGS / row.config),
           "--json", str(json_path), "--model", args.model, "--vocab_size", str(args.vocab_size),
           "--context", str(args.context), "--micro_batch", str(args.micro_batch), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--deadline", f"{deadline:.0f}"]
    cmd += ["--n_layer", str(args.n_layer)] if args.n_layer else []
    cmd += ["--rung", row.rung] if row.rung else []
    cmd += ["--client", row.client] if row.client else []
    return cmd


def run_logged(cmd: List[str], log: Path, limit: float) -> Optional[int]:
    """Run ``cmd`` in its own process group, output to ``log``; its exit status, or None when it ran past
    ``limit`` seconds (then the whole group is ended: a launcher's workers must not keep the GPU)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            pass
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break  # the group is gone
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        proc.wait()
        return None


def tail(path: Path, n: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + line for line in lines[-n:])


class Stage:
    """The stage's lines, its clock and its results, written to train.json and train_table.md."""

    def __init__(self, args, work: Path):
        self.args, self.work, self.out = args, work, Path(args.out)
        self.start = START
        self.results: List[dict] = []
        self.comparisons: List[dict] = []
        self.failed = 0

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.start)

    def line(self, word: str, text: str) -> None:
        self.failed += word == "FAIL"
        print(f"{word} {text}", flush=True)

    def add(self, row: Row, status: str, detail: str, seconds: float = 0.0, result: Optional[dict] = None) -> None:
        self.line(status, f"row {row.name}: {detail}")
        self.results.append(dict(name=row.name, label=row.label, config=row.config, status=status, detail=detail,
                                 seconds=round(seconds, 1), result=result))
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        first = next((x["result"] for x in self.results if x["result"]), {})
        data = dict(stage="train", commit=commit(), device=first.get("device"), versions=first.get("versions"),
                    budget_s=self.args.budget_s, seconds=round(time.time() - self.start), failed=self.failed,
                    settings=settings(self.args), rows=self.results, comparisons=self.comparisons)
        (self.out / "train.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "train_table.md").write_text(table(data))


def settings(args) -> dict:
    return dict(model=args.model, n_layer=args.n_layer, vocab_size=args.vocab_size, context=args.context,
                micro_batch=args.micro_batch, gradient_accumulation=1, warmup_steps=args.warmup, steps=args.steps)


def commit() -> str:
    """COMMIT from the environment, else this checkout's (``-dirty`` with uncommitted changes), else unknown."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=20)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "") if head.returncode == 0 else "unknown"


def build(stage: Stage, ops: set, device: str) -> Dict[str, Optional[str]]:
    """Build every op in ``ops`` side by side: ``{op: None when it loaded, else why not}``."""
    limit = min(BUILD_LIMIT_S, stage.left() - RESERVE_S)

    def one(op):
        t0 = time.time()
        return run_logged([sys.executable, "-c", BUILDS[op], device], stage.work / f"build_{op}.log", limit), \
            time.time() - t0

    errors = {}
    with ThreadPoolExecutor(max(len(ops), 1)) as pool:
        for op, (rc, seconds) in zip(sorted(ops), pool.map(one, sorted(ops))):
            errors[op] = None if rc == 0 else f"its build {'ran past %d s' % limit if rc is None else 'exited %d' % rc}"
            if rc == 0:
                stage.line("PASS", f"build {op} ({device}): loaded after {seconds:.0f} s")
            else:
                stage.line("FAIL", f"build {op} ({device}): {errors[op]}; last lines of build_{op}.log:\n"
                                   f"{tail(stage.work / f'build_{op}.log')}")
    return errors


def run_row(stage: Stage, row: Row, index: int, rows_left: int, build_errors: Dict[str, Optional[str]]) -> None:
    args = stage.args
    reason = unavailable(row) or (build_errors.get(op_of(row)) and f"{op_of(row)} did not build")
    if reason:
        stage.add(row, "SKIP", reason)
        return
    left = stage.left() - RESERVE_S
    limit = min(args.row_limit_s, max(left / rows_left, args.row_min_s), left)
    if limit < args.row_min_s:
        stage.add(row, "SKIP", f"{left:.0f} s of the {args.budget_s} s budget left, a row needs {args.row_min_s}")
        return
    t0 = time.time()
    json_path, log = stage.work / f"{row.name}.json", stage.work / f"{row.name}.log"
    rc = run_logged(row_command(args, row, args.master_port + index, json_path, t0 + limit - EXIT_S), log, limit)
    seconds = time.time() - t0
    if rc != 0 or not json_path.exists():
        why = f"over its {limit:.0f} s share" if rc is None else f"exit {rc}"
        stage.add(row, "FAIL", f"{why} after {seconds:.0f} s; last lines of {log.name}:\n{tail(log)}", seconds)
        return
    r = json.loads(json_path.read_text())
    finite = [r[k] for k in ("tokens_per_s", "step_ms_median", "peak_allocated_bytes", "peak_reserved_bytes",
                             "model_state_bytes_per_param", "loss_last")]
    bad = not all(math.isfinite(v) for v in finite) or (op_of(row) == "ds_q8" and not r["ds_q8_kernel_calls"])
    short = f", {r['steps']} of {r['steps_asked']} steps: the share ran out" if r["steps"] < r["steps_asked"] else ""
    ladder = f" (ladder {r['ladder_bytes_per_param']:.2f})" if r["ladder_bytes_per_param"] is not None else ""
    detail = (f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms_median']:.1f} ms, peak "
              f"{r['peak_allocated_bytes'] / 1e9:.1f} GB allocated / {r['peak_reserved_bytes'] / 1e9:.1f} reserved, "
              f"model states {r['model_state_bytes_per_param']:.2f} B/param{ladder}, loss {r['loss_last']:.3f}, "
              f"{seconds:.0f} s ({r['timed_from'] - t0:.0f} to the first timed step){short}")
    if bad:
        detail += "; a figure is not finite, or ds_q8's kernels did not run"
    stage.add(row, "FAIL" if bad else "PASS", detail, seconds, r)


def compare(stage: Stage) -> None:
    """TARGET (or INFO) lines: a row's tokens per second and peak memory against another's; the memory it saves
    against the difference of their model states the ladder predicts."""
    ran = {x["name"]: x["result"] for x in stage.results if x["status"] == "PASS"}
    for name, other, target in COMPARISONS:
        if name not in ran or other not in ran:
            continue
        a, b = ran[name], ran[other]
        speed = a["tokens_per_s"] / b["tokens_per_s"] - 1
        saved = (b["peak_allocated_bytes"] - a["peak_allocated_bytes"]) / 1e9
        ladder = (b["ladder_bytes_per_param"] - a["ladder_bytes_per_param"]) * a["n_params"] / 1e9
        found = dict(row=name, against=other, target=target, tokens_per_s=[a["tokens_per_s"], b["tokens_per_s"]],
                     speed_change=speed, peak_allocated_saved_gb=saved, ladder_saved_gb=ladder)
        stage.comparisons.append(found)
        for what, met, text in (
                ("tokens/s", speed >= 0, f"{a['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} ({speed:+.1%})"),
                ("peak memory", saved >= ladder, f"{saved:.1f} GB less allocated; the ladder's model states: "
                                                 f"{ladder:.1f} GB less")):
            head = f"{name} {what} against {other}"
            print(f"TARGET {head}: {'met' if met else 'missed'}, {text}" if target else f"INFO {head}: {text}",
                  flush=True)
    stage.write()


def table(data: dict) -> str:
    """train.json as Markdown: the settings, one table row per stage row (skipped and failed ones say why)."""
    s, v = data["settings"], data["versions"]
    first = next((x["result"] for x in data["rows"] if x["result"]), None)
    where = (f"{data['device']}; torch {v['torch']}, DeepSpeed {v['deepspeed']}, transformers {v['transformers']}; "
             f"{first['n_params'] / 1e6:.1f}M parameters ({first['n_layer']} layers, width {first['n_embd']})"
             ) if first else "no row ran"
    lines = [f"# Training stage: {s['model']} on one device", "",
             f"Commit {data['commit']}; {where}; vocabulary {s['vocab_size']} (the text: bytes of Python's standard "
             f"library); context {s['context']}, micro batch {s['micro_batch']}, gradient accumulation 1, "
             f"{s['warmup_steps']} warm-up step(s) then {s['steps']} timed; ZeRO-2, bf16, one rank, the deepspeed "
             f"launcher. Step: DeepSpeed's timer around engine.step(), median. GB: 10^9 bytes. The last column "
             f"scales the step to each config's own gradient accumulation (forward and backward measured once "
             f"a step). {data['seconds']} s of a {data['budget_s']} s budget.", "",
             "| row | config | steps | tokens/s | step ms | peak allocated GB | peak reserved GB "
             "| model states B/param | ladder B/param | loss at last step | tokens/s at the config's accumulation |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in data["rows"]:
        r = x["result"]
        if r is None:
            lines.append(f"| {x['label']} | `{x['config']}` | {x['status']}: {x['detail'].splitlines()[0]} "
                         "| | | | | | | | |")
            continue
        ladder = f"{r['ladder_bytes_per_param']:.2f}" if r["ladder_bytes_per_param"] is not None else "-"
        lines.append(f"| {x['label']} | `{x['config']}` | {r['steps']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_ms_median']:.1f} | {r['peak_allocated_bytes'] / 1e9:.1f} | "
                     f"{r['peak_reserved_bytes'] / 1e9:.1f} | {r['model_state_bytes_per_param']:.2f} | {ladder} | "
                     f"{r['loss_last']:.3f} | {r['tokens_per_s_at_config_accumulation']:,.0f} "
                     f"(x{r['config_accumulation']}) |")
    for c in data["comparisons"]:
        lines.append(f"\n{c['row']} against {c['against']}: {c['speed_change']:+.1%} tokens/s, "
                     f"{c['peak_allocated_saved_gb']:.1f} GB less peak allocated memory (the ladder's model states: "
                     f"{c['ladder_saved_gb']:.1f} GB less).")
    return "\n".join(lines) + "\n"


def cuda_library_headers(cuda_home: Optional[str]) -> List[str]:
    """The include folders of the NVIDIA libraries torch's wheels bring (site-packages/nvidia/*/include), where
    the toolkit at ``cuda_home`` lacks their headers (a toolkit of nvcc and the runtime alone): DeepSpeed's
    FusedAdam includes ATen/cuda/CUDAContext.h, which includes cusparse.h and cublas_v2.h. Empty otherwise."""
    if cuda_home and Path(cuda_home, "include", "cusparse.h").exists():
        return []
    found = [str(p) for root in sys.path for p in sorted(Path(root or ".").glob("nvidia/*/include"))]
    return list(dict.fromkeys(found))  # the toolkit's own folder (-I) still comes first: CPATH is searched after


def dry_run(args, rows: List[Row]) -> int:
    ops = sorted({op_of(r) for r in rows} - {None})
    print(f"dry run: build {', '.join(ops) or 'nothing'} side by side (at most {BUILD_LIMIT_S} s), then {len(rows)} "
          f"rows in {args.budget_s} s, each an equal share of what is left, {args.row_min_s}-{args.row_limit_s} s")
    for i, row in enumerate(rows):
        cmd = row_command(args, row, args.master_port + i, Path(args.out) / f"{row.name}.json", 0)
        print(f"row {row.name} ({row.label}): {' '.join(cmd)}")
        why = unavailable(row)
        if why:
            print(f"  here it would be skipped: {why}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [next(r for r in ROWS if r.name == name) for name in args.rows]
    if args.dry_run:
        return dry_run(args, rows)
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print(f"STOP preflight: no CUDA GPU visible (torch {torch.__version__}); nothing was built or run "
              "(--cpu runs the stage on DeepSpeed's CPU accelerator, small models only)", flush=True)
        return 2
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # the builds' and rows' DeepSpeed, even where a GPU is visible
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:  # DeepSpeed's FusedAdam build cannot parse 9.0a-style entries; every row loads what it built
        from ds_q8.op_builder.cuda import plain_arch_list

        os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(arch)
    headers = cuda_library_headers(os.environ.get("CUDA_HOME")) if device == "cuda" else []
    if headers:
        os.environ["CPATH"] = os.pathsep.join(headers + [p for p in [os.environ.get("CPATH")] if p])
        print(f"INFO CUDA_HOME={os.environ.get('CUDA_HOME')} has no cusparse.h: CPATH gets {headers}", flush=True)
    print(f"INFO train: {len(rows)} rows, {args.model}, context {args.context}, micro batch {args.micro_batch}, "
          f"{args.warmup}+{args.steps} steps, {device}, TORCH_EXTENSIONS_DIR="
          f"{os.environ.get('TORCH_EXTENSIONS_DIR', '(torch default)')}, TORCH_CUDA_ARCH_LIST="
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset)')}, budget {args.budget_s} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Stage(args, Path(tmp))
        stage.write()
        ops = {op_of(r) for r in rows if not unavailable(r)} - {None}
        build_errors = build(stage, ops | ({"ShareMemComm"} if device == "cpu" else set()), device)
        if args.build_only:
            return 1 if any(build_errors.values()) else 0
        for i, row in enumerate(rows):
            run_row(stage, row, i, len(rows) - i, build_errors)
        compare(stage)
        with tarfile.open(Path(args.out) / "train_logs.tar.gz", "w:gz") as tar:
            tar.add(tmp, arcname="train_logs")
    passed = sum(x["status"] == "PASS" for x in stage.results)
    verdict = "FAIL" if stage.failed else "PASS"
    print(f"{verdict} train: {passed} of {len(rows)} rows measured, {stage.failed} failed; "
          f"{time.time() - stage.start:.0f} s of {args.budget_s}; train_table.md, train.json, train_logs.tar.gz "
          f"in {args.out}", flush=True)
    return 1 if stage.failed else 0


if __name__ == "__main__":
    sys.exit(main())
