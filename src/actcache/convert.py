"""`actcache convert DIR --dtype D --to ROOT`: a cache with its values stored as another dtype.

The copy is a new cache of its own hash (``dtype`` and ``protocol`` enter the metadata):
float32 <-> float16 / bfloat16, i.e. protocol 1.0 <-> 2.0. Written the way a dump writes: each
shard to a temporary sibling renamed when complete (writer.open_shard_writer), shards.json last
(gather), then checked with a deep verify. A killed convert leaves no complete-looking shard;
running it again skips the complete shards and writes the same bytes (the conversion is a pure
function of the stored values: dtypes.py). A cache's hash promises the model's values stored as
its dtype; converted from a 16-bit cache, the values are already rounded (and back at float32 the
hash is the original float32 cache's), so that needs ``allow_rounded`` (``--allow-rounded``), and
the result belongs under another root than the workflow's dump_to.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from actcache.cache import ActivationCache
from actcache.dtypes import to_float32, to_stored
from actcache.errors import CacheIncompleteError, ConfigError
from actcache.protocol import DTYPES, SHARDS_FILE, Metadata
from actcache.validate import check_dir
from actcache.writer import ensure_metadata, gather, open_shard_writer, shard_is_complete

log = logging.getLogger(__name__)
CHUNK_BYTES = 64 * 2**20  # stored values read, converted and written per step


def converted_metadata(md: Metadata, dtype: str, where: str = "the cache") -> Metadata:
    """``md`` with ``dtype`` and its protocol version (keys of a newer minor version are dropped)."""
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: --dtype {dtype!r} is not a cache dtype; use one of {', '.join(DTYPES)}")
    if md.dtype == dtype:
        raise ConfigError(f"{where}: already stores {dtype}; pick another --dtype ({', '.join(DTYPES)})")
    if md.foreign:
        raise ConfigError(
            f"{where}: written by saev; convert reads actcache caches (protocol 1.x or 2.x). Train on it "
            "directly (`actcache train --cache DIR`)."
        )
    return dataclasses.replace(md, dtype=dtype, protocol=None, extra={})


def convert(src_dir: str | os.PathLike, dtype: str, to_root: str | os.PathLike, allow_rounded: bool = False) -> str:
    """Write the cache ``src_dir`` with ``dtype`` values under ``to_root``; returns its directory."""
    src = ActivationCache.open(src_dir, out_dtype="stored")
    md = converted_metadata(src.metadata, dtype, src.path)
    if src.metadata.dtype != "float32" and not allow_rounded:
        raise ConfigError(
            f"{src.path}: its values are rounded to {src.metadata.dtype}; as {dtype} they would sit under the hash "
            f"of a cache of the model's own values{' (the float32 cache they came from)' if dtype == 'float32' else ''}. "
            "Re-dump for exact values, or pass --allow-rounded and write under a root other than dump_to"
        )
    dest = os.path.join(os.fspath(to_root), md.hash)
    if os.path.abspath(dest) == os.path.abspath(src.path):
        raise ConfigError(f"--to {to_root}: the converted cache would replace its source; pick another root")
    done = os.path.exists(os.path.join(dest, SHARDS_FILE))
    if not done:
        ensure_metadata(to_root, md)
        for i in range(md.n_shards):
            if not shard_is_complete(dest, md, i):
                _convert_shard(src, md, dest, i)
        if src.labels is not None:
            from actcache.labels import write_labels

            write_labels(dest, src.labels, src.class_names)
        from actcache.ckptid import copy_source

        copy_source(src.path, dest)  # where a local checkpoint lies, for eval and visuals
        gather(dest)
    rep = check_dir(dest, deep=True)
    bad = [p for p in rep.problems if "NaN/Inf" not in p]  # non-finite values are the source's own
    if bad:
        raise CacheIncompleteError(f"{dest}: the converted cache does not verify:\n  - " + "\n  - ".join(bad))
    return dest


def _convert_shard(src: ActivationCache, md: Metadata, dest: str, shard: int) -> None:
    # guarded reads (shardguard.py): a source shard cut or rewritten meanwhile is one line naming it
    n = src.shards[shard].n_imgs
    step = max(1, CHUNK_BYTES // max(1, src.metadata.bytes_per_img))
    with open_shard_writer(dest, md, shard) as w:
        for a in range(0, n, step):
            block = src.read_shard(shard, a, a + step)
            w.write(to_stored(to_float32(block, src.metadata.dtype), md.dtype))
    log.info("converted shard %d of %d", shard + 1, md.n_shards)
