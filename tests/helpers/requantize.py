"""What requantizing a dequantized state may change: the export round trip's bounds, shared by the
checkpoint tests.

A block whose largest value is coded as 1.0 or -1.0 gets its stored maximum back, and so every code
back. A block whose largest is coded at a lower entry (a draw of the old-code rule while the scaled value
was under 1) gets that entry's value, rounded up to bfloat16, as its new maximum: its values are rescaled
and round to the nearest entry again, moving by at most half a step of the map's top binade. The
minifloat signed map steps 1/31 there, the dynamic maps 1/64 to 1/72 of the maximum or less.
"""
import torch

#: the largest move of a value in the round trip, relative to its block's maximum (half of 1/31, with
#: a float32 rounding's margin)
ROUND_TRIP = 1.0 / 62 * 1.01


def blocks_led_by_one(codes: torch.Tensor, code: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per block, whether its largest magnitude is coded as 1.0 (or -1.0)."""
    n = codes.numel()
    mags = torch.nn.functional.pad(code[codes.reshape(-1).long()].abs(), (0, (-n) % block_size))
    return mags.view(-1, block_size).max(1).values == 1.0


def assert_round_trip(before: torch.Tensor, after: torch.Tensor, code: torch.Tensor, block_size: int, what: str):
    """Codes before and after the round trip: every block led by +-1.0 keeps every code (and there is one)."""
    led = blocks_led_by_one(before, code, block_size)
    n = before.numel()
    moved = torch.nn.functional.pad((before.reshape(-1) != after.reshape(-1)).to(torch.uint8), (0, (-n) % block_size))
    moved = moved.view(-1, block_size).bool()
    assert bool(led.any()), f"{what}: no block is led by 1.0"
    assert not bool(moved[led].any()), f"{what}: {int(moved[led].sum())} codes moved in blocks led by 1.0"
