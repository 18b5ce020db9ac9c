"""StableEmbedding and the parameter-group helper."""
import pytest
import torch
from torch import nn

import ds_q8


def test_stable_embedding_is_a_drop_in_embedding():
    torch.manual_seed(0)
    emb = ds_q8.StableEmbedding(1000, 64, padding_idx=0)
    assert isinstance(emb, nn.Embedding)
    out = emb(torch.tensor([[0, 5, 999]]))
    assert out.shape == (1, 3, 64)
    # LayerNorm on the output: each vector has zero mean and unit variance (before the affine part)
    assert torch.allclose(out.mean(-1), torch.zeros(1, 3), atol=1e-5)
    # (the padding row is all zeros; LayerNorm's eps keeps the others' variance just under 1)
    assert torch.allclose(out[0, 1:].var(-1, unbiased=False), torch.ones(2), atol=1e-2)
    assert torch.equal(emb.weight[0], torch.zeros(64))


def test_stable_embedding_uses_xavier_uniform_init():
    torch.manual_seed(0)
    emb = ds_q8.StableEmbedding(4000, 256)
    bound = (6.0 / (4000 + 256)) ** 0.5
    w = emb.weight.detach()
    assert float(w.abs().max()) <= bound
    assert float(w.abs().max()) > 0.95 * bound  # uniform fills the interval
    assert abs(float(w.std()) - bound / 3 ** 0.5) < 0.02 * bound


def test_stable_embedding_keeps_32bit_state_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(ds_q8.StableEmbedding(5000, 32), nn.Linear(32, 5000))
    opt = ds_q8.Adam8bitBlock(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 5000, (64,))
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    emb = model[0]
    for p in (emb.weight, emb.norm.weight, emb.norm.bias):
        assert opt.state[p]["state1_fp32"].dtype == torch.float32 and "state1" not in opt.state[p]
    assert opt.state[model[1].weight]["state1"].dtype == torch.uint8
    assert losses[-1] < 0.5 * losses[0]


def test_stable_embedding_refuses_sparse():
    with pytest.raises(ValueError, match="sparse"):
        ds_q8.StableEmbedding(10, 4, sparse=True)


def test_param_groups_split_embeddings_and_no_decay():
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 100))
    model[3].weight = model[0].weight  # tied, as in language models
    groups = ds_q8.param_groups(model, weight_decay=0.1)
    by_id = {}
    for g in groups:
        for p in g["params"]:
            assert id(p) not in by_id, "a tied parameter must appear once"
            by_id[id(p)] = g
    assert by_id[id(model[0].weight)].get("optim_bits") == 32
    assert by_id[id(model[0].weight)]["weight_decay"] == 0.1
    assert by_id[id(model[1].weight)]["weight_decay"] == 0.1 and "optim_bits" not in by_id[id(model[1].weight)]
    assert by_id[id(model[1].bias)]["weight_decay"] == 0.0
    assert by_id[id(model[2].weight)]["weight_decay"] == 0.0
    opt = ds_q8.AdamW8bitBlock(groups)
    assert len(opt.param_groups) == len(groups)


def test_optimizers_are_registered_for_deepspeed_json():
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    ds_q8.register_with_deepspeed()  # what deepspeed.initialize does when it meets a ds_q8 optimizer

    for name, cls in ds_q8.OPTIMIZERS.items():
        assert getattr(torch.optim, name) is cls
        assert cls in ZERO_SUPPORTED_OPTIMIZERS
