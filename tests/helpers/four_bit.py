"""Adam moments for the 4-bit format's tests: silent elements inside an active block, and a silent block."""
import torch


def moments(n: int, seed: int = 0):
    """``n`` first and second moments over five decades of scale, in a random order."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 1, n)[torch.randperm(n, generator=g)]
    v = torch.rand(n, generator=g) * scale ** 2
    m = torch.randn(n, generator=g) * scale * 0.3
    v[5:40] = 0  # silent elements inside an active block
    m[5:40] = 0
    v[128:192] = 0  # a silent block
    m[128:192] = 0
    return m, v
