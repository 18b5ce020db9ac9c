"""The CUDA kernels against the pure-PyTorch reference on one GPU, bit for bit: block sizes 64-4096, sizes
{1, 7, bs-1, bs+1, 3bs+7}, every rule, every dtype pair, float32 states, 4-bit states, offset views, a side
stream, the skip flag, (de)quantize, and one tensor of 2^31+4099 elements.

All are marked ``gpu``: gpu_check/gpu_check.sh's correctness stage runs them (``pytest -m gpu``), and
without a GPU they skip. ``--kernel-device cpu`` runs them on the CPU op instead, to try them without a
GPU (the stream and skip-flag tests are CUDA's and skip there).
"""
import gc

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import ops

from helpers.compare import RULES, assert_same_bits, reference_step
from helpers.gpu_cases import BLOCK_SIZES, DTYPE_PAIRS, DTYPES, HUGE, sizes_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module(kernel_device):
    loaded = ops.load_op(kernel_device)
    assert loaded is not None, f"the {kernel_device} op did not load"
    return loaded


def pair(device, cls, sizes, pd, gd, bs, steps=2, min_8bit_size=0, seed=0, **kw):
    """The same optimizer with kernels and on the reference; both stepped; compared bit by bit."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p0 = [torch.randn(n, generator=gen, device=device).to(pd) for n in sizes]
    pk = [torch.nn.Parameter(x.clone()) for x in p0]
    pr = [torch.nn.Parameter(x.clone()) for x in p0]
    del p0
    if gd != pd:
        for a, b in zip(pk, pr):
            a.grad_dtype = b.grad_dtype = gd  # e.g. fp32 gradients of bf16 params
    ok = cls(pk, block_size=bs, min_8bit_size=min_8bit_size, impl="kernel", **kw)  # no silent fallback
    orf = cls(pr, block_size=bs, min_8bit_size=min_8bit_size, **kw)
    for s in range(steps):
        for a, b in zip(pk, pr):
            g = (torch.randn(a.numel(), generator=gen, device=device) * 10.0 ** (s % 3 - 1)).to(gd)
            a.grad, b.grad = g, g.clone()
            del g
        ok.step()
        reference_step(orf)
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_bits(a.data, b.data, f"param {i} ({a.numel()} elements)")
        for key, v in ok.state[a].items():
            if torch.is_tensor(v):
                assert_same_bits(v, orf.state[b][key], f"param {i} {key}")


def lists(device, sizes, pd, bs, offset=0, seed=0):
    """Parameters and gradients as views ``offset`` elements into their storage, random codes and maxima."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(n + offset, generator=gen, device=device).to(pd)[offset:] for n in sizes]
    grads = [torch.randn(n + offset, generator=gen, device=device).to(pd)[offset:] for n in sizes]
    states = [[torch.randint(0, 256, (n,), generator=gen, device=device, dtype=torch.uint8) for _ in range(2)]
              for n in sizes]
    absmax = [[torch.rand(-(-n // bs), generator=gen, device=device).to(torch.bfloat16) for _ in range(2)]
              for n in sizes]
    return params, grads, states, absmax


def adamw_args(device, module, bs):
    opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(torch.zeros(1, device=device))], block_size=bs, lr=1e-2)
    maps = opt._maps(opt.param_groups[0], torch.device(device))
    return maps, [ops.lookup_table(m, module) for m in maps], dict(opt._hyper(opt.param_groups[0], 3))


def flat(params, states, absmax):
    return list(params) + [t for s in states for t in s] + [t for a in absmax for t in a]


@pytest.mark.parametrize("pd,gd", DTYPE_PAIRS, ids=[f"p={p}-g={g}" for p, g in DTYPE_PAIRS])
@pytest.mark.parametrize("bs", BLOCK_SIZES, ids=lambda bs: f"bs={bs}")
def test_sweep(kernel_device, module, bs, pd, gd):
    pair(kernel_device, ds_q8.AdamW8bitBlock, sizes_for(bs), DTYPES[pd], DTYPES[gd], bs, lr=1e-2)


@pytest.mark.parametrize("pd,gd", DTYPE_PAIRS, ids=[f"p={p}-g={g}" for p, g in DTYPE_PAIRS])
@pytest.mark.parametrize("bs", [64, 256, 4096], ids=lambda bs: f"bs={bs}")
def test_four_bit_state(kernel_device, module, bs, pd, gd):
    """optim_bits=4 (ds_q8/format4.py): nibble codes, v's float32 maxima, r = m / sqrt(v) on its own."""
    pair(kernel_device, ds_q8.AdamW8bitBlock, sizes_for(bs), DTYPES[pd], DTYPES[gd], bs, steps=3, lr=1e-2, optim_bits=4)


@pytest.mark.parametrize("rule", list(RULES))
def test_rule(kernel_device, module, rule):
    cls, kw = RULES[rule]
    pair(kernel_device, cls, sizes_for(256) + [20_000], torch.float32, torch.float32, 256, steps=3, **kw)


@pytest.mark.parametrize("rule", ["adamw", "momentum", "lion", "rmsprop_momentum"])
def test_fp32_states(kernel_device, module, rule):
    cls, kw = RULES[rule]
    pair(kernel_device, cls, sizes_for(256) + [20_000], torch.bfloat16, torch.bfloat16, 256, min_8bit_size=10 ** 9,
         **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offset_views(kernel_device, module, dtype):
    """Views 1-3 elements into their storage step as their aligned copies do."""
    bs, pd = 256, DTYPES[dtype]
    maps, lookups, hyper = adamw_args(kernel_device, module, bs)
    for offset in (1, 2, 3):
        p, g, s, a = lists(kernel_device, sizes_for(bs), pd, bs, offset)
        q, h = [x.clone() for x in p], [x.clone() for x in g]
        t, b = [[c.clone() for c in st] for st in s], [[c.clone() for c in st] for st in a]
        ops.call(module, "step_many", p[0], "adamw", p, g, s, a, maps, lookups, bs, hyper, [], [])
        ops.call(module, "step_many", q[0], "adamw", q, h, t, b, maps, lookups, bs, hyper, [], [])
        for x, y in zip(flat(p, s, a), flat(q, t, b)):
            assert_same_bits(x, y, f"offset {offset}")


def test_side_stream(kernel_device, module):
    if kernel_device != "cuda":
        pytest.skip(f"no streams on {kernel_device}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pair(kernel_device, ds_q8.AdamW8bitBlock, sizes_for(512), torch.float32, torch.float32, 512, lr=1e-2)
    torch.cuda.current_stream().wait_stream(side)


def test_skip_flag(kernel_device, module):
    """Flag 1 writes nothing, flag 0 steps; 40 tensors in one launch."""
    if kernel_device != "cuda":
        pytest.skip("the skip flag is CUDA's")
    bs = 256
    maps, lookups, hyper = adamw_args(kernel_device, module, bs)
    p, g, s, a = lists(kernel_device, sizes_for(bs) * 8, torch.float32, bs)
    before = [x.clone() for x in flat(p, s, a)]
    module.step_many("adamw", p, g, s, a, maps, lookups, bs, hyper, [], [],
                     skip=torch.ones(1, dtype=torch.int32, device=kernel_device))
    for x, y in zip(flat(p, s, a), before):
        assert_same_bits(x, y, "skipped step")
    module.step_many("adamw", p, g, s, a, maps, lookups, bs, hyper, [], [],
                     skip=torch.zeros(1, dtype=torch.int32, device=kernel_device))
    assert any(not torch.equal(x, y) for x, y in zip(flat(p, s, a), before)), "flag 0 changed nothing"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize(kernel_device, module, dtype):
    bs, d = 2048, DTYPES[dtype]
    n = 3 * bs + 100
    x = (torch.randn(n, device=kernel_device) * torch.logspace(-8, 3, n, device=kernel_device)).to(d)
    want = F.quantize_blockwise(x, None, bs)
    got = ops.quantize_blockwise(x, None, bs)
    assert_same_bits(got[0], want[0], f"codes {d}")
    assert_same_bits(got[1], want[1], f"absmax {d}")
    assert_same_bits(ops.dequantize_blockwise(*got, None, bs, d), F.dequantize_blockwise(*want, None, bs, d),
                     f"dequantize {d}")


def test_huge(kernel_device, module):
    """One tensor of 2^31+4099 elements: offsets past int32 (gpu_check --quick leaves it out)."""
    try:
        pair(kernel_device, ds_q8.AdamW8bitBlock, [HUGE], torch.bfloat16, torch.bfloat16, 2048, steps=1, lr=1e-2)
    finally:
        gc.collect()
        if kernel_device == "cuda":
            torch.cuda.empty_cache()
