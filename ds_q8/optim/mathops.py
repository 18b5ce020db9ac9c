"""Float32 math whose bits a compiled kernel can reproduce, shared by the optimizers' reference steps."""
from __future__ import annotations

import torch


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of a float32 tensor.

    torch's CPU ``sqrt`` of float32 goes through a vector math library that is off by one unit in
    the last place for about a fifth of the inputs, so no compiled kernel could match it. The square
    root taken in float64 and rounded once to float32 is the correctly rounded one (float64 carries
    more than twice float32's precision), on every device, and equals the kernels' IEEE sqrt.
    """
    return x.double().sqrt_().to(torch.float32)


__all__ = ["sqrt_rn"]
