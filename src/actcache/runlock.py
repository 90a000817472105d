"""One owner per run directory: `train` holds ``<run_dir>/train.lock`` (flock, exclusive) from
before it writes run.json until it returns, so two trains of one SAE cannot both write its
checkpoints, metrics.jsonl and done.json.

The holder writes "host pid" into the lock file, so a second train names it: it exits with one
line at once, or waits for the holder with ``wait=True`` (`train --wait-for-lock`). A lock dies
with its process (a killed train leaves no stale lock; the file stays and is harmless). As for
dumps' shard locks (actcache.shardlock), Linux's NFS client turns flock into a lock the server
holds, so trains on different nodes see each other; where the filesystem refuses locks, train
logs one warning and goes on without one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time

from actcache.errors import TrainError, os_error_text
from actcache.rundir import LOCK_FILE

log = logging.getLogger(__name__)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
HOLDER_READ_S = 0.5  # how long to wait for a holder that has just taken the lock to write its name


class RunLock:
    """The exclusive locks one train holds on its run directories (release() or close() drops them)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def acquire(self, directory: str, wait: bool = False) -> None:
        """Lock ``directory`` (made if absent). Held by another process: TrainError naming the holder,
        or, with ``wait``, block until it ends."""
        if directory in self._held:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as err:
            raise TrainError(f"{path}: cannot open the run's lock file: {os_error_text(err)}; check the run "
                             "directory's permissions, or delete the file if it is not a plain file.") from None  # fmt: skip
        try:
            self._lock(fd, path, wait)
        except BaseException:
            os.close(fd)
            raise
        self._held[directory] = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)

    def _lock(self, fd: int, path: str, wait: bool) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as err:
            if err.errno in _UNSUPPORTED:
                log.warning("%s: this filesystem refuses file locks (%s); training without the run's lock, so make "
                            "sure no other train of this SAE runs", path, os.strerror(err.errno))  # fmt: skip
                return
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TrainError(f"{path}: cannot lock it: {os_error_text(err)}; check the filesystem.") from None
        holder = _holder(fd)
        if not wait:
            raise TrainError(
                f"{os.path.dirname(path)}: another train owns this run ({holder}); wait for it to end, stop it, "
                "or pass --wait-for-lock to start when it ends."
            )
        log.warning("%s: another train owns this run (%s); waiting for it to end (--wait-for-lock)",
                    os.path.dirname(path), holder)  # fmt: skip
        fcntl.flock(fd, fcntl.LOCK_EX)

    def release(self, directory: str) -> None:
        fd = self._held.pop(directory, None)
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    def close(self) -> None:
        for d in list(self._held):
            self.release(d)


def _holder(fd: int) -> str:
    """"host H, pid P" as the holder wrote it (it may be writing it right now: retry briefly)."""
    deadline = time.monotonic() + HOLDER_READ_S
    text = ""
    while True:
        try:
            text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        parts = text.split()
        if len(parts) == 2 and parts[1].isdigit():
            return f"host {parts[0]}, pid {parts[1]}"
        if time.monotonic() > deadline:
            return "holder not recorded"
        time.sleep(0.02)
