"""Packages whose public names are imported on first use (PEP 562), so that importing one light
submodule (for config validation or planning) does not load torch or the C kernel."""

from __future__ import annotations

import importlib


def lazy_names(package: str, where: dict[str, str], namespace: dict):
    """``__getattr__`` and ``__dir__`` for ``package``: ``where`` maps each public name to the
    submodule defining it; ``namespace`` is the package's ``globals()``, where a name is kept once
    imported so that later look-ups skip ``__getattr__``."""

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *where])

    return __getattr__, __dir__
