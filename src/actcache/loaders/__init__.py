"""Loaders over a cache: indexed (random access), ordered (storage order), shuffled (training).

The public names are imported on first use (PEP 562), so that importing a light submodule
(``actcache.loaders.options``, e.g. for config validation) loads neither torch nor the C kernel.
"""

from __future__ import annotations

import importlib

# public name -> the submodule that defines it
_LAZY = {
    "IndexedDataset": "actcache.loaders.indexed",
    "OrderedLoader": "actcache.loaders.ordered",
    "ShuffledLoader": "actcache.loaders.shuffled",
    "LoaderOptions": "actcache.loaders.options",
}

__all__ = ["IndexedDataset", "LoaderOptions", "OrderedLoader", "ShuffledLoader"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'actcache.loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
