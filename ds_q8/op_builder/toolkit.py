"""Where the CUDA toolkit is: ``CUDA_HOME`` when set, else found (no torch import, no package imports).

torch guesses the toolkit from the ``nvcc`` on PATH; where that is a wrapper script outside the
toolkit (``/usr/local/bin/nvcc`` on some machines) it guesses ``/usr/local`` and linking fails with
``cannot find -lcudart``. :func:`find_cuda_home` follows ``nvcc`` to a real toolkit or falls back
to ``/usr/local/cuda``. ``python ds_q8/op_builder/toolkit.py`` prints the answer (the Makefile
exports it before anything imports torch's extension builder).
"""
from __future__ import annotations

import glob
import os
import shutil
from typing import Optional


def is_toolkit(path: Optional[str]) -> bool:
    """A CUDA toolkit: bin/nvcc and the runtime library to link against."""
    if not path:
        return False
    libs = [os.path.join(path, d, "libcudart.so") for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux",
                                                                                          "lib"))]
    return os.path.isfile(os.path.join(path, "bin", "nvcc")) and any(os.path.exists(p) for p in libs)


def find_cuda_home() -> Optional[str]:
    """``CUDA_HOME`` (or ``CUDA_PATH``) when set; else the toolkit of the ``nvcc`` on PATH followed
    through links; else ``/usr/local/cuda`` or the newest ``/usr/local/cuda-*``; else None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return next((c for c in candidates if is_toolkit(c)), None)


if __name__ == "__main__":
    print(find_cuda_home() or "")
