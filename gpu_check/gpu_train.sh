#!/usr/bin/env bash
# The training stage of the GPU check, in one command of at most BUDGET_S (540) seconds on one CUDA GPU:
# GPT-2 XL at full depth (1.56e9 parameters, context 1024) trained with each shipped config through the
# deepspeed launcher, one launch per row, after the ops they need are built (gpu_check/gpu_train.py says
# which rows, the micro batch and the time budget, and why).
#
# Output in $OUT (default out/gpu_train): train_table.md (the table), train.json (every figure, the commit,
# the GPU), gpu_train.log (this script's lines) and train_logs.tar.gz (each build's and row's log).
#   OUT=DIR bash gpu_check/gpu_train.sh [gpu_check/gpu_train.py options]   exit 0 when every row that ran passed,
#                                                                     1 on a FAIL, 2 on STOP
#   DRY_RUN=1 OUT=DIR bash gpu_check/gpu_train.sh                       the rows and their command lines
# Packages the machine lacks come as wheels in .whl/ (gpu_check/gpu_env.sh); COMMIT=... names the code's
# commit where the copy of the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_train}
BUDGET_S=${BUDGET_S:-540}
DRY_RUN=${DRY_RUN:-0}
start=$(date +%s)
source gpu_check/gpu_env.sh  # PY, TORCH_EXTENSIONS_DIR, CUDA_HOME, WHEELS and install_wheels
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu_train.log") 2>&1

if [ "$DRY_RUN" = 1 ]; then
    set -- --dry-run "$@"
else
    wheels_log=$(mktemp)
    if ! install_wheels "$wheels_log"; then
        echo "STOP wheels: installing $WHEELS/ failed:"
        tail -n 15 "$wheels_log"
        exit 2
    fi
    rm -f "$wheels_log"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" gpu_check/gpu_train.py --out "$OUT" --budget_s $(( BUDGET_S - ($(date +%s) - start) )) "$@"
