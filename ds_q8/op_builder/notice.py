"""One line before a one-time compile, so that a first run says why it sits still.

Torch JIT-compiles an extension into ``$TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``)
and reuses it while it is newer than its sources. :func:`announce` prints a line when that will not
be the case: for ds_q8's ops and for the DeepSpeed ops that ds_q8's programs trigger.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Iterable, Optional


def _build_directory(name: str) -> Optional[str]:
    try:  # torch's own answer, when this torch has it
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(name, verbose=False)
    except Exception:  # noqa: BLE001 - a private helper of torch; without it no notice, no harm
        return None


def will_compile(name: str, sources: Iterable[str]) -> bool:
    """Whether loading extension ``name`` compiles it: no built module, or one older than a source."""
    folder = _build_directory(name)
    if folder is None:
        return False
    built = glob.glob(os.path.join(folder, f"{name}*.so"))
    if not built:
        return True
    newest_build = max(os.path.getmtime(f) for f in built)
    return any(os.path.getmtime(s) > newest_build for s in sources if os.path.exists(s))


def announce(name: str, sources: Iterable[str], what: str, duration: str) -> bool:
    """Print ``building <what> (once, <duration>)`` when extension ``name`` will be compiled."""
    sources = list(sources)
    if not will_compile(name, sources):
        return False
    print(f"building {what} (once, {duration}; cached in {_build_directory(name)})", file=sys.stderr, flush=True)
    return True


def announce_deepspeed_op(builder_cls, what: str, duration: str) -> bool:
    """The same for a DeepSpeed op builder (its JIT build prints only when it is done)."""
    try:
        builder = builder_cls()
        sources = [builder.deepspeed_src_path(s) for s in builder.strip_empty_entries(builder.sources())]
        return announce(builder.name, sources, what, duration)
    except Exception:  # noqa: BLE001 - a notice must never stop the program
        return False
