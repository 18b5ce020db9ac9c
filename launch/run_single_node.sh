#!/usr/bin/env bash
# Train on one machine with the deepspeed launcher: one rank per GPU (or NUM_GPUS CPU ranks).
#
#   launch/run_single_node.sh [train_gpt.py arguments...]
#   NUM_GPUS=8 launch/run_single_node.sh --model gpt2-xl --deepspeed_config ds_configs/gpt2_xl_8bit_zero2.json
#
# NUM_GPUS     ranks to start (default: every visible GPU, or 1 without GPUs)
# MASTER_PORT  rendezvous port (default 29500); pick another when two jobs share a machine
# PYTHON       the interpreter (default: see launch/python.sh); the ranks run the same one
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS=$("$PY" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
if ! [[ "$NUM_GPUS" =~ ^[1-9][0-9]*$ ]]; then
  echo "NUM_GPUS must be an integer >= 1, got '$NUM_GPUS'" >&2
  exit 2
fi
exec "$PY" -m deepspeed.launcher.runner --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}" launch/train_gpt.py "$@"
