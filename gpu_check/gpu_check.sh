#!/usr/bin/env bash
# Every GPU check of the CUDA kernels in one command of at most 540 s on one CUDA GPU (an H200 with
# 16 cores), stages in the order that answers first:
#   preflight    torch with CUDA, DeepSpeed, ds_q8 from this tree, a visible GPU; builds nothing and
#                stops everything with one STOP line (exit 2) when one is missing
#   build        the CUDA op and the CPU op, at the same time (every compile of the run is here), and
#                when asked the earlier kernel's op (OLD=DIR, gpu_check/kernel_compare.py) and the ops of
#                the training stage (TRAIN_OPS=1, for gpu_check/gpu_train.sh on the same machine next)
#   op-errors    what happens when the CUDA op raises (gpu_check/op_errors.py): the compilers and C++ runtime
#                of torch and of the op, each refused call in its own process, cuda-gdb's backtrace of one
#                that dies
#   correctness  pytest -m "gpu and not multirank" tests (gpu_check/gpu_check.py correctness): the kernels
#                against the pure-PyTorch reference, bit for bit (tests/test_gpu_kernels.py: block sizes
#                64-4096, sizes {1, 7, bs-1, bs+1, 3bs+7}, every rule, dtype pair, float32 states, offset
#                views, a side stream, the skip flag, (de)quantize, one 2^31+4099-element tensor) and the
#                other GPU tests (multi-tensor launches, on-device skips, CPU against GPU); a JSON report
#   speed        gpu_check/kernel_compare.py speed: copy, torch fused AdamW, the earlier (OLD) and current
#                kernels, AdamW8bitBlock.step(), bitsandbytes, at N parameters (fp32, and bf16 in place)
#                and over GPT-2 XL's 580 tensors, host time apart; TARGET lines (never a failure)
#   sanitizer    compute-sanitizer memcheck and racecheck on a small workload, ds_q8 kernels only
#   profile      Nsight Compute (ncu) on the earlier and current 8-bit step kernels and the 4-bit one:
#                one INFO line each (DRAM and SM throughput, occupancy, registers, issue rate, instructions,
#                shared-memory wavefronts and bank conflicts, DRAM bytes, stall reasons); the full table
#                in profile.log
#   deepspeed    pytest -m "gpu and multirank": the DeepSpeed fp16 overflow skips
# Each stage has its own limit, cut to what is left of BUDGET_S (540). ptxas figures are CI's
# (tests/test_cuda_build.py), not this script's.
#
# Output: at most 3 files in $OUT (default out/gpu_check): summary.json (every stage and check),
# gpu_check.log (this script's lines) and logs.tar.gz (each stage's full log and JSON).
#   OUT=DIR bash gpu_check/gpu_check.sh            the run; exit 0 when every stage passed, 2 on STOP
#   DRY_RUN=1 OUT=DIR bash gpu_check/gpu_check.sh  the stages and the checks' plan; needs no GPU
# Packages the machine lacks (deepspeed, bitsandbytes, ...) can come as wheels in .whl/
# (gpu_check/gpu_wheels.sh builds them on a machine with network access); WHEELS=DIR names another
# folder, WHEELS= none.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
N=${N:-1500000000}
BUDGET_S=${BUDGET_S:-540}
OLD=${OLD:-}            # a csrc folder of an earlier kernel (kernel_compare.py snapshot), to compare against
TRAIN_OPS=${TRAIN_OPS:-0}
DRY_RUN=${DRY_RUN:-0}
source gpu_check/gpu_env.sh  # PY, TORCH_EXTENSIONS_DIR, CUDA_HOME, WHEELS and install_wheels
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)  # stage logs and JSON: packed into $OUT/logs.tar.gz at the end
start=$(date +%s)
failed=0
stopped=0
: > "$WORK/stages.jsonl"
exec > >(tee "$OUT/gpu_check.log") 2>&1

