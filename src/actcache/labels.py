"""Optional per-image class labels stored beside a cache, invisible to protocol-v1 readers.

    <HASH>/labels.npy    int64 (n_imgs,): class index per image, -1 for an unlabelled image
    <HASH>/labels.json   {"format": "actcache-labels", "version": 1, "n_imgs": N, "classes": [...]}

Neither file is part of the hash or of shards.json, so v1 readers ignore them and a cache with or
without labels is the same cache.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

from actcache.errors import ProtocolError
from actcache.fsutil import atomic_write_bytes

LABELS_NPY = "labels.npy"
LABELS_JSON = "labels.json"


def write_labels(path: str, labels: np.ndarray, class_names: list[str] | None) -> None:
    labels = np.asarray(labels, dtype=np.int64)
    if labels.ndim != 1:
        raise ProtocolError(f"labels must be 1-D (one per image), got shape {labels.shape}")
    n_classes = int(labels.max()) + 1 if labels.size and labels.max() >= 0 else 0
    if class_names is None:
        class_names = [str(i) for i in range(n_classes)]
    if len(class_names) < n_classes or labels.min(initial=0) < -1:
        raise ProtocolError(
            f"labels reference class {n_classes - 1} (or below -1) but {len(class_names)} class names were given"
        )
    buf = io.BytesIO()
    np.save(buf, labels)
    atomic_write_bytes(os.path.join(path, LABELS_NPY), buf.getvalue())
    doc = {"format": "actcache-labels", "version": 1, "n_imgs": int(labels.size), "classes": list(class_names)}
    atomic_write_bytes(os.path.join(path, LABELS_JSON), (json.dumps(doc, indent=2) + "\n").encode())


def _load_npy(npath: str) -> np.ndarray:
    """labels.npy, a regular file (a FIFO would block np.load), no pickles; ProtocolError naming it."""
    import stat

    try:
        fd = os.open(npath, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ProtocolError(f"{npath}: not a regular file. Delete labels.* or re-dump.")
            return np.load(fh, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ProtocolError(f"{npath}: cannot read the labels array ({err}). Delete labels.* or re-dump.") from None


def read_labels(path: str, n_imgs: int) -> tuple[np.ndarray, list[str]] | None:
    """(labels, class_names), or None when the cache has no labels."""
    jpath, npath = os.path.join(path, LABELS_JSON), os.path.join(path, LABELS_NPY)
    if not os.path.exists(jpath):
        return None
    from actcache.protocol import read_json

    doc = read_json(jpath)
    if not isinstance(doc, dict) or doc.get("format") != "actcache-labels" or not isinstance(doc.get("classes"), list):
        raise ProtocolError(f"{jpath}: not an actcache labels file (needs format and classes). Delete it or re-dump.")
    labels = _load_npy(npath)
    if labels.shape != (n_imgs,) or labels.dtype.kind != "i":
        raise ProtocolError(
            f"{npath}: holds {labels.dtype} {labels.shape}, expected int ({n_imgs},) — one label per image. "
            "Delete labels.* or re-dump."
        )
    if labels.size and (labels.max() >= len(doc["classes"]) or labels.min() < -1):
        raise ProtocolError(f"{npath}: labels outside [-1, {len(doc['classes'])}); delete labels.* or re-dump.")
    return labels.astype(np.int64, copy=False), [str(c) for c in doc["classes"]]
