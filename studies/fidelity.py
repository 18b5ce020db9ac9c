"""Per-matrix fidelity on real models: every weight matrix's update against torch's AdamW.

Each optimizer trains the same model (built from a transformers config, never downloaded) from the same
weights on the same batches of real text (the standard library's source, byte vocabulary) for a few
steps; then, per weight matrix, the update ``p - p0`` is compared with torch's: its cosine and its norm
ratio. The lowest cosine over the matrices is the figure that matters: a matrix that one quantization
block spans across two parts of a fused projection shows there first (GPT-2's Conv1D ``c_attn`` holds
query, key and value columns side by side in each row; GPT-NeoX's ``query_key_value`` is an nn.Linear
of [3n, n] whose parts are rows).

For ds_q8 rows it also counts first moments that the 8-bit state lost: elements whose first moment is
stored as zero while torch's is not small against the element's own gradient scale
(``|m| > 0.3 sqrt(v)``, both torch's). Such zeros are rare even where blocks mix (rounding to nearest
stores a value as zero only below 2.5e-4 of its block's maximum on the minifloat map, 2.8e-6 on
dynamic6's, 2.8e-7 on the dynamic map): what mixing costs is coarse codes, which the cosine shows. A single one comes from an
element whose first moment passes near zero while its gradient scale is about as small, so that 8-bit's
rounding error over a few steps is as large as the moment itself (GPT-2 at 1600, 8 steps: one of 31
million, at 0.003 of its block's maximum and |m| = 0.32 sqrt(v)); a map that loses first moments
systematically loses millions (4-bit states: 1.2 million of those 31 million).

    python studies/fidelity.py                                   # GPT-2 at widths 128, 768 and 1600
    python studies/fidelity.py --arch neox --widths 768 --optimizers ds_q8 ds_q8:bs2048
    python studies/fidelity.py --optimizers lion8 lamb8 ademamix8 muon8  # the family against their 32-bit twins
    python studies/fidelity.py maps --out studies/results/maps/arith_768.json q8 q8:m=e4m3   # rows into a JSON

Optimizers: ``torch`` (torch.optim.AdamW, the reference, always run), ``ds_q8`` (AdamW8bitBlock at its
defaults, but with ``embeddings_32bit=False``: every matrix in 8 bits, the embeddings' too), ``ds_q8:bsN`` (block_size=N), ``ds_q8:4bit`` (``optim_bits=4``), ``ds_q8:R`` for a
``state_rounding`` R (``ds_q8:nearest``, ``ds_q8:stochastic``, ...), ``ds_q8:Q`` for a ``quantization`` Q
(``ds_q8:dynamic6``), ``ds_q8:ref`` (``impl="reference"``),
``bnb`` (bitsandbytes' AdamW8bit, when installed). ``lion8``,
``lamb8``, ``ademamix8`` and ``muon8`` compare Lion8bitBlock, LAMB8bitBlock, AdEMAMix8bitBlock and
Muon8bitBlock (its matrices at ``muon_lr`` 0.02, the rest at ``--lr``) with the same class at
``optim_bits=32`` (their 32-bit twin) instead of torch's AdamW; ``:bsN`` works for them too.
``q4[:m=...][:v=...]`` is AdamW with 4-bit states simulated in plain PyTorch (``studies/lowbit_sim.py``
names the variants), ``q8[:m=MAP][:v=MAP]`` the same at 8 bits with ds_q8's block 64 and guided rounding
on arithmetic-friendly maps (``studies/arith_maps.py``), ``torchao4``/``torchao8`` torchao's AdamW4bit/AdamW8bit (when torchao is installed):

    python studies/fidelity.py --optimizers torchao4 q4 "q4:m=lin0,vb64,n:v=log5h,b64f,n"

``--weight-decay 0.1 --decay matrices`` decays the weight matrices only (GPT-2's usual setting), ``--warmup W``
raises the learning rate linearly over the first W steps (``lr * (step + 1) / W``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "launch")]  # the studies, then the trainer's modules
import arith_maps  # noqa: E402
import gpt_data  # noqa: E402
import gpt_models  # noqa: E402
import lowbit_sim  # noqa: E402

VOCAB = gpt_data.BYTE_VOCAB_SIZE
#: default layers per width: enough matrices to show mixing, few enough to run on a laptop CPU
LAYERS = {128: 2, 768: 4, 1600: 2}
FAMILY = {"lion8": "Lion8bitBlock", "lamb8": "LAMB8bitBlock", "ademamix8": "AdEMAMix8bitBlock",
          "muon8": "Muon8bitBlock"}
#: Muon's rate for its matrices (the other parameters take --lr): Muon's usual 0.02, the configs' peak
MUON_LR = 0.02
#: |m| above this fraction of sqrt(v) is not small against the element's own gradient scale
M_LOST_FRACTION = 0.3


def build(arch: str, width: int, layers: int, context: int, seed: int) -> torch.nn.Module:
    """GPT-2 (Conv1D, fused q/k/v columns) or GPT-NeoX (nn.Linear, fused q/k/v rows), fresh weights."""
    torch.manual_seed(seed)
    heads = max(1, width // 64)
    if arch == "gpt2":
        return gpt_models.build_model(gpt_models.gpt2_config_of(layers, heads, width, VOCAB, context))
    if arch == "neox":
        from transformers import AutoModelForCausalLM, GPTNeoXConfig

        config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers,
                               num_attention_heads=heads, intermediate_size=4 * width,
                               max_position_embeddings=context, bos_token_id=0, eos_token_id=0,
                               tie_word_embeddings=False)
        return AutoModelForCausalLM.from_config(config)
    raise ValueError(f"--arch must be gpt2 or neox, got {arch!r}")


def state_roundings() -> Tuple[str, ...]:
    from ds_q8.optim.group_options import STATE_ROUNDINGS

    return STATE_ROUNDINGS


def quantizations() -> Tuple[str, ...]:
    from ds_q8.optim.group_options import QUANTIZATIONS

    return QUANTIZATIONS


def split(name: str) -> Tuple[str, Dict[str, int]]:
    if name.startswith("q4"):
        return "q4", dict(spec=lowbit_sim.parse(name))
    if name.startswith("q8"):
        return "q8", dict(spec=arith_maps.parse(name))
    if name in ("torchao4", "torchao8"):
        return name, {}
    base, *changes = name.split(":")
    options = {}
    for c in changes:
        if c == "4bit" and base == "ds_q8":
            options["optim_bits"] = 4
            continue
        if c in state_roundings() and base != "bnb":
            options["state_rounding"] = c
            continue
        if c in quantizations() and base != "bnb":
            options["quantization"] = c
            continue
        if c == "ref" and base != "bnb":
            options["impl"] = "reference"
            continue
        if not c.startswith("bs") or not c[2:].isdigit():
            raise ValueError(f"optimizer {name!r}: unknown change {c!r} (bsN sets block_size=N; ds_q8:4bit optim_bits=4; "
                             f"a state_rounding of {state_roundings()}; a quantization of {quantizations()}; "
                             f"ref: impl='reference')")
        options["block_size"] = int(c[2:])
    if base not in ("torch", "ds_q8", "bnb") + tuple(FAMILY):
        raise ValueError(f"optimizer {name!r}: must be torch, ds_q8, bnb, {', '.join(FAMILY)} (with :bsN)")
    return base, options


def make(name: str, lr: float, weight_decay: float, bits: int = 8) -> Callable:
    base, options = split(name)
    if base == "torch":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, foreach=False)
    if base == "q4":
        return lambda ps: lowbit_sim.SimAdamW4(ps, lr=lr, weight_decay=weight_decay, **options)
    if base == "q8":
        return lambda ps: arith_maps.SimAdamW8(ps, lr=lr, weight_decay=weight_decay, **options)
    if base.startswith("torchao"):
        import torchao.optim

        cls = torchao.optim.AdamW4bit if base == "torchao4" else torchao.optim.AdamW8bit
        return lambda ps: cls(ps, lr=lr, weight_decay=weight_decay)
    if base == "bnb":
        import bitsandbytes as bnb

        return lambda ps: bnb.optim.AdamW8bit(ps, lr=lr, weight_decay=weight_decay)
    import ds_q8

    cls = ds_q8.AdamW8bitBlock if base == "ds_q8" else getattr(ds_q8, FAMILY[base])
    # every matrix in the codec under study, the token embedding (and the head tied to it) included
    options.setdefault("embeddings_32bit", False)
    if base == "muon8":  # the matrices' momentum under Muon's rate, the rest under AdamW's
        return lambda ps: cls(ps, muon_lr=MUON_LR, adam_lr=lr, weight_decay=weight_decay, optim_bits=bits, **options)
    options.setdefault("optim_bits", bits)
    return lambda ps: cls(ps, lr=lr, weight_decay=weight_decay, **options)


#: which parameters ``weight_decay`` applies to: all of them, or the weight matrices only (``p.dim() >= 2``)
DECAY = ("all", "matrices")


def param_groups(model, weight_decay: float, decay: str = "all"):
    """The optimizer's parameters (each optimizer's ``weight_decay`` applies to all), or two groups: the
    matrices decayed and the rest (biases, norms, gains) not."""
    if decay == "all":
        return list(model.parameters())
    if decay != "matrices":
        raise ValueError(f"decay must be one of {DECAY}, got {decay!r}")
    params = list(model.parameters())
    return [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
            dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up over the first ``warmup`` steps, then ``lr``."""
    return lr * (step + 1) / warmup if step < warmup else lr


