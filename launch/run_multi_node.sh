#!/usr/bin/env bash
# Train on several machines listed in a hostfile, started by the deepspeed launcher.
#
#   HOSTFILE=launch/hostfile LAUNCHER=pdsh launch/run_multi_node.sh [train_gpt.py arguments...]
#
# HOSTFILE     "hostname slots=N" per machine (see launch/hostfile.example); default launch/hostfile
# LAUNCHER     how the ranks are started on the machines:
#                pdsh     ssh to each host (default; needs pdsh and password-less ssh)
#                openmpi  mpirun of Open MPI; ranks learn their place from MPI through mpi4py
#                mpich    mpirun of MPICH (e.g. pip install mpich)
# MASTER_ADDR  address of the first host as the others reach it (default: the launcher's choice)
# MASTER_PORT  rendezvous port (default 29500)
# LAUNCHER_ARGS extra arguments for the pdsh/mpirun command, passed through --launcher_args
# PYTHON       the interpreter (default: see launch/python.sh); every host runs the one at the same path
#
# The repository must be at the same path on every host, with the same Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
HOSTFILE=${HOSTFILE:-launch/hostfile}
LAUNCHER=${LAUNCHER:-pdsh}
case "$LAUNCHER" in
  pdsh|openmpi|mpich) ;;
  *) echo "LAUNCHER must be one of pdsh, openmpi, mpich; got '$LAUNCHER'" >&2; exit 2 ;;
esac
if [[ ! -f "$HOSTFILE" ]]; then
  echo "HOSTFILE '$HOSTFILE' does not exist; copy launch/hostfile.example and list your machines" >&2
  exit 2
fi
ARGS=(--hostfile "$HOSTFILE" --launcher "$LAUNCHER" --master_port "${MASTER_PORT:-29500}")
if [[ -n "${MASTER_ADDR:-}" ]]; then ARGS+=(--master_addr "$MASTER_ADDR"); fi
if [[ -n "${LAUNCHER_ARGS:-}" ]]; then ARGS+=(--launcher_args "$LAUNCHER_ARGS"); fi
# one host in the file would otherwise be started as a local job, skipping the chosen launcher
if [[ "$(grep -cv '^\s*\(#\|$\)' "$HOSTFILE")" == 1 ]]; then ARGS+=(--force_multi --no_ssh_check); fi
exec "$PY" -m deepspeed.launcher.runner "${ARGS[@]}" launch/train_gpt.py "$@"
