"""Per-shard checksums: one small record per shard, beside the cache and outside its v1 hash.

    <HASH>/.checksums/actsNNNNNN.bin.json
        {"algorithm": "xxh3_64-blocks", "block_bytes": 16777216, "nbytes": N,
         "digest": "<16 hex>", "cache": "<HASH>", "blocks": "<16 hex per block>"}

``digest`` is xxh3_64 over the concatenated 8-byte little-endian xxh3_64 digests of each
``block_bytes`` block of the shard's first ``nbytes`` bytes (its images; a zero-padded tail is not
covered). Blocks let ``verify --deep`` hash a shard in parallel threads while the dump hashes the
stream it writes, so no extra read pass is needed. A v1 reader ignores the hidden directory, as
it ignores labels.npy. One file per shard: the dump jobs of a cache each write their own shards'
records without sharing a file (no lock, safe on any shared filesystem).

A cache another tool wrote (saev) is never written into: its records live in a directory the user
names (``actcache seal DIR --to CHECKSUMS``, ``actcache verify --deep --checksums CHECKSUMS``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import xxhash

from actcache.errors import ProtocolError
from actcache.fsutil import atomic_write_bytes

ALGORITHM = "xxh3_64-blocks"
BLOCK = 16 * 2**20
RECORD_DIR = ".checksums"
_SUFFIX = ".json"
_MAX_RECORD = 2**20  # bytes; a larger file is not a record (65,536 block digests: a 1 TiB shard)
_MIN_BLOCK, _MAX_BLOCK = 2**12, 2**28


@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    nbytes: int
    digest: str
    cache: str
    block_bytes: int = BLOCK
    blocks: str | None = None  # each block's digest, 16 hex digits each (None: an older record)

    def to_dict(self) -> dict:
        doc = {"algorithm": ALGORITHM, "block_bytes": self.block_bytes, "nbytes": self.nbytes,
               "digest": self.digest, "cache": self.cache}  # fmt: skip
        if self.blocks is not None:
            doc["blocks"] = self.blocks
        return doc

    @property
    def n_blocks(self) -> int:
        return -(-self.nbytes // self.block_bytes)

    def block_digest(self, i: int) -> int | None:
        """Block ``i``'s digest, or None when the record does not list them."""
        return None if self.blocks is None else int(self.blocks[16 * i : 16 * i + 16], 16)


def block_hasher():
    """A streaming xxh3_64 for one block fed in pieces (``.update``, ``.intdigest()``); it releases
    the GIL, so blocks hash in parallel threads."""
    return xxhash.xxh3_64()


def hex_blocks(block_digests: list[int]) -> str:
    """The ``blocks`` field: each digest as 16 hex digits, in order."""
    return "".join(f"{d:016x}" for d in block_digests)


def combine(block_digests: list[int]) -> str:
    """The shard digest from its blocks' digests, in order."""
    joined = b"".join(d.to_bytes(8, "little") for d in block_digests)
    return xxhash.xxh3_64_hexdigest(joined)


class StreamHasher:
    """Digest of a byte stream fed in pieces of any size (the dump's batches)."""

    def __init__(self, block_bytes: int = BLOCK):
        self.block_bytes = block_bytes
        self.blocks: list[int] = []
        self._cur = xxhash.xxh3_64()
        self._fill = 0
        self.nbytes = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._fill)
            self._cur.update(view[:take])
            self._fill += take
            self.nbytes += take
            view = view[take:]
            if self._fill == self.block_bytes:
                self.blocks.append(self._cur.intdigest())
                self._cur, self._fill = xxhash.xxh3_64(), 0

    def block_digests(self) -> list[int]:
        return self.blocks + ([self._cur.intdigest()] if self._fill else [])

    def digest(self) -> str:
        return combine(self.block_digests())


def record_dir(cache_path: str) -> str:
    """Where a cache actcache wrote keeps its records."""
    return os.path.join(cache_path, RECORD_DIR)


def record_path(directory: str, shard: str) -> str:
    return os.path.join(directory, shard + _SUFFIX)


def write_record(directory: str, rec: Record) -> str:
    """Write one shard's record atomically; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = record_path(directory, rec.name)
    atomic_write_bytes(path, (json.dumps(rec.to_dict(), sort_keys=True) + "\n").encode("utf-8"))
    return path


def read_record(directory: str, shard: str) -> Record | None:
    """The record of ``shard`` in ``directory``; None when there is none; ProtocolError when unreadable."""
    path = record_path(directory, shard)
    try:
        with open(path, "rb") as fd:
            raw = fd.read(_MAX_RECORD + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ProtocolError(f"{path}: cannot read this checksum record ({err.strerror or err}); "
                            f"delete it and run `actcache seal` on the cache.") from None  # fmt: skip
    try:
        doc = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_RECORD else None
        rec = Record(shard, doc["nbytes"], doc["digest"], doc["cache"], doc["block_bytes"], doc.get("blocks"))
        ok = doc["algorithm"] == ALGORITHM and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rec.nbytes, rec.block_bytes)
        )
        ok = ok and _MIN_BLOCK <= rec.block_bytes <= _MAX_BLOCK  # the scan allocates one block per thread
        ok = ok and isinstance(rec.digest, str) and len(rec.digest) == 16 and isinstance(rec.cache, str)
        ok = ok and (rec.blocks is None or _blocks_ok(rec))
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise ProtocolError(
            f"{path}: not a checksum record ({ALGORITHM}); delete it and run `actcache seal` on the cache."
        )
    return rec


def _blocks_ok(rec: Record) -> bool:
    """The block list has one digest per block and they combine into the record's digest."""
    b = rec.blocks
    if not isinstance(b, str) or len(b) != 16 * rec.n_blocks:
        return False
    return combine([int(b[i : i + 16], 16) for i in range(0, len(b), 16)]) == rec.digest
