"""The CUDA op's list steps: step_many (one launch for all its tensors) with its device skip flag, and
step_fp32_many (float32 states), bit-identical to the pure-PyTorch reference on the same GPU; offset
views whose pointers are only 8-, 4- or 2-byte aligned. All but the lookup-cache test need a CUDA GPU."""
import pytest
import torch

import ds_q8
from ds_q8 import ops

from helpers.compare import RULES, assert_same_bits, assert_same_param, reference_step, spy_calls


SIZES = [1, 7, 63, 255, 257, 3 * 256 + 7, 4099, 20_000]


@pytest.fixture(scope="module")
def cuda_op():
    module = ops.load_op("cuda")
    assert module is not None, "the CUDA op did not load"
    return module


def _adamw_lists(cuda_op, sizes, dtype=torch.float32, block_size=256, seed=0, offset=0):
    """params, grads, states, absmax, maps, lookups and hyper of an AdamW8bitBlock step on `sizes`
    (each param a view `offset` elements into a larger buffer)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        buf = torch.randn(n + offset, generator=gen).to("cuda", dtype)
        params.append(buf[offset:])
    grads = [torch.randn(p.numel() + offset, generator=gen).to("cuda", dtype)[offset:] for p in params]
    opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(p.clone()) for p in params], block_size=block_size,
                               min_8bit_size=0, lr=1e-2)
    group = opt.param_groups[0]
    maps = opt._maps(group, torch.device("cuda"))
    lookups = [ops.lookup_table(m, cuda_op) for m in maps]
    states, absmax = [], []
    for p in params:
        nb = -(-p.numel() // block_size)
        states.append([torch.randint(0, 256, (p.numel(),), generator=gen, dtype=torch.uint8).cuda()
                       for _ in range(2)])
        absmax.append([torch.rand(nb, generator=gen).to(torch.bfloat16).cuda() for _ in range(2)])
    return params, grads, states, absmax, maps, lookups, dict(opt._hyper(group, 3))


def _snapshot(params, states, absmax):
    return [t.clone() for t in params] + [t.clone() for s in states for t in s] + [t.clone() for a in absmax for t in a]


@pytest.mark.gpu
def test_skip_flag_writes_nothing_and_zero_flag_changes_nothing(cuda_op):
    args = _adamw_lists(cuda_op, SIZES * 5)  # 40 tensors
    params, grads, states, absmax, maps, lookups, hyper = args
    before = _snapshot(params, states, absmax)
    cuda_op.step_many("adamw", params, grads, states, absmax, maps, lookups, 256, hyper, [], [],
                      skip=torch.ones(1, dtype=torch.int32, device="cuda"))
    for a, b in zip(_snapshot(params, states, absmax), before):
        assert_same_bits(a, b, "skipped step")

    again = _adamw_lists(cuda_op, SIZES * 5)
    cuda_op.step_many("adamw", params, grads, states, absmax, maps, lookups, 256, hyper, [], [],
                      skip=torch.zeros(1, dtype=torch.int32, device="cuda"))
    p2, g2, s2, a2 = again[:4]
    cuda_op.step_many("adamw", p2, g2, s2, a2, maps, lookups, 256, hyper, [], [])
    for a, b in zip(_snapshot(params, states, absmax), _snapshot(p2, s2, a2)):
        assert_same_bits(a, b, "flag 0 against no flag")
    assert not all(torch.equal(a, b) for a, b in zip(_snapshot(params, states, absmax), before))


# one case per test: a case that crashes the process (not only raises) is then named by the report
BAD_SKIP = {"int64": dict(dtype=torch.int64, device="cuda"), "two_values": dict(size=2, device="cuda"),
            "on_cpu": dict(device="cpu")}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BAD_SKIP))
def test_skip_flag_is_checked(cuda_op, case):
    params, grads, states, absmax, maps, lookups, hyper = _adamw_lists(cuda_op, [100])
    spec = dict(BAD_SKIP[case])
    bad = torch.zeros(spec.pop("size", 1), dtype=spec.pop("dtype", torch.int32), **spec)
    before = _snapshot(params, states, absmax)
    with pytest.raises(ValueError, match="skip"):
        cuda_op.step_many("adamw", params, grads, states, absmax, maps, lookups, 256, hyper, [], [], skip=bad)
    for a, b in zip(_snapshot(params, states, absmax), before):
        assert_same_bits(a, b, f"refused step ({case})")


@pytest.mark.gpu
def test_a_param_off_the_gpu_is_refused(cuda_op):
    """The binding's error path without a skip flag: its first check (check_cuda) raises."""
    params, grads, states, absmax, maps, lookups, hyper = _adamw_lists(cuda_op, [100])
    with pytest.raises(ValueError, match="param must be on"):
        cuda_op.step_many("adamw", [params[0].cpu()], grads, states, absmax, maps, lookups, 256, hyper, [], [])


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # fp32 views 4/8/12 bytes in: 4-, 8-, 4-byte aligned
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_views_match_aligned_copies(cuda_op, offset, dtype):
    p, g, s, a, maps, lookups, hyper = _adamw_lists(cuda_op, SIZES, dtype=dtype, offset=offset)
    # the same values in aligned tensors (fresh allocations are 256-byte aligned)
    q = [x.clone() for x in p]
    h = [x.clone() for x in g]
    t = [[c.clone() for c in st] for st in s]
    b = [[c.clone() for c in st] for st in a]
    cuda_op.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [])
    cuda_op.step_many("adamw", q, h, t, b, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_snapshot(p, s, a), _snapshot(q, t, b)):
        assert_same_bits(x, y, f"offset {offset}")


