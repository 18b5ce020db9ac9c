"""The non-finite check of a ds_q8 step, answered by the gradient norm that DeepSpeed already computed.

A ds_q8 step first makes sure that no gradient holds a NaN or Inf (``nonfinite="skip"``, see
``optim/nonfinite.py``), which on its own costs one read of every gradient. With gradient clipping
(DeepSpeed's default, 1.0) the engine has just computed the global gradient norm over all ranks,
and that norm is finite exactly when every gradient element is. This module hands that norm to the
optimizer (``Optimizer8bitBlock.grad_norm_source``) for the step it belongs to:

* ZeRO stages 1-3 and DeepSpeed's bf16 optimizer compute it inside their ``step()``, before they
  call the ds_q8 step: the norm is read while that ``step()`` runs, and only then;
* without ZeRO or 16-bit training the engine clips fp32 gradients itself and drops the norm: the
  clip below keeps it for the one ds_q8 step that follows.

Where no norm was computed (no clipping, other wrappers), the optimizer reads the gradients as before.

Two pieces of this module are copies of DeepSpeed engine logic, marked ``COPY OF DEEPSPEED`` below:
:func:`engine_clips_fp32` (when the engine clips fp32 gradients itself) and the clip that
:func:`_from_fp32_clip` puts in place of the engine's. ``tests/test_deepspeed_copies.py`` checks both
against the engine's own behaviour, and ``docs/deepspeed.md`` lists them for review at each DeepSpeed
release.
"""
from __future__ import annotations

import functools

from .lookup import ds_q8_optimizer


def _ds_q8_optimizer(engine):
    # the engine's optimizer or the one its wrapper steps directly: only a wrapper that calls the ds_q8
    # step itself computed the norm of the very gradients that step reads
    return ds_q8_optimizer(engine, depth=2)


def _wrappers():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer


def _from_wrapper(wrapper, opt) -> None:
    inside = [False]
    original = wrapper.step

    @functools.wraps(original)
    def step(*args, **kwargs):
        inside[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] = False

    wrapper.step = step  # this engine's wrapper only
    # the wrapper sets _global_grad_norm before it calls the ds_q8 step; None where it computed none
    opt.grad_norm_source = lambda: getattr(wrapper, "_global_grad_norm", None) if inside[0] else None


def engine_clips_fp32(engine) -> bool:
    """Whether the engine clips fp32 gradients itself (``clip_fp32_gradients``) before each step."""
    # COPY OF DEEPSPEED: the condition in DeepSpeedEngine._take_model_step (deepspeed/runtime/engine.py),
    # as of DeepSpeed 0.19.8
    return engine.gradient_clipping() > 0.0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()
                                                      or engine.zero_optimization())


def _from_fp32_clip(engine, opt) -> None:
    from deepspeed.runtime.utils import clip_grad_norm_

    pending = {}

    def clip_fp32_gradients():
        # COPY OF DEEPSPEED: the body of DeepSpeedEngine.clip_fp32_gradients (deepspeed/runtime/engine.py), as of
        # DeepSpeed 0.19.8, which drops the norm that clip_grad_norm_ returns; this keeps it for the next step
        pending["norm"] = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                                          mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients
    opt.grad_norm_source = lambda: pending.pop("norm", None)


def attach(engine) -> bool:
    """Give the engine's ds_q8 optimizer the engine's gradient norm; False where it has none to give."""
    opt = _ds_q8_optimizer(engine)
    if opt is None:
        return False
    outer = engine.optimizer
    if outer is opt:
        if engine_clips_fp32(engine):
            _from_fp32_clip(engine, opt)
            return True
        return False
    if isinstance(outer, _wrappers()):
        _from_wrapper(outer, opt)
        return True
    return False


def _attach_hook(engine, result, *args, **kwargs) -> None:
    attach(engine)
