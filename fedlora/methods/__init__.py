"""Federated LoRA methods, one module each, registered by name (``get_method("rolora")``).

Every module of this package is imported here, so a new method only has to exist and carry the
``@register`` decorator; its class is also exported under its own name.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import (AveragedFactors, Method, Objective, RankSlots, RuntimeFacts, Sampler, available_methods, build,
                   create_method, get_method, method_parameters, register, resolve_options)

_INFRA = {"base", "hypergradient"}
for _m in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if _m not in _INFRA and not _m.startswith("_"):
        _mod = _importlib.import_module(f"{__name__}.{_m}")
        for _name in getattr(_mod, "__all__", ()):
            globals()[_name] = getattr(_mod, _name)

__all__ = ["Method", "AveragedFactors", "FactorLoRA", "Objective", "RankSlots", "RuntimeFacts", "Sampler",
           "available_methods", "build", "create_method", "get_method", "method_parameters", "register",
           "resolve_options"] + sorted(
    n for n, v in list(globals().items()) if isinstance(v, type) and issubclass(v, Method) and v is not Method)