def train(model_fn, make_opt, text, steps: int, batch: int, context: int, seed: int, weight_decay: float = 0.01,
          decay: str = "all", warmup: int = 0, lr: Optional[float] = None,
          after_step: Optional[Callable] = None):
    """The model after ``steps`` steps, its initial weights and the optimizer (``lr`` is needed for ``warmup``);
    ``after_step(step, model, opt)`` is called after each step (``step`` counts from 1)."""
    model = model_fn()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(param_groups(model, weight_decay, decay))
    for step in range(steps):
        if warmup:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr, warmup)
        x, y = gpt_data.get_batch(text, batch, context, seed, 0, step)
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(step + 1, model, opt)
    return model, init, opt


def lost_first_moments(ref_opt, ref_model, opt, model) -> Dict[str, int]:
    """Per matrix: elements whose first moment ``opt`` stores as zero while torch's ``|m| > 0.3 sqrt(v)``."""
    import ds_q8

    if not isinstance(opt, ds_q8.Optimizer8bitBlock):
        return {}
    ref_params, params = dict(ref_model.named_parameters()), dict(model.named_parameters())
    out = {}
    for n, p in params.items():
        if p.dim() != 2 or "exp_avg" not in opt.rule_of(p).state_names:
            continue
        st = ref_opt.state[ref_params[n]]
        m = opt.dequantized_state(p)["exp_avg"].reshape(-1)
        big = st["exp_avg"].reshape(-1).abs() > M_LOST_FRACTION * st["exp_avg_sq"].reshape(-1).sqrt()
        out[n] = int(((m == 0) & big).sum())
    return out


