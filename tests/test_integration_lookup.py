"""What the DeepSpeed hooks look up the same way (``ds_q8.integration.lookup``)."""
from types import SimpleNamespace

import pytest
import torch

import ds_q8
from ds_q8.integration import grad_norm
from ds_q8.integration.lookup import (checkpoint_folder, checkpoint_tag, ds_q8_optimizer, optimizer_class,
                                      optimizer_classes)


def test_optimizer_classes_are_the_registry():
    assert optimizer_classes() == ds_q8.OPTIMIZERS and "Optimizer8bitBlock" not in ds_q8.OPTIMIZERS
    assert optimizer_class("AdamW8bitBlock") is ds_q8.AdamW8bitBlock
    with pytest.raises(ValueError, match="unknown optimizer 'Adam'"):
        optimizer_class("Adam")
    with pytest.raises(ValueError, match="unknown optimizer 'Optimizer8bitBlock'"):
        optimizer_class("Optimizer8bitBlock")


def test_ds_q8_optimizer_through_wrappers():
    opt = ds_q8.Adam8bitBlock([torch.nn.Parameter(torch.zeros(4))])
    direct = SimpleNamespace(optimizer=opt)
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt))
    deep = SimpleNamespace(optimizer=SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt)))
    assert ds_q8_optimizer(direct) is opt and ds_q8_optimizer(wrapped) is opt and ds_q8_optimizer(deep) is opt
    assert ds_q8_optimizer(SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))) is None
    assert ds_q8_optimizer(SimpleNamespace()) is None
    # the gradient norm is the ds_q8 step's only where the wrapper that computed it steps ds_q8 itself
    assert grad_norm._ds_q8_optimizer(wrapped) is opt and grad_norm._ds_q8_optimizer(deep) is None


def test_checkpoint_tag_and_folder(tmp_path):
    assert checkpoint_tag(tmp_path) is None and checkpoint_folder(tmp_path) is None
    assert checkpoint_tag(tmp_path, "step5") == "step5" and checkpoint_folder(tmp_path, "step5") is None
    (tmp_path / "step5").mkdir()
    assert checkpoint_folder(tmp_path, "step5") == tmp_path / "step5"
    (tmp_path / "latest").write_text("step5\n")
    assert checkpoint_tag(tmp_path) == "step5" and checkpoint_folder(str(tmp_path)) == tmp_path / "step5"
    (tmp_path / "latest").write_text("step6")
    assert checkpoint_tag(tmp_path) == "step6" and checkpoint_folder(tmp_path) is None


def test_a_universal_load_reads_latest_universal(tmp_path):
    # what DeepSpeed's load_checkpoint reads for tag=None under "checkpoint": {"load_universal": true}
    (tmp_path / "latest").write_text("step5")
    (tmp_path / "latest_universal").write_text("step5_universal")
    assert checkpoint_tag(tmp_path, universal=True) == "step5_universal"
    assert checkpoint_tag(tmp_path, "other", universal=True) == "other"


def test_the_file_check_verifies_the_folder_deepspeed_loads(tmp_path):
    from ds_q8.integration import checkpoint_files
    from ds_q8.integration.checkpoint_files import CorruptCheckpointError

    for tag in ("step5", "step5_universal"):
        (tmp_path / tag).mkdir()
        torch.save({"x": torch.zeros(3)}, tmp_path / tag / "mp_rank_00_model_states.pt")
    (tmp_path / "step5" / "mp_rank_00_model_states.pt").write_bytes(b"PK not a zip")
    (tmp_path / "latest").write_text("step5")
    (tmp_path / "latest_universal").write_text("step5_universal")
    opt = ds_q8.Adam8bitBlock([torch.nn.Parameter(torch.zeros(4))])

    def engine(universal):
        return SimpleNamespace(optimizer=opt, global_rank=0, load_universal_checkpoint=lambda: universal)

    checkpoint_files._check_engine_load(engine(True), str(tmp_path))  # loads step5_universal: whole
    with pytest.raises(CorruptCheckpointError, match="step5"):
        checkpoint_files._check_engine_load(engine(False), str(tmp_path))
