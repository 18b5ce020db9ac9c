"""The ablation switches (tensor-wise absmax, linear map) and the ablation program itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ds_q8
from ds_q8 import functional as F

STUDIES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, STUDIES)
import ablation  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- block_size=None: one absmax per tensor
def test_tensorwise_quantization_is_one_block_over_everything():
    x = torch.randn(32, 32) * torch.logspace(-3, 1, 32)
    codes, absmax = F.quantize_blockwise(x, block_size=None)
    assert absmax.shape == (1,) and float(absmax[0]) == float(F.stored_absmax(x.abs().max()))
    same_codes, same_absmax = F.quantize_blockwise(x, block_size=1024)  # 1024 elements: one block too
    assert torch.equal(codes, same_codes) and torch.equal(absmax, same_absmax)
    back = F.dequantize_blockwise(codes, absmax, block_size=None)
    torch.testing.assert_close(back, F.dequantize_blockwise(codes, absmax, block_size=1024), rtol=0, atol=0)
    # small entries lose precision with one scale for all: block-wise must do better here
    err_tensor = (back - x).abs().mean()
    c64, a64 = F.quantize_blockwise(x, block_size=64)
    assert (F.dequantize_blockwise(c64, a64, block_size=64) - x).abs().mean() < err_tensor


def _adam_run(block_size, shape, steps=4, **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = ds_q8.Adam8bitBlock([p], lr=1e-2, block_size=block_size, **kw)
    for _ in range(steps):
        p.grad = torch.randn(shape) * torch.logspace(-4, 0, shape[-1])
        opt.step()
    return p, opt


def test_optimizer_block_size_none_keeps_one_absmax_per_state():
    p, opt = _adam_run(None, (64, 64))
    st = opt.state[p]
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].shape == (1,) and st["absmax2"].shape == (1,)
    # a 4096-element tensor is exactly one block of 4096: identical codes and parameters
    q, opt4096 = _adam_run(4096, (64, 64))
    assert torch.equal(p, q) and torch.equal(st["state2"], opt4096.state[q]["state2"])
    # a bigger tensor is not silently quantized block-wise
    big, opt_big = _adam_run(None, (64, 256))
    blocked, opt_blocked = _adam_run(2048, (64, 256))
    assert opt_big.state[big]["absmax1"].numel() == 1 and opt_blocked.state[blocked]["absmax1"].numel() == 8
    assert not torch.equal(big, blocked)


def test_block_size_none_survives_a_checkpoint():
    p, opt = _adam_run(None, (64, 96))
    fresh = ds_q8.Adam8bitBlock([p], lr=1e-2, block_size=None)
    fresh.load_state_dict(opt.state_dict())
    for key in ("state1", "absmax1", "state2", "absmax2"):
        assert torch.equal(fresh.state[p][key], opt.state[p][key]) and fresh.state[p][key].dtype == opt.state[p][key].dtype
    torch.testing.assert_close(fresh.dequantized_state(p)["exp_avg_sq"], opt.dequantized_state(p)["exp_avg_sq"])


def test_bad_block_size_mentions_none():
    with pytest.raises(ValueError, match="block_size must be a power of two .* or None"):
        ds_q8.Adam8bitBlock([torch.nn.Parameter(torch.zeros(4))], block_size=1000)


def test_linear_quantization_stores_codes_of_the_linear_map():
    p, opt = _adam_run(2048, (64, 64), quantization="linear")
    st = opt.state[p]
    got = opt.dequantized_state(p)
    for i, (name, signed) in enumerate([("exp_avg", True), ("exp_avg_sq", False)], start=1):
        want = F.dequantize_blockwise(st[f"state{i}"], st[f"absmax{i}"], F.create_linear_map(signed), 2048)
        assert torch.equal(got[name], want)
    dyn, _ = _adam_run(2048, (64, 64))
    assert not torch.equal(p, dyn)


# ---------------------------------------------------------------- the ablation program
def test_corpus_split_is_deterministic_and_by_file():
    train, val = ablation.load_corpus(50_000, 5_000)
    train2, val2 = ablation.load_corpus(50_000, 5_000)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert train.numel() == 50_000 and val.numel() == 5_000
    files = ablation.stdlib_files()
    with open(files[0], "rb") as f:  # file 0 is validation text, file 1 training text
        assert bytes(val[:100].tolist()) == f.read(100)
    with open(files[1], "rb") as f:
        assert bytes(train[:100].tolist()) == f.read(100)


def test_stable_embedding_replaces_wte_and_stays_tied():
    cfg = ablation.QUICK
    model = ablation.build_model(cfg, stable_embedding=True, seed=0)
    wte = model.transformer.wte
    assert isinstance(wte, ds_q8.StableEmbedding) and model.lm_head.weight is wte.weight
    out = model(torch.zeros(1, 8, dtype=torch.long)).logits
    out.sum().backward()
    assert wte.weight.grad is not None and wte.norm.weight.grad is not None
    opt = ablation.make_optimizer("8-bit dynamic block-wise", model, 1e-3, cfg)
    opt.step()
    assert opt.state[wte.weight]["state1_fp32"].dtype == torch.float32  # StableEmbedding keeps 32-bit state
    plain = ablation.build_model(cfg, stable_embedding=False, seed=0)
    plain(torch.zeros(1, 8, dtype=torch.long)).logits.sum().backward()
    opt = ablation.make_optimizer("8-bit dynamic block-wise", plain, 1e-3, cfg)
    opt.step()
    assert opt.state[plain.transformer.wte.weight]["state1"].dtype == torch.uint8


@pytest.mark.slow
def test_quick_ablation_writes_table_plot_and_runs(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(STUDIES), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(STUDIES, "ablation.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "ablation.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "optimizer" not in ln]
    assert len(rows) == 2 * len(ablation.VARIANTS)
    runs = json.loads((tmp_path / "ablation.json").read_text())["runs"]
    assert len(runs) == len(rows)
    for r in runs:
        assert r["unstable"] or 1.0 < r["perplexity"] < 256.0, r
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--lrs"):
        ablation.main(["--quick", "--lrs", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--steps"):
        ablation.main(["--quick", "--steps", "0", "--out", str(tmp_path)])
