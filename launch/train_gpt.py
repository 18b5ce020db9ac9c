"""Train a GPT-2 language model with DeepSpeed and ds_q8's 8-bit block-wise optimizers.

One rank:        python launch/train_gpt.py
Several ranks:   deepspeed --num_gpus 8 launch/train_gpt.py --model gpt2-xl --deepspeed_config ds_configs/gpt2_xl_8bit_zero2.json
MPI:             mpirun -np 2 python launch/train_gpt.py ...

The optimizer, precision, ZeRO stage and batch size come from the DeepSpeed JSON config; the model,
data, schedule length and checkpointing from the command line. With no arguments it trains the
tiny model on the Python standard library's source text for a few minutes on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

# OpenMP threads that spin while waiting make CPU training on a busy machine several times slower
# (tiny model, 2 shared cores: 2.5-3.3 s/step spinning vs 0.4-0.5 s/step passive). It must be set
# before torch loads OpenMP; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

import checkpointing
import dist_setup
import gpt_data
import gpt_models
from metrics_log import MetricsLog

DEFAULT_CONFIG = REPO / "ds_configs" / "tiny_cpu_8bit.json"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not where the help already says it, nor for unset flags."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)".strip()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train GPT-2 with DeepSpeed and 8-bit block-wise optimizers.",
                                 formatter_class=_DefaultsHelp)
    ap.add_argument("--deepspeed_config", default=str(DEFAULT_CONFIG), help="DeepSpeed JSON config")
    ap.add_argument("--model", default="tiny", choices=sorted(gpt_models.SIZES), help="GPT-2 size")
    ap.add_argument("--n_layer", type=positive_int, default=None, help="override the size's depth")
    ap.add_argument("--context", type=positive_int, default=None,
                    help="tokens per sequence (default 128 for tiny, 1024 for the GPT-2 sizes)")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    ap.add_argument("--stable_embedding", action="store_true", help="ds_q8.StableEmbedding for the tokens")
    ap.add_argument("--compute", default="auto", choices=["auto", "bf16", "fp32"],
                    help="what a bf16 config's forward and backward compute in: bf16, or fp32 read from the bf16 "
                         "weights (masters, gradients and optimizer state stay as the config says; "
                         "gpt_models.compute_in_fp32); auto: fp32 on a CPU without native bf16 matrix products, "
                         "where bf16 is many times slower, else bf16. An fp32 config computes in fp32 (default: auto)")
    ap.add_argument("--data", default=None, help="text file or folder (default: Python's standard library)")
    ap.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: bytes, vocab 256)")
    ap.add_argument("--micro_batch", type=positive_int, default=None,
                    help="sequences per rank per micro-step (overrides train_micro_batch_size_per_gpu)")
    ap.add_argument("--grad_accum", type=positive_int, default=None,
                    help="micro-steps per optimizer step (overrides gradient_accumulation_steps)")
    ap.add_argument("--max_steps", type=positive_int, default=200, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides the config)")
    ap.add_argument("--eval_interval", type=non_negative_int, default=50, help="0: evaluate at the end only")
    ap.add_argument("--eval_batches", type=positive_int, default=8, help="validation batches per evaluation")
    ap.add_argument("--save_dir", default=str(REPO / "out" / "tiny-8bit"),
                    help="checkpoints, metrics.jsonl and summary.json")
    ap.add_argument("--save_interval", type=non_negative_int, default=100, help="0: save at the end only")
    ap.add_argument("--quant_report_interval", type=non_negative_int, default=0,
                    help="every N steps, the 8-bit state's telemetry in metrics.jsonl (rank 0's partition: codes at "
                         "zero and at the extremes, requantization error); 0: off")
    ap.add_argument("--stop_at", type=positive_int, default=None,
                    help="stop after this step as if interrupted; the schedule still spans --max_steps")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument("--overwrite", action="store_true", help="discard an earlier run's checkpoints in save_dir")
    ap.add_argument("--world_invariant_data", action="store_true",
                    help="draw micro-batch m of step s on rank r as the run's micro-batch (s * grad_accum + m) * "
                         "world + r, not per rank: 1 rank with --grad_accum 2 then sees the batches 2 ranks with "
                         "--grad_accum 1 see, in the order they are summed (the same at world size 1)")
    ap.add_argument("--copy_bf16_masters", action="store_true",
                    help="with bf16 masters, keep DeepSpeed's own master copy and flattened gradient (the memory "
                         "ladder's rung (d)) instead of stepping the bf16 parameters in place, and under ZeRO-Offload "
                         "its host copies (ds_q8.integration.host_copies): to compare memory")
    ap.add_argument("--seed", type=non_negative_int, default=1234, help="model initialisation and data order")
    ap.add_argument("--tensorboard", action="store_true", help="also log to <save_dir>/tensorboard")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    ap.add_argument("--label", default=None, help="what the progress bar says it runs (default: the model, "
                                                  "the config's name and the precision of compute)")
    ap.add_argument("--master_port", type=positive_int, default=None, help="rendezvous port (one rank / MPI)")
    ap.add_argument("--dist_timeout", type=positive_int, default=dist_setup.DEFAULT_TIMEOUT_S,
                    help="seconds a rank waits in a collective for the others before failing (a dead or hung "
                         "rank then ends the job instead of stalling it); must outlast the slowest checkpoint write")
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = ap.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.resume and args.overwrite:
        ap.error("--resume and --overwrite exclude each other")
    if args.stop_at is not None and args.stop_at > args.max_steps:
        ap.error(f"--stop_at must be in [1, --max_steps={args.max_steps}], got {args.stop_at}")
    if args.context is None:
        args.context = 128 if args.model == "tiny" else gpt_models.GPT2_CONTEXT
    return args


def load_ds_config(args) -> dict:
    """Read the JSON config and fill the values that depend on the command line."""
    try:
        cfg = json.loads(Path(args.deepspeed_config).read_text())
    except FileNotFoundError:
        raise SystemExit(f"--deepspeed_config: no such file {args.deepspeed_config!r}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"--deepspeed_config {args.deepspeed_config!r} is not valid JSON: {e}")
    if args.micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg.pop("train_batch_size", None)  # DeepSpeed derives it; a stale value would contradict
    if args.grad_accum is not None:
        cfg["gradient_accumulation_steps"] = args.grad_accum
        cfg.pop("train_batch_size", None)
    sched = cfg.get("scheduler", {}).get("params", {})
    if args.lr is not None:  # a config without an optimizer section (a client optimizer's) keeps none otherwise
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if isinstance(sched.get("warmup_max_lr"), (int, float)):
            # the warm-up keeps the config's shape: its start moves with the peak, so a peak below the
            # config's start does not turn the warm-up into a decay
            peak = sched["warmup_max_lr"]
            if isinstance(sched.get("warmup_min_lr"), (int, float)) and peak > 0:
                sched["warmup_min_lr"] = sched["warmup_min_lr"] * args.lr / peak
            sched["warmup_max_lr"] = args.lr
    if sched.get("total_num_steps") == "auto":
        sched["total_num_steps"] = args.max_steps
    return cfg


def config_weight_decay(cfg: dict) -> float:
    """The optimizer's weight decay in a DeepSpeed config (0 where it names none)."""
    return float(cfg.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))