# summary.json and logs.tar.gz from $WORK, whatever happened before
pack() {
    [ "$DRY_RUN" = 1 ] && { rm -rf "$WORK"; return; }
    "$PY" - "$WORK" "$OUT/summary.json" "$failed" "$stopped" "$(( $(date +%s) - start ))" "$BUDGET_S" <<'PYEOF'
import glob, json, os, sys
work, path, failed, stopped, seconds, budget = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
stages = [json.loads(line) for line in open(os.path.join(work, "stages.jsonl")) if line.strip()]
checks = {}
for f in sorted(glob.glob(os.path.join(work, "gpu_check_*.json"))):
    with open(f) as fh:
        checks[os.path.basename(f)[10:-5]] = json.load(fh)
gpu = open(os.path.join(work, "gpu.txt")).read().strip() if os.path.exists(os.path.join(work, "gpu.txt")) else None
verdict = "STOP" if stopped else ("FAIL" if failed else "PASS")
with open(path, "w") as fh:
    json.dump({"verdict": verdict, "seconds": seconds, "budget_s": budget, "gpu": gpu, "stages": stages,
               "checks": checks}, fh, indent=1)
PYEOF
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" .
    rm -rf "$WORK"
}
trap pack EXIT

# stage NAME LIMIT_S LOG COMMAND...: runs it within min(LIMIT_S, what is left of the budget), logs
# stdout+stderr to $WORK/LOG, prints its PASS/FAIL/TARGET/INFO/SKIP/STOP lines and a verdict line
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    if [ "$DRY_RUN" = 1 ]; then
        echo "stage $name (limit ${limit}s, log $log): $*"
        return 0
    fi
    local left=$(( BUDGET_S - ($(date +%s) - start) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "SKIP stage $name: the ${BUDGET_S} s budget is spent"
        printf '{"stage": "%s", "rc": null, "seconds": 0, "log": null, "skipped": "budget"}\n' "$name" \
            >> "$WORK/stages.jsonl"
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$WORK/$log" 2>&1
    rc=$?
    grep -E '^(PASS|FAIL|INFO|SKIP|STOP|TARGET) ' "$WORK/$log" || true
    if [ $rc -eq 0 ]; then echo "PASS stage $name ($(( $(date +%s) - t0 )) s)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "FAIL stage $name: over its ${limit} s limit; see $log"
    elif [ $rc -ne 2 ]; then echo "FAIL stage $name: exit $rc; last lines of $log:"; tail -n 15 "$WORK/$log"
    fi
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "limit": %d, "log": "%s"}\n' "$name" "$rc" \
        "$(( $(date +%s) - t0 ))" "$limit" "$log" >> "$WORK/stages.jsonl"
    [ $rc -eq 0 ] || failed=1
    return $rc
}

if [ "$DRY_RUN" != 1 ] && ! install_wheels "$WORK/wheels.log"; then
    echo "STOP preflight: installing $WHEELS/ failed (see wheels.log)"
    stopped=1
    exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# ---- preflight: stops the run at once when a stage could not run
stage preflight 45 preflight.log "$PY" gpu_check/gpu_check.py preflight
rc=$?
if [ $rc -ne 0 ]; then
    [ $rc -eq 2 ] || echo "STOP preflight: exit $rc (see preflight.log in logs.tar.gz); nothing else can run"
    stopped=1
    exit 2
