"""A loader's batches staged by a thread of their own, ahead of the consumer: the visuals pass
and the trainer both use it to overlap a batch's host-to-device copy with work on the one before."""

from __future__ import annotations

import threading


class StagedFeed:
    """Batches of a loader, each passed through ``stage`` by a thread of its own, ``depth`` ahead
    of the consumer, so that staging one batch overlaps the consumer's work on the one before.

    ``stage`` is a context manager factory, entered in the thread, that yields the function
    ``batch -> item``; the item must not refer to the loader's batch buffers (which the loader
    reuses once the thread lets go of the batch). ``next()`` gives the items in order (after
    ``on_take(item)``), raises the thread's error (the loader's, or staging's), and StopIteration
    at the end. ``close()`` stops the thread, also when the consumer stops early or fails.
    """

    def __init__(self, loader, stage, depth: int = 2, on_take=None, name: str = "actcache-staged-feed"):
        import queue

        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stage, self.on_take = stage, on_take
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(iter(loader),), name=name, daemon=True)
        self.thread.start()

    def _run(self, batches) -> None:
        try:
            with self.stage() as stage:
                for batch in batches:
                    item = stage(batch)
                    del batch  # the loader may reuse its buffer set now
                    if not self._put(("item", item)):
                        return
            self._put(("end", None))
        except BaseException as err:  # noqa: BLE001 - raised in the consumer
            self._put(("error", err))

    def _put(self, entry) -> bool:
        import queue

        while not self.stopping.is_set():
            try:
                self.q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self):
        kind, item = self.q.get()
        if kind == "end":
            self.q.put((kind, item))  # every later next() ends too
            raise StopIteration
        if kind == "error":
            self.q.put((kind, item))
            raise item
        if self.on_take is not None:
            self.on_take(item)
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; it ends at its next batch (a loader still reading is stopped by its
        own close(), which follows)."""
        self.stopping.set()
        self.thread.join(timeout)