def step_seed(seed: int, rank: int, step: int) -> int:
    # torch's RNG (dropout) is re-seeded every step from (seed, rank, step), so a resumed run
    # needs no saved RNG state to draw what the uninterrupted run drew.
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729) % (2 ** 63)


def innermost_optimizer(engine):
    """The torch optimizer holding the state, below DeepSpeed's ZeRO / precision wrappers."""
    opt = engine.optimizer
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def quantization_record(report: dict) -> dict:
    """The totals of a quantization report as flat metrics: ``quant_<state>_<at_zero|at_extreme|rel_error|zeroed>``."""
    return {f"quant_{state}_{key}": value for state, stats in report["states"].items()
            for key, value in stats.items() if value is not None}


def optimizer_state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))


def muon_momentum_bytes(opt) -> tuple:
    """(bytes, elements, 8-bit bytes, 8-bit elements) of the momentum of the optimizer's Muon groups
    (``use_muon``): every state tensor but the step count, so block maxima count; the 8-bit pair covers
    the groups whose momentum is kept in 1-byte codes. All zeros for an optimizer without Muon groups."""
    total = elements = total8 = elements8 = 0
    for group in opt.param_groups:
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            tensors = [t for k, t in opt.state.get(p, {}).items() if k != "step" and torch.is_tensor(t)]
            size = sum(t.numel() * t.element_size() for t in tensors)
            total, elements = total + size, elements + p.numel()
            if any(t.element_size() == 1 for t in tensors):
                total8, elements8 = total8 + size, elements8 + p.numel()
    return total, elements, total8, elements8


