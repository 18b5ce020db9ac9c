"""Quantization telemetry: what the 8-bit state is doing, on request.

``optimizer.track_quantization(every=N)`` measures the requantization error of every N-th step (of
each tensor's step count, so that it does not matter whether a wrapper such as ZeRO steps the
parameter groups in one ``step()`` call or one each): for each optimized tensor, each of its
parameters and each 8-bit state, the kernels (and the
reference) add up ``sum |requantized - x|`` and ``sum |x|`` over the elements they requantize, into a
small float64 tensor on the tensor's device. Nothing is read back: on a GPU the sums stay on the
device until :meth:`report` asks. Off (the default), no sum is kept and the kernels get none.

``optimizer.quantization_report()`` then returns, per state and in total and per parameter:
  * ``at_zero``: the fraction of 8-bit elements at the map's zero (code 0 of an unsigned map, 127 of
    the signed one) -- a second moment there means a wiped history unless its gradient is zero;
  * ``at_extreme``: the fraction at the map's ends (codes 0 and 255 of the signed map, 255 of the
    unsigned one), the block maxima and their ties;
  * ``rel_error``: ``sum |requantized - x| / sum |x|`` of each tensor's last measured step (None
    before one); ``measured_step`` says which step that was.
Under ZeRO each rank reports the partition it holds.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .layout import StateLayout


class Telemetry:
    """The error sums of the measured steps, one ``(segments, states, 2)`` float64 tensor per tensor."""

    def __init__(self, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (measure every N-th step), got {every!r}")
        self.every = every
        self.measured_step: Optional[int] = None
        self.sums: Dict[torch.Tensor, torch.Tensor] = {}

    def sums_for(self, tensor: torch.Tensor, layout: StateLayout, k: int, step: int) -> Optional[torch.Tensor]:
        """The zeroed sums for ``tensor``'s step number ``step`` when that step is measured, else None."""
        if step % self.every or not layout.has8:
            return None
        s = self.sums.get(tensor)
        if s is None:
            s = self.sums[tensor] = torch.zeros(len(layout.segments), k, 2, dtype=torch.float64, device=tensor.device)
        else:
            s.zero_()
        self.measured_step = step if self.measured_step is None else max(self.measured_step, step)
        return s


def add_error(sums: Optional[torch.Tensor], k: int, requantized: torch.Tensor, x: torch.Tensor) -> None:
    """The reference's share of the sums: state ``k``'s requantized values against their fp32 ones."""
    if sums is None:
        return
    sums[k, 0] += (requantized.double() - x.double()).abs().sum()
    sums[k, 1] += x.double().abs().sum()


def _fractions(codes: torch.Tensor, signed: bool, total: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    zero = 127 if signed else 0
    at_zero = (codes == zero).sum()
    at_extreme = ((codes == 0) | (codes == 255)).sum() if signed else (codes == 255).sum()
    total["n"] += codes.numel()
    total["at_zero"] += at_zero
    total["at_extreme"] += at_extreme
    return {"n": codes.numel(), "at_zero": at_zero, "at_extreme": at_extreme}


def report(states, names, telemetry: Optional[Telemetry]) -> dict:
    """See the module doc. ``states`` are ``(tensor, QuantizedState)`` of every 8-bit tensor. Reads every
    8-bit state's codes once (on a GPU: one transfer at the end)."""
    k = len(names)
    totals = [{"n": 0, "at_zero": 0, "at_extreme": 0, "err": 0.0, "mag": 0.0} for _ in range(k)]
    params: List[dict] = []
    for tensor, qs in states:
        layout = qs.layout
        sums = telemetry.sums.get(tensor) if telemetry is not None else None
        for si, seg in enumerate(layout.segments):
            if not seg.eight_bit:
                continue
            entry = {"group": layout.group_index, "param": seg.param_index, "name": seg.name, "numel": seg.numel}
            for i, name in enumerate(names):
                stats = _fractions(qs.segment_codes(si, i), qs.signed[i], totals[i])
                if sums is not None:
                    stats["err"], stats["mag"] = sums[si, i, 0], sums[si, i, 1]
                    totals[i]["err"] = totals[i]["err"] + stats["err"]
                    totals[i]["mag"] = totals[i]["mag"] + stats["mag"]
                entry[name] = stats
            params.append(entry)
    measured = telemetry is not None and telemetry.measured_step is not None

    def finish(stats: dict) -> dict:
        n = max(1, int(stats["n"]))
        out = {"at_zero": float(stats["at_zero"]) / n, "at_extreme": float(stats["at_extreme"]) / n}
        mag = float(stats.get("mag", 0.0))
        out["rel_error"] = (float(stats["err"]) / mag if mag > 0 else 0.0) if measured and "err" in stats else None
        return out

    for entry in params:
        for name in names:
            entry[name] = finish(entry[name])
    return {"states": {name: finish(t) for name, t in zip(names, totals)}, "params": params,
            "measured_step": telemetry.measured_step if telemetry is not None else None}
