"""Fidelity on real models: GPT-2 as transformers builds it (its Conv1D `c_attn` holds the query, key and
value columns side by side in each row) and GPT-NeoX (its nn.Linear `query_key_value` is [3n, n], the
parts are rows), trained on real text (Python's standard library) from the same weights and batches with
AdamW8bitBlock and with torch's AdamW, every weight matrix's update compared (studies/fidelity.py).

The query and key gradients of a fused projection are about 100x smaller than the value gradients. A
quantization block that spans the parts codes q and k's moments against v's maximum: with the 2048-element
blocks of format 2 the lowest cosine was 0.9838 at width 768 (`h.2.attn.c_attn`, 4 layers, 25 steps) and
a seed at a high learning rate stayed on a plateau. With 64-element blocks no block spans two parts at any
width that is a multiple of 64.

The bounds, from the measurements in these configurations (8 steps of batch 8, lr 6e-4): every matrix's
update at a cosine of at least 0.999 against torch's (measured: 0.9998 at widths 128, 768 and 1600 and on
GPT-NeoX at 768; GPT-2 at 768 and 1600 is checked over the longer horizon below, under tighter bounds,
and not again here) and within 1% of its norm (measured: 0.1%); no first moment that torch holds above 0.3
of its gradient scale (|m| > 0.3 sqrt(v)) stored as zero, beyond one in a million weights (measured: none,
or one of 31 million at 1600, an element whose moment passes near zero at 0.003 of its block's maximum,
where 8-bit's rounding error is as large as the moment; 4-bit states lose 1.2 million of those 31 million,
studies/fidelity.py); no second moment with a gradient history
stored as zero (the zero point). The same check with 2048-element blocks at width 128 measures 0.9903 on
`h.1.attn.c_attn`: the test can fail.
"""
import sys
from pathlib import Path

import pytest
import torch

import ds_q8

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # studies/
import fidelity  # noqa: E402  (it puts launch/ on sys.path)
import gpt_data  # noqa: E402

STEPS, LR, BATCH, CONTEXT = 8, 6e-4, 8, 64
NORM_BOUND, COSINE_BOUND = 0.01, 0.999
#: first moments stored as zero that torch holds above 0.3 sqrt(v), per weight-matrix element: what a map's
#: range gives up. Measured on the minifloat default (the signed map stores values under 2.5e-4 of their
#: block's maximum as zero): 1.2e-6 (GPT-NeoX 768, 8 steps: 9 of 7.5 million, in the embedding), 1.8e-7
#: (GPT-2 1600, 25 steps); on dynamic6 none. A map that loses first moments systematically loses a few
#: percent (4-bit states: 1.2 million of 31 million, studies/fidelity.py).
LOST_RATE = 1e-5


def assert_few_lost(row):
    assert row["m_lost"] <= LOST_RATE * row["matrix_elements"], row["lost_per_matrix"]


@pytest.fixture(scope="module")
def text():
    train, _ = gpt_data.load_splits(None, gpt_data.ByteTokenizer())
    return train


@pytest.mark.slow
@pytest.mark.parametrize("arch,width,layers", [("gpt2", 128, 2), ("neox", 768, 1)])
def test_every_weight_matrix_updates_like_torch_adamw(text, arch, width, layers):
    names = ["ds_q8", "ds_q8:bs2048"] if (arch, width) == ("gpt2", 128) else ["ds_q8"]
    rows = {r["optimizer"]: r for r in fidelity.run(arch, width, layers, names, STEPS, LR, 0.01, BATCH, CONTEXT,
                                                    text=text)}
    ours = rows["ds_q8"]
    report = "\n".join(f"{m['matrix']}: norm ratio {m['norm_ratio']:.4f}, cosine {m['cosine']:.5f}"
                       for m in ours["per_matrix"])
    assert any("attn" in m["matrix"] or "query_key_value" in m["matrix"] for m in ours["per_matrix"])
    assert ours["min_cosine"] >= COSINE_BOUND, report
    assert 1 - NORM_BOUND <= ours["norm_ratio_lo"] and ours["norm_ratio_hi"] <= 1 + NORM_BOUND, report
    assert_few_lost(ours)
    if "ds_q8:bs2048" in rows:  # blocks across the parts of c_attn: the same check fails
        assert rows["ds_q8:bs2048"]["min_cosine"] < COSINE_BOUND


#: the longer horizon, as GPT-2 is trained: 25 steps of batch 16, lr 6e-4, weight decay 0.1 on the matrices
#: only, with and without a 10-step linear warm-up; per case the optimizers and their bounds. The bounds sit
#: below what the default (every state guided by its old code, on the minifloat maps) measures, 0.99962,
#: 0.99927 and 0.99962 on an AMD EPYC with AVX-512, and above the default
#: before it (dynamic6: 0.99940, 0.99859 and 0.99963 there and on an Intel Xeon) at 768 and above
#: bitsandbytes' AdamW8bit (0.99921, 0.99825, 0.99864) everywhere (docs/history.md, "Minifloat maps" and
#: "The same bits on an AMD EPYC with AVX-512"). The lowest cosine is where a rounding rule's noise and a
#: map's coarseness show; the 8-step check above is too short to see them.
HORIZON_STEPS, HORIZON_BATCH, HORIZON_DECAY = 25, 16, 0.1
HORIZON = [(768, 4, 0, {"ds_q8": 0.9995}),
           (768, 4, 10, {"ds_q8": 0.9990}),
           (1600, 2, 0, {"ds_q8": 0.9995})]


@pytest.mark.slow
@pytest.mark.parametrize("width,layers,warmup,bounds", HORIZON)
def test_every_weight_matrix_updates_like_torch_adamw_over_25_steps(text, width, layers, warmup, bounds):
    rows = fidelity.run("gpt2", width, layers, list(bounds), HORIZON_STEPS, LR, HORIZON_DECAY, HORIZON_BATCH, CONTEXT,
                        text=text, decay="matrices", warmup=warmup)
    for ours in rows:
        report = (f"{ours['optimizer']}: lowest {ours['min_cosine']:.5f} ({ours['worst_matrix']}), "
                  f"median {ours['median_cosine']:.5f}")
        print(report)
        assert ours["min_cosine"] >= bounds[ours["optimizer"]], report
        assert 1 - NORM_BOUND <= ours["norm_ratio_lo"] and ours["norm_ratio_hi"] <= 1 + NORM_BOUND, report
        assert_few_lost(ours)


@pytest.mark.slow
def test_no_second_moment_with_a_gradient_history_is_stored_as_zero(text):
    torch.manual_seed(0)
    model = fidelity.build("gpt2", 128, 2, CONTEXT, 0)
    # every matrix in 8 bits, the token embedding's too: its rarely seen rows are the test's hardest case
    opt = ds_q8.AdamW8bitBlock(model.parameters(), lr=LR, impl="kernel", embeddings_32bit=False)
    seen = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    for step in range(STEPS):
        x, y = gpt_data.get_batch(text, BATCH, CONTEXT, 0, 0, step)
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, fidelity.VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            seen[n] |= p.grad != 0
        opt.step()
    for n, p in model.named_parameters():
        if p.dim() == 2:
            state = opt.state[p]
            assert ds_q8.Optimizer8bitBlock.is_8bit_state(state), n
            assert int(((state["state2"] == 0) & seen[n]).sum()) == 0, n
