"""HF transformers' Trainer, DeepSpeed config with "optimizer": {"type": "Adam8bitBlock", "auto" params}."""
import json
import sys

import pytest

from helpers.ds_launch import SCRIPTS, free_port, run_checked

pytestmark = pytest.mark.multirank


def test_hf_trainer_trains_tiny_gpt2_with_adam8bitblock(tmp_path):
    out = tmp_path / "hf.json"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           str(SCRIPTS / "hf_train.py"), "--out", str(out), "--workdir", str(tmp_path / "trainer")]
    run_checked(cmd, tmp_path / "hf.log", timeout=400, cwd=tmp_path, result=out)
    r = json.loads(out.read_text())
    assert r["optimizer"] == "Adam8bitBlock"
    assert "torch.uint8" in r["state_dtypes"]
    assert r["betas"] == [0.9, 0.999]  # "auto" filled by the Trainer (as a list, which the optimizer accepts)
    assert len(r["losses"]) == 8
    assert r["losses"][-1] < 0.8 * r["losses"][0]
