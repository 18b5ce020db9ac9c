"""8-bit block-wise optimizers.

Every module of this package that defines an :class:`Optimizer8bitBlock` subclass (a public name
that does not start with an underscore) is imported here, and the class exported: an optimizer is
added by writing its module, nothing else. Their names are also their DeepSpeed JSON ``"type"`` names.
"""
import importlib as _importlib
import inspect as _inspect
import pkgutil as _pkgutil

from .base import Optimizer8bitBlock

__all__ = ["Optimizer8bitBlock"]

for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name, _obj in _inspect.getmembers(_module, _inspect.isclass):
        if (issubclass(_obj, Optimizer8bitBlock) and _obj is not Optimizer8bitBlock and not _name.startswith("_")
                and _obj.__module__ == _module.__name__):
            globals()[_name] = _obj
            __all__.append(_name)
