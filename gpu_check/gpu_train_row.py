"""One row of the training stage (gpu_check/gpu_train.py): a GPT-2 trained with one DeepSpeed config, measured.

    deepspeed --num_gpus 1 --no_local_rank gpu_check/gpu_train_row.py --config ds_configs/FILE --json PATH [...]

Warm-up steps first, not timed; the last of them counts the model states on the live engine
(ds_q8.memory.measure). Then --steps timed optimizer steps of one micro batch each (gradient accumulation 1),
ended early, and reported so, when the next would pass --deadline. PATH gets the row's figures as JSON:
tokens per second over the timed steps, the optimizer step (DeepSpeed's own timer around engine.step():
CUDA events on a GPU, the host clock on the CPU), the peak memory of the process, model-state bytes per
parameter measured and as the memory ladder predicts them (ds_q8.memory), and the losses.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE.parent), str(HERE.parent / "launch"), str(HERE)) if p not in sys.path]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dist_setup  # noqa: E402
import gpt_data  # noqa: E402
import gpt_models  # noqa: E402
import train_gpt  # noqa: E402

#: the shipped config whose optimizer hyperparameters a client optimizer takes, so that every row trains alike
CLIENT_HYPERPARAMETERS = HERE.parent / "ds_configs" / "gpt2_xl_8bit_zero2.json"
CLIENTS = ("bitsandbytes",)  # --client: bitsandbytes' AdamW8bit


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="DeepSpeed JSON config")
    ap.add_argument("--client", choices=CLIENTS, help="an optimizer object handed to deepspeed.initialize "
                    "(the config then has no optimizer section and sets zero_allow_untested_optimizer)")
    ap.add_argument("--json", required=True, help="where the row's figures go")
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(gpt_models.SIZES))
    ap.add_argument("--n_layer", type=train_gpt.positive_int, default=None, help="override the size's depth")
    ap.add_argument("--vocab_size", type=train_gpt.positive_int, default=gpt_models.GPT2_VOCAB_SIZE,
                    help="the model's vocabulary (the text is bytes, ids below 256)")
    ap.add_argument("--context", type=train_gpt.positive_int, default=gpt_models.GPT2_CONTEXT)
    ap.add_argument("--micro_batch", type=train_gpt.positive_int, required=True)
    ap.add_argument("--warmup", type=train_gpt.positive_int, default=3, help="untimed steps (at least 1)")
    ap.add_argument("--steps", type=train_gpt.positive_int, default=30, help="timed steps")
    ap.add_argument("--deadline", type=float, default=0.0, help="Unix time the timed steps must end by (0: none)")
    ap.add_argument("--rung", help="the row's rung of ds_q8.memory.LADDER, for the predicted model states")
    ap.add_argument("--seed", type=train_gpt.non_negative_int, default=1234)
    args = ap.parse_args(argv)
    if args.vocab_size < gpt_data.BYTE_VOCAB_SIZE:
        ap.error(f"--vocab_size must be at least {gpt_data.BYTE_VOCAB_SIZE} (byte tokens), got {args.vocab_size}")
    return args


def client_optimizer(name: str, groups):
    params = json.loads(CLIENT_HYPERPARAMETERS.read_text())["optimizer"]["params"]
    if name == "bitsandbytes":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                                   weight_decay=params["weight_decay"])
    raise ValueError(f"--client must be one of {CLIENTS}, got {name!r}")


def predicted_bytes(groups, rung):
    """The ladder's model-state bytes for these parameter groups at ZeRO-2 on one rank (None without a rung)."""
    if rung is None:
        return None
    from ds_q8.memory import predict_model_states

    sizes = [[p.numel() for p in g["params"]] for g in groups]
    return sum(predict_model_states(sizes, rung, group_bits=[g.get("optim_bits", 8) for g in groups]).values())


