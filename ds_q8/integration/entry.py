"""Where DeepSpeed first meets a ds_q8 optimizer: the one DeepSpeed hook ``import ds_q8`` installs.

``import ds_q8`` imports no DeepSpeed and patches none of its private places. When DeepSpeed is
imported (before or after ds_q8), its public ``deepspeed.initialize`` is wrapped, and nothing else.
A call of it installs the whole patch table (``integration.patches``) before DeepSpeed builds
anything, when the call hands DeepSpeed a ds_q8 optimizer:

* an optimizer instance of a ds_q8 class;
* a config (``config``, ``config_params``, or the file of ``args.deepspeed_config``) whose
  ``"optimizer": {"type": ...}`` names a ds_q8 class, as DeepSpeed resolves it (case aside);
* an optimizer callable that returns a ds_q8 optimizer: the table is installed when it returns, inside
  the engine's ``_configure_optimizer``, so the rows that run after that method are run for this
  engine once ``initialize`` returns.

Calls for other optimizers patch nothing. ``ds_q8.register_with_deepspeed()`` installs the table at once.
"""
from __future__ import annotations

import base64
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from typing import Callable, Optional


def after_import(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is, else right after its
    import runs (nothing is imported here)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it for ``name`` and has the module's own loader
    call ``callback`` after the module ran, then leaves ``sys.meta_path``."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        # a file loader is made for this one module, so its exec_module can be wrapped for it alone
        if isinstance(spec.loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self.callback(module)

            spec.loader.exec_module = exec_module
        return spec


def read_config(config) -> Optional[dict]:
    """A DeepSpeed config as DeepSpeed accepts it (a dict, a JSON file's path, base64 of JSON), or None
    where it is none of those (DeepSpeed then reports it)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        return None
    try:
        if os.path.isfile(config):
            with open(config) as f:
                return json.load(f)
        return json.loads(base64.urlsafe_b64decode(str(config)).decode("utf-8"))
    except (OSError, ValueError):
        return None


def _config_of(arguments: dict):
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    args = arguments.get("args")
    for field in ("deepspeed_config", "deepscale_config"):
        if getattr(args, field, None) is not None:
            config = getattr(args, field)
    return read_config(config)


def names_ds_q8(arguments: dict, ours: Callable[[object], bool], type_names) -> bool:
    """Whether a call's arguments give DeepSpeed a ds_q8 optimizer, or a config that names one."""
    if ours(arguments.get("optimizer")):
        return True
    config = _config_of(arguments) or {}
    section = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    return str(section.get("type", "")).lower() in {n.lower() for n in type_names}


def guard(original: Callable, install: Callable, late: Callable, ours: Callable, type_names) -> Callable:
    """``deepspeed.initialize`` that calls ``install()`` first when it meets a ds_q8 optimizer (see the
    module's docstring); ``late(engine)`` runs the rows it missed when a callable made the optimizer."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        try:
            call = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # DeepSpeed's own error
        made = []
        maker = call.arguments.get("optimizer")
        if names_ds_q8(call.arguments, ours, type_names):
            install()
        elif callable(maker) and not hasattr(maker, "param_groups"):
            @functools.wraps(maker)
            def make(params):
                optimizer = maker(params)
                if ours(optimizer):
                    install()
                    made.append(optimizer)
                return optimizer

            call.arguments["optimizer"] = make
        result = original(*call.args, **call.kwargs)
        if made:
            late(result[0] if isinstance(result, tuple) else result)
        return result

    return initialize