def muon_staging_bytes(engine) -> int:
    """Bytes of the second momentum copy DeepSpeed's ZeRO-1/2 keeps for its own Muon outside the optimizer
    state (the momentum of the step in flight, committed once the step survives the overflow check)."""
    staged = getattr(engine.optimizer, "_muon_pending_momentum", None) or {}
    return sum(t.numel() * t.element_size() for t, _ in staged.values() if torch.is_tensor(t))


def all_reduce_sum(values, device):
    import deepspeed.comm as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(engine, val, args, mbs, rank, world, device) -> float:
    # Batch i goes to rank i % world: the evaluated text is the same at any world size. Every rank runs
    # as many forwards (one it does not count where the batches run out): under ZeRO-3 each forward
    # gathers parameters from all ranks.
    engine.eval()
    total, count = 0.0, 0
    for i in range(rank, -(-args.eval_batches // world) * world, world):
        x, y = gpt_data.get_batch(val, mbs, args.context, args.seed, rank=0, step=min(i, args.eval_batches - 1),
                                  stream=1)
        logits = engine(input_ids=x.to(device)).logits
        if i < args.eval_batches:
            total += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).view(-1)).item()
            count += 1
    engine.train()
    total, count = all_reduce_sum([total, count], device)
    return total / count


def announce_deepspeed_builds(cfg: dict) -> None:
    """A line before each DeepSpeed op a first run compiles (DeepSpeed says so only when done)."""
    import torch

    if torch.cuda.is_available():
        return  # the CPU ops below are for CPU runs
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder, ShareMemCommBuilder
    from ds_q8.op_builder.notice import announce_deepspeed_op

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        announce_deepspeed_op(ShareMemCommBuilder, "DeepSpeed's CPU communication op", "about two minutes")
    opt = cfg.get("optimizer", {})
    if opt.get("type") in ("Adam", "AdamW") and not opt.get("params", {}).get("torch_adam", False):
        announce_deepspeed_op(FusedAdamBuilder, "DeepSpeed's CPU Adam op", "about a minute")


@dataclasses.dataclass
class Run:
    """What the stages after the engine's construction share: the command line, this rank's place in the
    job, the engine and its batch shape."""
    args: argparse.Namespace
    rank: int
    world: int
    engine: object
    device: object
    mbs: int  # sequences per rank per micro-step
    gas: int  # micro-steps per optimizer step
    compute: str = "fp32"  # what the forward and backward compute in (compute_dtype)
    label: str = ""  # the progress bar's description

    @property
    def tokens_per_step(self) -> int:
        return self.mbs * self.gas * self.world * self.args.context


