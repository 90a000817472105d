"""IndexedDataset: a torch map-style Dataset over a cache (random access, one vector per item)."""

from __future__ import annotations

import os

import numpy as np
import torch

from actcache.cache import ActivationCache
from actcache.loaders.buffers import as_tensor
from actcache.loaders.common import Selection


class IndexedDataset(torch.utils.data.Dataset):
    """Every selected vector of the cache as one item.

    patches in {"cls", "image", "all"}; layer a recorded layer value or "all". Item i is a dict:
    act (D,) float32 tensor (out_dtype="stored": a 16-bit cache's own values), image_i, patch_i (-1 for CLS), layer (the layer value), token
    (position on the stored token axis). Items are ordered image-major, then layer, then token.
    """

    def __init__(
        self, path: str | os.PathLike | ActivationCache, patches: str = "image", layer: int | str = -2,
        out_dtype: str = "float32",
    ):  # fmt: skip
        self.cache = path if isinstance(path, ActivationCache) else ActivationCache.open(path, out_dtype=out_dtype)
        self.metadata = self.cache.metadata
        self.sel = Selection(self.metadata, patches, layer)

    @property
    def d_vit(self) -> int:
        return self.metadata.d_vit

    def __len__(self) -> int:
        return self.sel.n_examples

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if isinstance(i, (np.integer,)):
            i = int(i)
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"IndexedDataset index must be an int, got {type(i).__name__}")
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} examples")
        img, layer, token, patch = self.sel.decode(i)
        layer = int(layer)
        vec = self.cache[img, layer, int(token)]
        return {
            "act": as_tensor(np.array(vec)),
            "image_i": int(img),
            "patch_i": int(patch),
            "layer": layer,
            "token": int(token),
        }
