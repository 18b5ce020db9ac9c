"""Command line, data, config filling and checkpoint bookkeeping: no training (the memory plan: studies/tests)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers.cli import assert_usage_error
from helpers.train import CONFIGS, LAUNCH, REPO, run  # noqa: F401  (puts launch/ on sys.path)

import checkpointing
import gpt_data
import gpt_models
import train_gpt
from metrics_log import MetricsLog, read_metrics


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("argv, field", [
    (["--max_steps", "0"], "--max_steps"),
    (["--seed", "-1"], "--seed"),
    (["--eval_interval", "-5"], "--eval_interval"),
    (["--model", "gpt5"], "--model"),
    (["--dropout", "1.5"], "--dropout"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--max_steps", "5", "--stop_at", "6"], "--stop_at"),
    (["--resume", "--overwrite"], "--overwrite"),
    (["--micro_batch", "0"], "--micro_batch"),
])
def test_bad_arguments_name_the_field(argv, field, capsys):
    assert_usage_error(train_gpt.parse_args, argv, field, capsys)


def test_defaults_train_the_tiny_model_with_the_8bit_cpu_config():
    args = train_gpt.parse_args([])
    assert args.model == "tiny" and args.context == 128
    assert args.deepspeed_config == str(CONFIGS / "tiny_cpu_8bit.json")
    assert train_gpt.parse_args(["--model", "gpt2"]).context == 1024
    # the deepspeed launcher appends --local_rank=N
    assert train_gpt.parse_args(["--local_rank=1"]).local_rank == 1


def test_config_auto_values_and_overrides(tmp_path):
    args = train_gpt.parse_args(["--max_steps", "77", "--lr", "0.01", "--micro_batch", "3", "--grad_accum", "2"])
    cfg = train_gpt.load_ds_config(args)
    assert cfg["scheduler"]["params"]["total_num_steps"] == 77
    assert cfg["optimizer"]["params"]["lr"] == 0.01
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 0.01
    # the warm-up's start moves with the peak (the tiny configs warm up from a tenth of it): a peak of
    # 1e-4, below the config's start of 3e-4, still warms up
    low = train_gpt.load_ds_config(train_gpt.parse_args(["--lr", "1e-4"]))["scheduler"]["params"]
    assert low["warmup_max_lr"] == 1e-4 and low["warmup_min_lr"] == pytest.approx(1e-5)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, msg in [(bad, "not valid JSON"), (tmp_path / "missing.json", "no such file")]:
        with pytest.raises(SystemExit, match=msg):
            train_gpt.load_ds_config(train_gpt.parse_args(["--deepspeed_config", str(path)]))


def test_every_shipped_config_is_json_with_a_known_optimizer():
    import ds_q8
    names = sorted(p.name for p in CONFIGS.glob("*.json"))
    assert {"tiny_cpu_8bit.json", "tiny_cpu_32bit.json", "gpt2_xl_8bit_zero2.json", "gpt2_xl_32bit_zero2.json",
            "gpt2_xl_8bit_zero2_offload.json"} <= set(names)
    readme = (CONFIGS / "README.md").read_text()
    for name in names:
        cfg = json.loads((CONFIGS / name).read_text())
        if "optimizer" in cfg:
            assert cfg["optimizer"]["type"] in set(ds_q8.OPTIMIZERS) | {"Adam", "AdamW", "Muon"}, name
        else:  # a client optimizer's: DeepSpeed must be told to accept it under ZeRO
            assert cfg["zero_allow_untested_optimizer"] is True, name
        assert name in readme, f"{name} is not explained in ds_configs/README.md"
    xl8 = json.loads((CONFIGS / "gpt2_xl_8bit_zero2.json").read_text())
    xl32 = json.loads((CONFIGS / "gpt2_xl_32bit_zero2.json").read_text())
    assert xl8["optimizer"]["type"] == "Adam8bitBlock" and xl8["zero_optimization"]["stage"] == 2
    assert xl8["bf16"]["enabled"] is True
    # the baseline differs only in the optimizer type and its 8-bit-only settings
    for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "scheduler", "zero_optimization",
              "bf16", "gradient_clipping"):
        assert xl8[k] == xl32[k], k
    for k in ("lr", "betas", "eps", "weight_decay"):
        assert xl8["optimizer"]["params"][k] == xl32["optimizer"]["params"][k], k
    # the offload twins: DeepSpeed's AdamW (DeepSpeedCPUAdam, fp32 masters) beside ds_q8 with bf16 masters
    q8 = json.loads((CONFIGS / "decoder_7b_8bit_bf16master_zero2_offload.json").read_text())
    ds = json.loads((CONFIGS / "decoder_7b_32bit_zero2_offload.json").read_text())
    assert (q8["optimizer"]["type"], ds["optimizer"]["type"]) == ("AdamW8bitBlock", "AdamW")
    assert q8["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and q8["zero_optimization"]["stage"] == 2
    assert q8["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True} and ds["bf16"] == {"enabled": True}
    assert {k: v for k, v in q8["optimizer"]["params"].items() if k not in ("block_size", "stochastic_rounding")} \
        == ds["optimizer"]["params"]
    assert {k: v for k, v in q8.items() if k not in ("optimizer", "bf16")} == \
        {k: v for k, v in ds.items() if k not in ("optimizer", "bf16")}
    # the Muon twins: the same config but for the type, and torch's AdamW as DeepSpeed Muon's auxiliary Adam
    muon8 = json.loads((CONFIGS / "tiny_cpu_muon8bit.json").read_text())
    muon = json.loads((CONFIGS / "tiny_cpu_muon.json").read_text())
    assert (muon8["optimizer"]["type"], muon["optimizer"]["type"]) == ("Muon8bitBlock", "Muon")
    assert muon["optimizer"]["params"].pop("torch_adam") is True
    assert muon8["optimizer"]["params"] == muon["optimizer"]["params"]
    assert {k: v for k, v in muon8.items() if k != "optimizer"} == {k: v for k, v in muon.items() if k != "optimizer"}


# ---------------------------------------------------------------- data
def test_folder_corpus_split_and_batches_are_deterministic(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 30)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("0123456789" * 30)
    (tmp_path / ".hidden").write_text("zzzz" * 100)
    train, val = gpt_data.load_splits(str(tmp_path), gpt_data.ByteTokenizer())
    assert train.numel() == 540 and val.numel() == 60  # 90/10 of each of the two visible files
    assert ord("z") not in train.tolist()
    b1 = gpt_data.get_batch(train, 4, 16, seed=1, rank=0, step=3)
    b2 = gpt_data.get_batch(train, 4, 16, seed=1, rank=0, step=3)
    assert torch.equal(b1[0], b2[0]) and torch.equal(b1[0][:, 1:], b1[1][:, :-1])
    other = [gpt_data.get_batch(train, 4, 16, seed=s, rank=r, step=t)[0]
             for s, r, t in [(2, 0, 3), (1, 1, 3), (1, 0, 4)]]
    assert all(not torch.equal(b1[0], o) for o in other)


def test_default_corpus_is_the_standard_library():
    files = gpt_data.default_corpus_files()
    assert len(files) > 50 and any(f.name == "argparse.py" for f in files)


def test_bad_data_is_reported(tmp_path):
    with pytest.raises(ValueError, match="--data"):
        gpt_data.corpus_files(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no files"):
        gpt_data.corpus_files(str(tmp_path))
    with pytest.raises(ValueError, match="--context"):
        gpt_data.check_length("validation", torch.arange(10), 128)
    with pytest.raises(ValueError, match="--tokenizer"):
        gpt_data.make_tokenizer(str(tmp_path / "nope"))


# ---------------------------------------------------------------- checkpoints and metrics
def test_resume_ignores_checkpoints_without_the_completion_marker(tmp_path):
    for step in (4, 8, 12):
        (tmp_path / checkpointing.tag_for(step)).mkdir()
        (tmp_path / checkpointing.tag_for(step) / "model.pt").write_bytes(b"x" * step)
    checkpointing.mark_complete(str(tmp_path), 4, {})
    checkpointing.mark_complete(str(tmp_path), 8, {})
    assert checkpointing.latest_complete(str(tmp_path)) == ("step8", 8)
    (tmp_path / "notes").mkdir()
    checkpointing.clear_run(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    assert checkpointing.latest_complete(str(tmp_path / "absent")) is None


def test_metrics_of_steps_after_the_resumed_checkpoint_are_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)))
    log = MetricsLog(str(tmp_path), resume_step=4, tensorboard=False)
    log.write({"step": 5, "loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- models and the 1.5B plan
def test_model_sizes():
    assert gpt_models.SIZES["gpt2-xl"] == (48, 25, 1600)
    cfg = gpt_models.gpt2_config("gpt2-xl", 256, 64, n_layer=2)
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size) == (2, 1600, 256)
    with pytest.raises(ValueError, match="--n_layer"):
        gpt_models.gpt2_config("tiny", 256, 64, n_layer=0)
    with pytest.raises(ValueError, match="--model"):
        gpt_models.gpt2_config("gpt3", 256, 128)


def test_a_local_tokenizer_folder_is_used_without_network(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(tmp_path / "tok")
    tok = gpt_data.make_tokenizer(str(tmp_path / "tok"))
    assert 256 < tok.vocab_size <= 300
    ids = tok.encode("def f(x):\n    return x + 1\n")
    assert ids.dtype == torch.long and 0 < ids.numel() < 20  # merges learned: fewer tokens than bytes
    assert tok.decode(ids.tolist()) == "def f(x):\n    return x + 1\n"
