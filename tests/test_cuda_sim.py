"""The CUDA op's device code executed on the CPU: its binding, launchers and kernels
(``q8_cuda_kernels.cu``, unmodified) compiled with g++ over the harness of ``tests/cuda_sim``, one
fiber per CUDA thread. Every result is compared bit for bit with the pure-PyTorch reference.

The module runs in three builds: plain (here, the shipped ``.cu`` unmodified), ThreadSanitizer and
AddressSanitizer with UBSan (``test_sanitized_builds_are_clean`` runs this file again in a process with
the sanitizer's runtime; ``Q8_SIM_BUILD`` says which build a process uses).
``test_planted_bugs_are_reported`` plants known bugs, each behind a switch, in a copy of the device code
and checks that each is reported; the sanitized runs of the whole file use that copy with every switch
off, so one build per sanitizer serves both.

What this proves: the device code's arithmetic, indexing, tails, alignment paths, barriers and warp
exchanges, and the host code that packs tensor lists, splits grids and passes the skip flag. What
only a GPU can show: nvcc's code generation, the GPU memory model (races between CTAs, the
order of global writes), and speed.
"""
import functools
import os

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8 import ops


from helpers import sim_op
from helpers.compare import assert_same_bits, assert_same_param, extreme_gradients, reference_step
from helpers.optimizer_cases import kernel_cases

#: the device code under test: the shipped .cu, or (planted-bug runs) the copy Q8_SIM_KERNELS names
KERNELS = os.environ.get("Q8_SIM_KERNELS", sim_op.CU)
PARENT = sim_op.BUILD == "plain" and "Q8_SIM_KERNELS" not in os.environ

pytestmark = [pytest.mark.cuda_sim, pytest.mark.slow]  # a build of about a minute first

RULES = kernel_cases()
DTYPE_PAIRS = {  # (param, grad): every pair the CUDA op accepts
    "fp32": (torch.float32, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16-fp32grad": (torch.float16, torch.float32),
    "bf16-fp32grad": (torch.bfloat16, torch.float32),
}
BLOCK_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]
#: The rule x dtype matrix per build. ThreadSanitizer checks how threads share memory: the barriers and
#: warp exchanges of the block reductions (every block size below), CTAs that split a tensor or a list,
#: the skip flag; a kernel's dtypes change only how it converts, not how its threads synchronise, so
#: under it every rule runs with one pair (16-bit parameters, fp32 gradients: both load widths and the
#: stochastic writes). AddressSanitizer with UBSan, which checks loads, stores and conversions, and the
#: plain build run every pair.
PAIRS = [pair for pair in DTYPE_PAIRS if sim_op.BUILD != "tsan" or pair == "bf16-fp32grad"]
#: The same for the (de)quantize kernels: one 16-bit dtype under ThreadSanitizer, all three elsewhere.
QUANT_DTYPES = [torch.bfloat16] if sim_op.BUILD == "tsan" else [torch.float32, torch.float16, torch.bfloat16]


def sizes_of(bs):
    return [1, 7, bs - 1, bs, bs + 1, 3 * bs + 7]


@pytest.fixture(scope="module")
def sim():
    return sim_op.load(kernels=KERNELS, name="_planted" if KERNELS != sim_op.CU else "")


def launches(sim):
    return sim_op.stat(sim, "launches")


def run_pair(sim, cls, kw, sizes, dtype, grad_dtype=None, block_size=256, steps=3, seed=0, grads=None, **options):
    """One optimizer over params of ``sizes`` stepped through the harness, one through the reference;
    returns (params, optimizer) of both. Each step's gradients span three decades (or are ``grads[s]``,
    given for one param)."""
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    pk = [torch.nn.Parameter(x.clone()) for x in p0]
    pr = [torch.nn.Parameter(x.clone()) for x in p0]
    for a, b in zip(pk, pr):
        if grad_dtype is not None:
            a.grad_dtype = b.grad_dtype = grad_dtype
    common = dict(block_size=block_size, min_8bit_size=0)
    common.update(kw)
    common.update(options)
    ok, orf = cls(pk, impl="kernel", **common), cls(pr, impl="reference", **common)
    before = launches(sim)
    for s in range(steps):
        for i, (a, b) in enumerate(zip(pk, pr)):
            g = torch.randn(a.numel(), generator=gen) * 10.0 ** ((s + i) % 3 - 1)
            if grads is not None:
                g = grads[s].clone()
            elif a.numel() > block_size and s == 1:
                g[:block_size] = 0  # a block whose state decays towards zero
            g = g.to(grad_dtype or dtype)
            a.grad, b.grad = g.clone(), g.clone()
        with sim_op.as_cpu_op(sim):
            ok.step()
        reference_step(orf)
    assert launches(sim) >= before + steps, "the harness did not run"
    return (pk, ok), (pr, orf)


