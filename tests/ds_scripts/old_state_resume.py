"""Resume the DeepSpeed checkpoints of tests/data/old_state (ZeRO-2, one rank, written by older commits) with
this ds_q8, one engine per commit, and print what loaded (tests/test_checkpoint_codec.py).

Run as one process of one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): python old_state_resume.py
COMMIT... For each commit it builds the engine from the config that wrote the checkpoint, loads it, compares
the optimizer's decoded state with what the old code decoded (``ds.ref.pt``) and the masters with the saved
ones, trains two more steps and prints ``RESULT {json}``.
"""
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch

import deepspeed

DATA = Path(__file__).resolve().parents[1] / "data" / "old_state"
_spec = importlib.util.spec_from_file_location("write_old_state", DATA / "write_old_state.py")
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)  # the model and data the checkpoints were trained with


def resume(commit: str) -> dict:
    folder = DATA / commit / "ds"
    ref = torch.load(folder / "ds.ref.pt", map_location="cpu", weights_only=True)
    m = old.model()
    engine, _, _, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ref["config"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(str(folder), tag=f"step{old.STEPS}")
    inner = engine.optimizer.optimizer
    flat = [p for g in inner.param_groups for p in g["params"]]
    worst = 0.0
    for p, want in zip(flat, ref["decoded"]):
        got = inner.dequantized_state(p)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name, w in want.items():
            # relative to each value; zeros must stay zeros
            rel = (got[name] - w).abs() / w.abs().clamp_min(torch.finfo(torch.float32).tiny)
            worst = max(worst, float(rel.max()))
    losses = []
    for step in range(old.STEPS, old.STEPS + 2):
        x, y = old.data(step)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"worst_rel": worst, "losses": losses, "steps": sorted({int(st["step"]) for st in inner.state.values()}),
            "warnings": [str(w.message) for w in caught if "minifloat" in str(w.message)]}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    print("RESULT " + json.dumps({commit: resume(commit) for commit in sys.argv[1:]}))


if __name__ == "__main__":
    main()
