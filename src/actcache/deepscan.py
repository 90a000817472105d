"""`verify --deep`: read every stored byte of a cache once and check what the bytes say.

Per shard, in one read: NaN/Inf values (the first one located as image, layer, token, dim),
an all-zero shard, the checksum against the shard's record (:mod:`actcache.checksums`), and
shards holding the same bytes as another. Flipped bytes, a zeroed shard, a shard copied over
another and two swapped shards all fail here, each naming the shard.

A shard that changes while it is read (its identity: device, inode, size and change time, taken
before and after the scan; :mod:`actcache.shardguard`), or that is shorter than its images, is a
problem too, and its digest is not kept: ``seal`` never records a short or changed read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading

import numpy as np

from actcache import checksums
from actcache.errors import ProtocolError
from actcache.protocol import Metadata
from actcache.shardguard import identity

CHUNK = checksums.BLOCK  # bytes a thread takes at a time: one checksum block
PIECE = 2**20  # bytes read, checked and hashed at once within a chunk (fits the CPU cache)
AHEAD = 4  # chunks asked of the kernel ahead of the checkers (posix_fadvise WILLNEED)


@dataclasses.dataclass
class Scan:
    size: int  # bytes read
    n_bad: int  # NaN/Inf among the first ``valid`` bytes
    first_bad: int | None  # byte offset of the first of them
    digest: str | None  # checksum of the first ``valid`` bytes (None when valid is 0)
    all_zero: bool  # every one of the first ``valid`` bytes is zero (and valid > 0)
    blocks: list[int] = dataclasses.field(default_factory=list)  # each block's digest (checksums.py)


def _check_floats(buf_f32: np.ndarray) -> tuple[int, int | None, bool]:
    """(NaN/Inf count, index of the first, all zero) of one chunk."""
    # A finite sum of squares proves every element finite (one pass, BLAS: faster than a plain
    # sum); only otherwise (a NaN/Inf, or squares too large for float32) count exactly. It is
    # zero only when every element is zero, or tiny (squares underflow): any() tells.
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.dot(buf_f32, buf_f32)
    if np.isfinite(s):
        return 0, None, bool(s == 0 and not buf_f32.any())
    finite = np.isfinite(buf_f32)
    n_bad = int(buf_f32.size - np.count_nonzero(finite))
    return n_bad, int(np.argmin(finite)), False


def _check_values(buf, n_bytes: int, dtype: str) -> tuple[int, int | None, bool]:
    """(NaN/Inf count, index of the first, all zero) of the first ``n_bytes`` of ``buf``."""
    if dtype == "float32":
        return _check_floats(np.frombuffer(buf, dtype=np.float32, count=n_bytes // 4))
    bits = np.frombuffer(buf, dtype=np.uint16, count=n_bytes // 2)
    exp = np.uint16(0x7C00 if dtype == "float16" else 0x7F80)  # exponent all ones: NaN or Inf
    bad = (bits & exp) == exp
    n_bad = int(np.count_nonzero(bad))
    return n_bad, (int(np.argmax(bad)) if n_bad else None), (not n_bad and not (bits & 0x7FFF).any())


def _scan_file(
    fpath: str, valid: int, n_threads: int | None = None, block: int | None = None, dtype: str = "float32"
) -> Scan:
    """Read a file once and check its first ``valid`` bytes (a padded tail is read, not checked).

    ``n_threads`` threads each take ``block``-byte chunks and read them with ``pread``, a piece at
    a time, into a buffer of their own, to check and hash each piece (numpy and xxhash release the GIL, so reading, checking and hashing
    overlap on every core); each chunk asks the kernel for the chunks ``AHEAD`` of it, so cold
    data streams in with large reads. Plain reads rather than a memory map: a disk error is an
    OSError naming the file, not a SIGBUS.
    """
    block = block or CHUNK
    width = 4 if dtype == "float32" else 2  # bytes per stored value
    n_threads = n_threads or max(1, min(4, os.cpu_count() or 1))
    local = threading.local()
    with open(fpath, "rb", buffering=0) as fh:
        fd = fh.fileno()
        before = identity(os.fstat(fd))
        size = before[2]
        if size < valid:
            raise ProtocolError(f"{fpath}: is {size:,} bytes but its images need {valid:,} (it changed after it "
                                "was checked); nothing is recorded for it. Run again when no process writes it.")  # fmt: skip
        if size == 0:
            return Scan(0, 0, None, None, False)
        n_chunks = -(-size // block)

        def check(i: int):
            start = i * block
            with contextlib.suppress(AttributeError, OSError):
                if i + AHEAD < n_chunks:
                    os.posix_fadvise(fd, (i + AHEAD) * block, block, os.POSIX_FADV_WILLNEED)
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(PIECE)
            view = memoryview(buf)
            want = min(block, size - start)
            hasher = checksums.block_hasher()
            bad, first, zero = 0, None, True
            # Piece by piece, so each piece is checked and hashed while it is still in the CPU cache.
            for at in range(start, start + want, PIECE):
                n = min(PIECE, start + want - at)
                _read_exactly(fd, view[:n], at, fpath, size)
                cut = max(0, min(n, valid - at))
                if cut:
                    hasher.update(view[:cut])
                    b, f, z = _check_values(buf, cut, dtype)
                    bad, zero = bad + b, zero and z
                    first = at + width * f if first is None and f is not None else first
            return bad, first, zero, hasher.intdigest() if valid > start else None

        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, 0, min(size, AHEAD * block), os.POSIX_FADV_WILLNEED)
        try:
            with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
                parts = list(pool.map(check, range(n_chunks)))
        except OSError as err:
            raise ProtocolError(f"{fpath}: read error ({err.strerror or err}); the file or the disk is damaged. "
                                "Re-dump this shard (delete it, then rerun its dump job).") from None  # fmt: skip
        _same_file(fpath, fd, before)
    digests = [p[3] for p in parts if p[3] is not None]
    firsts = [p[1] for p in parts if p[1] is not None]
    return Scan(
        size=size,
        n_bad=sum(p[0] for p in parts),
        first_bad=min(firsts) if firsts else None,
        digest=checksums.combine(digests) if digests else None,
        all_zero=bool(digests) and all(p[2] for p in parts),
        blocks=digests,
    )


def _same_file(fpath: str, fd: int, before) -> None:
    """ProtocolError unless the file under ``fpath`` is still the one opened, unchanged (identity
    after the scan equals ``before``): what was hashed is then what the file holds."""
    try:
        after, now = identity(os.fstat(fd)), os.stat(fpath)
    except OSError as err:
        raise ProtocolError(f"{fpath}: cannot be looked at after the scan ({err.strerror or err}); run again.") from None
    if after != before or (now.st_dev, now.st_ino) != before[:2]:
        raise ProtocolError(
            f"{fpath}: changed while it was read (size {before[2]:,} -> {after[2]:,} bytes, or written to, or "
            "replaced); nothing is recorded for it. Run again when no process writes it."
        )


def _read_exactly(fd: int, view: memoryview, at: int, fpath: str, size: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if n == 0:
            raise ProtocolError(f"{fpath}: ended at byte {at + got:,} while being read (expected {size:,}); "
                                "another process may be rewriting it. Run verify again.")  # fmt: skip
        got += n


def locate_byte(md: Metadata, shard_idx: int, offset: int) -> str:
    """'image I, layer L, token T, dim D' of the float at byte ``offset`` of shard ``shard_idx``."""
    D, T = md.d_vit, md.n_tokens_per_img
    img, rest = divmod(offset // md.itemsize, len(md.layers) * T * D)
    layer, rest = divmod(rest, T * D)
    token, dim = divmod(rest, D)
    return f"image {shard_idx * md.n_imgs_per_shard + img}, layer {md.layers[layer]}, token {token}, dim {dim}"


def _record(directory: str, name: str, md: Metadata, rep) -> checksums.Record | None:
    try:
        rec = checksums.read_record(directory, name)
    except ProtocolError as err:
        rep.problems.append(str(err))
        return None
    if rec is not None and rec.cache != md.hash:
        rep.problems.append(
            f"{checksums.record_path(directory, name)}: a checksum record of cache {rec.cache}, not of this one "
            f"({md.hash}); point --checksums at this cache's records, or delete it and run `actcache seal`."
        )
        return None
    return rec


def deep_scan(path: str, md: Metadata, rep, checksums_dir: str | None = None) -> None:
    """Read every stored byte of the shards in ``rep`` once; add what is wrong to ``rep.problems``."""
    directory = checksums_dir or checksums.record_dir(path)
    total_bad, n_ok, unsealed = 0, 0, []
    by_digest: dict[str, str] = {}
    for idx, st in enumerate(rep.shards):
        if st.size is None:
            continue
        fpath = os.path.join(path, st.name)
        valid = st.n_imgs * md.bytes_per_img
        rec = _record(directory, st.name, md, rep) if valid else None
        try:
            scan = _scan_file(fpath, valid, block=rec.block_bytes if rec else None, dtype=md.dtype)
        except ProtocolError as err:  # shrank or changed while read, or unreadable: no digest kept
            rep.problems.append(str(err))
            continue
        rep.bytes_read += scan.size
        st.n_nonfinite = scan.n_bad
        total_bad += scan.n_bad
        if scan.n_bad:
            rep.problems.append(
                f"{fpath}: {scan.n_bad:,} NaN/Inf values among its {st.n_imgs} images, the first at "
                f"{locate_byte(md, idx, scan.first_bad)}. The model produced non-finite activations (check "
                "the checkpoint and dtype) or the file is corrupt; re-dump this shard."
            )
        if scan.all_zero:
            rep.problems.append(f"{fpath}: every value is zero (the file was zeroed or never filled); "
                                "delete it and re-dump this shard.")  # fmt: skip
        if scan.digest is None:
            continue
        if scan.digest in by_digest:
            rep.problems.append(f"{fpath}: holds the same bytes as {by_digest[scan.digest]} (a copy of another "
                                "shard); delete it and re-dump this shard.")  # fmt: skip
        by_digest.setdefault(scan.digest, st.name)
        block = rec.block_bytes if rec else checksums.BLOCK
        blocks = checksums.hex_blocks(scan.blocks)
        rep.digests[st.name] = checksums.Record(st.name, valid, scan.digest, md.hash, block, blocks)
        if rec is None:
            unsealed.append(st.name)
        elif rec.nbytes != valid or rec.digest != scan.digest:
            rep.problems.append(
                f"{fpath}: checksum mismatch ({checksums.ALGORITHM} {scan.digest} over {valid:,} bytes; its record "
                f"{checksums.record_path(directory, st.name)} says {rec.digest} over {rec.nbytes:,}). The bytes "
                "changed after they were written (a flipped bit, a zeroed or replaced file, or two shards swapped); "
                "delete this shard and re-run its dump job."
            )
        else:
            n_ok += 1
    rep.n_nonfinite = total_bad
    rep.checksums = _summary(n_ok, unsealed, rep.path, md.foreign)


def _summary(n_ok: int, unsealed: list[str], path: str, foreign: bool) -> str:
    if not unsealed:
        return f"checksums of all {n_ok} shard(s) match"
    if not n_ok:
        return f"no checksums (add them with `actcache seal {path}{' --to DIR' if foreign else ''}`)"
    shown = ", ".join(unsealed[:5]) + (" ..." if len(unsealed) > 5 else "")
    return f"checksums of {n_ok} shard(s) match; no checksums for {len(unsealed)} ({shown})"
