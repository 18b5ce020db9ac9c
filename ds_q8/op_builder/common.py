"""What both ds_q8 builders add to DeepSpeed's OpBuilder.

* Sources live in this package's ``csrc/``, not in DeepSpeed's tree, so every path is absolute.
* DeepSpeed's ``load()`` imports a prebuilt module only when its own ``installed_ops`` lists it,
  which never holds for an op built by another package. ``load()`` here imports the module that
  ``setup.py`` prebuilt (``ds_q8._q8_cpu`` / ``ds_q8._q8_cuda``) first and JIT-compiles otherwise.
"""
import glob
import hashlib
import importlib
import os

from deepspeed.ops.op_builder.builder import OpBuilder

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def csrc(*parts: str) -> str:
    return os.path.join(CSRC, *parts)


def headers() -> list:
    """Every header in csrc/: the C++ ones (``.h``) and the CUDA step's (``.cuh``), sorted."""
    return sorted(glob.glob(csrc("**", "*.h"), recursive=True) + glob.glob(csrc("**", "*.cuh"), recursive=True))


def headers_define() -> str:
    """``-DQ8_HEADERS=<digest of every header in csrc/>``, for the compiler flags.

    torch's JIT cache rebuilds an op when its sources or flags change, not its headers; most of the
    kernels live in headers, so their digest goes into the flags and a changed header rebuilds."""
    digest = hashlib.sha1()
    for path in headers():
        digest.update(os.path.relpath(path, CSRC).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"-DQ8_HEADERS={digest.hexdigest()[:16]}"


class PrebuiltFirstMixin:
    """``load()``: the prebuilt extension if importable, else a JIT build (cached by torch)."""

    def absolute_name(self):
        return f"ds_q8.{self.name}"

    def include_paths(self):
        return [csrc("includes")]

    #: the op in the notice printed before a first (JIT) build, and how long that takes
    DESCRIPTION = ("ds_q8 kernels", "about a minute")

    def load(self, verbose=False):
        cache = OpBuilder._loaded_ops
        if self.name in cache:
            return cache[self.name]
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError:
            from .notice import announce

            announce(self.name, list(self.sources()) + headers(), *self.DESCRIPTION)
            module = self.jit_load(verbose)
        cache[self.name] = module
        return module
