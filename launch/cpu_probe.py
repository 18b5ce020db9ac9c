"""How fast this CPU runs a GPT's forward and backward in fp32 and in bf16: the measurement launch/compare.py
makes before its first run, to choose what its bf16 runs compute in and how many steps fit its time budget.

    python launch/cpu_probe.py                 # the tiny GPT at the main job's batch (16 x 128 tokens)
    python launch/cpu_probe.py --model gpt2 --micro_batch 1 --context 256

torch has native bf16 matrix products on a CPU only where oneDNN finds AVX-512 with bf16 support (or AMX);
elsewhere (AVX2: AMD Zen 3 and older, most laptops) a bf16 product takes a generic path many times slower
than fp32. Which path a CPU takes is not a matter of its name: the probe times three forward-and-backward
passes of the same model on random tokens, interleaved so that a shared machine's load falls on all three:

* ``fp32``: fp32 weights, fp32 arithmetic (the fp32 runs);
* ``bf16``: bf16 weights, bf16 arithmetic (a bf16 run as on a GPU);
* ``bf16_fp32_compute``: bf16 weights read as fp32 (``gpt_models.compute_in_fp32``; a bf16 run on a CPU
  without native bf16: masters and gradients stay bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, Optional

# as train_gpt.py: OpenMP threads that spin while waiting slow a shared CPU several times (before torch loads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

#: the probe's three passes (the module docstring says what each is)
MODES = ("fp32", "bf16", "bf16_fp32_compute")


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else what Python's platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def onednn_bf16() -> Optional[bool]:
    """Whether torch sends bf16 matrix products to oneDNN here (its native bf16 path); None when torch does not
    say (the check is an internal op of torch's)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


@dataclasses.dataclass
class Probe:
    cpu: str  # cpu_name()
    capability: str  # torch.backends.cpu.get_cpu_capability(): the vector code torch's own kernels run
    onednn_bf16: Optional[bool]
    threads: int  # torch's intra-op threads, as the runs will use them
    seconds: Dict[str, float]  # mode -> seconds of one forward and backward (the fastest of the timed passes)
    shape: str  # the model and batch measured

    @property
    def bf16_slowdown(self) -> float:
        """How many times its fp32 time a bf16 forward and backward takes here."""
        return self.seconds["bf16"] / self.seconds["fp32"]

    def bf16_is_slow(self, factor: float = 2.5) -> bool:
        """Whether a bf16 run should compute in fp32 from its bf16 weights here: where oneDNN has no native bf16
        matrix products, or bf16 measured more than ``factor`` times the fp32 compute (a timing alone can be
        thrown by other jobs on a shared CPU; torch's own answer cannot)."""
        return self.onednn_bf16 is False or self.seconds["bf16"] > factor * self.seconds["bf16_fp32_compute"]

    def describe(self) -> str:
        native = {True: "yes", False: "no", None: "not reported"}[self.onednn_bf16]
        return (f"{self.cpu} ({os.cpu_count()} logical CPUs, {self.threads} torch threads); torch's CPU capability "
                f"{self.capability}, oneDNN bf16 matrix products: {native}; one forward and backward of the "
                f"{self.shape}: fp32 {1e3 * self.seconds['fp32']:.0f} ms, bf16 {1e3 * self.seconds['bf16']:.0f} ms "
                f"({self.bf16_slowdown:.1f}x), bf16 weights computed in fp32 "
                f"{1e3 * self.seconds['bf16_fp32_compute']:.0f} ms")


def measure(model: str = "tiny", context: int = 128, micro_batch: int = 16, vocab_size: int = 256,
            n_layer: Optional[int] = None, passes: int = 5, mode_s: float = 3.0) -> Probe:
    """Time up to ``passes`` forward-and-backward passes in each of :data:`MODES`, round-robin, after one
    untimed pass each (first-call set-up), and keep each mode's fastest: on a shared CPU other jobs only ever
    add time (one busy moment here made a median 25 times the quiet figure). A mode is timed at least once
    and no more once its timed passes add up to ``mode_s``: the slow bf16 path takes seconds a pass and needs
    no more to be told apart."""
    import torch
    import torch.nn.functional as F

    import gpt_models

    config = gpt_models.gpt2_config(model, vocab_size, context, n_layer)
    models = {}
    for mode in MODES:
        torch.manual_seed(0)
        m = gpt_models.build_model(config, dtype=None if mode == "fp32" else torch.bfloat16)
        models[mode] = gpt_models.compute_in_fp32(m) if mode == "bf16_fp32_compute" else m
    tokens = torch.randint(0, vocab_size, (micro_batch, context), generator=torch.Generator().manual_seed(0))

    def one_pass(m) -> float:
        t0 = time.perf_counter()
        logits = m(input_ids=tokens).logits
        F.cross_entropy(logits.float().view(-1, logits.size(-1)), tokens.view(-1)).backward()
        m.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for m in models.values():
        one_pass(m)
    timed = {mode: [] for mode in MODES}
    for _ in range(passes):
        for mode in MODES:
            if sum(timed[mode]) < mode_s:
                timed[mode].append(one_pass(models[mode]))
    shape = f"{model} GPT{f' ({n_layer} layers)' if n_layer else ''}, {micro_batch} x {context} tokens"
    return Probe(cpu=cpu_name(), capability=torch.backends.cpu.get_cpu_capability(), onednn_bf16=onednn_bf16(),
                 threads=torch.get_num_threads(), seconds={k: min(v) for k, v in timed.items()},
                 shape=shape)


def main(argv=None) -> Probe:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--n_layer", type=int, default=None)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--vocab_size", type=int, default=256)
    args = ap.parse_args(argv)
    probe = measure(args.model, args.context, args.micro_batch, args.vocab_size, args.n_layer)
    print(probe.describe())
    return probe


if __name__ == "__main__":
    main()