fi
if [ "$DRY_RUN" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt" 2>&1 || true
    cat "$WORK/gpu.txt"
fi

# ---- build: every compile of the run
build_args=()
[ -n "$OLD" ] && build_args+=(--earlier "$OLD")
[ "$TRAIN_OPS" = 1 ] && build_args+=(--train-ops)
stage build 150 build.log "$PY" gpu_check/gpu_check.py build "${build_args[@]}" || {
    echo "STOP build: nothing else can run"; stopped=1; exit 2; }

# ---- an error raised in the CUDA op: does it reach Python as an exception?
stage op-errors 90 op_errors.log "$PY" gpu_check/op_errors.py

# ---- correctness: the GPU tests (pytest -m gpu), each a PASS/FAIL/SKIP line and a row of its JSON report
stage correctness 110 correctness.log "$PY" gpu_check/gpu_check.py correctness --out "$WORK"

# ---- speed: figures against targets
old_args=()
[ -n "$OLD" ] && old_args+=(--old "$OLD")
stage speed 120 speed.log "$PY" gpu_check/kernel_compare.py speed "${old_args[@]}" --n "$N" \
    --json "$WORK/gpu_check_speed.json"

# ---- compute-sanitizer on a small workload: ds_q8's kernels only, no caching allocator hiding overruns
SAN=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
if [ "$DRY_RUN" = 1 ] || [ -x "$SAN" ]; then
    for tool in memcheck racecheck; do
        before=$failed
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage "sanitizer-$tool" 30 "sanitizer_$tool.log" "$SAN" --tool "$tool" \
            --kernel-name kns=ds_q8 --error-exitcode 3 "$PY" gpu_check/gpu_check.py sanitize
        if [ "$DRY_RUN" != 1 ] && grep -qiE "device (is )?not supported|not supported on this device" \
            "$WORK/sanitizer_$tool.log"; then
            echo "SKIP sanitizer-$tool: device not supported by compute-sanitizer"
            failed=$before
        fi
    done
else
    echo "SKIP sanitizer: compute-sanitizer not found"
fi

# ---- Nsight Compute on the step kernels: where their time goes (figures, never a failure)
NCU=$(command -v ncu || echo "$CUDA_HOME/bin/ncu")
if [ "$DRY_RUN" = 1 ] || [ -x "$NCU" ]; then
    # the earlier and the current kernel twice each, then the 4-bit one twice (kernel_compare.py profile),
    # or without OLD the 8-bit and 4-bit steps of gpu_check.py profile (the second of each)
    if [ -n "$OLD" ]; then workload=(gpu_check/kernel_compare.py profile --old "$OLD"); launches=(0 6)
    else workload=(gpu_check/gpu_check.py profile); launches=(1 2); fi
    sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis
              --section WarpStateStats --csv --page details)
    counters=$("$PY" -c "import sys; sys.path.insert(0, 'gpu_check'); import gpu_check as g; print(','.join(g.PROFILE_COUNTERS))")
    stalls=$("$PY" -c "import sys; sys.path.insert(0, 'gpu_check'); import gpu_check as g; print(g.PROFILE_STALLS)")
    stage profile 90 profile.log "$NCU" --clock-control none --kernel-name "regex:step4?_kernel" \
        --launch-skip "${launches[0]}" --launch-count "${launches[1]}" "${sections[@]}" \
        --metrics "$counters,$stalls" "$PY" "${workload[@]}"
    if [ "$DRY_RUN" != 1 ] && grep -q "Failed to find metric" "$WORK/profile.log"; then  # the sections alone
        echo "INFO profile: a counter is unknown to this ncu; profiling with the sections only"
        stage profile-sections 45 profile.log "$NCU" --clock-control none --kernel-name "regex:step4?_kernel" \
            --launch-skip "${launches[0]}" --launch-count "${launches[1]}" "${sections[@]}" "$PY" "${workload[@]}"
    fi
    [ "$DRY_RUN" = 1 ] || "$PY" gpu_check/gpu_check.py ncu-summary "$WORK/profile.log"
else
    echo "SKIP profile: ncu not found"
fi

# ---- the multi-rank GPU tests: DeepSpeed's fp16 overflow skips (last: the slowest to start)
stage deepspeed-gpu 40 deepspeed_gpu.log "$PY" -m pytest -q -rs -p no:cacheprovider -m "gpu and multirank" tests

if [ "$DRY_RUN" = 1 ]; then
    for s in correctness sanitize profile; do "$PY" gpu_check/gpu_check.py "$s" --dry-run --out "$OUT" || failed=1; done
    exit $failed
fi
verdict=$([ $failed -eq 0 ] && echo PASS || echo FAIL)
echo "$verdict gpu_check: $(( $(date +%s) - start )) s of the ${BUDGET_S} s budget; summary.json, logs.tar.gz in $OUT"
exit $failed