def assert_same(kernel, reference, label=""):
    (pk, ok), (pr, orf) = kernel, reference
    for i, (a, b) in enumerate(zip(pk, pr)):
        assert_same_param(a, ok, b, orf, f"{label} param {i} ({a.numel()} elements)")


# ---------------------------------------------------------------------------- 8-bit steps

@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_and_dtype_pair(sim, rule, pair):
    cls, kw = RULES[rule]
    dtype, grad_dtype = DTYPE_PAIRS[pair]
    kernel, reference = run_pair(sim, cls, kw, sizes_of(256), dtype, grad_dtype)
    assert kernel[1].is_8bit_state(kernel[1].state[kernel[0][-1]])
    assert_same(kernel, reference, f"{rule} {pair}")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("rule", ["adamw", "lion", "adagrad"])
def test_every_block_size_and_tail(sim, rule, block_size):
    # T = block_size/8 threads per block: 8 to 512, a warp's shuffles alone up to 32, shared memory beyond
    cls, kw = RULES[rule]
    kernel, reference = run_pair(sim, cls, kw, sizes_of(block_size), torch.bfloat16, torch.float32,
                                 block_size=block_size, steps=2)
    assert sim_op.stat(sim, "last_threads") == max(256, block_size // 8)
    assert_same(kernel, reference, f"{rule} block_size {block_size}")


@pytest.mark.parametrize("options", [dict(state_rounding="nearest", stochastic_rounding=False),
                                     dict(stochastic_rounding=True, sr_seed=7), dict(quantization="dynamic6"),
                                     dict(state_rounding="stochastic"), dict(state_rounding="guided"),
                                     dict(state_rounding="guided", quantization="linear"),
                                     dict(state_rounding="guided", quantization="dynamic"),
                                     dict(quantization="minifloat")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_choices(sim, dtype, options):
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, sizes_of(256), dtype, steps=3, **options)
    assert_same(kernel, reference, str(options))


@pytest.mark.parametrize("state_rounding", ["guided", "stochastic", "nearest"])
def test_non_finite_blocks(sim, state_rounding):
    """test_kernels' extreme gradients (NaN and Inf in one block: the exact path) with nonfinite="off"."""
    grads = extreme_gradients()
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, [grads[0].numel()], torch.float32, block_size=64,
                                 grads=grads, state_rounding=state_rounding, nonfinite="off")
    assert_same(kernel, reference, state_rounding)


@pytest.mark.parametrize("rounding", ["guided", "stochastic", "nearest"])
@pytest.mark.parametrize("pair", PAIRS)
def test_minifloat_maps_every_pair_and_rounding(sim, pair, rounding):
    """quantization="minifloat" (the default): both states coded from their bits in one pass, the default's
    kernel (guided) and the one that reads the rounding at run time, with and without stochastic writes."""
    dtype, grad_dtype = DTYPE_PAIRS[pair]
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, sizes_of(256), dtype, grad_dtype, steps=3,
                                 quantization="minifloat", state_rounding=rounding,
                                 stochastic_rounding=dtype != torch.float32 and rounding != "nearest")
    assert sim_op.last_kernel_is(sim, "adamw fp32 guided" if rounding == "guided" else "adamw fp32 run-time") or \
        dtype != torch.float32
    assert_same(kernel, reference, f"minifloat {pair} {rounding}")


