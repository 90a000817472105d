"""The dump's writer thread: batches of activations -> shard files, overlapping the forward pass.

``ShardSink`` owns one open shard at a time (``writer.open_shard_writer``: temporary sibling,
fsync, rename when the shard's last image is written). The main thread ``put``s batches into a
bounded queue; an error in the thread (disk full, file size limit) surfaces as a ``DumpError`` at
the next ``put`` or at ``finish``, and the shard being written is discarded (no partial file).
``PinnedRing`` provides page-locked host buffers for asynchronous device-to-host copies.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading

import numpy as np
import torch

from actcache.errors import DumpError
from actcache.protocol import Metadata, shard_name
from actcache.writer import open_shard_writer

log = logging.getLogger(__name__)

QUEUE_DEPTH = 3  # batches of activations waiting for the writer thread


_END = "end"  # every queued batch written; the last shard must be complete
_STOP = "stop"  # write what is queued, then discard an incomplete shard (after a data error)


class _Discarded(Exception):
    pass


def write_error(err: BaseException, path: str, shard: int | None) -> DumpError:
    """A DumpError saying what failed and where (err is a write/fsync/rename failure)."""
    if isinstance(err, DumpError):
        return err
    what = f"shard {shard_name(shard)}" if shard is not None else "a shard"
    where = os.path.join(path, shard_name(shard)) if shard is not None else path
    if isinstance(err, OSError):
        hint = {
            errno.EFBIG: "the file size limit was reached (ulimit -f / RLIMIT_FSIZE, or the filesystem's maximum "
            "file size)",
            errno.ENOSPC: "the filesystem is full",
            errno.EDQUOT: "the disk quota is exceeded",
            errno.EACCES: "permission denied",
            errno.EROFS: "the filesystem is read-only",
        }.get(err.errno, "an I/O error")
        code = errno.errorcode.get(err.errno, str(err.errno))
        msg = f"writing {what} to {where} failed: {err.strerror or err} ({code}: {hint})"
    else:
        msg = f"writing {what} to {where} failed: {type(err).__name__}: {err}"
    return DumpError(
        msg + ". The incomplete shard was discarded (no partial file is kept); fix the cause and re-run the "
        "same command: complete shards are kept and skipped."
    )


class ShardSink:
    """Background thread writing (shard, acts_BLTD) batches into shard files, one open at a time.

    ``put`` blocks while ``depth`` batches are queued and raises the writer's error (a DumpError)
    as soon as the thread has failed; ``finish`` waits for the last shard to be renamed.
    """

    def __init__(self, path: str, md: Metadata, depth: int = QUEUE_DEPTH, on_done=None):
        self.path, self.md = path, md
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: DumpError | None = None
        self.done: list[int] = []
        self.on_done = on_done
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name="actcache-shard-writer", daemon=True)

    def start(self) -> ShardSink:
        self._thread.start()
        return self

    def _run(self) -> None:
        cm = w = None
        shard = None
        try:
            while not self._abort.is_set():
                try:
                    item = self.q.get(timeout=0.2)
                except queue.Empty:
                    continue
                if item == _END or item == _STOP:
                    if w is not None and item == _END:
                        raise DumpError(f"internal error: shard {shard_name(shard)} incomplete at the end")
                    break
                shard_idx, acts, ready = item
                if w is not None and shard_idx != shard:
                    raise DumpError(f"internal error: shard {shard_name(shard)} incomplete when {shard_idx} began")
                if w is None:
                    shard = shard_idx
                    cm = open_shard_writer(self.path, self.md, shard_idx)
                    w = cm.__enter__()
                if ready is not None:
                    ready.synchronize()  # the device-to-host copy of this batch
                w.write(acts)
                if w.n_written == w.n_expected:
                    done_cm, cm, w = cm, None, None
                    done_cm.__exit__(None, None, None)  # fsync + rename (+ fsync of the directory)
                    self.done.append(shard_idx)
                    if self.on_done is not None:
                        self.on_done(shard_idx)
        except BaseException as err:  # noqa: BLE001 - reported to the main thread
            self.error = write_error(err, self.path, shard)
            self.error.__cause__ = err
        finally:
            if cm is not None:  # an incomplete shard: remove its temporary file
                with contextlib.suppress(BaseException):
                    cm.__exit__(_Discarded, _Discarded(), None)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if not self._thread.is_alive():
            raise DumpError("internal error: the shard writer thread stopped unexpectedly")

    def put(self, shard_idx: int, acts_BLTD: np.ndarray, ready=None) -> None:
        self._put((shard_idx, acts_BLTD, ready))

    def _put(self, item) -> None:
        while True:
            self._check()
            try:
                self.q.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def finish(self) -> None:
        """Wait until every queued batch is written and the last shard renamed; raise its error."""
        self._put(_END)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abort(self, drain: bool) -> None:
        """Stop: with ``drain`` write what is queued first (complete shards are kept)."""
        if drain and self.error is None:
            with contextlib.suppress(BaseException):
                self._put(_STOP)
        else:
            self._abort.set()
        self._thread.join()


class PinnedRing:
    """Page-locked host buffers reused round-robin for asynchronous device-to-host copies.

    ``size`` = queue depth + 2 covers every batch that can be alive at once (queued, being
    written, being filled), so a buffer is never overwritten before the writer is done with it.
    """

    def __init__(self, size: int):
        self.bufs: list[torch.Tensor | None] = [None] * size
        self.i = 0

    def copy(self, acts: torch.Tensor):
        k = self.i % len(self.bufs)
        self.i += 1
        buf = self.bufs[k]
        if buf is None or buf.numel() < acts.numel():
            buf = self.bufs[k] = torch.empty(acts.numel(), dtype=acts.dtype, pin_memory=True)
        host = buf[: acts.numel()].view(acts.shape)
        host.copy_(acts, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host.numpy(), ready
