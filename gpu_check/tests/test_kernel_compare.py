"""gpu_check/kernel_compare.py, the GPU check's comparison of the CUDA step kernel with an earlier one: its
snapshot of an earlier revision, and its tables, run here through the CUDA op's CPU harness (the
same calls, on CPU tensors) so that a GPU run only measures."""
import argparse
import math
import os
import sys

import pytest

from helpers import sim_op

sys.path.insert(0, os.path.join(sim_op.ROOT, "gpu_check"))
import kernel_compare  # noqa: E402


def test_a_snapshot_holds_adam_rules_only(tmp_path):
    csrc = kernel_compare.snapshot("HEAD", str(tmp_path / "earlier"))
    assert os.path.exists(os.path.join(csrc, "cuda", "q8_cuda_kernels.cu"))
    common = open(os.path.join(csrc, "includes", "q8_rules.h")).read()
    rules = common[common.index("#define Q8_RULES(X)"):].split("\n")[0]
    assert rules == '#define Q8_RULES(X) X("adam", AdamRule<false>) X("adamw", AdamRule<true>)'
    assert kernel_compare.revision(csrc) == os.popen(f"git -C {sim_op.ROOT} rev-parse --short HEAD").read().strip()


@pytest.mark.cuda_sim
@pytest.mark.slow
def test_the_tables_run_through_the_harness(monkeypatch, capsys):
    sim = sim_op.load()
    monkeypatch.setattr(kernel_compare, "DEVICE", "cpu")
    args = argparse.Namespace(n=3000, many=(5, 700), reps=3, no_peers=True)
    result = kernel_compare.speed(args, sim, sim)
    tables = {}
    for row in result["rows"]:
        assert math.isfinite(row["ms"]) and row["ms"] > 0 and len(row["runs_ms"]) == 3, row
        tables.setdefault(row["table"], []).append(row["name"])
    assert len(tables) == 3
    one, bf16, many = tables.values()
    assert one[0].startswith("copy") and "current kernel" in one and any(n.startswith("earlier kernel") for n in one)
    assert any("nonfinite=skip" in n for n in one) and any("torch AdamW fused" in n for n in many)
    assert bf16 == ["earlier kernel (earlier), bf16 in place", "current kernel, bf16 in place"]
    for key in ("ds_q8", "torch"):
        assert result["host_device"][key]["host_ms"] > 0
    assert "| current kernel |" in capsys.readouterr().out
