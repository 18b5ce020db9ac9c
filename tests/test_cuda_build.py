"""The CUDA op: it compiles without a GPU (so CI catches build errors), and on a GPU its steps and
(de)quantization are bit-identical to the pure-PyTorch reference run on the same GPU."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import ds_q8
from ds_q8 import functional as F
from ds_q8.optim import rules
from ds_q8.op_builder import Q8CUDABuilder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_check"))
import ptxas_report  # noqa: E402

from helpers.compare import DTYPES, RULES, assert_quantization_matches, assert_same_bits, assert_same_run, run_both

pytestmark = pytest.mark.slow

GPU = torch.cuda.is_available()


def test_nvcc_flags_keep_ieee_rounding(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST") or "9.0")
    args = Q8CUDABuilder().nvcc_args()
    assert "-fmad=false" in args and "--use_fast_math" not in args
    assert "-ffp-contract=off" in Q8CUDABuilder().cxx_args()


def test_architecture_specific_entries_build_as_their_plain_architecture(monkeypatch):
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed's parser cannot read."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a 8.0+PTX;10.0f;9.0")
    args = Q8CUDABuilder().nvcc_args()
    gencode = [a for a in args if a.startswith("-gencode")]
    assert gencode == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80",
                       "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_100,code=sm_100"]


@pytest.mark.skipif(GPU, reason="a GPU is visible, so the architecture can be probed")
def test_incompatible_without_gpu_or_arch_list_says_why(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    b = Q8CUDABuilder()
    assert not b.is_compatible()
    assert "TORCH_CUDA_ARCH_LIST" in b.error_log or "CPU-only" in b.error_log or "CUDA toolkit" in b.error_log


@pytest.fixture(scope="module")
def built():
    """The CUDA op, built once for this file, and what its build printed. Without a GPU it is built for
    sm_90 with DS_Q8_PTXAS_VERBOSE=1, so the log holds ptxas's report of every kernel (nothing where the
    build was cached)."""
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build")
    with pytest.MonkeyPatch.context() as mp:
        if not GPU:  # (with a GPU the op's other tests load the default build: no second one for the report)
            mp.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST") or "9.0")
            mp.setenv("DS_Q8_PTXAS_VERBOSE", "1")
        b = Q8CUDABuilder()
        assert b.is_compatible(), b.error_log
        # the build's compiler output goes to file descriptor 1 (torch runs ninja on it): read it there
        with tempfile.TemporaryFile(mode="w+") as log:
            sys.stdout.flush()
            saved = os.dup(1)
            os.dup2(log.fileno(), 1)
            try:
                module = b.load(verbose=True)
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
            log.seek(0)
            return module, log.read()


def test_cuda_extension_compiles_and_imports(built):
    """A build error in the CUDA sources fails here, with or without a GPU."""
    module, _ = built
    # every rule Python knows has its functor, and no other
    assert set(module.rules()) == {r.kernel for r in vars(rules).values() if isinstance(r, rules.Rule) and r.has_kernel}
    # the table, the segment search's tables (512 bytes) and a word saying they are usable, then from the
    # next 16-byte boundary the step's floor tables (q8_floortable.h) and a word saying they are
    table_size = 0xC000 - 0x3FFF + 1
    fast_flag = table_size + 512 // 4
    floor_at = (fast_flag + 1 + 3) // 4 * 4
    floor_words = 2 * (0x3F80 - 0x3480 + 1) + 2 * 256 + 256 + 256 + 2
    lookup = module.build_lookup(F.create_dynamic_map(True))
    assert lookup.dtype == torch.int32 and lookup.numel() == floor_at + floor_words + 4
    assert lookup[fast_flag].item() == 1 and lookup[floor_at + floor_words].item() == 1
    linear = module.build_lookup(F.create_linear_map(signed=True))
    assert linear[fast_flag].item() == 0  # no zero entry: no segment search
    assert linear[floor_at + floor_words].item() == 1  # but floor tables
    assert module.limits() == {"min_block_size": F.MIN_BLOCK_SIZE, "max_block_size": F.MAX_BLOCK_SIZE,
                               "max_states": F.MAX_STATES}


@pytest.mark.gpu
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n,block_size", [(3 * 256 + 7, 256), (4096 * 2 + 33, 4096), (100, 64), (5000, 2048)])
def test_cuda_step_bit_identical(rule, dtype, n, block_size):
    cls, kw = RULES[rule]
    kernel, reference = run_both(cls, kw, n, DTYPES[dtype], steps=4, block_size=block_size, device="cuda")
    assert_same_run(kernel, reference)


@pytest.mark.gpu
def test_cuda_step_fp32_grads_and_offset_views():
    kernel, reference = run_both(ds_q8.AdamW8bitBlock, {}, 3001, torch.bfloat16, steps=3, block_size=128,
                                 grad_dtype=torch.float32, device="cuda")
    assert_same_run(kernel, reference)


@pytest.mark.gpu
def test_cuda_matches_cpu_kernels():
    """Same math on both devices: 10 AdamW steps give the same codes and params on CPU and GPU."""
    n = 50_000
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(10)]
    out = []
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(p0.clone().to(device))
        opt = ds_q8.AdamW8bitBlock([p], block_size=256)
        for g in grads:
            p.grad = g.to(device)
            opt.step()
        out.append((p.detach().cpu(), {k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}))
    assert_same_bits(out[0][0], out[1][0], "param")
    for key in out[0][1]:
        assert_same_bits(out[0][1][key], out[1][1][key], key)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_quantize_dequantize_match_reference(dtype):
    n, block_size = 4096 * 3 + 100, 2048
    x = (torch.randn(n) * torch.logspace(-8, 3, n)).to(DTYPES[dtype]).cuda()
    x[:block_size] = 0
    assert_quantization_matches(x, F.create_dynamic_map(True), block_size)


def test_kernels_keep_every_array_in_registers(built):
    """ptxas reports a 0-byte stack frame and no spills for every kernel: read from the build's log, or
    where the build was cached, from gpu_check/ptxas_report.py compiling the kernels again."""
    from ds_q8.op_builder.cuda import use_cuda_home

    rows = ptxas_report.parse(built[1])
    if rows:
        assert not ptxas_report.bad(rows), ptxas_report.bad(rows)
        return
    if not use_cuda_home():
        pytest.skip("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "gpu_check", "ptxas_report.py")], capture_output=True,
                          text=True, cwd=root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "PASS ptxas" in proc.stdout and " 0 with a stack frame or spills" in proc.stdout, out[-6000:]


def test_architectures_below_volta_are_left_out():
    """__grid_constant__ kernel parameters need compute capability 7.0 or later."""
    b = Q8CUDABuilder()
    assert b.filter_ccs(["6.1", "7.0", "9.0+PTX"]) == [["7", "0"], ["9", "0+PTX"]]
