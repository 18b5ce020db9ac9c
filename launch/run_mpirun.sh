#!/usr/bin/env bash
# Train with ranks started by mpirun/mpiexec directly, without the deepspeed launcher. DeepSpeed reads
# rank and world size from MPI through mpi4py (pip install mpi4py, plus an MPI such as pip's mpich).
#
#   NP=2 launch/run_mpirun.sh [train_gpt.py arguments...]
#   NP=16 MPI_ARGS="-hosts node1,node2 -ppn 8" launch/run_mpirun.sh --model gpt2-xl ...
#
# NP           number of ranks (default 2)
# MPIRUN       the MPI starter (default mpiexec: the environment's own, e.g. pip's mpich, first)
# PYTHON       the interpreter of the ranks (default: see launch/python.sh)
# MPI_ARGS     extra arguments for it (hosts, binding)
# MASTER_PORT  rendezvous port for torch.distributed (default 29500)
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
NP=${NP:-2}
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
  echo "NP must be an integer >= 1, got '$NP'" >&2
  exit 2
fi
# shellcheck disable=SC2086  # MPI_ARGS is a list of words
exec "${MPIRUN:-mpiexec}" -n "$NP" ${MPI_ARGS:-} "$PY" launch/train_gpt.py --master_port "${MASTER_PORT:-29500}" "$@"