def wide_gradients(n, block, seed):
    """Per block a few elements far above the rest: second moments at the top entry and, a dozen decades under
    it, at the unsigned map's zero point (code 1); first moments at both ends of the signed map."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 1e-7
    g[::block] = 3.0
    g[block::2 * block] = -3.0  # every other block's largest first moment is negative: the map's bottom
    g[5::block] = 1e-12
    return g


@pytest.mark.parametrize("block_size", [64, 4096])
def test_minifloat_top_entry_and_zero_point(sim, block_size):
    n = 2 * block_size + 3
    grads = [wide_gradients(n, block_size, s) for s in range(3)]
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, [n], torch.float32, block_size=block_size,
                                 grads=grads, quantization="minifloat")
    pk, ok = kernel
    m, v = ok.state[pk[0]]["state1"], ok.state[pk[0]]["state2"]
    assert bool((v == 1).any()) and bool((v == 255).any()) and bool((m >= 254).any()) and bool((m <= 1).any())
    assert_same(kernel, reference, f"top and zero point, block {block_size}")


@pytest.mark.parametrize("quantization", ["minifloat", "dynamic6"])
@pytest.mark.parametrize("scale", [1e-36, 1e33])
def test_blocks_outside_the_fast_codec(sim, quantization, scale):
    """Gradients so small or large that the moments' block maxima leave [2^-100, 2^100] (the minifloat codec
    takes them value by value) and the rule's divisions leave their fast path (the warp runs it again)."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(700, generator=gen) * scale for _ in range(3)]
    for g in grads:
        g[:64] = torch.randn(64, generator=gen)  # one block of ordinary values beside them
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, [700], torch.float32, block_size=64, grads=grads,
                                 quantization=quantization, nonfinite="off")
    assert_same(kernel, reference, f"{quantization} x{scale}")


@pytest.mark.parametrize("quantization", ["dynamic", "linear"])
def test_table_maps_run_their_own_kernel(sim, quantization):
    """Maps coded through their tables take the kernel with FloorTables in shared memory (kCodecTables); the
    minifloat maps take one without them."""
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, [3 * 256 + 7], torch.float32, steps=2,
                                 quantization=quantization)
    assert sim_op.last_kernel_is(sim, "adamw fp32 tables")
    assert_same(kernel, reference, quantization)
    run_pair(sim, ds_q8.AdamW8bitBlock, {}, [300], torch.float32, steps=1, quantization="minifloat")
    assert not sim_op.last_kernel_is(sim, "adamw fp32 tables")


@pytest.mark.parametrize("maps", [("minifloat", "dynamic"), ("dynamic", "minifloat"), ("swapped", "swapped")])
@pytest.mark.parametrize("rounding", [[3, 3], [1, 0]])
def test_mixed_maps_match_the_cpu_op(sim, maps, rounding):
    """A minifloat map beside a table map, or on a state of the other sign, takes the kernel of table maps and
    codes that state value by value (q8_mf_code): the same bits as the CPU op."""
    from ds_q8 import ops

    p, g, s, a, _, _, hyper = _lists(sim, sizes_of(256), torch.float32)
    signed = (True, False)
    names = [m if m != "swapped" else "minifloat" for m in maps]
    signs = [not sg if m == "swapped" else sg for m, sg in zip(maps, signed)]
    code = [F.state_map(name, sg, torch.device("cpu")) for name, sg in zip(names, signs)]
    cpu = ops.load_op("cpu", required=True)
    keys, index = [5 + i for i in range(len(p))], [3 * i for i in range(len(p))]
    q, t, b = [x.clone() for x in p], [[c.clone() for c in st] for st in s], [[c.clone() for c in st] for st in a]
    sim.step_many("adamw", p, g, s, a, code, [sim.build_lookup(c) for c in code], 256, hyper, keys, index,
                  rounding_modes=rounding)
    assert sim_op.last_kernel_is(sim, "adamw fp32 tables")
    cpu.step_many(ops.cpu_isa(), "adamw", q, g, t, b, code, [cpu.build_lookup(c) for c in code], 256, hyper, keys,
                  index, rounding_modes=rounding)
    for x, y in zip(_flat(p, s, a), _flat(q, t, b)):
        assert_same_bits(x, y, f"{maps} {rounding}")


CODEC_CHECKS = ["encode signed", "encode unsigned", "decode", "scale"]


