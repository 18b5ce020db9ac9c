"""Refuse ZeRO settings that would silently corrupt 8-bit optimizer state.

The optimizer is built before ZeRO wraps it and never sees the DeepSpeed config, so the check
sits on the engine's step that does the wrapping: it runs on every rank, before any buffer is
allocated, and only when the optimizer being wrapped is a ds_q8 one.

* ``elastic_checkpoint`` (stages 1 and 2): saving cuts every state tensor to the unpadded
  length (block maxima included) and loading hands ranks another rank's copy when shapes
  differ. Changing world size works through universal checkpoints instead.
* NVMe optimizer offload (ZeRO-Infinity): state is swapped through buffers of the parameter's
  dtype and size, which uint8 codes and per-block maxima are not.
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
