"""``launch/train_gpt.py`` with faults injected from outside, as ``DS_Q8_FAULT`` asks (faults.py).

Crash-safety and rank-death tests run this instead of the trainer: the same arguments, the same run,
plus a process that kills (or stops) itself at a named point:

* ``step``: right after optimizer step STEP (DeepSpeed's engine step that ends an accumulation);
* ``mid_step``: inside optimizer step STEP, between the optimizer's first and second parameter group;
* ``mid_save``: while the checkpoint of step STEP is being written (its first file cut in half);
* ``save``: after this rank's files of that checkpoint are flushed, before it is marked complete.
"""
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "launch"))
sys.path.insert(0, str(HERE))

import checkpointing  # noqa: E402
import faults  # noqa: E402
import train_gpt  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def install() -> None:
    real_step, real_save, real_flush = DeepSpeedEngine.step, DeepSpeedEngine.save_checkpoint, checkpointing.flush

    def step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            faults.arm_mid_step(train_gpt.innermost_optimizer(self), self.global_steps + 1, _rank())
        result = real_step(self, *args, **kwargs)
        if boundary:
            faults.at("step", self.global_steps, _rank())
        return result

    def save_checkpoint(self, save_dir, tag=None, client_state=None, *args, **kwargs):
        faults.arm_mid_save(self, (client_state or {}).get("step"), _rank())
        return real_save(self, save_dir, tag, client_state or {}, *args, **kwargs)

    def flush(save_dir, step):
        real_flush(save_dir, step)
        faults.at("save", step, _rank())

    DeepSpeedEngine.step = step
    DeepSpeedEngine.save_checkpoint = save_checkpoint
    checkpointing.flush = flush


if __name__ == "__main__":
    install()
    train_gpt.main()
