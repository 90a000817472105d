"""Read-only support for caches written by saev's current release (protocol "2.1").

Such a cache lives in ``.../saev/shards/<h>/`` with the v1 byte layout and different JSON names:

    metadata.json  family, ckpt, layers, content_tokens_per_example, cls_token, d_model,
                   n_examples, max_tokens_per_shard, data, dataset, pixel_agg, dtype, protocol
    shards.json    [{"name": "acts000000.bin", "n_examples": N}, ...]
    labels.bin     optional uint8 (n_examples, content_tokens_per_example)

``<h>`` is the first 8 hex characters of the sha256 of the metadata as compact JSON, keys in file
order, non-ASCII kept raw. ``data`` is base64 of a pickle: it stays an opaque string here and is
never decoded. actcache never writes into such a directory (``SaevMetadata.foreign``).
:class:`SaevMetadata` maps the fields onto :class:`actcache.protocol.Metadata`'s names, so the
cache, the loaders and training see the same sizes, layout and coordinates as for a v1 cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import ClassVar

from actcache import protocol
from actcache.errors import ProtocolError
from actcache.protocol import METADATA_FILE, SHARDS_FILE, Metadata, ShardInfo, _is_int

PROTOCOLS = ("2.1", "1.1", "1.0.0")  # saev's reader treats these alike
FAMILIES = ("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip")
PIXEL_AGGS = ("majority", "prefer-fg")
LABELS_FILE = "labels.bin"
HASH_LEN = 8

# saev's key -> the Metadata field holding it; the order is saev's field order (the hash input).
KEYS = {
    "family": "vit_family",
    "ckpt": "vit_ckpt",
    "layers": "layers",
    "content_tokens_per_example": "n_patches_per_img",
    "cls_token": "cls_token",
    "d_model": "d_vit",
    "n_examples": "n_imgs",
    "max_tokens_per_shard": "max_patches_per_shard",
    "data": "data",
    "dataset": "dataset",
    "pixel_agg": "pixel_agg",
    "dtype": "dtype",
    "protocol": "protocol",
}

_CHECKS = {
    "family": (lambda v: v in FAMILIES, f"one of {', '.join(FAMILIES)}"),
    "ckpt": (lambda v: isinstance(v, str), "a string"),
    "layers": (
        lambda v: isinstance(v, (list, tuple)) and bool(v) and all(_is_int(x) for x in v) and len(set(v)) == len(v),
        "a non-empty list of distinct integers",
    ),
    "content_tokens_per_example": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "cls_token": (lambda v: isinstance(v, bool), "true or false"),
    "d_model": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "n_examples": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "max_tokens_per_shard": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "data": (lambda v: isinstance(v, str), "a string (base64; actcache never decodes it)"),
    "dataset": (lambda v: isinstance(v, str), "a string"),
    "pixel_agg": (lambda v: v in PIXEL_AGGS, f"one of {', '.join(PIXEL_AGGS)}"),
    "dtype": (lambda v: v == "float32", "'float32'"),
    "protocol": (lambda v: v in PROTOCOLS, f"one of {', '.join(PROTOCOLS)}"),
}


def is_saev_doc(doc: object) -> bool:
    """True when a parsed metadata.json uses saev 2.x's field names."""
    return isinstance(doc, dict) and "family" in doc and "content_tokens_per_example" in doc


def saev_hash(doc: dict) -> str:
    """The directory name saev gives a cache: sha256 of compact JSON in file order, first 8 hex."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_LEN]


@dataclasses.dataclass(frozen=True, eq=True)
class SaevMetadata(Metadata):
    """metadata.json of a saev 2.x cache, seen through v1's field names (read-only)."""

    foreign: ClassVar[bool] = True
    dataset: str = ""
    pixel_agg: str = "majority"

    def __post_init__(self) -> None:
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        for key, (ok, what) in _CHECKS.items():
            value = getattr(self, KEYS[key])
            if not ok(value):
                shown = value if key != "data" else type(value).__name__
                raise ProtocolError(f"{METADATA_FILE}: saev field '{key}' must be {what}, got {shown!r}.")
        if self.n_imgs_per_shard < 1:
            raise ProtocolError(
                f"{METADATA_FILE}: max_tokens_per_shard={self.max_patches_per_shard} cannot hold one example "
                f"({self.n_tokens_per_img} tokens x {len(self.layers)} layers); the cache is unreadable."
            )

    def to_dict(self) -> dict:
        """The document in saev's names and field order."""
        doc = {key: getattr(self, name) for key, name in KEYS.items()}
        doc["layers"] = list(self.layers)
        return doc

    @classmethod
    def from_dict(cls, doc: object, where: str = METADATA_FILE) -> SaevMetadata:
        if not isinstance(doc, dict):
            raise ProtocolError(f"{where}: expected a JSON object, got {type(doc).__name__}.")
        missing = [k for k in KEYS if k not in doc]
        unknown = [k for k in doc if k not in KEYS]
        if missing or unknown:
            raise ProtocolError(
                f"{where}: a saev 2.1 metadata.json has exactly the keys {', '.join(KEYS)}; "
                f"missing: {', '.join(missing) or 'none'}; unknown: {', '.join(unknown) or 'none'}."
            )
        try:
            return cls(**{name: doc[key] for key, name in KEYS.items()})
        except ProtocolError as err:
            raise ProtocolError(str(err).replace(METADATA_FILE, where, 1)) from None

    def dump(self, directory: str | os.PathLike) -> str:
        raise ProtocolError(f"{directory}: a saev cache is read-only here; actcache never writes into it.")

    @property
    def hash(self) -> str:
        return saev_hash(self.to_dict())

    @property
    def labels_nbytes(self) -> int:
        """Size of labels.bin when present: one uint8 per content token of each example."""
        return self.n_imgs * self.n_patches_per_img


def parse_shards(doc: object, where: str = SHARDS_FILE) -> list[ShardInfo]:
    """saev's shards.json ([{name, n_examples}, ...]) as ShardInfo rows: v1's table, saev's count key."""
    return protocol.parse_shards(doc, where, count="n_examples")


def read_shards(directory: str | os.PathLike) -> list[ShardInfo]:
    return protocol.read_shards(directory, count="n_examples")


def read_token_labels(path: str | os.PathLike, md: Metadata):
    """labels.bin of a saev cache as a read-only uint8 memmap (n_examples, content tokens): saev's
    per-patch labels (segmentation datasets); a ConfigError when the cache has none."""
    import numpy as np

    from actcache.errors import ConfigError

    fpath = os.path.join(os.fspath(path), LABELS_FILE)
    if not md.foreign or not os.path.isfile(fpath):
        raise ConfigError(
            f"{path}: no {LABELS_FILE}; token_labels=True needs a saev cache written with per-patch labels "
            "(saev writes them for segmentation datasets); drop token_labels"
        )
    if os.path.getsize(fpath) != md.labels_nbytes:
        raise ProtocolError(f"{fpath}: {os.path.getsize(fpath):,} bytes, expected {md.labels_nbytes:,}")
    return np.memmap(fpath, dtype=np.uint8, mode="r", shape=(md.n_imgs, md.n_patches_per_img))
