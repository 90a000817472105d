"""Loaders over a cache: indexed (random access), ordered (storage order), shuffled (training).

The public names are imported on first use (PEP 562), so that importing a light submodule
(``actcache.loaders.options``, e.g. for config validation) loads neither torch nor the C kernel.
"""

from __future__ import annotations

from actcache.lazy import lazy_names

# public name -> the submodule that defines it
_LAZY = {
    "IndexedDataset": "actcache.loaders.indexed",
    "OrderedLoader": "actcache.loaders.ordered",
    "ShuffledLoader": "actcache.loaders.shuffled",
    "LoaderOptions": "actcache.loaders.options",
}

__all__ = ["IndexedDataset", "LoaderOptions", "OrderedLoader", "ShuffledLoader"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