@pytest.mark.parametrize("check", CODEC_CHECKS)
def test_device_codec_value_by_value(sim, check):
    """The minifloat codec's device form against q8_minifloat.h on every value where a decision changes
    (tests/cuda_sim/device_checks.h)."""
    bad, checked = sim_op.device_check(sim, check)
    assert checked > (100 if check == "scale" else 2000) and bad == 0, (bad, checked)


@pytest.mark.parametrize("check", ["division", "square root"])
def test_device_division_and_root_where_fast(sim, check):
    """q8_div_checked and q8_sqrt_checked, wherever they say their fast path is exact, give IEEE's bits with
    approximations of the worst accuracy the PTX ISA allows (ptx_emulation.h); they admit most operands."""
    count = 400_000 if sim_op.BUILD == "plain" else 40_000
    bad, fast = sim_op.device_check(sim, check, count, 11)
    assert bad == 0 and fast > count // 5, (bad, fast)


@pytest.mark.parametrize("states", ["8-bit", "fp32"])
@pytest.mark.parametrize("grad", [p for p in ("bf16", "bf16-fp32grad") if p in PAIRS])
def test_correction_bytes(sim, grad, states):
    """correction_byte=True: bf16 parameters read and written as 24-bit values with their bytes
    (q8_bf16_join / q8_bf16_split), in both kernels; the bytes are state and compared too."""
    dtype, grad_dtype = DTYPE_PAIRS[grad]
    options = dict(correction_byte=True, min_8bit_size=0 if states == "8-bit" else 10 ** 9)
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, sizes_of(256), dtype, grad_dtype, steps=3, **options)
    pk, ok = kernel
    assert all(ok.state[p]["correction"].any() for p in pk if p.numel() > 7)
    assert_same(kernel, reference, f"correction bytes {grad} {states}")


# ---------------------------------------------------------------------------- 4-bit steps

@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
def test_four_bit_state(sim, pair, block_size):
    """optim_bits=4 (ds_q8/format4.py): nibble loads and stores at every tail, v's maximum then r's
    reduced across the T threads (a warp's shuffles at 64, shared memory at 4096), the float32
    second-moment maxima; the bits of the reference."""
    dtype, grad_dtype = DTYPE_PAIRS[pair]
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {"optim_bits": 4}, sizes_of(block_size), dtype,
                                 grad_dtype, block_size=block_size, steps=3)
    pk, ok = kernel
    assert ok.state[pk[-1]]["absmax2"].dtype == torch.float32  # 4-bit state, not 8-bit
    assert_same(kernel, reference, f"4-bit {pair} block_size {block_size}")


@pytest.mark.parametrize("options", [dict(correction_byte=True), dict(stochastic_rounding=False)])
def test_four_bit_state_parameter_writes(sim, options):
    kernel, reference = run_pair(sim, ds_q8.Adam8bitBlock, {"optim_bits": 4}, sizes_of(256), torch.bfloat16,
                                 steps=3, **options)
    assert_same(kernel, reference, f"4-bit {options}")


def test_lists_longer_than_one_launch(sim):
    """40 tensors: one launch per step, each CTA walking tiles of many tensors."""
    sizes = [1 + (37 * i) % 700 for i in range(40)]
    before = launches(sim)
    kernel, reference = run_pair(sim, ds_q8.AdamW8bitBlock, {}, sizes, torch.float32, steps=2)
    assert launches(sim) - before == 2
    assert_same(kernel, reference, "40 tensors")


def test_many_ctas_per_tensor(sim):
    """Tensors of many CTAs each, in one list: the block-to-tensor search across CTA ranges."""
    kernel, reference = run_pair(sim, ds_q8.Adam8bitBlock, {}, [20_000, 3, 9_000, 64 * 8 + 1],
                                 torch.float32, block_size=64, steps=2)
    assert_same(kernel, reference, "many CTAs")


# ---------------------------------------------------------------------------- float32 states

@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rule", list(RULES))
def test_fp32_state_kernel(sim, rule, pair):
    cls, kw = RULES[rule]
    dtype, grad_dtype = DTYPE_PAIRS[pair]
    kernel, reference = run_pair(sim, cls, kw, sizes_of(256) + [2048 + 9], dtype, grad_dtype, steps=2,
                                 min_8bit_size=10 ** 9)
    pk, ok = kernel
    assert not ok.is_8bit_state(ok.state[pk[0]])
    assert_same(kernel, reference, f"fp32 states {rule} {pair}")


