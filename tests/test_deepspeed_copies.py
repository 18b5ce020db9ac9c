"""The pieces of DeepSpeed logic that ds_q8 copies, against what DeepSpeed itself does on a real engine
(the list to review at each DeepSpeed release is in docs/deepspeed.md):

* ``grad_norm.engine_clips_fp32``: the engine's condition for clipping fp32 gradients itself
  (``DeepSpeedEngine._take_model_step``), against whether the engine's step calls its clip;
* the clip that ``grad_norm`` puts in place of ``DeepSpeedEngine.clip_fp32_gradients``: the same
  gradients, bit for bit, as the engine's own method, and the norm it computed kept;
* ``ds_q8.optim.muon.tag_muon``: the ``use_muon`` tags of ``deepspeed.set_optimizer_flags`` for
  ``"type": "Muon"``.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

deepspeed = pytest.importorskip("deepspeed")

from ds_q8.integration import engine_hooks, grad_norm  # noqa: E402
from ds_q8.optim.muon import tag_muon  # noqa: E402

from helpers.ds_launch import free_port  # noqa: E402


@pytest.fixture(scope="module")
def one_rank():
    import os

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _engine(clip=1.0, stage=0, bf16=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip,
           "optimizer": {"type": "Adam8bitBlock", "params": {"lr": 1e-3, "min_8bit_size": 256, "impl": "reference"}},
           "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _backward(engine, scale=100.0):
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(4, 32, dtype=dtype)
    engine.backward(engine(x).float().pow(2).mean() * scale)  # a norm well above the clip


@pytest.mark.parametrize("clip,stage,bf16", [(1.0, 0, False), (0.0, 0, False), (1.0, 1, False), (1.0, 2, True)])
def test_the_clip_condition_is_the_engines(one_rank, clip, stage, bf16):
    engine = _engine(clip, stage, bf16)
    calls = []
    own = engine.clip_fp32_gradients
    engine.clip_fp32_gradients = lambda: calls.append(own())
    _backward(engine)
    engine.step()
    assert bool(calls) == grad_norm.engine_clips_fp32(engine)


def test_the_clip_is_the_engines_bit_for_bit(one_rank):
    engine = _engine()
    assert "clip_fp32_gradients" in vars(engine)  # ds_q8's clip is in place on this engine
    _backward(engine)
    params = [p for p in engine.module.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    type(engine).clip_fp32_gradients(engine)  # DeepSpeed's own method
    theirs = [p.grad.clone() for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    engine.clip_fp32_gradients()
    assert all(torch.equal(a, p.grad) for a, p in zip(theirs, params))
    assert not all(torch.equal(a, g) for a, g in zip(theirs, grads))  # it clipped
    norm = engine.optimizer.grad_norm_source()
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    assert engine.optimizer.grad_norm_source() is None  # for one step only


def _deepspeed_set_optimizer_flags():
    flags = deepspeed.set_optimizer_flags
    while engine_hooks.installed(flags):  # DeepSpeed's own, under ds_q8's wrapper if it is installed
        flags = flags.__wrapped__
    return flags


def _muon_model():
    model = nn.ModuleDict({"embed_tokens": nn.Embedding(50, 16), "layer": nn.Linear(16, 16),
                           "norm": nn.LayerNorm(16), "conv": nn.Conv1d(4, 4, 3), "lm_head": nn.Linear(16, 50),
                           "Embedding_proj": nn.Linear(16, 16, bias=False)})
    partitioned = nn.Parameter(torch.zeros(0))
    partitioned.ds_shape = torch.Size([16, 16])  # a ZeRO-3 placeholder: tagged by its layer's shape
    model.register_parameter("partitioned", partitioned)
    return model


def test_the_muon_tags_are_deepspeeds():
    theirs = _muon_model()
    _deepspeed_set_optimizer_flags()(SimpleNamespace(optimizer_name="muon", optimizer_params={}), theirs)
    tags = tag_muon(_muon_model())
    assert tags == {name: p.use_muon for name, p in theirs.named_parameters()}
    assert set(tags.values()) == {True, False}
