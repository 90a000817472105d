"""Per-cache activation statistics for ``scale_norm``: the mean L2 norm of each recorded layer.

``scale_norm=True`` in a loader scales every activation by ``sqrt(d_vit) / mean_norm`` so the
mean L2 norm becomes sqrt(d_vit) (as in the seed's ShuffledConfig). The mean norm is computed
once per cache from a bounded, evenly spaced sample of images (at most ``MAX_IMGS``), for each
layer and each token kind ("cls", "image" = patch tokens, "all"), and stored beside the cache::

    <dump_to>/<HASH>/actcache-stats.json
    {"version": 1, "n_imgs_sampled": 256, "d_vit": 768,
     "layers": {"-2": {"all": 27.1, "image": 26.9, "cls": 41.0}, ...}}

It is written atomically (``actcache.fsutil.atomic_write_bytes``) and is not part of protocol
v1: other readers ignore it. A cache directory that is not writable still works (the statistic
is then recomputed by each process, with a warning). Nothing is written into a cache another tool
wrote (``metadata.foreign``, e.g. a saev cache): its statistic is kept in this process's memory.
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings

import numpy as np

from actcache.dtypes import to_float32
from actcache.fsutil import atomic_write_bytes

STATS_FILE = "actcache-stats.json"
VERSION = 1
MAX_IMGS = 256
KINDS = ("all", "image", "cls")

_lock = threading.Lock()
_in_memory: dict[str, dict] = {}  # real path -> statistic of a foreign cache


def sample_images(n_imgs: int, max_imgs: int = MAX_IMGS) -> np.ndarray:
    """Evenly spaced image indices (all of them when there are few)."""
    k = min(n_imgs, max_imgs)
    return np.unique(np.linspace(0, n_imgs - 1, k).round().astype(np.int64))


def compute(cache, max_imgs: int = MAX_IMGS) -> dict:
    """Mean L2 norm per layer and token kind over a sample of images (reads <= max_imgs images)."""
    md = cache.metadata
    imgs = sample_images(md.n_imgs, max_imgs)
    L = len(md.layers)
    sums = {k: np.zeros(L) for k in KINDS}
    counts = {k: 0 for k in KINDS}
    c = int(md.cls_token)
    for i in imgs.tolist():
        acts = cache[i]
        acts = acts if acts.dtype == np.float32 else to_float32(acts, md.dtype)  # opened with out_dtype="stored"
        norms_LT = np.linalg.norm(acts, axis=-1).astype(np.float64)
        sums["all"] += norms_LT.sum(axis=1)
        counts["all"] += norms_LT.shape[1]
        sums["image"] += norms_LT[:, c:].sum(axis=1)
        counts["image"] += norms_LT.shape[1] - c
        if c:
            sums["cls"] += norms_LT[:, 0]
            counts["cls"] += 1
    layers = {}
    for li, value in enumerate(md.layers):
        layers[str(value)] = {k: float(sums[k][li] / counts[k]) for k in KINDS if counts[k]}
    return {"version": VERSION, "n_imgs_sampled": int(len(imgs)), "d_vit": md.d_vit, "layers": layers}


def _valid(doc, md) -> bool:
    try:
        return (
            doc["version"] == VERSION and doc["d_vit"] == md.d_vit and all(str(v) in doc["layers"] for v in md.layers)
        )
    except (KeyError, TypeError):
        return False


def load_or_compute(cache, max_imgs: int = MAX_IMGS) -> dict:
    """The stored statistic, computed and written on first use."""
    if getattr(cache.metadata, "foreign", False):
        # Always from the whole cache on disk (not a training view of it), so that every process,
        # a resumed run and an export all get the same factor.
        from actcache.cache import ActivationCache

        key = os.path.realpath(cache.path)
        with _lock:
            if key not in _in_memory:
                _in_memory[key] = compute(ActivationCache.open(cache.path), max_imgs)
            return _in_memory[key]
    path = os.path.join(cache.path, STATS_FILE)
    with _lock:
        try:
            with open(path, "rb") as fd:
                doc = json.loads(fd.read().decode("utf-8"))
            if _valid(doc, cache.metadata):
                return doc
        except (OSError, ValueError):
            pass
        doc = compute(cache, max_imgs)
        try:
            atomic_write_bytes(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        except OSError as err:
            warnings.warn(f"could not store {path} ({err}); the norm statistic is recomputed each time", stacklevel=2)
        return doc


def scale_factors(cache, sel) -> list[float]:
    """sqrt(d_vit) / mean norm for each selected layer (in the selection's layer order)."""
    doc = load_or_compute(cache)
    md = cache.metadata
    out = []
    for li in sel.layer_idx:
        mean = doc["layers"][str(md.layers[li])][sel.patches]
        out.append(math.sqrt(md.d_vit) / mean if mean > 0 else 1.0)
    return out
