#!/usr/bin/env bash
# Fetch into .whl/ (ignored by git) the wheels that gpu_check/gpu_check.sh installs on a GPU machine
# without network access: DeepSpeed (built here as a pure-Python wheel) and its missing needs, and
# the peers of the bench (bitsandbytes, torchao). PY_VERSION is the GPU machine's Python (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    bitsandbytes==0.50.2 torchao==0.18.0 hjson annotated-types typing-inspection typing-extensions pydantic
# pydantic pins one pydantic-core release exactly
core=$(unzip -p .whl/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "pydantic-core==$core"
deepspeed=$("$PY" -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1 || true)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w .whl "deepspeed${deepspeed:+==$deepspeed}"
du -sh .whl
ls .whl