def compare(ref, ref_init, ours) -> List[dict]:
    """Per weight matrix: cosine and norm ratio of the update against the reference's."""
    ref_params, params = dict(ref.named_parameters()), dict(ours.named_parameters())
    rows = []
    for n, p in ref_params.items():
        if p.dim() != 2:
            continue
        u_ref = (p.detach() - ref_init[n]).reshape(-1)
        u = (params[n].detach() - ref_init[n]).reshape(-1)
        rows.append(dict(matrix=n, cosine=float(torch.nn.functional.cosine_similarity(u, u_ref, dim=0)),
                         norm_ratio=float(u.norm() / u_ref.norm())))
    return rows


def run(arch: str, width: int, layers: int, optimizers: List[str], steps: int = 25, lr: float = 6e-4,
        weight_decay: float = 0.01, batch: int = 16, context: int = 64, seed: int = 0, text=None,
        decay: str = "all", warmup: int = 0) -> List[dict]:
    """One row per optimizer: its lowest and median per-matrix cosine (and the lowest's matrix), the norm
    ratios' range and the first moments lost, against torch's AdamW (or the class's own 32-bit twin for
    the family)."""
    if text is None:
        text, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    model_fn = lambda: build(arch, width, layers, context, seed)  # noqa: E731
    refs: Dict[str, tuple] = {}
    rows = []
    for name in optimizers:
        base, options = split(name)
        ref_name = base + "@32" if base in FAMILY else "torch"
        if ref_name not in refs:
            make_ref = make("torch", lr, weight_decay) if ref_name == "torch" else make(base, lr, weight_decay, 32)
            refs[ref_name] = train(model_fn, make_ref, text, steps, batch, context, seed, weight_decay, decay, warmup, lr)
        ref, ref_init, ref_opt = refs[ref_name]
        if name == "torch":
            continue
        t0 = time.time()
        model, _, opt = train(model_fn, make(name, lr, weight_decay), text, steps, batch, context, seed, weight_decay,
                              decay, warmup, lr)
        per = compare(ref, ref_init, model)
        elements = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        lost = lost_first_moments(ref_opt, ref, opt, model) if ref_name == "torch" else {}
        worst = min(per, key=lambda r: r["cosine"])
        rows.append(dict(arch=arch, width=width, layers=layers, optimizer=name, reference=ref_name,
                         steps=steps, lr=lr, weight_decay=weight_decay, decay=decay, warmup=warmup,
                         min_cosine=worst["cosine"], worst_matrix=worst["matrix"],
                         median_cosine=statistics.median(r["cosine"] for r in per),
                         norm_ratio_lo=min(r["norm_ratio"] for r in per), norm_ratio_hi=max(r["norm_ratio"] for r in per),
                         m_lost=sum(lost.values()) if lost else None, matrix_elements=elements, per_matrix=per,
                         lost_per_matrix=lost,
                         seconds=round(time.time() - t0, 1)))
        del model, opt
    return rows


