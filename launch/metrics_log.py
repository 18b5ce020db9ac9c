"""Metrics as JSON lines in ``<save_dir>/metrics.jsonl``, mirrored to TensorBoard when asked and installed."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(path) -> list:
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
            # a process killed while appending leaves at most its last line cut short
    return rows


class MetricsLog:
    def __init__(self, save_dir: str, resume_step: int, tensorboard: bool):
        self.path = Path(save_dir) / "metrics.jsonl"
        # A run that died after its last checkpoint logged steps the resumed run will redo:
        # drop them so every step appears once.
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("--tensorboard: the tensorboard package is not installed; metrics go to "
                      f"{self.path} only", file=sys.stderr)
            else:
                self.writer = SummaryWriter(str(Path(save_dir) / "tensorboard"), purge_step=resume_step + 1)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
