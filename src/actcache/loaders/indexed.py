"""IndexedDataset: a torch map-style Dataset over a cache (random access, one vector per item).

Each item is read with one pread from the shard file through the cache's guarded reads
(:class:`actcache.shardguard.ShardFiles`), not out of a memory mapping: a shard truncated
meanwhile gives a short read (a LoaderError naming it), never SIGBUS; a shard replaced or written
to since the cache was opened is refused after the read, before the item is returned; with
``verify_reads="first"`` each checksum block is checked the first time the process reads it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from actcache.cache import ActivationCache
from actcache.dtypes import to_float32
from actcache.loaders.buffers import as_tensor
from actcache.loaders.common import Selection
from actcache.shardguard import DEFAULT_VERIFY_READS


class IndexedDataset(torch.utils.data.Dataset):
    """Every selected vector of the cache as one item.

    patches in {"cls", "image", "all"}; layer a recorded layer value or "all". Item i is a dict:
    act (D,) float32 tensor (out_dtype="stored": a 16-bit cache's own values), image_i, patch_i (-1 for CLS), layer (the layer value), token
    (position on the stored token axis). Items are ordered image-major, then layer, then token.
    token_labels=True (a saev cache with labels.bin): also token_label, the patch's label (-1 for CLS).
    """

    def __init__(
        self, path: str | os.PathLike | ActivationCache, patches: str = "image", layer: int | str = -2,
        out_dtype: str = "float32", verify_reads: str = DEFAULT_VERIFY_READS, token_labels: bool = False,
    ):  # fmt: skip
        # (an ActivationCache given keeps its own out_dtype and verify_reads)
        self.cache = (
            path if isinstance(path, ActivationCache)
            else ActivationCache.open(path, out_dtype=out_dtype, verify_reads=verify_reads)
        )  # fmt: skip
        self.metadata = self.cache.metadata
        self.sel = Selection(self.metadata, patches, layer)
        self.token_labels_NP = None
        if token_labels:
            from actcache.saev import read_token_labels

            self.token_labels_NP = read_token_labels(self.cache.path, self.metadata)

    def close(self) -> None:
        """Close the shard files (they are opened again on the next read)."""
        self.cache.close()

    def _read(self, img: int, layer_i: int, token: int) -> np.ndarray:
        """Vector (image, layer position, token) with one pread from its shard file."""
        md = self.metadata
        shard, local = divmod(img, md.n_imgs_per_shard)
        offset = ((local * len(md.layers) + layer_i) * md.n_tokens_per_img + token) * md.d_vit * md.itemsize
        stored = np.empty(md.d_vit, md.storage)
        self.cache.files.read_into(shard, offset, stored)
        return to_float32(stored, md.dtype) if self.cache.convert else stored

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
        vec = self._read(int(img), self.metadata.layer_index(layer), int(token))
        item = {
            "act": as_tensor(vec),
            "image_i": int(img),
            "patch_i": int(patch),
            "layer": layer,
            "token": int(token),
        }
        if self.token_labels_NP is not None:
            item["token_label"] = int(self.token_labels_NP[img, patch]) if patch >= 0 else -1
        return item