def peak_memory(device) -> tuple:
    """(peak allocated, peak reserved, what they are) for this process."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                "torch.cuda.max_memory_allocated / max_memory_reserved")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, rss, "peak RSS of the process (ru_maxrss), both columns"


def versions() -> dict:
    import deepspeed
    import transformers

    found = dict(torch=torch.__version__, deepspeed=deepspeed.__version__, transformers=transformers.__version__,
                 python=platform.python_version())
    if "bitsandbytes" in sys.modules:
        found["bitsandbytes"] = sys.modules["bitsandbytes"].__version__
    return found


def build_engine(args, cfg: dict, device) -> tuple:
    """``(engine, parameter count, model-state bytes the ladder predicts or None)``."""
    import deepspeed
    import ds_q8

    torch.manual_seed(args.seed)
    config = gpt_models.gpt2_config(args.model, args.vocab_size, args.context, args.n_layer)
    bf16 = bool(cfg.get("bf16", {}).get("enabled", False))
    with device:  # the weights are made where they train: 1.5e9 of them take long to initialise on a host
        model = gpt_models.build_model(config, dtype=torch.bfloat16 if bf16 else None)
    n_params = sum(p.numel() for p in model.parameters())
    groups = ds_q8.param_groups(model, train_gpt.config_weight_decay(cfg))
    predicted = predicted_bytes(groups, args.rung)  # before ZeRO puts its flat partitions into the groups
    client = client_optimizer(args.client, groups) if args.client else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=None if client else groups,
                                           optimizer=client, config=cfg)
    return engine, n_params, predicted


def measure(args, engine, device) -> dict:
    """Warm-up steps (the last one counts the model states), then the timed ones: the raw figures."""
    import ds_q8
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.timer import SynchronizedWallClockTimer
    from ds_q8.memory.measure import measure_model_states

    train, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    rank, mbs = int(os.environ.get("RANK", "0")), engine.train_micro_batch_size_per_gpu()
    timer = SynchronizedWallClockTimer()("optimizer_step")  # the engine's own timer class
    losses = []

    def train_step(step: int) -> None:
        x, y = gpt_data.get_batch(train, mbs, args.context, args.seed, rank, step)
        logits = engine(input_ids=x.to(device)).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).view(-1))
        engine.backward(loss)
        timer.start()
        engine.step()
        timer.stop()
        losses.append(loss.detach())

    def kernel_calls() -> int:
        return sum(n for (kind, _), n in ds_q8.ops.CALLS.items() if kind == device.type)

    for step in range(args.warmup - 1):
        train_step(step)
    states = measure_model_states(engine, lambda: train_step(args.warmup - 1))
    calls_before = kernel_calls()
    timer.reset()
    get_accelerator().synchronize()
    timed_from, t0 = time.time(), time.perf_counter()
    done = 0
    while done < args.steps:
        if done and args.deadline and time.time() + (time.perf_counter() - t0) / done > args.deadline:
            break  # the next step would end past the deadline
        train_step(args.warmup + done)
        done += 1
    get_accelerator().synchronize()
    window = time.perf_counter() - t0
    timer.elapsed(reset=False)
    return dict(model_states=states, steps=done, timed_from=timed_from, window_s=window,
                step_ms=list(timer.elapsed_records), tokens_per_step=mbs * args.context * engine.world_size,
                ds_q8_kernel_calls=kernel_calls() - calls_before,  # in the timed steps: ds_q8's kernels ran
                losses=[float(v) for v in torch.stack(losses).float().cpu()])


def main(argv=None) -> dict:
    args = parse_args(argv)
    import ds_q8
    from deepspeed.accelerator import get_accelerator
    from ds_q8.integration.noise import quiet

    quiet()
    dist_setup.init()
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))
    cfg = train_gpt.load_ds_config(argparse.Namespace(deepspeed_config=args.config, micro_batch=args.micro_batch,
                                                      grad_accum=1, lr=None, max_steps=args.warmup + args.steps))
    if cfg.get("optimizer", {}).get("type") in ds_q8.registry.OPTIMIZERS:
        ds_q8.ops.load_op(device.type, required=True)  # the kernels, or a clear error: no silent reference step
    engine, n_params, predicted = build_engine(args, cfg, device)
    m = measure(args, engine, device)

    allocated, reserved, memory_source = peak_memory(device)
    step_mean_s = statistics.fmean(m["step_ms"]) / 1000
    micro_s = m["window_s"] / m["steps"] - step_mean_s  # forward and backward of one micro batch
    accumulation = int(json.loads(Path(args.config).read_text()).get("gradient_accumulation_steps", 1))
    module = engine.module.config
    result = dict(
        config=Path(args.config).name, client=args.client,
        optimizer=type(train_gpt.innermost_optimizer(engine)).__name__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        versions=versions(), model=args.model, n_layer=module.n_layer, n_embd=module.n_embd,
        vocab_size=args.vocab_size, n_params=n_params, context=args.context,
        micro_batch=engine.train_micro_batch_size_per_gpu(), world_size=engine.world_size,
        warmup_steps=args.warmup, steps_asked=args.steps, **m,
        tokens_per_s=m["tokens_per_step"] * m["steps"] / m["window_s"],
        step_ms_median=statistics.median(m["step_ms"]), step_ms_mean=step_mean_s * 1000,
        config_accumulation=accumulation, tokens_per_s_at_config_accumulation=accumulation * m["tokens_per_step"]
        / (accumulation * micro_s + step_mean_s),
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, memory_source=memory_source,
        model_state_bytes_per_param=sum(m["model_states"].values()) / n_params,
        ladder_rung=args.rung, ladder_bytes_per_param=None if predicted is None else predicted / n_params,
        loss_first=m["losses"][0], loss_last=m["losses"][-1])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
    dist_setup.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # a 1.5e9-parameter engine takes a while to tear down and gloo's teardown can abort after the last
    # line: the figures are written, so leave at once
    os._exit(0)
