"""Is a shard still the file a reader opened, and are its bytes the ones that were written?

Identity. Every reader (ActivationCache, both loaders, IndexedDataset, convert, stats) records
each shard's (device, inode, size, change time) when it opens a cache, and looks again with
``fstat`` after reading and before handing the data out. The kernel moves a file's change time
(``st_ctime_ns``) on every write and truncate, before the bytes change, so a copy over the shard
that keeps its size, a truncate followed by re-extending, or one flipped bit written through the
page cache all show, and the data read is refused (a one-line :class:`ShardChangedError`), never
handed out. A file renamed over the shard shows as a new inode.

Verified reads (``verify_reads: first``). Where a shard has a checksum record listing its
blocks' digests (:mod:`actcache.checksums`), each block is hashed from the file (plain reads,
through the page cache, so what the kernel has cached is what is checked) the first time the
process reads any byte of it, and compared with the record before the data goes out. Which
blocks a process has checked is kept per (cache, shard, identity), for every reader in the
process. A record without the block list (written before it existed) is checked whole, once, at
the first read of its shard; ``actcache seal`` adds the list. A block checked, then rewritten,
moves the change time: the identity check above catches that.
"""

from __future__ import annotations

import os
import threading

import xxhash

from actcache import checksums
from actcache.errors import LoaderError, ProtocolError, os_error_text

Identity = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_ctime_ns)
VERIFY_READS = ("first", "off")
DEFAULT_VERIFY_READS = "off"  # BENCHMARKS.md "verify_reads": first costs more than the bar for a default
PIECE = 2**20  # bytes read and hashed at once while checking a block (stays in the CPU cache)

FIX = (
    "do not rewrite, replace or remove a cache's shards while it is read; check the cache with "
    "`actcache verify --deep DIR` and re-dump the shards it reports"
)


class ShardChangedError(LoaderError):
    """A shard changed after a reader opened it, or its bytes do not match their checksum record."""


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def identities(path: str, names: list[str]) -> list[Identity]:
    """The identity of each shard file now (one stat each)."""
    out = []
    for name in names:
        try:
            out.append(identity(os.stat(os.path.join(path, name))))
        except OSError as err:
            raise ShardChangedError(f"cannot open shard {name} in {path}: {os_error_text(err)}; {FIX}") from None
    return out


def change(st: os.stat_result, expected: Identity, need: int) -> str | None:
    """What differs between the file ``st`` describes and the one opened (``expected``): replaced,
    cut below ``need`` bytes, resized, or written to; None when nothing does."""
    dev, ino, size, ctime = expected
    if (st.st_dev, st.st_ino) != (dev, ino):
        return f"was replaced after it was opened (a new file under its name: inode {st.st_ino}, not {ino})"
    if st.st_size < need:
        return f"is {st.st_size:,} bytes but {need:,} are needed: it was truncated after it was opened"
    if st.st_size != size:
        return f"changed size after it was opened ({size:,} -> {st.st_size:,} bytes)"
    if st.st_ctime_ns != ctime:
        return (
            "was written to after it was opened (its change time moved: rewritten in place, copied over, "
            "or truncated and re-extended)"
        )
    return None


