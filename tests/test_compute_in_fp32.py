"""gpt_models.compute_in_fp32: a bf16 model's forward and backward computed in fp32 (the demo's bf16 runs on a
CPU without native bf16 matrix products). The weights, their gradients and so DeepSpeed's bf16 masters stay
bf16; each gradient is the fp32 computation's gradient rounded to bf16 once."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.train import CONFIGS, summary, train

import gpt_models


def tiny_gpt():
    torch.manual_seed(0)
    config = gpt_models.gpt2_config_of(n_layer=2, n_head=2, n_embd=32, vocab_size=64, context=16)
    return gpt_models.build_model(config, dtype=torch.bfloat16)


def grads(model, tokens) -> dict:
    logits = model(input_ids=tokens).logits
    F.cross_entropy(logits.float().view(-1, logits.size(-1)), tokens.view(-1)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def test_gradients_are_the_fp32_gradients_rounded_to_bf16():
    bf16 = tiny_gpt()
    reference = copy.deepcopy(bf16).float()  # the same weights, exactly, in fp32
    fast = gpt_models.compute_in_fp32(copy.deepcopy(bf16))
    want, got, plain = grads(reference, TOKENS), grads(fast, TOKENS), grads(bf16, TOKENS)
    assert want.keys() == got.keys() and len(got) > 10
    assert fast.lm_head.weight is fast.transformer.wte.weight  # still tied: one weight, one gradient
    worst_plain = 0.0
    for name, g in got.items():
        assert g.dtype == torch.bfloat16, name  # what DeepSpeed's bf16 mode reads and reduces
        ref = want[name].bfloat16()
        # the fp32 computation's gradient rounded once; a sum whose order torch picks may move the last bit
        torch.testing.assert_close(g, ref, rtol=2 ** -7, atol=1e-6 * ref.abs().max().item(), msg=name)
        scale = want[name].abs().max().item() or 1.0
        worst_plain = max(worst_plain, (plain[name].float() - want[name]).abs().max().item() / scale)
    # bf16 arithmetic lands farther away than one rounding: the comparison can tell the two apart
    assert worst_plain > 2 ** -8
    assert all(p.dtype == torch.bfloat16 for p in fast.parameters())  # the masters stay bf16


def test_the_loss_matches_fp32_and_the_weights_are_not_copied_in_place():
    bf16 = tiny_gpt()
    before = {n: p.detach().clone() for n, p in bf16.named_parameters()}
    fast = gpt_models.compute_in_fp32(bf16)
    assert fast is bf16
    with torch.no_grad():
        logits = fast(input_ids=TOKENS).logits
        ref = copy.deepcopy(fast)
        ref.forward = type(ref).forward.__get__(ref)  # the plain forward again
        ref_logits = ref.float()(input_ids=TOKENS).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, before[n]) and p.dtype == torch.bfloat16 for n, p in fast.named_parameters())


def test_auto_computes_in_fp32_only_without_native_bf16(monkeypatch):
    assert gpt_models.bf16_compute("bf16") == "bf16" and gpt_models.bf16_compute("fp32") == "fp32"
    monkeypatch.setattr(gpt_models, "native_bf16", lambda device="cpu": False)
    assert gpt_models.bf16_compute("auto") == "fp32"
    for answer in (True, None):  # None: torch does not say; bf16 as configured
        monkeypatch.setattr(gpt_models, "native_bf16", lambda device="cpu", a=answer: a)
        assert gpt_models.bf16_compute("auto") == "bf16"
    with pytest.raises(ValueError, match="--compute"):
        gpt_models.bf16_compute("fp16")


@pytest.mark.slow
def test_deepspeed_trains_bf16_masters_from_fp32_compute(tmp_path):
    """The trainer with a bf16 config and --compute fp32: DeepSpeed's bf16 engine takes the bf16 gradients,
    its masters and moments stay bf16 (the same state bytes as bf16 compute), and the losses follow the bf16
    compute run's within what bf16 rounding moves."""
    runs = {}
    for compute in ("fp32", "bf16"):
        d = tmp_path / compute
        train(d, "--deepspeed_config", CONFIGS / "tiny_cpu_bf16_states.json", "--n_layer", "1", "--context", "32",
              "--max_steps", "4", "--eval_interval", "0", "--save_interval", "0", "--compute", compute)
        runs[compute] = summary(d)
    fast, plain = runs["fp32"], runs["bf16"]
    assert fast["compute"] == "fp32" and plain["compute"] == "bf16"
    assert fast["masters"] == plain["masters"] == "bf16"
    # two bf16 moments a parameter (and a step count a tensor)
    assert fast["optimizer_state_bytes"] == plain["optimizer_state_bytes"] == pytest.approx(4 * fast["n_params"],
                                                                                             abs=100)
    assert fast["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=0.02)


def test_weights_made_available_inside_the_forward_stay_bf16():
    """ZeRO-3 frees each weight after use and makes it available again in a hook inside the forward, by
    reading its bf16 partition (``param.data = partition.data.to(device).view(shape)``). Those reads compute
    nothing: the weight stays bf16, so what autograd saved of it and the gradient it gets stay bf16 too."""
    model = tiny_gpt()
    partitions = {p: (p.detach().clone().flatten(), p.shape) for p in model.parameters()}

    def gather(module, args):
        for p in module.parameters(recurse=False):
            flat, shape = partitions[p]
            p.data = flat.data.to(device=p.device).view(shape)

    def release(module, args, output):
        for p in module.parameters(recurse=False):
            p.data = torch.empty(0, dtype=p.dtype)

    for m in model.modules():
        m.register_forward_pre_hook(gather)
        if not any(p is model.transformer.wte.weight for p in m.parameters(recurse=False)):
            m.register_forward_hook(release)  # the tied weight is read again by the LM head
    fast = gpt_models.compute_in_fp32(model)
    seen = []
    fast.transformer.ln_f.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    for m in model.modules():  # backward reads the saved weights: make them available again, in bf16
        m.register_full_backward_pre_hook(lambda m, g: gather(m, ()))
    got = grads(fast, TOKENS)
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.bfloat16 for p in fast.parameters())
    assert all(g is not None and g.dtype == torch.bfloat16 for g in got.values())


@pytest.mark.slow
def test_zero3_trains_bf16_masters_from_fp32_compute(tmp_path):
    """ZeRO-3 on one rank with bf16 masters, computing in fp32 (what ``--compute auto`` picks on a CPU
    without native bf16): trains as the bf16 compute run does."""
    import json

    config = json.loads((CONFIGS / "tiny_cpu_8bit_bf16master.json").read_text())
    config["zero_optimization"] = {"stage": 3}
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(config))
    runs = {}
    for compute in ("fp32", "bf16"):
        d = tmp_path / compute
        train(d, "--deepspeed_config", path, "--n_layer", "1", "--context", "32", "--max_steps", "4",
              "--eval_interval", "0", "--save_interval", "0", "--compute", compute)
        runs[compute] = summary(d)
    fast, plain = runs["fp32"], runs["bf16"]
    assert fast["compute"] == "fp32" and fast["masters"] == plain["masters"] == "bf16"
    assert fast["optimizer_state_bytes"] == plain["optimizer_state_bytes"]
    assert fast["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=0.02)