def join_job(args, cfg: dict) -> tuple:
    """Load DeepSpeed and ds_q8, join the other ranks and choose the checkpoint to resume from:
    ``(rank, world size, resume point)``, the point as ``checkpointing.resume_point`` gives it (None: start
    fresh). It is chosen before the engine exists: a checkpoint of another world size loads through its
    universal conversion, which the engine must be configured for."""
    import deepspeed  # noqa: F401  (loaded before quiet() filters its logger)
    import ds_q8  # noqa: F401  (registers Adam8bitBlock & co. as DeepSpeed optimizer types)
    from ds_q8.integration.noise import quiet

    quiet()  # warnings DeepSpeed prints on every run (ds_q8/integration/noise.py says which)
    announce_deepspeed_builds(cfg)
    dist_setup.init(args.master_port, args.dist_timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    resume = None
    if args.resume:
        resume = checkpointing.resume_point(args.save_dir, world, report=None if rank == 0 else (lambda _: None))
        if resume is not None and resume[2]:
            cfg.setdefault("checkpoint", {})["load_universal"] = True
    return rank, world, resume


def load_data(args) -> tuple:
    """``(tokenizer, training tokens, validation tokens)``, each split checked to hold a whole sequence."""
    tokenizer = gpt_data.make_tokenizer(args.tokenizer)
    train, val = gpt_data.load_splits(args.data, tokenizer)
    gpt_data.check_length("train", train, args.context)
    gpt_data.check_length("validation", val, args.context)
    return tokenizer, train, val


def compute_dtype(args, cfg: dict) -> str:
    """What this run's forward and backward compute in, ``bf16`` or ``fp32`` (--compute; an fp32 config
    computes in fp32)."""
    if not cfg.get("bf16", {}).get("enabled", False):
        return "fp32"
    return gpt_models.bf16_compute(args.compute, "cuda" if torch.cuda.is_available() else "cpu")


def build_engine(args, cfg: dict, vocab_size: int) -> tuple:
    """``(model, DeepSpeed engine, parameter count)``, the count taken before ZeRO partitions the parameters.
    ds_q8's kernels are loaded here: a first run compiles them before the progress bar starts."""
    import deepspeed
    import ds_q8

    torch.manual_seed(args.seed)  # same initial weights on every rank and every run
    config = gpt_models.gpt2_config(args.model, vocab_size, args.context, args.n_layer, args.dropout)
    bf16 = bool(cfg.get("bf16", {}).get("enabled", False))
    model = gpt_models.build_model(config, args.stable_embedding, torch.bfloat16 if bf16 else None)
    n_params = sum(p.numel() for p in model.parameters())
    if compute_dtype(args, cfg) == "fp32" and bf16:
        gpt_models.compute_in_fp32(model)  # bf16 weights, gradients and masters; fp32 arithmetic
        zero = cfg.get("zero_optimization") or {}
        if int(zero.get("stage", 0)) == 3:
            # ZeRO-3's memory-efficient linear saves the bf16 weight for its own backward, which then meets
            # an fp32 gradient; torch's linear lets autograd cast the weight's gradient back to bf16
            cfg = dict(cfg, zero_optimization=dict(zero, memory_efficient_linear=False))
    groups = ds_q8.param_groups(model, config_weight_decay(cfg))  # embeddings keep 32-bit state
    if args.copy_bf16_masters:
        from ds_q8.integration import host_copies, shared_masters

        shared_masters.ENABLED = host_copies.ENABLED = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    ds_q8.ops.load_op(torch.device(engine.device).type)
    return model, engine, n_params


def quantization_telemetry(engine, interval: int, rank: int):
    """The optimizer, set to report on its 8-bit state every ``interval`` steps; None without
    --quant_report_interval or when the optimizer keeps no 8-bit state."""
    if not interval:
        return None
    import ds_q8

    opt = innermost_optimizer(engine)
    if isinstance(opt, ds_q8.optim.Optimizer8bitBlock):
        opt.track_quantization(interval)
        return opt
    if rank == 0:
        print(f"--quant_report_interval: {type(opt).__name__} keeps no 8-bit state; no telemetry")
    return None


def first_step(run: Run, resume) -> int:
    """The step training starts from: the resume point's, once its checkpoint is loaded, else 0 (with
    --overwrite, after the earlier run's checkpoints are discarded). Creates --save_dir."""
    args, rank = run.args, run.rank
    start_step = 0
    if args.resume:
        if resume is not None:
            tag, _, universal = resume
            if universal and rank == 0:
                print(f"--resume: {tag}, converted from a checkpoint of another world size, at {run.world} rank(s)")
            _, client = run.engine.load_checkpoint(args.save_dir, tag=tag)
            if client.get("seed") != args.seed:
                raise SystemExit(f"--seed {args.seed} differs from the checkpoint's seed {client.get('seed')}; "
                                 "a resumed run must use the seed it started with")
            start_step = client["step"]
        elif rank == 0:
            print(f"--resume: no complete checkpoint in {args.save_dir}, starting from step 0")
    elif args.overwrite and rank == 0:
        checkpointing.clear_run(args.save_dir)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    return start_step


def train_step(run: Run, train, step: int) -> float:
    """Optimizer step ``step`` (0-based), its ``gas`` micro-steps accumulated: the loss, averaged over the
    micro-steps and the ranks."""
    args, engine, device = run.args, run.engine, run.device
    mbs, gas, rank, world = run.mbs, run.gas, run.rank, run.world
    torch.manual_seed(step_seed(args.seed, rank, step))
    loss_sum = 0.0
    for micro in range(gas):
        if args.world_invariant_data:
            x, y = gpt_data.get_batch(train, mbs, args.context, args.seed, 0, (step * gas + micro) * world + rank)
        else:
            x, y = gpt_data.get_batch(train, mbs, args.context, args.seed, rank, step * gas + micro)
        logits = engine(input_ids=x.to(device)).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).view(-1))
        engine.backward(loss)
        engine.step()
        loss_sum += loss.item()
    (loss_sum,) = all_reduce_sum([loss_sum / gas], device)
    return loss_sum / world


