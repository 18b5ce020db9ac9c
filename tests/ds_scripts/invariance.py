"""Train one small model under several ZeRO configs at this world size; dump every parameter's fp32
value and optimizer state as DeepSpeed reports them (tests/test_zero_invariance.py).

Usage: deepspeed --num_gpus N invariance.py --plan plan.json --out DIR   (or with --plain: no DeepSpeed)

The gradients are integer-valued and the same on every rank, so ZeRO's averaging reproduces them
bit for bit at any world size, and they depend on the parameters (a parameter that drifts by one
ulp changes the next gradients). Each job writes DIR/<name>.pt (rank 0) with
``{"params": {name: fp32 tensor}, "state": {name: {state: fp32 tensor}}, "raw": ...}``.
"""
import argparse
import json
import os
import sys

import torch
from torch import nn

SHAPES = {  # name -> shape; sizes chosen so that partitions cut parameters and blocks of 64 at 1-4 ranks
    "emb": (37, 11),     # 407 elements, marked 32-bit (like StableEmbedding)
    "w1": (300, 7),      # 2100
    "b1": (7,),          # below min_8bit_size: fp32 state
    "w2": (129, 13),     # 1677
    "norm": (200,),      # fp32 state
    "w3": (1000,),       # 8-bit, 1000 = 15 blocks of 64 and 40
    "w4": (77, 51),      # 3927
}
BLOCK, MIN_8BIT = 64, 256


class IntGrad(torch.autograd.Function):
    """Contributes nothing to the loss's value; its gradient is ``x + round(4 p)``, an integer."""

    @staticmethod
    def forward(ctx, p, x):
        ctx.save_for_backward(p, x)
        return (p * 0).sum()

    @staticmethod
    def backward(ctx, _):
        p, x = ctx.saved_tensors
        return (x + torch.round(p.float() * 4)).to(p.dtype), None


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen)))
        self.emb.ds_q8_optim_bits = 32

    def forward(self, step):
        gen = torch.Generator().manual_seed(1000 + int(step.reshape(-1)[0]))
        loss = torch.zeros((), dtype=self.w1.dtype, device=self.w1.device)
        for name, p in self.named_parameters():
            x = torch.randint(-8, 9, p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
            loss = loss + IntGrad.apply(p, x)
        return loss


def opt_params(lr: float, correction: bool = False, bits: int = 8) -> dict:
    out = {"lr": lr, "block_size": BLOCK, "min_8bit_size": MIN_8BIT}
    if bits != 8:  # optim_bits=4: Adam's moments in 4 bits each
        out["optim_bits"] = bits
    if correction:  # bf16 masters with a correction byte: 24-bit masters
        out["correction_byte"] = True
    return out


def config(job: dict) -> dict:
    c = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
         "optimizer": {"type": job["optimizer"], "params": opt_params(job.get("lr", 0.05), job.get("correction", False),
                                                                    job.get("bits", 8))},
         "zero_optimization": {"stage": job["stage"]}}
    if job.get("bf16"):
        c["bf16"] = {"enabled": True}
        if job.get("bf16_master"):
            c["bf16"]["bf16_master_weights_and_grads"] = True
    if job.get("universal"):
        c["checkpoint"] = {"load_universal": True}
    c["zero_optimization"].update(job.get("zero", {}))
    return c


def collect_deepspeed(engine, opt):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params, state = {}, {}
    stage = engine.zero_optimization_stage()
    for name, p in engine.module.named_parameters():
        if stage == 0:
            params[name] = p.detach().float().clone()
            state[name] = {k: v.clone() for k, v in opt.dequantized_state(p).items()}
        else:
            params[name] = safe_get_full_fp32_param(p).detach().clone()
            link = getattr(p, "_ds_q8_link", None)  # with a rule per group (Muon), the group's states
            names = opt.rule_of(link.tensor).state_names if link is not None else opt.state_names
            state[name] = {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in names}
    return params, state