def table(rows: List[dict]) -> str:
    head = ["model", "optimizer", "against", "lowest cosine (matrix)", "median cosine", "norm ratio range",
            "first moments lost"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        short = r["worst_matrix"].replace("transformer.", "").replace("gpt_neox.layers.", "layers.")
        lost = "" if r["m_lost"] is None else str(r["m_lost"])
        lines.append(f"| {r['arch']} {r['width']} ({r['layers']}) | {r['optimizer']} | {r['reference']} | "
                     f"{r['min_cosine']:.5f} (`{short}`) | {r['median_cosine']:.5f} | "
                     f"{r['norm_ratio_lo']:.4f} - {r['norm_ratio_hi']:.4f} | {lost} |")
    return "\n".join(lines) + "\n"


def maps_run(args) -> int:
    """``maps``: variants of ``studies/arith_maps.py`` (or any optimizer here) against torch's AdamW, the
    reference's run kept in ``--cache`` between calls, rows added to (or replaced in) ``--out`` by name."""
    torch.set_num_threads(args.threads)
    text, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    layers = args.layers
    model_fn = lambda: build("gpt2", args.width, layers, args.context, args.seed)  # noqa: E731
    fit = lambda make_opt: train(model_fn, make_opt, text, args.steps, args.batch, args.context,  # noqa: E731
                                 args.seed, args.weight_decay, "matrices", args.warmup, args.lr)
    key = f"w{args.width}_l{layers}_s{args.steps}_wu{args.warmup}_lr{args.lr:g}_wd{args.weight_decay:g}"
    cache = os.path.join(args.cache, key + ".pt")
    if os.path.exists(cache):
        saved = torch.load(cache)
        ref = model_fn()
        ref.load_state_dict(saved["final"])
        ref_init = saved["init"]
    else:
        t0 = time.time()
        ref, ref_init, _ = fit(make("torch", args.lr, args.weight_decay))
        os.makedirs(args.cache, exist_ok=True)
        torch.save(dict(final=ref.state_dict(), init=ref_init), cache)
        print(f"reference trained in {time.time() - t0:.0f} s", flush=True)
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    for name in args.names:
        t0 = time.time()
        model, _, _ = fit(make(name, args.lr, args.weight_decay))
        per = compare(ref, ref_init, model)
        worst = min(per, key=lambda r: r["cosine"])
        spec = arith_maps.parse(name) if name.startswith("q8") else dict(m=name, v=name, rule=None, seed=None)
        row = dict(optimizer=name, m_map=spec["m"], v_map=spec["v"], bits_seed=spec["seed"], width=args.width, layers=layers,
                   steps=args.steps, lr=args.lr, weight_decay=args.weight_decay, decay="matrices",
                   warmup=args.warmup, block=arith_maps.BLOCK, rounding="guided", m_rule=spec.get("rule"), min_cosine=worst["cosine"],
                   worst_matrix=worst["matrix"], median_cosine=statistics.median(r["cosine"] for r in per),
                   per_matrix=per, seconds=round(time.time() - t0, 1))
        rows = [r for r in rows if r["optimizer"] != name] + [row]
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"| {args.width} ({layers}) wu{args.warmup} | {name} | {row['min_cosine']:.5f} "
              f"(`{worst['matrix'].replace('transformer.', '')}`) | {row['median_cosine']:.5f} | {row['seconds']} s |",
              flush=True)
        del model
    return 0