def save_checkpoint(run: Run, done: int) -> None:
    """The checkpoint after step ``done``, marked complete once every rank has written its files."""
    args = run.args
    run.engine.save_checkpoint(args.save_dir, tag=checkpointing.tag_for(done),
                               client_state=dict(step=done, seed=args.seed))
    checkpointing.flush(args.save_dir, done)
    dist_setup.barrier()  # every rank's files are on disk before the marker says so
    if run.rank == 0:
        checkpointing.mark_complete(args.save_dir, done, dict(seed=args.seed, world_size=run.world))


def train_loop(run: Run, train, val, telemetry, log, start_step: int) -> tuple:
    """Train from ``start_step`` to --stop_at (or --max_steps), evaluating, logging and saving at their
    intervals: ``(each step's seconds, the last evaluation's loss or None when none ran)``."""
    from tqdm import tqdm

    args, rank = run.args, run.rank
    step_times = []
    eval_loss = None
    end_step = args.stop_at or args.max_steps
    bar = tqdm(range(start_step, end_step), initial=start_step, total=args.max_steps, desc=run.label,
               disable=rank != 0 or args.no_progress, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        lr = run.engine.get_lr()[0]  # the rate this step uses
        loss = train_step(run, train, step)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        done = step + 1
        record = dict(step=done, loss=loss, lr=lr, step_time_s=dt, tokens_per_s=run.tokens_per_step / dt)
        last = done == args.max_steps
        if last or (args.eval_interval and done % args.eval_interval == 0):
            eval_loss = evaluate(run.engine, val, args, run.mbs, rank, run.world, run.device)
            record.update(eval_loss=eval_loss, eval_ppl=math.exp(min(eval_loss, 50.0)))
        if telemetry is not None and done % args.quant_report_interval == 0:
            record.update(quantization_record(telemetry.quantization_report()))
        if rank == 0:
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if "eval_loss" in record:
                bar.write(f"step {done}: eval loss {eval_loss:.4f} (ppl {record['eval_ppl']:.2f})")
        if last or done == end_step or (args.save_interval and done % args.save_interval == 0):
            save_checkpoint(run, done)
    bar.close()
    return step_times, eval_loss


def summarize(run: Run, model, n_params: int, start_step: int, step_times, eval_loss: float) -> dict:
    """summary.json: the run, its final evaluation, its speed (the first step left out when there are
    others) and its memory, optimizer state and Muon momentum summed over the ranks."""
    args, engine = run.args, run.engine
    opt_bytes = optimizer_state_bytes(innermost_optimizer(engine))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    muon = muon_momentum_bytes(innermost_optimizer(engine))
    total_opt_bytes, rss_sum, *muon = all_reduce_sum([opt_bytes, peak_rss, *muon, muon_staging_bytes(engine)],
                                                     run.device)
    hosts = dist_setup.hostnames()
    steady = step_times[1:] or step_times  # the first step pays for lazy state and warm-up
    tokens_per_step = run.tokens_per_step
    summary = dict(
        model=args.model, n_params=n_params, world_size=run.world, config=str(args.deepspeed_config),
        optimizer=type(innermost_optimizer(engine)).__name__, steps=args.max_steps, start_step=start_step,
        context=args.context, micro_batch=run.mbs, compute=run.compute,
        masters="bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32",
        final_eval_loss=eval_loss, final_eval_ppl=math.exp(min(eval_loss, 50.0)),
        mean_step_time_s=sum(steady) / len(steady) if steady else None,
        tokens_per_s=tokens_per_step * len(steady) / sum(steady) if steady else None,
        optimizer_state_bytes=int(total_opt_bytes), optimizer_state_bytes_rank0=opt_bytes,
        peak_rss_bytes_rank0=peak_rss, peak_rss_bytes_sum=int(rss_sum), hosts=hosts,
    )
    if muon[1]:  # Muon groups: their momentum, all ranks (elements: of the partitions that hold it)
        summary.update(muon_params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
                                      if getattr(p, "use_muon", False)),
                       muon_momentum_bytes=int(muon[0]), muon_momentum_elements=int(muon[1]),
                       muon_momentum_bytes_8bit=int(muon[2]), muon_momentum_elements_8bit=int(muon[3]),
                       muon_staging_bytes=int(muon[4]))
    if torch.cuda.is_available():
        summary["peak_device_bytes_rank0"] = torch.cuda.max_memory_allocated()
    summary.update(offload_record(engine, model))
    return summary