@pytest.mark.gpu
def test_offset_codes_views(cuda_op):
    # codes slices 1, 2 or 4 bytes into a buffer: per-element and 32-bit accesses
    p, g, s, a, maps, lookups, hyper = _adamw_lists(cuda_op, [4099, 5000, 257])
    s_off = []
    for k, st in enumerate(s):
        views = []
        for c in st:
            buf = torch.empty(c.numel() + 4, dtype=torch.uint8, device="cuda")
            v = buf[1 + k % 3:1 + k % 3 + c.numel()]
            v.copy_(c)
            views.append(v)
        s_off.append(views)
    q = [x.clone() for x in p]
    b = [[c.clone() for c in st] for st in a]
    cuda_op.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [])
    cuda_op.step_many("adamw", q, g, s_off, b, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_snapshot(p, s, a), _snapshot(q, s_off, b)):
        assert_same_bits(x, y, "codes views")


def _run_fp32_pair(cls, kw, dtype, steps=3, sizes=SIZES, grad_dtype=None):
    gen = torch.Generator().manual_seed(5)
    p0 = [torch.randn(n, generator=gen).to("cuda", dtype) for n in sizes]
    pk = [torch.nn.Parameter(x.clone()) for x in p0]
    pr = [torch.nn.Parameter(x.clone()) for x in p0]
    common = dict(block_size=256, min_8bit_size=10 ** 9, **kw)  # every state float32
    ok, orf = cls(pk, impl="kernel", **common), cls(pr, impl="reference", **common)
    for s in range(steps):
        for a, b in zip(pk, pr):
            g = (torch.randn(a.numel(), generator=gen) * 10.0 ** (s % 3 - 1)).to("cuda", grad_dtype or dtype)
            a.grad, b.grad = g.clone(), g.clone()
        ok.step()
        reference_step(orf)
    return pk, ok, pr, orf


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["adamw", "adam", "momentum", "lion", "rmsprop_momentum", "adagrad", "lamb"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_step_fp32_many_bit_identical_to_reference(rule, dtype):
    cls, kw = RULES[rule]
    pk, ok, pr, orf = _run_fp32_pair(cls, kw, dtype)
    assert not ok.is_8bit_state(ok.state[pk[0]])
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_param(a, ok, b, orf, f"param {i}")


@pytest.mark.gpu
def test_step_fp32_many_fp32_grads_of_bf16_params():
    pk, ok, pr, orf = _run_fp32_pair(ds_q8.AdamW8bitBlock, {}, torch.bfloat16, grad_dtype=torch.float32)
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_param(a, ok, b, orf, f"param {i}")


@pytest.mark.gpu
def test_step_fp32_many_is_one_kernel_call(monkeypatch, cuda_op):
    calls = spy_calls(monkeypatch)
    _run_fp32_pair(ds_q8.AdamW8bitBlock, {}, torch.float32, steps=1)
    assert [name for name, _ in calls].count("step_fp32_many") == 1


@pytest.mark.gpu
def test_step_fp32_many_skip_flag(cuda_op):
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(n, generator=gen).cuda() for n in SIZES]
    grads = [torch.randn(n, generator=gen).cuda() for n in SIZES]
    states = [[torch.rand(n, generator=gen).cuda() for _ in range(2)] for n in SIZES]
    opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(params[0].clone())], min_8bit_size=10 ** 9)
    hyper = dict(opt._hyper(opt.param_groups[0], 2))
    before = [t.clone() for t in params] + [t.clone() for s in states for t in s]
    cuda_op.step_fp32_many("adamw", params, grads, states, hyper, [], [],
                           skip=torch.full((1,), 7, dtype=torch.int32, device="cuda"))
    for a, b in zip([t for t in params] + [t for s in states for t in s], before):
        assert_same_bits(a, b, "skipped fp32 step")
    cuda_op.step_fp32_many("adamw", params, grads, states, hyper, [], [],
                           skip=torch.zeros(1, dtype=torch.int32, device="cuda"))
    assert not torch.equal(params[-1], before[len(SIZES) - 1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_default_map_lookup_is_built_once(device):
    """quantize_blockwise without code= uses one cached default map: one lookup table, not one per call."""
    x = torch.randn(10_000, device=device)
    ops.quantize_blockwise(x)
    count = len(ops._lookups)
    for _ in range(5):
        ops.quantize_blockwise(x)
    assert len(ops._lookups) == count
    code = torch.linspace(0, 1, 256)  # a map of the caller's: its table goes with it
    ops.quantize_blockwise(x.abs(), code.to(device))
    del code
    import gc
    gc.collect()
    assert len(ops._lookups) == count


@pytest.mark.gpu
def test_stream_is_respected(cuda_op):
    """A step launched on a side stream runs there: same bits as on the default stream."""
    params, grads, states, absmax, maps, lookups, hyper = _adamw_lists(cuda_op, SIZES)
    p2, g2, s2, a2 = _adamw_lists(cuda_op, SIZES)[:4]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda_op.step_many("adamw", params, grads, states, absmax, maps, lookups, 256, hyper, [], [])
    torch.cuda.current_stream().wait_stream(side)
    cuda_op.step_many("adamw", p2, g2, s2, a2, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_snapshot(params, states, absmax), _snapshot(p2, s2, a2)):
        assert_same_bits(x, y, "side stream")
