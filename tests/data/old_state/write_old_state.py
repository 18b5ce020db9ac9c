"""Write optimizer state with an older ds_q8, for tests/test_checkpoint_codec.py.

State format 3 names no codec, and two commits wrote it with different signed minifloat maps: 4c6c1cd's
two-zero layout (entries 127 and 128 both zero, 1.0 at 255) and 047c763's one-zero layout (one zero at
127, 1.0 at 254). These files are what each of them wrote, so that the tests load real old checkpoints
rather than state made up to look like them.

Run it with the commit it documents on the path, from a worktree of that commit, with the worktree's own
extension cache (the CPU op builds in about a minute):

    git worktree add --detach /tmp/q8_047 047c763
    cd /tmp/q8_047 && TORCH_EXTENSIONS_DIR=/tmp/q8_047/.ext_cache OMP_NUM_THREADS=1 PYTHONPATH=/tmp/q8_047 \\
        python $CHECKOUT/tests/data/old_state/write_old_state.py $CHECKOUT/tests/data/old_state/047c763

(``$CHECKOUT`` this checkout), and the same with 4c6c1cd. The script refuses to run unless ds_q8 is imported
from a git checkout at one of those two commits. Into the output folder it writes, per case:

  <case>.optim.pt    opt.state_dict(), as torch.save wrote it;
  <case>.ref.pt      what that code decoded (opt.dequantized_state of each parameter), the parameters after
                     training, and the case's settings;

and ``ds/``: a DeepSpeed checkpoint (ZeRO-2, one rank, CPU, gloo) of AdamW8bitBlock, tag ``step4``, with
``ds.ref.pt`` beside it (the engine's flat partition decoded, its fp32 master, the module's parameters).

Cases: AdamW8bitBlock, Lion8bitBlock (with stochastic state rounding) and AdEMAMix8bitBlock on minifloat
maps (the default at 047c763; named explicitly at 4c6c1cd, whose default was dynamic6), AdamW8bitBlock on
dynamic6 (4c6c1cd only), and ``undecidable``: a tensor whose every block is led by a negative first moment
but holds small positive ones, so that the codes alone cannot tell the two layouts apart. The settings that
are not the default: ``min_8bit_size=16``, so that every tensor of the small model keeps 8-bit state, the
learning rates, and Lion's rounding.
"""
import argparse
import os
import socket
import subprocess
import sys

import torch
from torch import nn

import ds_q8

COMMITS = {"4c6c1cd": "4c6c1cde3afac097319e56d54414a9634630b7d7",
           "047c763": "047c7635cfade8184d53d239316a97edfbd93ec8"}
STEPS = 4
SMALL = 16  # min_8bit_size: every tensor of the model keeps 8-bit state


def commit_of_package() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(ds_q8.__file__)))
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    return head.stdout.strip()


def model() -> nn.Module:
    """1788 parameters: 18 + 1 + 9 + 1 blocks of 64 (the last one 12 long)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 12))


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, 24, generator=g)
    return x, torch.sin(x[:, :12] * 3.0)


def train(m: nn.Module, opt, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()


def cases(short: str) -> dict:
    # 4c6c1cd's default map was dynamic6: its minifloat cases name the map
    mini = {"quantization": "minifloat"} if short == "4c6c1cd" else {}
    out = {"adamw": ("AdamW8bitBlock", dict(lr=1e-2, **mini)),
           # stochastic state rounding (the default for bf16 parameters): a block's largest may code one entry low
           "lion": ("Lion8bitBlock", dict(lr=1e-3, stochastic_rounding=True, state_rounding="stochastic", **mini)),
           "ademamix": ("AdEMAMix8bitBlock", dict(lr=1e-2, t_alpha=4, t_beta3=4, **mini))}
    if short == "4c6c1cd":  # its default map, which a format-3 checkpoint names and which loads unchanged
        out["adamw_dynamic6"] = ("AdamW8bitBlock", dict(lr=1e-2, quantization="dynamic6"))
    return out


def write_case(out: str, case: str, cls_name: str, options: dict, commit: str) -> None:
    m = model()
    opt = getattr(ds_q8, cls_name)(m.parameters(), min_8bit_size=SMALL, **options)
    train(m, opt)
    torch.save(opt.state_dict(), os.path.join(out, f"{case}.optim.pt"))
    params = list(m.parameters())
    torch.save({"commit": commit, "optimizer": cls_name, "options": dict(options, min_8bit_size=SMALL),
                "params": [p.detach().clone() for p in params],
                "decoded": [opt.dequantized_state(p) for p in params]}, os.path.join(out, f"{case}.ref.pt"))


def write_undecidable(out: str, commit: str, short: str) -> None:
    """Every block's largest first moment is negative, and each block holds small positive ones: codes above
    127 that the two layouts read differently, and no block that says which layout wrote them."""
    g = torch.Generator().manual_seed(7)
    grad = -(1.0 + torch.rand(512, generator=g))
    grad[::5] = 0.05 * torch.rand(grad[::5].shape, generator=g)  # small positive moments in every block
    w = nn.Parameter(torch.zeros(512))
    options = dict(lr=1e-2, **({"quantization": "minifloat"} if short == "4c6c1cd" else {}))
    opt = ds_q8.AdamW8bitBlock([w], min_8bit_size=SMALL, **options)
    for _ in range(STEPS):
        opt.zero_grad()
        (w * grad).sum().backward()
        opt.step()
    torch.save(opt.state_dict(), os.path.join(out, "undecidable.optim.pt"))
    torch.save({"commit": commit, "optimizer": "AdamW8bitBlock", "options": dict(options, min_8bit_size=SMALL),
                "params": [w.detach().clone()], "grad": grad, "decoded": [opt.dequantized_state(w)]},
               os.path.join(out, "undecidable.ref.pt"))


def write_deepspeed(out: str, commit: str, short: str) -> None:
    """A ZeRO-2 checkpoint of one rank on the CPU (gloo), AdamW8bitBlock on the case's minifloat map."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo")
    params = dict(lr=1e-2, min_8bit_size=SMALL, **({"quantization": "minifloat"} if short == "4c6c1cd" else {}))
    config = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW8bitBlock", "params": params}, "zero_optimization": {"stage": 2}}
    m = model()
    engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config)
    for step in range(STEPS):
        x, y = data(step)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
    folder = os.path.join(out, "ds")
    engine.save_checkpoint(folder, tag=f"step{STEPS}")
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's scripts, not state: keep the files small
        if os.path.exists(os.path.join(folder, script)):
            os.remove(os.path.join(folder, script))
    inner = engine.optimizer.optimizer
    flat = [p for g in inner.param_groups for p in g["params"]]
    # the masters and the module's parameters are in the checkpoint itself
    torch.save({"commit": commit, "config": config, "decoded": [inner.dequantized_state(p) for p in flat]},
               os.path.join(folder, "ds.ref.pt"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    commit = commit_of_package()
    short = next((k for k, v in COMMITS.items() if v == commit), None)
    if short is None:
        print(f"ds_q8 is imported from {ds_q8.__file__} at {commit}; run this at one of {sorted(COMMITS)}",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for case, (cls_name, options) in cases(short).items():
        write_case(args.out, case, cls_name, options, commit)
    write_undecidable(args.out, commit, short)
    if not args.no_deepspeed:
        write_deepspeed(args.out, commit, short)
    print(f"wrote {args.out} at {commit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
