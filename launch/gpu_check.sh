#!/usr/bin/env bash
# Every GPU check of the CUDA kernels in one run of about 6 minutes on one CUDA GPU (H200-sized):
#   0. preflight: nvidia-smi, python imports (torch with CUDA, ds_q8 from this tree): stops at once
#      when one fails;
#   1. build: ptxas figures of every kernel (launch/ptxas_report.py; 0 B stack, 0 spills), then the
#      JIT build of the op for the visible GPU, full logs in $OUT;
#   2. compute-sanitizer memcheck and racecheck on a small workload ("device not supported" is a skip);
#   3. correctness: kernels against the pure-PyTorch reference at block sizes 64-4096, sizes
#      {1, 7, bs-1, bs+1, 3bs+7, 2^31+4099}, offset views, fp32/fp16/bf16 params with fp32 or 16-bit
#      grads, every rule, float32 states, the skip flag, a side stream (launch/gpu_check.py), and the
#      GPU tests of tests/test_cuda_build.py, tests/test_cuda_multi.py and tests/test_cuda_skip.py;
#   4. speed by CUDA events (median of 5): the raw kernel against copy bandwidth, the optimizer step
#      against torch fused AdamW and bitsandbytes AdamW8bit, at 1.5e9 fp32 parameters and on the
#      GPT-2 XL tensor list.
# Prints PASS/FAIL lines; writes stages.jsonl (one JSON line per stage, as it finishes),
# gpu_check_*.json (one entry per check, rewritten as it goes), the logs and summary.txt to $OUT
# (default out/gpu_check). Exit status: non-zero when any stage failed.
#   OUT=DIR bash launch/gpu_check.sh          the run
#   DRY_RUN=1 OUT=DIR bash launch/gpu_check.sh  prints the stages and the checks' plan; needs no GPU
# Packages the machine lacks (deepspeed, bitsandbytes, ...) can come as wheels in .whl/
# (launch/gpu_wheels.sh fetches them on a machine with network access).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
N=${N:-1500000000}
source launch/python.sh  # PY: PYTHON, the active or .venv environment, else python3
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ext_cache}
if [ -z "${CUDA_HOME:-}" ]; then
    CUDA_HOME=$("$PY" ds_q8/op_builder/toolkit.py 2>/dev/null || true)
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
fi
start=$(date +%s)
failed=0
: > "$OUT/stages.jsonl"

# stage NAME TIMEOUT_S LOG COMMAND...: runs it with a time limit, logs stdout+stderr, records the result
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    if [ "$DRY_RUN" = 1 ]; then
        echo "stage $name (limit ${limit}s, log $OUT/$log): $*"
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
    rc=$?
    grep -E '^(PASS|FAIL|INFO|SKIP) ' "$OUT/$log" || true
    if [ $rc -eq 0 ]; then echo "PASS stage $name ($(( $(date +%s) - t0 )) s)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "FAIL stage $name: over its ${limit}s limit; see $OUT/$log"
    else echo "FAIL stage $name: exit $rc; last lines of $OUT/$log:"; tail -n 15 "$OUT/$log"
    fi
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "log": "%s"}\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
        "$log" >> "$OUT/stages.jsonl"
    [ $rc -eq 0 ] || failed=1
    return $rc
}

if [ "$DRY_RUN" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_q8_site \
        .whl/*.whl > "$OUT/wheels.log" 2>&1 || { echo "FAIL preflight: installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/ds_q8_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# ---- 0. preflight: fail fast
if [ "$DRY_RUN" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
    cat "$OUT/gpu.txt"
fi
stage preflight 120 preflight.log "$PY" -c '
import os, sys, torch
import ds_q8, deepspeed
from ds_q8 import functional, ops
from ds_q8.op_builder import Q8CUDABuilder
here = os.path.dirname(os.path.dirname(os.path.abspath(ds_q8.__file__)))
assert os.path.samefile(here, os.getcwd()), f"ds_q8 comes from {here}, not from this tree"
assert torch.version.cuda, f"torch {torch.__version__} is a CPU-only build"
assert torch.cuda.is_available(), "no CUDA GPU visible"
print(f"PASS preflight: torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__},",
      torch.cuda.get_device_name(), f"CUDA_HOME={os.environ.get(\"CUDA_HOME\")}")
try:
    import bitsandbytes
    print(f"INFO bitsandbytes {bitsandbytes.__version__}")
except Exception as exc:
    print(f"INFO bitsandbytes unavailable ({exc}): its speed rows will be skipped")
' || { echo "FAIL preflight: nothing else can run"; exit 1; }

# ---- 1. builds: the ptxas report (an sm_90 object) compiles while the op builds
stage ptxas 240 ptxas.log "$PY" launch/ptxas_report.py --log "$OUT/ptxas_nvcc.log" --json "$OUT/ptxas.json" &
ptxas_pid=$!
stage build 300 build.log "$PY" -c '
import time
from ds_q8 import ops
from ds_q8.op_builder import Q8CUDABuilder
t = time.time()
module = Q8CUDABuilder().load(verbose=True)
print(f"PASS build: CUDA op loaded after {time.time() - t:.0f} s")
' || { echo "FAIL build: nothing else can run"; wait "$ptxas_pid"; exit 1; }
wait "$ptxas_pid" || failed=1

# ---- 2. compute-sanitizer on a small workload
SAN=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
if [ "$DRY_RUN" = 1 ] || [ -x "$SAN" ]; then
    for tool in memcheck racecheck; do
        before=$failed
        stage "sanitizer-$tool" 150 "sanitizer_$tool.log" "$SAN" --tool "$tool" --error-exitcode 3 \
            "$PY" launch/gpu_check.py sanitize
        if [ "$DRY_RUN" != 1 ] && grep -qiE "device (is )?not supported|not supported on this device" \
            "$OUT/sanitizer_$tool.log"; then
            echo "SKIP sanitizer-$tool: device not supported by compute-sanitizer"
            failed=$before
        fi
    done
else
    echo "SKIP sanitizer: compute-sanitizer not found"
fi

# ---- 3. correctness
stage correctness 240 correctness.log "$PY" launch/gpu_check.py correctness --out "$OUT"
stage gpu-tests 240 gpu_tests.log "$PY" -m pytest -q -rs -p no:cacheprovider -x tests/test_cuda_multi.py \
    tests/test_cuda_skip.py tests/test_cuda_build.py -k "not compiles_and_imports and not registers"

# ---- 4. speed
stage speed 240 speed.log "$PY" launch/gpu_check.py speed --n "$N" --out "$OUT"

# ---- 5. DeepSpeed fp16 overflow skips and the multi-tensor GPU tests (last: the slowest to start)
stage deepspeed-gpu 150 deepspeed_gpu.log "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_multi_tensor.py \
    tests/test_engine_faults.py -k "cuda or fp16"

if [ "$DRY_RUN" = 1 ]; then
    for s in correctness speed sanitize; do "$PY" launch/gpu_check.py "$s" --dry-run --out "$OUT" || failed=1; done
    exit $failed
fi
verdict=$([ $failed -eq 0 ] && echo PASS || echo FAIL)
echo "$verdict gpu_check: $(( $(date +%s) - start )) s; stages in $OUT/stages.jsonl" | tee "$OUT/summary.txt"
exit $failed
