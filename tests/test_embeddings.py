"""Embeddings keep 32-bit state by default (the group option ``embeddings_32bit``), also in a plain
``model.parameters()``: the marks their modules set (``ds_q8.embeddings``) in plain PyTorch, a model built
before ``import ds_q8``, tied weights, explicit groups winning, the one log line, checkpoints written before
the option, and ``deepspeed.initialize`` marking by name. Two ranks under ZeRO: ``test_deepspeed_zero.py``."""
import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_q8
from ds_q8 import embeddings
from ds_q8.embeddings import EMBEDDING_ATTR

from helpers.ds_launch import free_port

REPO = Path(__file__).resolve().parents[1]
MIN = 1024  # every matrix below reaches it: only the option decides the embeddings' bits


class TinyGPT(nn.Module):
    def __init__(self, tied: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, 32), nn.Embedding(48, 32)
        self.fc = nn.Linear(32, 64)
        self.head = nn.Linear(32, 64, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        return self.head(h) + self.fc(h)


def eight_bit(opt, model) -> dict:
    """name -> whether the parameter's state is 8-bit, read from the state a step created."""
    x = torch.randint(0, 64, (2, 8))
    model(x).square().mean().backward()
    opt.step()
    return {n: "state1" in opt.state[p] for n, p in model.named_parameters() if p.dim() == 2}


def test_embeddings_keep_32bit_state_from_model_parameters():
    model = TinyGPT()
    assert model.wte.weight.ds_q8_embedding == "Embedding.weight"
    opt = ds_q8.AdamW8bitBlock(model.parameters(), lr=1e-3, min_8bit_size=MIN)
    assert opt.param_groups[0]["embeddings_32bit"] is True
    # the tied head is the token embedding itself: one tensor, listed once
    assert eight_bit(opt, model) == {"wte.weight": False, "wpe.weight": False, "fc.weight": True}
    assert set(opt.state[model.wte.weight]) == {"step", "state1_fp32", "state2_fp32"}


def test_the_option_keeps_them_at_the_groups_bits():
    model = TinyGPT()
    opt = ds_q8.AdamW8bitBlock(model.parameters(), lr=1e-3, min_8bit_size=MIN, embeddings_32bit=False)
    assert eight_bit(opt, model) == {"wte.weight": True, "wpe.weight": True, "fc.weight": True}


@pytest.mark.parametrize("name", sorted(ds_q8.OPTIMIZERS))
def test_every_optimizer_takes_the_option(name):
    cls = ds_q8.OPTIMIZERS[name]
    model = TinyGPT()
    for flag, expected in ((True, False), (False, True)):
        opt = cls(model.parameters(), min_8bit_size=MIN, embeddings_32bit=flag)
        assert opt.layout_of(model.wpe.weight).segments[0].eight_bit is expected
        assert opt.layout_of(model.fc.weight).segments[0].eight_bit is True


def test_an_untied_head_is_no_embedding():
    model = TinyGPT(tied=False)
    assert getattr(model.head.weight, EMBEDDING_ATTR, None) is None
    opt = ds_q8.AdamW8bitBlock(model.parameters(), lr=1e-3, min_8bit_size=MIN)
    assert eight_bit(opt, model) == {"wte.weight": False, "wpe.weight": False, "fc.weight": True, "head.weight": True}


def test_a_weight_an_embedding_adopts_is_marked():
    head = nn.Linear(32, 64, bias=False)
    emb = nn.Embedding(64, 32)
    emb.weight = head.weight  # tied the other way round: the embedding registers the head's weight
    assert getattr(head.weight, EMBEDDING_ATTR, None) == "Embedding.weight"


def test_explicit_groups_win():
    model = TinyGPT()
    groups = ds_q8.param_groups(model, weight_decay=0.1)
    assert eight_bit(ds_q8.AdamW8bitBlock(groups, min_8bit_size=MIN), model) == \
        {"wte.weight": False, "wpe.weight": False, "fc.weight": True}
    groups = ds_q8.param_groups(model, weight_decay=0.1, embeddings_32bit=False)
    assert all(g["embeddings_32bit"] is False for g in groups)
    assert eight_bit(ds_q8.AdamW8bitBlock(groups, min_8bit_size=MIN), model) == \
        {"wte.weight": True, "wpe.weight": True, "fc.weight": True}
    # a group that chose its own optim_bits keeps them for its embeddings, unless it asks for 32 bits
    opt = ds_q8.AdamW8bitBlock([{"params": [model.wte.weight, model.fc.weight], "optim_bits": 8},
                                {"params": [model.wpe.weight, model.fc.bias], "optim_bits": 8,
                                 "embeddings_32bit": True}], min_8bit_size=MIN)
    assert [g["embeddings_32bit"] for g in opt.param_groups] == [False, True]
    assert eight_bit(opt, model) == {"wte.weight": True, "wpe.weight": False, "fc.weight": True}
    # the constructor's optim_bits is no group's own choice
    opt = ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN, optim_bits=8)
    assert eight_bit(opt, model)["wte.weight"] is False


