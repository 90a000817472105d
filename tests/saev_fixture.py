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
    if labels:  # per-patch labels (uint8, no CLS slot)
        np.random.default_rng(seed + 1).integers(0, 151, (n, P), dtype=np.uint8).tofile(
            os.path.join(path, "labels.bin")
        )
    return path, doc, acts


def tree_state(path) -> dict:
    """Name -> (size, mtime_ns) of every file under ``path``: proves nothing was written there."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), path)] = (st.st_size, st.st_mtime_ns)
    return out


SAEV_KEYS = ("family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
             "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol")  # fmt: skip


def read_saev_cache(path):
    """A reader written from saev 2.1's format facts (Metadata.load, ShardInfo, the ordered and
    shuffled loaders): checks what they check and returns (metadata doc, logical (n, L, T, D) array)."""
    parts = os.path.normpath(path).split(os.sep)
    assert parts[-3:-1] == ["saev", "shards"], "saev's loaders require <...>/saev/shards/<h>"
    with open(os.path.join(path, "metadata.json"), encoding="utf-8") as fd:
        raw = fd.read()
    doc = json.loads(raw)
    assert tuple(doc) == SAEV_KEYS, list(doc)  # Metadata(**doc): exactly these keys, in field order
    assert raw == json.dumps(doc, indent=2, ensure_ascii=False)  # orjson, 2-space indent, no newline
    assert parts[-1] == dir_hash(doc)
    assert doc["protocol"] == "2.1" and doc["dtype"] == "float32" and isinstance(doc["data"], str)
    assert doc["pixel_agg"] in ("majority", "prefer-fg") and isinstance(doc["dataset"], str)
    n, L, P, D = doc["n_examples"], len(doc["layers"]), doc["content_tokens_per_example"], doc["d_model"]
    T = P + int(doc["cls_token"])
    E = doc["max_tokens_per_shard"] // (T * L)
    assert E >= 1
    with open(os.path.join(path, "shards.json"), encoding="utf-8") as fd:
        table = json.load(fd)
    assert [list(s) for s in table] == [["name", "n_examples"]] * len(table)
    assert [s["name"] for s in table] == [f"acts{i:06d}.bin" for i in range(len(table))]
    assert len(table) == n // E + 1 and sum(s["n_examples"] for s in table) == n  # + the empty one on a multiple
    assert all(s["n_examples"] == E for s in table[:-1])  # the ordered loader's assertion
    out = np.empty((n, L, T, D), np.float32)
    for i, s in enumerate(table):
        file = os.path.join(path, s["name"])
        assert os.path.getsize(file) == E * L * T * D * 4  # every shard full size
        block = np.fromfile(file, dtype="<f4").reshape(E, L, T, D)
        out[i * E : i * E + s["n_examples"]] = block[: s["n_examples"]]
        assert not block[s["n_examples"] :].any()  # zero padding
    return doc, out