# ---------------------------------------------------------------------------- direct op calls

def _lists(sim, sizes, dtype=torch.float32, block_size=256, seed=0, offset=0, states=2, fp32=False):
    """AdamW inputs for step_many (or step_fp32_many): each param/grad a view ``offset`` elements
    into a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n + offset, generator=gen).to(dtype)[offset:] for n in sizes]
    grads = [torch.randn(n + offset, generator=gen).to(dtype)[offset:] for n in sizes]
    opt = ds_q8.AdamW8bitBlock([torch.nn.Parameter(params[0].clone())], block_size=block_size, min_8bit_size=0)
    group = opt.param_groups[0]
    hyper = dict(opt._hyper(group, 3))
    if fp32:
        st = [[torch.rand(n, generator=gen) for _ in range(states)] for n in sizes]
        return params, grads, st, hyper
    maps = opt._maps(group, torch.device("cpu"))
    lookups = [sim.build_lookup(m) for m in maps]
    codes = [[torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for _ in range(states)] for n in sizes]
    absmax = [[torch.rand(-(-n // block_size), generator=gen).to(torch.bfloat16) for _ in range(states)] for n in sizes]
    return params, grads, codes, absmax, maps, lookups, hyper


def _flat(*lists):
    out = []
    for x in lists:
        for t in x:
            out.extend(t if isinstance(t, list) else [t])
    return [t.clone() for t in out]


@pytest.mark.parametrize("offset", [1, 2, 3])  # fp32 views 4, 8 and 12 bytes in
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_offset_views_match_aligned_copies(sim, dtype, offset):
    p, g, s, a, maps, lookups, hyper = _lists(sim, sizes_of(256), dtype, offset=offset)
    q, h, t, b = [x.clone() for x in p], [x.clone() for x in g], [[c.clone() for c in st] for st in s], \
        [[c.clone() for c in st] for st in a]
    sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [])
    sim.step_many("adamw", q, h, t, b, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_flat(p, s, a), _flat(q, t, b)):
        assert_same_bits(x, y, f"offset {offset}")


def test_misaligned_code_views_match_aligned_copies(sim):
    p, g, s, a, maps, lookups, hyper = _lists(sim, [4099, 5000, 257, 8, 16])
    s_off = []
    for k, st in enumerate(s):
        views = []
        for c in st:
            buf = torch.empty(c.numel() + 4, dtype=torch.uint8)
            v = buf[1 + k % 3:1 + k % 3 + c.numel()]
            v.copy_(c)
            views.append(v)
        s_off.append(views)
    q, b = [x.clone() for x in p], [[c.clone() for c in st] for st in a]
    sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [])
    sim.step_many("adamw", q, g, s_off, b, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_flat(p, s, a), _flat(q, s_off, b)):
        assert_same_bits(x, y, "codes views")


def test_skip_flag_set_and_clear(sim):
    args = _lists(sim, sizes_of(256) * 7)  # 42 tensors
    p, g, s, a, maps, lookups, hyper = args
    before = _flat(p, s, a)
    sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [], skip=torch.ones(1, dtype=torch.int32))
    for x, y in zip(_flat(p, s, a), before):
        assert_same_bits(x, y, "skipped step")
    p2, g2, s2, a2 = _lists(sim, sizes_of(256) * 7)[:4]
    sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, [], [], skip=torch.zeros(1, dtype=torch.int32))
    sim.step_many("adamw", p2, g2, s2, a2, maps, lookups, 256, hyper, [], [])
    for x, y in zip(_flat(p, s, a), _flat(p2, s2, a2)):
        assert_same_bits(x, y, "flag 0 against no flag")
    assert not all(torch.equal(x, y) for x, y in zip(_flat(p, s, a), before))

    p, g, st, hyper = _lists(sim, sizes_of(256) * 7, fp32=True)
    before = _flat(p, st)
    sim.step_fp32_many("adamw", p, g, st, hyper, [], [], skip=torch.full((1,), 7, dtype=torch.int32))
    for x, y in zip(_flat(p, st), before):
        assert_same_bits(x, y, "skipped fp32 step")
    sim.step_fp32_many("adamw", p, g, st, hyper, [], [], skip=torch.zeros(1, dtype=torch.int32))
    assert not torch.equal(p[-1], before[len(p) - 1])


def test_unsupported_dtype_pair_is_refused(sim):
    p, g, s, a, maps, lookups, hyper = _lists(sim, [100])
    with pytest.raises(ValueError, match="no CUDA kernel for param"):
        sim.step_many("adamw", p, [x.half() for x in g], s, a, maps, lookups, 256, hyper, [], [])


def test_guided_rounding_outside_the_defaults_form_is_refused(sim):
    """The CUDA step takes guided rounding as state_rounding="guided" gives it (every state 3, by its old
    code) and nearest or stochastic in any mix; a state guided beside one that is not, or a mode that is
    none of these (2), gets an error naming the field, and writes nothing."""
    p, g, s, a, maps, lookups, hyper = _lists(sim, [300, 70])
    keys, index = [11, 12], [0, 0]
    before = _flat(p, s, a)
    for states in ([1, 3], [3, 0]):
        with pytest.raises(ValueError, match="rounding_modes: the CUDA step takes guided rounding only"):
            sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, keys, index, rounding_modes=states)
    for states in ([2, 2], [2, 3], [3, 2], [2, 0]):
        with pytest.raises(ValueError, match="rounding_modes entries must be .*, got 2"):
            sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, keys, index, rounding_modes=states)
    for x, y in zip(_flat(p, s, a), before):
        assert_same_bits(x, y, "refused step")
    for states in ([3, 3], [1, 0], [0, 1], [1, 1], [0, 0]):  # adamw: m signed, v unsigned
        sim.step_many("adamw", p, g, s, a, maps, lookups, 256, hyper, keys, index, rounding_modes=states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_guided_default_runs_its_own_kernel(sim, dtype):
    """state_rounding="guided" (the default) launches step_kernel's kGuided instance, every other rounding
    the kernel that reads it at run time: both give the reference's bits, so only the launch tells them
    apart."""
    name = "fp32" if dtype == torch.float32 else "bf16"
    for rounding, kernel in (("guided", "guided"), ("stochastic", "run-time"), ("nearest", "run-time"),
                             ("stochastic_unsigned", "run-time")):
        ours, reference = run_pair(sim, ds_q8.AdamW8bitBlock, dict(state_rounding=rounding), [3 * 256 + 7], dtype,
                                   steps=2)
        assert sim_op.last_kernel_is(sim, f"adamw {name} {kernel}"), rounding
        other = "run-time" if kernel == "guided" else "guided"
        assert not sim_op.last_kernel_is(sim, f"adamw {name} {other}"), rounding
        assert_same(ours, reference, rounding)


def test_telemetry_sums_match_the_cpu_op(sim):
    """The kernels' requantization error sums (atomicAdd of doubles) against the CPU op's."""
    sizes = sizes_of(256)
    reports = []
    for use_sim in (True, False):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        opt = ds_q8.AdamW8bitBlock(params, block_size=256, min_8bit_size=0, impl="kernel")
        opt.track_quantization(1)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.numel(), generator=gen)
            if use_sim:
                with sim_op.as_cpu_op(sim):
                    opt.step()
            else:
                opt.step()
        reports.append(opt.quantization_report())
    assert reports[0]["measured_step"] == reports[1]["measured_step"] == 2
    for name, total in reports[1]["states"].items():
        assert total["rel_error"] > 0
        assert reports[0]["states"][name] == pytest.approx(total, rel=1e-9), name
    for mine, theirs in zip(reports[0]["params"], reports[1]["params"]):
        for name in reports[1]["states"]:
            assert mine[name] == pytest.approx(theirs[name], rel=1e-9), (mine["param"], name)


# ---------------------------------------------------------------------------- (de)quantize

@pytest.mark.parametrize("quantization", ["dynamic", "minifloat"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantize_and_dequantize(sim, dtype, block_size, quantization):
    gen = torch.Generator().manual_seed(block_size)
    for signed in (True, False):
        code = F.state_map(quantization, signed, torch.device("cpu"))
        lookup = sim.build_lookup(code)
        for n in sizes_of(block_size):
            x = torch.randn(n, generator=gen).to(dtype) * 3
            x = x if signed else x.abs()
            codes, absmax = sim.quantize(x, code, lookup, block_size)
            rc, ra = F.quantize_blockwise(x, code, block_size)
            assert_same_bits(codes, rc, f"codes n={n}")
            assert_same_bits(absmax, ra, f"absmax n={n}")
            out = sim.dequantize(codes, absmax, code, block_size, dtype)
            assert_same_bits(out, F.dequantize_blockwise(rc, ra, code, block_size, dtype), f"dequantize n={n}")


#: where build_lookup flags the segment search's tables and the step's floor tables (q8_cuda_api.h:
#: kLookupSize words of the nearest-code table, the 128-word FastMap, its flag; the floor flag is 4th from the end)
FAST_FLAG, FLOOR_FLAG = (0xC000 - 0x3FFF + 1) + 128, -4


@pytest.mark.parametrize("quantization", ["minifloat", "dynamic6", "dynamic"])
def test_the_maps_of_a_quantization_get_the_search_and_floor_tables(sim, quantization):
    """The CUDA op's tables for every state map of these quantizations: the step rounds by one floor-table
    read and the (de)quantize kernels search by segments; none takes the exact search."""
    for signed in (True, False):
        lookup = sim.build_lookup(F.state_map(quantization, signed, torch.device("cpu")))
        assert int(lookup[FAST_FLAG]) == 1 and int(lookup[FLOOR_FLAG]) == 1, signed
    no_tables = sim.build_lookup(F.create_linear_map(signed=True))  # no zero entry: no segment search
    assert int(no_tables[FAST_FLAG]) == 0 and int(no_tables[FLOOR_FLAG]) == 1


def test_quantize_misaligned_views(sim):
    code = F.state_map("dynamic", True, torch.device("cpu"))
    lookup = sim.build_lookup(code)
    base = torch.randn(3000)
    for offset in (1, 2, 3):
        x = base[offset:offset + 2500]
        codes, absmax = sim.quantize(x, code, lookup, 256)
        rc, ra = F.quantize_blockwise(x.contiguous(), code, 256)
        assert_same_bits(codes, rc, f"offset {offset}")
        assert_same_bits(absmax, ra, f"offset {offset}")


# ---------------------------------------------------------------------------- planted bugs
# Each: (build that must report it, what it is, text of the .cu, the same text with the bug behind
# Q8_SIM_BUG(n), the tests to run, what the report must say).
PLANTED = {
    1: ("tsan", "a __syncthreads removed from the block reduction",
        "    if ((threadIdx.x & 31) == 0) red[warp] = local;\n    __syncthreads();\n",
        "    if ((threadIdx.x & 31) == 0) red[warp] = local;\n    if (!Q8_SIM_BUG(1)) __syncthreads();\n",
        "test_every_block_size_and_tail and adamw-1024", "ThreadSanitizer: data race"),
    2: ("asan", "threads past the end return before the shuffles of the block reduction",
        "    const uint16_t stored = q8_absmax_store(qblock_absmax(local, Tq, red));\n",
        "    if (Q8_SIM_BUG(2) && !live) return;\n    const uint16_t stored = q8_absmax_store(qblock_absmax(local, Tq, red));\n",
        "test_quantize_and_dequantize and dtype0-256", "lane(s) of its warp"),
    3: ("asan", "an off-by-one in the dequantize kernel's tail",
        "    const int cnt = (int)(numel - start < kElems ? numel - start : kElems);\n    uint32_t c[kElems];\n",
        "    const int cnt = (int)(numel - start < kElems ? numel - start + (Q8_SIM_BUG(3) ? 1 : 0) : kElems);\n"
        "    uint32_t c[kElems];\n",
        "test_quantize_and_dequantize and dtype0-256", "AddressSanitizer: heap-buffer-overflow"),
    4: ("asan", "16-byte loads through an 8-byte-aligned pointer",
        "void load_words(const void* p, uint32_t (&w)[kWords], int align) {\n    if (kWords % 4 == 0 && align >= 16) {",
        "void load_words(const void* p, uint32_t (&w)[kWords], int align) {\n"
        "    if (kWords % 4 == 0 && align >= (Q8_SIM_BUG(4) ? 8 : 16)) {",
        "test_offset_views_match_aligned_copies and dtype0-2", "misaligned address"),
    5: ("asan", "the wrong tensor for a tile from the list",
        "        while (list.first_tile[t + 1] <= tile) ++t;\n",
        "        while (Q8_SIM_BUG(5) ? list.first_tile[t + 1] < tile : list.first_tile[t + 1] <= tile) ++t;\n",
        "test_lists_longer_than_one_launch", "differ"),
}


def planted_copy() -> str:
    """The device code with every planted bug behind its switch, at a stable path (so its builds are
    cached); returns the copy of q8_cuda_kernels.cu, beside the copies of the files it includes."""
    folder = os.path.join(sim_op.build_dir(), "ds_q8_cuda_sim_planted")
    os.makedirs(folder, exist_ok=True)
    sources = {os.path.basename(p): open(p).read() for p in sim_op.device_sources(os.path.dirname(sim_op.CU))}
    for n, (_, what, old, new, _, _) in PLANTED.items():
        holders = [name for name, text in sources.items() if text.count(old) == 1]
        assert len(holders) == 1 and sum(t.count(old) for t in sources.values()) == 1, \
            f"planted bug {n} ({what}): its text is no longer in the device code once"
        sources[holders[0]] = sources[holders[0]].replace(old, new)
    for name, text in sources.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
    return os.path.join(folder, "q8_cuda_kernels.cu")


def _run_planted(build, bug, select):
    return sim_op.run_sanitized(build, [__file__, "-x", "-k", select],
                                env={"Q8_SIM_KERNELS": planted_copy(), "Q8_SIM_BUG": str(bug),
                                     "Q8_SIM_WATCHDOG_S": "20"}, timeout=300)


@functools.lru_cache(maxsize=None)
def clean_run(build: str):
    """This file's matrix in a process with the ``build``'s runtime, on the planted copy with no bug switched on:
    the shipped device code but for the five switches, all off. One build per sanitizer then serves both this
    run and the planted bugs, and this run is every planted bug's control (the copy passes without its bug)."""
    return sim_op.run_sanitized(build, [__file__], env={"Q8_SIM_KERNELS": planted_copy()},
                                timeout=600)  # the tests that start these runs skip in them


