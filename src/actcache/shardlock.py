"""Per-shard locks, so that dumps of overlapping shard ranges write each shard once.

A dump holds ``<HASH>/.actcache-dump/actsNNNNNN.bin.lock`` (``flock``, exclusive) from the first
batch of a shard until the shard is renamed into place. A second dump that finds the lock held
skips that shard, writes the rest of its range, then waits for the holder and writes only what
the holder left unfinished (it was killed, say). A lock dies with its process, so a killed dump
leaves no stale lock; the lock file itself stays and is harmless.

Shared filesystems: Linux's NFS client turns ``flock`` into a byte-range lock held by the server
(NLM for NFSv3, in the protocol for NFSv4), so dumps on different nodes see each other's locks,
and a dead node's locks end with its lease. Where the filesystem refuses locks (ENOLCK,
EOPNOTSUPP, ENOSYS, EINVAL: Lustre mounted without ``-o flock``, some FUSE filesystems), or the
lock file cannot be made, the dump logs one warning and goes on without them: concurrent dumps may then repeat work, never corrupt
it, since every shard is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading

log = logging.getLogger(__name__)


class ShardLocks:
    """The locks one dump holds on the shards of one cache (``lock_dir``: its job-mark directory)."""

    def __init__(self, lock_dir: str):
        self.dir = lock_dir
        self.enabled = True
        self._held: dict[str, int] = {}
        self._mutex = threading.Lock()  # the writer thread releases what the main thread took

    def path(self, shard: str) -> str:
        return os.path.join(self.dir, shard + ".lock")

    def _open(self, shard: str) -> int:
        os.makedirs(self.dir, exist_ok=True)
        return os.open(self.path(shard), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)

    def _disable(self, err: OSError) -> None:
        self.enabled = False
        log.warning(
            "%s: this filesystem refuses file locks (%s); dumping without per-shard locks, so concurrent "
            "dumps of the same shards may both write them (each shard is still written atomically)",
            self.dir, os.strerror(err.errno),
        )  # fmt: skip

    def try_acquire(self, shard: str) -> bool:
        """True: this dump may write ``shard`` (lock taken, or locks unsupported here). False:
        another process holds it."""
        if not self.enabled:
            return True
        try:
            fd = self._open(shard)
        except OSError as err:  # no lock file here (read-only marks directory, say): no locks
            self._disable(err)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            self._disable(err)
            return True
        with self._mutex:
            self._held[shard] = fd
        return True

    def release(self, shard: str) -> None:
        with self._mutex:
            fd = self._held.pop(shard, None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    def release_all(self) -> None:
        for shard in list(self._held):
            self.release(shard)

    def wait(self, shard: str) -> None:
        """Block until no process holds ``shard``'s lock (its writer finished or died)."""
        if not self.enabled:
            return
        try:
            fd = self._open(shard)
        except OSError as err:
            self._disable(err)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            self._disable(err)
        finally:
            os.close(fd)
