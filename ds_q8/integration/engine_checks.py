"""Refuse ZeRO settings that would silently corrupt 8-bit optimizer state.

The optimizer is built before ZeRO wraps it and never sees the DeepSpeed config, so the check
sits on the engine's step that does the wrapping: it runs on every rank, before any buffer is
allocated, and only when the optimizer being wrapped is a ds_q8 one.

* ``elastic_checkpoint`` (stages 1 and 2): saving cuts every state tensor to the unpadded
  length (block maxima included) and loading hands ranks another rank's copy when shapes
  differ. Changing world size works through universal checkpoints instead.
* NVMe optimizer offload (ZeRO-Infinity): state is swapped through buffers of the parameter's
  dtype and size, which uint8 codes and per-block maxima are not.
* Offload paths that step parameters with an optimizer of DeepSpeed's own instead of the ds_q8 one,
  with fp32 (or bf16) moments: partial offload (ZeRO-3 ``offload_optimizer.ratio`` below 1: the
  sub-groups kept on the accelerator are stepped by a 32-bit ``torch.optim.AdamW``), SuperOffload
  (ZeRO-3 ``offload_optimizer.super_offload``: a ``DeepSpeedCPUAdam`` in a worker process steps
  every sub-group) and ZenFlow (``zero_optimization.zenflow``: a 32-bit ``ZenFlowSelectiveAdamW`` steps the
  gradients' largest columns on the accelerator). Each would train part or all of the model in 32 bits
  while the 8-bit state sat unused. At stages 1 and 2 DeepSpeed itself rejects ``ratio`` below 1 and
  ignores ``super_offload``.

Offload settings that change only where buffers live (``pin_memory``, and the NVMe pipeline and buffer
settings, which DeepSpeed reads only for NVMe) leave the 8-bit state as it is and are accepted.
"""
from __future__ import annotations


class UnsupportedZeroConfig(ValueError):
    """A DeepSpeed ZeRO setting that ds_q8 optimizers cannot work with."""


def check_zero_config(engine, optimizer) -> None:
    from ..optim import Optimizer8bitBlock

    if not isinstance(optimizer, Optimizer8bitBlock):
        return
    name = type(optimizer).__name__
    stage = engine.zero_optimization_stage()
    if stage in (1, 2) and engine.zero_elastic_checkpoint():
        raise UnsupportedZeroConfig(
            f"zero_optimization.elastic_checkpoint=true is not supported with {name}: it truncates and mixes "
            "8-bit state across ranks. Set it to false; to resume at another world size convert the checkpoint "
            "with `python -m ds_q8.checkpoint to-universal` and load it with checkpoint.load_universal=true"
        )
    offload = engine.zero_offload_optimizer()
    device = getattr(offload, "device", None) if offload is not None else None
    if device is not None and str(getattr(device, "value", device)) == "nvme":
        raise UnsupportedZeroConfig(
            f"zero_optimization.offload_optimizer.device=\"nvme\" is not supported with {name}: NVMe swapping "
            "moves optimizer state through fp32 buffers and would corrupt uint8 codes. Use \"cpu\" (8-bit state "
            "in host memory) or \"none\""
        )
    _check_offload_paths(engine, name, stage, offload)


def _check_offload_paths(engine, name: str, stage: int, offload) -> None:
    zenflow = getattr(engine, "zenflow_config", lambda: None)()
    if zenflow is not None:
        raise UnsupportedZeroConfig(
            f"zero_optimization.zenflow is not supported with {name}: ZenFlow steps the gradients' most important "
            "columns with its own 32-bit AdamW (ZenFlowSelectiveAdamW) on the accelerator, outside the 8-bit state. "
            "Remove the zenflow section; \"offload_optimizer\": {\"device\": \"cpu\"} steps the 8-bit state on the CPU"
        )
    if offload is None or stage != 3 or str(getattr(offload.device, "value", offload.device)) != "cpu":
        return
    ratio = getattr(offload, "ratio", 1.0)
    if ratio != 1.0:
        raise UnsupportedZeroConfig(
            f"zero_optimization.offload_optimizer.ratio={ratio} is not supported with {name}: DeepSpeed steps the "
            "sub-groups it keeps on the accelerator with a 32-bit torch.optim.AdamW. The valid value is 1.0 (every "
            "sub-group offloaded and stepped with 8-bit state); without offload, set offload_optimizer.device to "
            "\"none\""
        )
    if getattr(offload, "super_offload", False):
        raise UnsupportedZeroConfig(
            f"zero_optimization.offload_optimizer.super_offload=true is not supported with {name}: SuperOffload "
            "steps every sub-group with its own DeepSpeedCPUAdam (fp32 moments) in a worker process, not with the "
            "8-bit optimizer. "
            "Set it to false: ZeRO-3 offload then steps the 8-bit state on the CPU"
        )


def _master_weights_without_cpu_adam(original):
    """DeepSpeed allows bf16 (or fp16) master weights only with bf16 optimizer states on the
    accelerator or with DeepSpeedCPUAdam under ZeRO-Offload: its validators guard optimizers that
    would keep fp32 moments next to 16-bit masters. A ds_q8 optimizer keeps 8-bit moments whatever
    the masters' dtype, on the accelerator or offloaded, and steps 16-bit masters itself (with
    stochastic rounding), so for it those validators do not apply."""
    def configure(self, *args, **kwargs):
        from ..optim import Optimizer8bitBlock

        if isinstance(getattr(self, "optimizer", None), Optimizer8bitBlock):
            kwargs["fp16_offload_validator"] = None
            kwargs["bf16_offload_validator"] = None
        return original(self, *args, **kwargs)

    return configure
