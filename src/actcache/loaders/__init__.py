"""Loaders over a cache: indexed (random access), ordered (storage order), shuffled (training)."""

from actcache.loaders.indexed import IndexedDataset

__all__ = ["IndexedDataset", "OrderedLoader", "ShuffledLoader"]


def __getattr__(name):
    if name == "OrderedLoader":
        from actcache.loaders.ordered import OrderedLoader

        return OrderedLoader
    if name == "ShuffledLoader":
        from actcache.loaders.shuffled import ShuffledLoader

        return ShuffledLoader
    raise AttributeError(f"module 'actcache.loaders' has no attribute {name!r}")