def maps_main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="fidelity.py maps", description=maps_run.__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="q8[:m=MAP][:v=MAP][:rule=RULE][:seed=N], or any optimizer here (ds_q8, ...)")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="out/arith_maps_ref", help="where the reference run is kept between calls")
    ap.add_argument("--out", required=True, help="results JSON (rows are added or replaced by name)")
    return maps_run(ap.parse_args(argv))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["maps"]:
        return maps_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "neox"])
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 768, 1600])
    ap.add_argument("--layers", type=int, help="layers at every width (default: 2 at 128 and 1600, 4 at 768)")
    ap.add_argument("--optimizers", nargs="+", default=["ds_q8", "ds_q8:bs2048", "bnb"])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--decay", default="all", choices=DECAY, help="the parameters weight decay applies to")
    ap.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up (0: none)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="out/fidelity", help="output folder (fidelity.md, fidelity.json)")
    args = ap.parse_args(argv)
    for name in args.optimizers:
        try:
            split(name)
        except ValueError as e:
            ap.error(str(e))
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.weight_decay < 0:
        ap.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    for key in ("steps", "batch", "context", "threads"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.lr <= 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    names = list(args.optimizers)
    if "bnb" in names:
        try:
            import bitsandbytes  # noqa: F401
        except Exception:
            print("bitsandbytes is not installed: its rows are left out (pip install bitsandbytes)")
            names.remove("bnb")
    torch.set_num_threads(args.threads)
    text, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    rows = []
    for width in args.widths:
        layers = args.layers or LAYERS.get(width, 2)
        rows += run(args.arch, width, layers, names, args.steps, args.lr, args.weight_decay, args.batch, args.context,
                    args.seed, text, args.decay, args.warmup)
        print(table([r for r in rows if r["width"] == width]), flush=True)
    decayed = "the weight matrices" if args.decay == "matrices" else "every parameter"
    warm = f"{args.warmup} steps of linear warm-up" if args.warmup else "no warm-up"
    header = (f"{args.arch}, byte vocabulary, the standard library's source, AdamW lr {args.lr:g} ({warm}), betas 0.9/0.999, "
              f"weight decay {args.weight_decay:g} on {decayed}, {args.steps} steps of batch {args.batch} x context {args.context}, seed {args.seed}; "
              "per weight matrix the update's cosine and norm ratio against the reference's.\n\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fidelity.md"), "w") as f:
        f.write(header + table(rows))
    with open(os.path.join(args.out, "fidelity.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(header + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