def open_shard(path: str, name: str, expected: Identity, need: int) -> int:
    """A read-only descriptor of the shard, checked to be the file that was opened first, unchanged;
    ShardChangedError naming it otherwise."""
    try:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
    except OSError as err:
        raise ShardChangedError(f"cannot open shard {name} in {path}: {os_error_text(err)}; {FIX}") from None
    try:
        bad = change(os.fstat(fd), expected, need)
        if bad:
            raise ShardChangedError(f"shard {name} in {path} {bad}; {FIX}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_change(fd: int, expected: Identity, need: int) -> str | None:
    """:func:`change` of an open descriptor (its inode cannot change: size and change time can)."""
    try:
        return change(os.fstat(fd), expected, need)
    except OSError as err:
        return f"cannot be looked at ({os_error_text(err)})"


# ---- verified reads ---------------------------------------------------------------------------
# (real cache path, shard, identity) -> (1 per block checked, a lock per block: two threads
# reading one block check it once, threads reading different blocks check them at once)
_checked: dict[tuple, tuple[bytearray, list[threading.Lock]]] = {}
_checked_lock = threading.Lock()
_scratch = threading.local()


def _checked_blocks(key: tuple, n: int) -> tuple[bytearray, list[threading.Lock]]:
    with _checked_lock:
        got = _checked.get(key)
        if got is None:
            got = _checked[key] = (bytearray(n), [threading.Lock() for _ in range(n)])
        return got


def _hash_range(fd: int, start: int, n: int) -> int | None:
    """xxh3_64 of bytes [start, start + n) of the file read with plain reads; None if it ends early."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(PIECE))
    h = xxhash.xxh3_64()
    at, end = start, start + n
    while at < end:
        got = os.preadv(fd, [buf[: min(PIECE, end - at)]], at)
        if got <= 0:
            return None
        h.update(buf[:got])
        at += got
    return h.intdigest()


def _ask(fd: int, start: int, end: int) -> None:
    """Ask the kernel for bytes [start, end) now (large reads, ahead of the hashing)."""
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):  # (only a hint)
        pass


class ReadVerifier:
    """verify_reads for one opened cache: its shards' records, read on first use, and the check of
    each block the first time this process reads it (:meth:`ensure`)."""

    def __init__(
        self, path: str, names: list[str], ids: list[Identity], cache_hash: str, valid: list[int], mode: str,
        directory: str | None = None,
    ):  # fmt: skip
        if mode not in VERIFY_READS:
            raise ProtocolError(f"verify_reads={mode!r}: use one of {', '.join(VERIFY_READS)}")
        self.path, self.names, self.ids, self.valid = path, names, ids, valid
        self.cache_hash, self.on = cache_hash, mode == "first"
        self.directory = directory or checksums.record_dir(path)
        self._real = os.path.realpath(path)
        self._records: dict[int, checksums.Record | None] = {}

    def record(self, shard: int) -> checksums.Record | None:
        """The shard's checksum record (None: it has none); an unusable one is a ShardChangedError."""
        if shard not in self._records:
            name = self.names[shard]
            try:
                rec = checksums.read_record(self.directory, name)
            except ProtocolError as err:
                raise ShardChangedError(str(err)) from None
            if rec is not None and (rec.cache != self.cache_hash or rec.nbytes != self.valid[shard]):
                raise ShardChangedError(
                    f"{checksums.record_path(self.directory, name)}: a checksum record of cache {rec.cache} over "
                    f"{rec.nbytes:,} bytes, not of this shard ({self.cache_hash}, {self.valid[shard]:,} bytes); "
                    f"delete it and run `actcache verify --deep {self.path}`, then `actcache seal {self.path}`."
                )
            self._records[shard] = rec
        return self._records[shard]

    def unsealed(self) -> list[str]:
        """Names of the shards without a checksum record."""
        return [self.names[i] for i in range(len(self.names)) if self.record(i) is None]

    def ensure(self, shard: int, fd: int, start: int, end: int) -> None:
        """Check every block under bytes [start, end) of the shard not checked yet in this process
        (``fd``: the descriptor the data is read through); ShardChangedError on a mismatch."""
        if not self.on or end <= start:
            return
        rec = self.record(shard)
        if rec is None:
            return
        try:
            self._ensure(shard, fd, rec, start, end)
        except OSError as err:
            raise ShardChangedError(
                f"shard {self.names[shard]} in {self.path} could not be read to check its checksum "
                f"({os_error_text(err)}); {FIX}"
            ) from None

    def _ensure(self, shard: int, fd: int, rec: checksums.Record, start: int, end: int) -> None:
        B = rec.block_bytes
        done, locks = _checked_blocks((self._real, self.names[shard], self.ids[shard]), rec.n_blocks)
        lo, hi = start // B, min(-(-end // B), rec.n_blocks)
        if all(done[lo:hi]):
            return
        if rec.blocks is None:  # an older record: only the whole shard can be checked, at once
            with locks[0]:
                if not all(done):
                    self._check_whole(shard, fd, rec, done)
            return
        _ask(fd, lo * B, min(rec.nbytes, hi * B))
        for i in range(lo, hi):
            if done[i]:
                continue
            with locks[i]:
                if done[i]:  # another thread checked it meanwhile
                    continue
                if _hash_range(fd, i * B, min(B, rec.nbytes - i * B)) != rec.block_digest(i):
                    self._mismatch(shard, fd, i * B, min((i + 1) * B, rec.nbytes))
                done[i] = 1

    def _check_whole(self, shard: int, fd: int, rec: checksums.Record, done: bytearray) -> None:
        B = rec.block_bytes
        _ask(fd, 0, rec.nbytes)
        got = [_hash_range(fd, i * B, min(B, rec.nbytes - i * B)) for i in range(rec.n_blocks)]
        if None in got or checksums.combine(got) != rec.digest:
            self._mismatch(shard, fd, 0, rec.nbytes)
        done[:] = b"\x01" * rec.n_blocks

    def _mismatch(self, shard: int, fd: int, a: int, b: int) -> None:
        name = self.names[shard]
        bad = fd_change(fd, self.ids[shard], self.valid[shard])
        if bad:  # (the file changed since it was opened: say that, not only that the bytes differ)
            raise ShardChangedError(f"shard {name} in {self.path} {bad}; {FIX}")
        raise ShardChangedError(
            f"shard {name} in {self.path}: bytes {a:,}-{b:,} do not match their checksum record "
            f"({checksums.record_path(self.directory, name)}): they changed after they were written (a flipped "
            f"bit, a rewrite); check the cache with `actcache verify --deep {self.path}` and re-dump the "
            "shards it reports"
        )


class ShardFiles:
    """Guarded plain reads of a cache's shards (ActivationCache, IndexedDataset): each shard opened
    once, checked to be the file first seen, blocks verified on first read (``verify_reads``),
    and the file looked at again after every read, before the bytes are used."""

    def __init__(self, path: str, names: list[str], need: list[int], cache_hash: str, verify_reads: str):
        self.path, self.names, self.need = path, list(names), list(need)
        self.ids = identities(path, self.names)
        self.verifier = ReadVerifier(path, self.names, self.ids, cache_hash, self.need, verify_reads)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # DataLoader workers (spawn) open their own descriptors
        return {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _fds={}, _lock=threading.Lock())

    def fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            new = open_shard(self.path, self.names[shard], self.ids[shard], self.need[shard])
            with self._lock:
                fd = self._fds.setdefault(shard, new)
            if fd != new:  # another thread opened it first
                os.close(new)
        return fd

    def read_into(self, shard: int, offset: int, dst) -> None:
        """Fill the writable buffer ``dst`` with the shard's bytes from ``offset`` on."""
        view = memoryview(dst).cast("B")
        fd = self.fd(shard)
        self.verifier.ensure(shard, fd, offset, offset + len(view))
        got = 0
        try:
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    break
                got += n
        except OSError as err:
            raise self.error(shard, f"read error: {os_error_text(err)}") from None
        if got < len(view):
            raise self.error(shard, f"short read at byte {offset + got:,}")
        self.check(shard)

    def check(self, shard: int) -> None:
        """ShardChangedError naming the shard if it changed since it was opened."""
        bad = fd_change(self.fd(shard), self.ids[shard], self.need[shard])
        if bad:
            raise ShardChangedError(f"shard {self.names[shard]} in {self.path} {bad}; {FIX}")

    def error(self, shard: int, what: str) -> ShardChangedError:
        bad = fd_change(self.fd(shard), self.ids[shard], self.need[shard])
        return ShardChangedError(
            f"shard {self.names[shard]} in {self.path} {bad or 'could not be read'} ({what}); {FIX}"
        )

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:  # a cache dropped without close() must not keep its shards open
        fds = getattr(self, "_fds", None) or {}
        self._fds = {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
