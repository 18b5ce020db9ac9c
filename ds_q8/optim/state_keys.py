"""Where a tensor's state lives in the optimizer's ``state[tensor]`` dict: the storage keys, written here
and nowhere else (``qstate.py`` says what each holds), and the constants their readers share."""
from __future__ import annotations

import torch

# Elements dequantized at a time by the readers and the reference: bounds their fp32 temporaries.
CHUNK = 1 << 20


def codes_key(i: int) -> str:
    """Key of state ``i``'s codes (``i`` from 0)."""
    return f"state{i + 1}"


def absmax_key(i: int) -> str:
    return f"absmax{i + 1}"


def fp32_key(i: int) -> str:
    return f"state{i + 1}_fp32"


#: key of a bf16 tensor's correction bytes (``correction_byte=True``): int8, one per element of the
#: optimized tensor (a ZeRO partition's, padding included), saved and partitioned like the parameter
CORRECTION_KEY = "correction"


def storage_keys(num_states: int) -> frozenset:
    """Every key a state entry of ``num_states`` states may hold."""
    keys = {"step", CORRECTION_KEY}
    for i in range(num_states):
        keys |= {codes_key(i), absmax_key(i), fp32_key(i)}
    return frozenset(keys)


def is_8bit(entry: dict) -> bool:
    """Whether a state entry holds codes."""
    s = entry.get(codes_key(0))
    return s is not None and s.dtype == torch.uint8


def has_storage(entry: dict) -> bool:
    """Whether a state entry has been created (holds codes or fp32 values)."""
    return "step" in entry and any(k.startswith("state") for k in entry)


__all__ = ["CHUNK", "codes_key", "absmax_key", "fp32_key", "CORRECTION_KEY", "storage_keys",
           "is_8bit", "has_storage"]