def test_the_log_says_it_once(caplog, monkeypatch):
    monkeypatch.setattr(embeddings, "_said", set())
    model = TinyGPT()
    with caplog.at_level(logging.WARNING, logger="ds_q8"):
        for _ in range(2):
            ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN)
        ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN, embeddings_32bit=False)
        ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=10 ** 6)  # 32-bit anyway: nothing to say
    lines = [r.getMessage() for r in caplog.records if r.name == "ds_q8"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "AdamW8bitBlock keeps 32-bit state for 2 embedding parameter(s)" in line
    assert "Embedding.weight [64, 32], Embedding.weight [48, 32]" in line and "3,584 elements" in line
    assert "plateau" in line and "embeddings_32bit=False" in line and "docs/usage.md#embeddings" in line


def test_a_group_added_later_is_said_too(caplog, monkeypatch):
    monkeypatch.setattr(embeddings, "_said", set())
    model = TinyGPT()
    with caplog.at_level(logging.WARNING, logger="ds_q8"):
        opt = ds_q8.Adam8bitBlock([model.fc.weight], min_8bit_size=MIN)
        assert not caplog.records
        opt.add_param_group({"params": [model.wpe.weight]})
    assert [r.getMessage().count("Embedding.weight [48, 32]") for r in caplog.records] == [1]


def run_fresh(code: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-c", code, str(free_port())], capture_output=True, text=True, cwd=REPO,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_a_model_built_before_import_is_recognised_and_a_later_deepcopy_is_not():
    out = run_fresh(r"""
import copy, torch
model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
import ds_q8
opt = ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=1024)
print("before import:", [opt.layout_of(p).segments[0].eight_bit for p in model.parameters()])
twin = copy.deepcopy(model)  # torch copies parameters without their attributes
opt = ds_q8.AdamW8bitBlock(twin.parameters(), min_8bit_size=1024)
print("deepcopy:", [opt.layout_of(p).segments[0].eight_bit for p in twin.parameters()])
opt = ds_q8.AdamW8bitBlock(ds_q8.param_groups(twin), min_8bit_size=1024)
print("param_groups:", [opt.layout_of(p).segments[0].eight_bit for p in twin.parameters()])
""")
    assert "before import: [False, True, False]" in out
    assert "deepcopy: [True, True, False]" in out
    assert "param_groups: [False, True, False]" in out


def test_a_checkpoint_written_before_the_option_resumes_with_it_off():
    model = TinyGPT()
    opt = ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN, embeddings_32bit=False)
    eight_bit(opt, model)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:  # as ds_q8 wrote it before the option existed
        del g["embeddings_32bit"]
    with pytest.raises(ValueError, match=r"8-bit there, 32-bit here\).*embeddings_32bit=False to resume it"):
        ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN).load_state_dict(copy.deepcopy(sd))
    again = ds_q8.AdamW8bitBlock(model.parameters(), min_8bit_size=MIN, embeddings_32bit=False)
    again.load_state_dict(sd)
    assert "embeddings_32bit" not in again.param_groups[0]  # the saved group, as torch loads it
    assert eight_bit(again, model) == {"wte.weight": True, "wpe.weight": True, "fc.weight": True}


def test_deepspeed_initialize_marks_embeddings_by_name():
    """One rank, ZeRO-2, the JSON type: the marks are taken off first, as for a parameter no mark reached;
    ``deepspeed.initialize`` marks the model's embeddings by name before the engine builds the optimizer."""
    pytest.importorskip("deepspeed")
    out = run_fresh(r"""
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch, deepspeed, ds_q8
from torch import nn
model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
del model[0].weight.ds_q8_embedding
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "Adam8bitBlock", "params": {"lr": 1e-3, "min_8bit_size": 1024}}}
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
print("mark:", model[0].weight.ds_q8_embedding)
base = opt.optimizer
flat = base.param_groups[0]["params"][0]
print("segments:", [(s.param_numel, s.eight_bit) for s in base.layout_of(flat).segments])
""")
    assert "mark: 0.weight" in out
    assert "segments: [(2048, False), (2048, True), (64, False)]" in out
    assert "keeps 32-bit state for 1 embedding parameter(s) (0.weight [64, 32]; 2,048 elements" in out
