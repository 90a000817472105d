"""Write caches the way saev's current release (protocol "2.1") does, from the format facts alone:
``<root>/saev/shards/<h>/`` with a field-order metadata.json, ``n_examples`` in shards.json, every
shard file full size (the last zero-padded) and an extra all-zero shard on an exact multiple."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle

import numpy as np


def saev_doc(n, layers, P, cls, D, E, data=None, ckpt="hf-hub:test/tiny", family="clip") -> dict:
    T = P + int(cls)
    return {
        "family": family,
        "ckpt": ckpt,
        "layers": list(layers),
        "content_tokens_per_example": P,
        "cls_token": cls,
        "d_model": D,
        "n_examples": n,
        "max_tokens_per_shard": E * T * len(layers),
        "data": data if data is not None else base64.b64encode(pickle.dumps({"root": "fake"})).decode(),
        "dataset": "fake",
        "pixel_agg": "majority",
        "dtype": "float32",
        "protocol": "2.1",
    }


def dir_hash(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:8]


def write_saev_cache(root, n=7, layers=(3, 7), P=4, cls=True, D=5, E=3, seed=0, labels=False, **kw):
    """Returns (cache dir, metadata doc, logical array (n, L, T, D))."""
    doc = saev_doc(n, layers, P, cls, D, E, **kw)
    T, L = P + int(cls), len(layers)
    acts = np.random.default_rng(seed).standard_normal((n, L, T, D), dtype=np.float32)
    path = os.path.join(os.fspath(root), "saev", "shards", dir_hash(doc))
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w", encoding="utf-8") as fd:
        fd.write(json.dumps(doc, indent=2, ensure_ascii=False))
    n_files = n // E + 1  # ceil(n / E), plus the empty trailing shard when n % E == 0
    table = []
    for s in range(n_files):
        block = np.zeros((E, L, T, D), np.float32)
        part = acts[s * E : (s + 1) * E]
        block[: len(part)] = part
        block.tofile(os.path.join(path, f"acts{s:06d}.bin"))
        table.append({"name": f"acts{s:06d}.bin", "n_examples": len(part)})
    with open(os.path.join(path, "shards.json"), "w") as fd:
        fd.write(json.dumps(table, indent=2))
    if labels:
        np.zeros((n, P), np.uint8).tofile(os.path.join(path, "labels.bin"))
    return path, doc, acts


def tree_state(path) -> dict:
    """Name -> (size, mtime_ns) of every file under ``path``: proves nothing was written there."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), path)] = (st.st_size, st.st_mtime_ns)
    return out