# the first test of each build pays for its clean run (below: 600 s at most) and then one sanitized run of a
# few tests (300 s at most)
@pytest.mark.timeout(960)
@pytest.mark.skipif(not PARENT, reason="runs from the plain build's process")
@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_are_reported(bug):
    build, what, _, _, select, report = PLANTED[bug]
    control = clean_run(build)  # the copy with no bug active passes every test, the selected ones among them
    assert control.returncode == 0, f"the planted copy without its bug fails:\n{control.stdout[-3000:]}" \
                                    f"\n{control.stderr[-3000:]}"
    run = _run_planted(build, bug, select)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and report in out, f"planted bug {bug} ({what}) was not reported as {report!r} " \
                                                  f"by the {build} build (rc {run.returncode}):\n{out[-4000:]}"


# ---------------------------------------------------------------------------- sanitizer builds

SANITIZER_REPORTS = ("ThreadSanitizer", "AddressSanitizer", "runtime error:", "LeakSanitizer")


# 1.5 min each on the 2-core machine, the build included, the machine idle (4-7 min before the harness ran
# fibers, in CI with the other worker busy): the run's limit is 600 s, and the test's a little above it
@pytest.mark.timeout(660)
@pytest.mark.skipif(not PARENT, reason="runs from the plain build's process")
@pytest.mark.parametrize("build", ["tsan", "asan"])
def test_sanitized_builds_are_clean(build):
    """This file's matrix again, in a process with the build's runtime: every test passes, no report."""
    run = clean_run(build)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"the {build} build failed (rc {run.returncode}):\n{out[-6000:]}"
    found = [r for r in SANITIZER_REPORTS if r in out]
    assert not found, f"the {build} build reported {found}:\n{out[-6000:]}"
    assert " passed" in run.stdout and "failed" not in run.stdout
