"""actcache: cache Vision-Transformer activations on disk (protocol v1) and train SAEs on them."""

from actcache.errors import ActCacheError
from actcache.protocol import Metadata

__version__ = "0.1.0"


def __getattr__(name):
    # ActivationCache pulls in numpy only; kept lazy so `import actcache` stays cheap.
    if name == "ActivationCache":
        from actcache.cache import ActivationCache

        return ActivationCache
    raise AttributeError(f"module 'actcache' has no attribute {name!r}")


__all__ = ["ActCacheError", "ActivationCache", "Metadata", "__version__"]
