# Sourced (from the checkout's root) by gpu_check/gpu_check.sh and gpu_check/gpu_train.sh: what a run on a GPU
# machine needs in its environment.
#   PY                    the interpreter (launch/python.sh)
#   TORCH_EXTENSIONS_DIR  .ext_cache/ of this checkout unless set: every JIT build lands there once, and
#                         every later stage and process loads it from there
#   CUDA_HOME             the toolkit ds_q8's finder names (nvcc on PATH followed), else /usr/local/cuda
#   install_wheels LOG    installs $WHEELS/*.whl (WHEELS: default .whl/, WHEELS= none) into /tmp/ds_q8_site
#                         and puts that first on PYTHONPATH; returns 1, pip's output in LOG, when pip fails.
#                         gpu_check/gpu_wheels.sh builds .whl/ on a machine with network access.
source launch/python.sh
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ext_cache}
if [ -z "${CUDA_HOME:-}" ]; then
    CUDA_HOME=$("$PY" ds_q8/op_builder/toolkit.py 2>/dev/null || true)
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
fi
WHEELS=${WHEELS-.whl}

install_wheels() {
    [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null || return 0
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ds_q8_site \
        "$WHEELS"/*.whl > "$1" 2>&1 || return 1
    export PYTHONPATH=/tmp/ds_q8_site${PYTHONPATH:+:$PYTHONPATH}
}
