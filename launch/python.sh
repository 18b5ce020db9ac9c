# Sourced by the launch scripts: sets PY, the Python interpreter of the environment the job runs in.
# Never a bare `python` from PATH, which on a machine whose packages live in a virtual environment is
# an interpreter without torch. In order:
#   PYTHON         set by the caller (the tests set it to their own interpreter);
#   VIRTUAL_ENV    the activated virtual environment's bin/python;
#   .venv          this checkout's environment, made by `make`;
#   python3        on PATH, for installs outside any virtual environment.
# The folder of PY goes first on PATH, as activating the environment would put it: the environment's
# own mpiexec/mpirun (pip's mpich) and ninja are found before any others, also by DeepSpeed's launchers.
_ds_q8_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
  PY=$VIRTUAL_ENV/bin/python
elif [[ -x "$_ds_q8_root/.venv/bin/python" ]]; then
  PY=$_ds_q8_root/.venv/bin/python
else
  PY=$(command -v python3 || true)
fi
if [[ -z "$PY" ]] || ! command -v "$PY" >/dev/null 2>&1; then
  echo "no Python interpreter found: set PYTHON, activate a virtual environment or run 'make install'" >&2
  exit 2
fi
PY=$(command -v "$PY")
export PATH="$(dirname "$PY"):$PATH"
unset _ds_q8_root
