"""Writing a cache: one shard at a time (atomic), metadata.json, and gather -> shards.json.

Shards are written to a temporary sibling, fsynced, then renamed, so a killed writer never leaves
a file that looks complete. The last shard is written at the full shard size with a sparse zero
tail, so the cache also opens in the seed's own readers (which memmap every shard at full size);
shards.json records its true n_imgs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
from collections.abc import Callable

import numpy as np

from actcache import checksums
from actcache.dtypes import is_stored_as, to_stored
from actcache.errors import CacheIncompleteError, DumpError, ProtocolError
from actcache.fsutil import atomic_open, remove_stale_temps
from actcache.protocol import METADATA_FILE, Metadata, shard_name, write_shards

log = logging.getLogger(__name__)


def cache_dir(dump_to: str | os.PathLike, md: Metadata) -> str:
    return os.path.join(os.fspath(dump_to), md.hash)


def ensure_metadata(dump_to: str | os.PathLike, md: Metadata) -> str:
    """Create <dump_to>/<HASH>/ with metadata.json (atomically); check an existing one matches."""
    path = cache_dir(dump_to, md)
    os.makedirs(path, exist_ok=True)
    mpath = os.path.join(path, METADATA_FILE)
    if os.path.exists(mpath):
        try:
            existing = Metadata.load(mpath)
        except ProtocolError as err:
            raise DumpError(f"{mpath} exists but is unreadable ({err}); move it away and re-run.") from None
        if existing.to_dict() != md.to_dict():
            raise DumpError(
                f"{mpath} exists and differs from the metadata being written although the "
                "directory name is the same hash; the file was edited. Restore it or delete the directory."
            )
    else:
        md.dump(path)
    return path


def shard_is_complete(path: str, md: Metadata, shard_idx: int) -> bool:
    """A shard file exists with the size actcache writes (full size; exact size also accepted)."""
    fpath = os.path.join(path, shard_name(shard_idx))
    try:
        size = os.stat(fpath).st_size
    except FileNotFoundError:
        return False
    exact = md.shard_n_imgs(shard_idx) * md.bytes_per_img
    return size in (exact, md.shard_nbytes)


def write_shard(path: str, md: Metadata, shard_idx: int, acts_NLTD: np.ndarray) -> str:
    """Write shard ``shard_idx`` atomically from a (n_imgs_in_shard, L, T, D) float32 array (or stored values)."""
    n = md.shard_n_imgs(shard_idx)
    want = (n, len(md.layers), md.n_tokens_per_img, md.d_vit)
    if acts_NLTD.shape != want:
        raise DumpError(f"shard {shard_idx}: activations have shape {acts_NLTD.shape}, expected {want}.")
    with open_shard_writer(path, md, shard_idx) as w:
        w.write(acts_NLTD)
    return os.path.join(path, shard_name(shard_idx))


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="actcache-shard-hash"))
    return _POOL[0]


class _ShardWriter:
    def __init__(self, fd, md: Metadata, shard_idx: int):
        self.fd, self.md, self.shard_idx = fd, md, shard_idx
        self.n_expected = md.shard_n_imgs(shard_idx)
        self.n_written = 0
        self.hasher = checksums.StreamHasher()  # hashes the bytes as they are written: no extra read

    def write(self, acts_BLTD: np.ndarray) -> None:
        """A batch of float32 values, or of the cache's stored values (a 16-bit dump casts on the device)."""
        a = np.ascontiguousarray(acts_BLTD)
        if not is_stored_as(a, self.md.dtype):
            a = to_stored(a, self.md.dtype)
        if a.shape[1:] != self.md.shard_shape[1:]:
            raise DumpError(f"shard {self.shard_idx}: batch shape {a.shape[1:]} != {self.md.shard_shape[1:]}")
        if self.n_written + a.shape[0] > self.n_expected:
            raise DumpError(f"shard {self.shard_idx}: more than {self.n_expected} images written")
        view = memoryview(a).cast("B")
        # Hash in a helper thread while this one writes the same bytes (both release the GIL);
        # waited for before returning, since the caller may reuse the buffer (pinned host memory).
        hashed = _hash_pool().submit(self.hasher.update, view)
        try:
            self.fd.write(view)
        finally:
            hashed.result()
        self.n_written += a.shape[0]

    def finish(self) -> None:
        if self.n_written != self.n_expected:
            raise DumpError(
                f"shard {self.shard_idx}: {self.n_written} images written, expected {self.n_expected}; "
                "the shard is not kept."
            )
        # Full-size file with a sparse zero tail (seed readers memmap every shard at full size).
        self.fd.truncate(self.md.shard_nbytes)

    def record(self) -> checksums.Record:
        name = shard_name(self.shard_idx)
        h = self.hasher
        blocks = h.block_digests()
        return checksums.Record(
            name, h.nbytes, checksums.combine(blocks), self.md.hash, h.block_bytes, checksums.hex_blocks(blocks)
        )