def check_state_api(engine, opt, world) -> dict:
    """DeepSpeed's per-parameter state accessors on ds_q8 state: set, read back, and a bad name."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    import ds_q8

    out = {}
    try:  # a name the optimizer does not have: every rank must raise, none may wait in a collective
        safe_get_full_optimizer_state(engine.module.w4, "no_such_state")
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    msgs = [None] * world
    dist.all_gather_object(msgs, msg)
    out["bad_name"] = msgs
    for pname in ("w4", "norm"):
        p = getattr(engine.module, pname)
        link = getattr(p, "_ds_q8_link", None)  # the first state of the parameter's group's rule
        rule = opt.rule_of(link.tensor if link is not None else p)
        name, signed = rule.state_names[0], rule.state_signed[0]
        n = int(getattr(p, "ds_numel", p.numel()))
        shape = tuple(getattr(p, "ds_shape", p.shape))
        base = torch.linspace(-1.0, 1.0, n) ** 3 * 0.01
        value = (base if signed else base.abs()).view(shape)
        safe_set_full_optimizer_state(p, value, name)
        got = safe_get_full_optimizer_state(p, name)
        if pname == "w4":  # 8-bit: the value quantized in the parameter's own blocks
            group = opt._state_group(link.tensor if link is not None else p)
            code = ds_q8.functional.state_map(group["quantization"], signed, "cpu")  # the group's own map
            codes, absmax = ds_q8.functional.quantize_blockwise(value, code, BLOCK)
            want = ds_q8.functional.dequantize_blockwise(codes, absmax, code, BLOCK)
        else:  # fp32 state: exactly the value
            want = value
        out[f"set_get_{pname}"] = float((got.float().cpu() - want).abs().max())
    return out


def run_job(job, rank, world, out_dir):
    import deepspeed
    import ds_q8  # noqa: F401  (registers the types)

    torch.manual_seed(0)
    model = Bag()
    if job.get("bf16"):
        model = model.to(torch.bfloat16)
        model.emb.ds_q8_optim_bits = 32  # .to() keeps Parameter objects, so the mark stays; set again to be sure
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(job))
    opt = engine.optimizer
    while not isinstance(opt, ds_q8.Optimizer8bitBlock):
        opt = opt.optimizer
    import torch.distributed as dist

    if job.get("load"):
        try:
            engine.load_checkpoint(job["load"][0], tag=job["load"][1])
        except Exception as e:  # a job that expects an error records it (on every rank)
            if not job.get("expect_error"):
                raise
            errors = [None] * world
            dist.all_gather_object(errors, f"{type(e).__name__}: {e}")
            if rank == 0:
                torch.save({"errors": errors}, os.path.join(out_dir, f"{job['name']}.pt"))
            return
    start = job.get("start_step", 0)
    for step in range(start, start + job["steps"]):
        loss = engine(torch.tensor([step]))
        engine.backward(loss)
        engine.step()
    if job.get("save"):
        engine.save_checkpoint(job["save"][0], tag=job["save"][1])
    params, state = collect_deepspeed(engine, opt)
    api = check_state_api(engine, opt, world) if job.get("api") else None

    layouts = [None] * world  # what each rank's partitions hold: proof that the sharded path ran
    mine = [{"segments": len(lay.segments), "shared_pieces": len(lay.shared8), "slots": lay.num_slots,
             "fp32_segments": sum(not s.eight_bit for s in lay.segments)} for lay in opt.tensors.layouts.values()]
    dist.all_gather_object(layouts, mine)
    corrections = [None] * world  # correction bytes each rank holds: proof that the option reached its tensors
    dist.all_gather_object(corrections, sum(st["correction"].numel() for st in opt.state.values() if "correction" in st))
    if rank == 0:
        torch.save({"params": params, "state": state, "world": world, "layouts": layouts, "api": api,
                    "correction_bytes": sum(corrections)}, os.path.join(out_dir, f"{job['name']}.pt"))
    if hasattr(engine, "destroy"):
        engine.destroy()


def run_plain(job, out_dir):
    """The same training in a plain PyTorch loop (no DeepSpeed)."""
    import ds_q8

    torch.manual_seed(0)
    model = Bag()
    cls = ds_q8.OPTIMIZERS[job["optimizer"]]
    opt = cls(model.parameters(), **opt_params(job.get("lr", 0.05), bits=job.get("bits", 8)))
    for step in range(job["steps"]):
        opt.zero_grad()
        model(torch.tensor([step])).backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: opt.dequantized_state(p) for n, p in model.named_parameters()}
    torch.save({"params": params, "state": state, "world": 0}, os.path.join(out_dir, f"{job['name']}.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    torch.set_num_threads(1)
    if args.plain:
        for job in plan:
            run_plain(job, args.out)
        return 0
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for job in plan:
        run_job(job, rank, world, args.out)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