def offload_record(engine, model) -> dict:
    """Under ZeRO-Offload: each rank's host bytes, part by part (``ds_q8.memory.measure_offload``), and the parameter
    groups as this trainer makes them (sizes and bits), from which ``ds_q8.memory.predict_offload`` predicts them."""
    import deepspeed.comm as dist
    import ds_q8
    from ds_q8.memory.measure_offload import measure_host_states

    offload = engine.zero_offload_optimizer()
    if offload is None or str(getattr(offload.device, "value", offload.device)) != "cpu":
        return {}
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, measure_host_states(engine))
    groups = ds_q8.param_groups(model, 0.0)
    return dict(host_states=by_rank, param_group_bits=[g.get("optim_bits", 8) for g in groups],
                param_group_sizes=[[getattr(p, "ds_numel", p.numel()) for p in g["params"]] for g in groups])


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_ds_config(args)
    if not (args.resume or args.overwrite) and checkpointing.has_checkpoints(args.save_dir):
        raise SystemExit(f"--save_dir {args.save_dir} holds checkpoints of an earlier run: pass --resume to "
                         "continue it or --overwrite to discard it")
    rank, world, resume = join_job(args, cfg)
    tokenizer, train, val = load_data(args)
    model, engine, n_params = build_engine(args, cfg, tokenizer.vocab_size)
    telemetry = quantization_telemetry(engine, args.quant_report_interval, rank)
    compute = compute_dtype(args, cfg)
    masters = "bf16" if cfg.get("bf16", {}).get("enabled", False) else "fp32"
    label = args.label or f"{args.model} {Path(args.deepspeed_config).stem} ({masters} masters, {compute} compute)"
    run = Run(args, rank, world, engine, engine.device, engine.train_micro_batch_size_per_gpu(),
              engine.gradient_accumulation_steps(), compute, label)
    start_step = first_step(run, resume)
    log = MetricsLog(args.save_dir, start_step, args.tensorboard) if rank == 0 else None
    if rank == 0:
        print(f"{args.model}: {n_params / 1e6:.2f}M params, {world} rank(s), {run.tokens_per_step} tokens/step, "
              f"optimizer {type(innermost_optimizer(engine)).__name__}, train {train.numel()} / "
              f"val {val.numel()} tokens")
    step_times, eval_loss = train_loop(run, train, val, telemetry, log, start_step)
    if eval_loss is None:  # resumed from the final checkpoint: nothing trained, still report
        eval_loss = evaluate(engine, val, args, run.mbs, rank, world, run.device)
    summary = summarize(run, model, n_params, start_step, step_times, eval_loss)
    if rank == 0:
        (Path(args.save_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.close()
        print(json.dumps(summary))
    dist_setup.shutdown()
    return summary


def cli() -> None:
    """main() for the command line: a failed collective ends the rank at once with a message that says
    what happened and where to continue, not only gloo's traceback."""
    try:
        main()
    except Exception as e:  # noqa: BLE001  (anything else is re-raised as it is)
        if not dist_setup.is_peer_failure(e):
            raise
        import traceback

        traceback.print_exc()
        args = parse_args()
        found = checkpointing.latest_complete(args.save_dir, report=lambda _: None)
        where = (f"the last complete checkpoint is {Path(args.save_dir) / found[0]}; continue with --resume "
                 f"(on fewer ranks too)" if found else f"no complete checkpoint in {args.save_dir} yet")
        print(dist_setup.peer_failure_message(e, args.dist_timeout) + f"; {where}", file=sys.stderr, flush=True)
        # exit now: gloo's teardown can wait on the lost peer's sockets
        os._exit(1)


if __name__ == "__main__":
    cli()
