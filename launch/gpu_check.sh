#!/usr/bin/env bash
# Every GPU check of the CUDA kernels in one run, for a machine with one CUDA GPU:
#   1. JIT-build the CUDA op for the visible GPU and import it;
#   2. the GPU tests: codes and parameters bit-identical to the reference, multi-tensor steps,
#      DeepSpeed fp16 overflow skips;
#   3. the bench at N parameters (default 1.5e9): ds_q8 against torch's fused AdamW, bitsandbytes and
#      torchao where installed, and the device's copy bandwidth.
# Packages the machine lacks (deepspeed, bitsandbytes, torchao, ...) can come as wheels in .whl/:
# launch/gpu_wheels.sh fetches them on a machine with network access.
# Writes gpu.txt, build.log, tests.log, bench.log, bench_cuda.json and summary.txt to $OUT
# (default out/gpu_check). Exit status: non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
N=${N:-1500000000}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_q8_site \
        .whl/*.whl || { echo "installing .whl/ failed" | tee "$OUT/summary.txt"; exit 1; }
    export PYTHONPATH=/tmp/ds_q8_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/build.log"
import time
import torch
from ds_q8 import ops
assert torch.cuda.is_available(), "no CUDA GPU visible"
t = time.time()
module = ops.load_op("cuda")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: CUDA op",
      "loaded" if module is not None else "NOT loaded", f"after {time.time() - t:.0f} s")
raise SystemExit(0 if module is not None else 1)
PYEOF
build=$?

"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py tests/test_multi_tensor.py \
    tests/test_engine_faults.py -k "(cuda or fp16) and not compiles_and_imports" 2>&1 | tee "$OUT/tests.log"
tests=$?

"$PY" -m ds_q8.bench --device cuda --n "$N" --no-reference --skip foreach --many 1000 4096 --reps 5 \
    --json "$OUT/bench_cuda.json" 2>&1 | tee "$OUT/bench.log"
bench=$?

echo "build rc=$build, tests rc=$tests, bench rc=$bench; $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"
[ "$build" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