class open_shard_writer:
    """Context manager streaming one shard to a temporary file; renamed only when complete.

    The shard's checksum record is written just before the rename, so a complete shard always
    has one (a record without its shard, left by a kill in between, is rewritten by the rerun).
    """

    def __init__(self, path: str, md: Metadata, shard_idx: int):
        self.path = path
        self.target = os.path.join(path, shard_name(shard_idx))
        self.md, self.shard_idx = md, shard_idx

    def __enter__(self) -> _ShardWriter:
        self._cm = atomic_open(self.target, "wb")
        fd = self._cm.__enter__()
        self._w = _ShardWriter(fd, self.md, self.shard_idx)
        return self._w

    def __exit__(self, et, ev, tb):
        tmp = self._w.fd.name
        try:
            if et is None:
                try:
                    self._w.finish()
                    checksums.write_record(checksums.record_dir(self.path), self._w.record())
                except BaseException as err:
                    self._cm.__exit__(type(err), err, err.__traceback__)
                    raise
            return self._cm.__exit__(et, ev, tb)
        except BaseException:
            _remove_quietly(tmp)  # atomic_open skips its cleanup when closing the file fails too (EFBIG)
            raise
        finally:
            if et is not None:
                _remove_quietly(tmp)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def missing_shards(path: str, md: Metadata) -> list[int]:
    return [i for i in range(md.n_shards) if not shard_is_complete(path, md, i)]


def gather(path: str | os.PathLike) -> str:
    """Verify every expected shard of <HASH>/ and write shards.json atomically.

    Refuses (CacheIncompleteError, listing them) when any shard is missing or has the wrong size,
    and (ProtocolError) when the directory is named by a hash that its metadata.json no longer has.
    """
    path = os.fspath(path)
    md = Metadata.load(path)
    _check_dir_name(path, md)
    remove_stale_temps(path)
    bad = []
    for i in range(md.n_shards):
        fpath = os.path.join(path, shard_name(i))
        if not os.path.exists(fpath):
            bad.append(f"{shard_name(i)}: missing")
        elif not shard_is_complete(path, md, i):
            bad.append(
                f"{shard_name(i)}: {os.path.getsize(fpath):,} bytes, expected {md.shard_nbytes:,}; delete it and re-dump"
            )
    if bad:
        raise CacheIncompleteError(
            f"{path}: cannot gather, {len(bad)} of {md.n_shards} shards are not complete:\n  - "
            + "\n  - ".join(bad)
            + "\nRun `actcache dump` for the missing shard ranges, then gather again."
        )
    return write_shards(path, md.expected_shards())


def _check_dir_name(path: str, md: Metadata) -> None:
    name = os.path.basename(os.path.normpath(path))
    if re.fullmatch(r"[0-9a-f]{64}", name) and name != md.hash:
        raise ProtocolError(
            f"{path}: cannot gather: its metadata.json hashes to {md.hash}, not to the directory's name "
            "(metadata.json was edited after the dump, or the directory was renamed). Restore the original "
            "metadata.json, or re-dump into a new directory."
        )


def write_cache(
    dump_to: str | os.PathLike,
    md: Metadata,
    fill: Callable[[int, int], np.ndarray],
    labels: np.ndarray | None = None,
    class_names: list[str] | None = None,
) -> str:
    """Write a whole cache, shard by shard, from ``fill(start, end) -> (end-start, L, T, D)``.

    Used by the demo, tests and benchmarks (synthetic activations); the ViT dump streams
    batches through :class:`open_shard_writer` instead.
    """
    path = ensure_metadata(dump_to, md)
    for i in range(md.n_shards):
        start, end = md.shard_img_range(i)
        write_shard(path, md, i, fill(start, end))
    if labels is not None:
        from actcache.labels import write_labels

        write_labels(path, labels, class_names)
    gather(path)
    return path


def write_cache_from_array(dump_to: str | os.PathLike, md: Metadata, acts_NLTD: np.ndarray, **kw) -> str:
    if acts_NLTD.shape != (md.n_imgs, len(md.layers), md.n_tokens_per_img, md.d_vit):
        raise DumpError(f"array shape {acts_NLTD.shape} does not match the metadata")
    return write_cache(dump_to, md, lambda s, e: acts_NLTD[s:e], **kw)


def synthetic_metadata(
    n_imgs: int,
    layers=(-2,),
    n_patches_per_img: int = 16,
    cls_token: bool = True,
    d_vit: int = 32,
    max_patches_per_shard: int = 2_400_000,
    seed: int = 0,
    vit_family: str = "clip",
    dtype: str = "float32",
) -> Metadata:
    return Metadata(
        vit_family=vit_family,
        vit_ckpt="synthetic",
        layers=tuple(layers),
        n_patches_per_img=n_patches_per_img,
        cls_token=cls_token,
        d_vit=d_vit,
        n_imgs=n_imgs,
        max_patches_per_shard=max_patches_per_shard,
        data={"__class__": "SyntheticActivations", "seed": seed},
        dtype=dtype,
    )


def synthetic_fill(md: Metadata, seed: int = 0) -> Callable[[int, int], np.ndarray]:
    """Deterministic activations: image i's values depend only on (seed, i)."""

    def fill(start: int, end: int) -> np.ndarray:
        out = np.empty((end - start, len(md.layers), md.n_tokens_per_img, md.d_vit), np.float32)
        for j, i in enumerate(range(start, end)):
            rng = np.random.default_rng([seed, i])
            out[j] = rng.standard_normal(out.shape[1:], dtype=np.float32)
        return out

    return fill
