"""Quantization telemetry: what the quantized (8- or 4-bit) state is doing, on request.

``optimizer.track_quantization(every=N)`` measures the requantization error of every N-th step (of
each tensor's step count, so that it does not matter whether a wrapper such as ZeRO steps the
parameter groups in one ``step()`` call or one each): for each optimized tensor, each of its
parameters and each quantized state, the kernels (and the reference) add up ``sum |requantized - x|``,
``sum |x|`` and the number of nonzero values requantized to zero over the elements they requantize,
into a small float64 tensor on the tensor's device. Nothing is read back: on a GPU the sums stay on the
device until :meth:`report` asks. Off (the default), no sum is kept and the kernels get none. 4-bit
state (``optim_bits=4``) is measured by its reference step, which the 4-bit kernels equal bit for bit:
a measured step of such a tensor takes the reference's time, the others the kernel's.

``optimizer.quantization_report()`` then returns, for every state of every group's rule (an optimizer
with a rule per group, Muon8bitBlock, reports its matrices' ``momentum_buffer`` beside its AdamW's
``exp_avg`` and ``exp_avg_sq``), in total and per parameter:
  * ``at_zero``: the fraction of quantized elements at the map's zero (code 0 of an unsigned 8-bit
    map, 127 of the signed one, 7 of the 4-bit first moment's; the 4-bit second moment's map has no
    zero) -- a second moment there means a wiped history unless its gradient is zero;
  * ``at_extreme``: the fraction at the map's ends (both ends of a signed map, the top of an unsigned
    one), the block maxima and their ties;
  * ``rel_error``: ``sum |requantized - x| / sum |x|`` of each tensor's last measured step (None
    before one); ``measured_step`` says which step that was;
  * ``zeroed``: the fraction of elements whose value was not zero but was stored as zero (the map's
    zero code, or a block maximum of zero) at the last measured step (None before one). A first moment
    coded against a block maximum 100x larger than itself (a block that mixes the parts of a fused
    projection) shows here: its update is lost.
Under ZeRO each rank reports the partition it holds.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .layout import StateLayout

#: sums per state: sum |requantized - x|, sum |x|, and nonzero values requantized to zero (the kernels'
#: Q8_TELEMETRY_SUMS)
SUMS = 3


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
            s = self.sums[tensor] = torch.zeros(len(layout.segments), k, SUMS, dtype=torch.float64, device=tensor.device)
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
    sums[k, 2] += ((requantized == 0) & (x != 0)).sum().double()


def _landmarks(code_map: torch.Tensor) -> tuple:
    """The codes at ``code_map``'s zero (none where the map has no zero) and at its ends (both ends of a
    map with negative entries, the top of one without), as index tensors."""
    zero = (code_map == 0).nonzero().flatten()
    ends = (code_map == code_map.max()).nonzero().flatten()
    if bool(code_map.min() < 0):
        ends = torch.cat([ends, (code_map == code_map.min()).nonzero().flatten()])
    return zero, ends


def _fractions(codes: torch.Tensor, landmarks: tuple, total: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    zero, ends = landmarks
    c = codes.to(torch.int64)
    at_zero = torch.isin(c, zero.to(c.device)).sum()
    at_extreme = torch.isin(c, ends.to(c.device)).sum()
    total["n"] += codes.numel()
    total["at_zero"] += at_zero
    total["at_extreme"] += at_extreme
    return {"n": codes.numel(), "at_zero": at_zero, "at_extreme": at_extreme}


def report(states, telemetry: Optional[Telemetry]) -> dict:
    """See the module doc. ``states`` are ``(tensor, QuantizedState, state names)`` of every quantized
    tensor, each with its own rule's names; the totals are per state name. Reads every state's codes once
    (on a GPU: one transfer at the end)."""
    totals: Dict[str, dict] = {}
    params: List[dict] = []
    for tensor, qs, names in states:
        layout = qs.layout
        sums = telemetry.sums.get(tensor) if telemetry is not None else None
        for name in names:
            totals.setdefault(name, {"n": 0, "at_zero": 0, "at_extreme": 0, "err": 0.0, "mag": 0.0, "zeroed": 0.0})
        landmarks = [_landmarks(m) for m in qs.code_maps("cpu")]  # once a tensor, on the host: no device sync
        for si, seg in enumerate(layout.segments):
            if not seg.eight_bit:
                continue
            entry = {"group": layout.group_index, "param": seg.param_index, "name": seg.name, "numel": seg.numel}
            codes = qs.segment_codes(si)
            for i, name in enumerate(names):
                stats = _fractions(codes[i], landmarks[i], totals[name])
                if sums is not None:
                    stats["err"], stats["mag"], stats["zeroed"] = sums[si, i, 0], sums[si, i, 1], sums[si, i, 2]
                    for key in ("err", "mag", "zeroed"):
                        totals[name][key] = totals[name][key] + stats[key]
                entry[name] = stats
            params.append(entry)
    measured = telemetry is not None and telemetry.measured_step is not None

    def finish(stats: dict) -> dict:
        n = max(1, int(stats["n"]))
        out = {"at_zero": float(stats["at_zero"]) / n, "at_extreme": float(stats["at_extreme"]) / n}
        mag = float(stats.get("mag", 0.0))
        timed = measured and "err" in stats
        out["rel_error"] = (float(stats["err"]) / mag if mag > 0 else 0.0) if timed else None
        out["zeroed"] = float(stats["zeroed"]) / n if timed else None
        return out

    for entry in params:
        for name in entry:
            if isinstance(entry[name], dict):
                entry[name] = finish(entry[name])
    return {"states": {name: finish(t) for name, t in totals.items()}, "params": params,
            "measured_step": telemetry.measured_step if telemetry is not None else None}
