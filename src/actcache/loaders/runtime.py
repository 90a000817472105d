"""The threads of one loader iteration: start, status, errors, timeouts, shutdown; and metrics.

Every thread runs through :meth:`Runtime.spawn`: an exception in it is recorded (its traceback
goes to the debug log), everything stops, and the consumer's next wait raises :class:`LoaderError`
with one line: the thread, what it was doing, and the exception's type and text. Threads report what they are doing (:meth:`Runtime.status`), so a
:class:`BatchTimeoutError` names what stalled (which reader, which shard and images). A timeout
measures a stall, not a slow start: the consumer gives up only when it has waited
``batch_timeout_s`` and no reader has finished a read (:meth:`Runtime.progressed`) within that
time. A cold shuffled loader's first batch needs its whole first fill (``buffer_bytes`` of
reads), which is slow but not stalled.

The consumer waits in short slices, so a Ctrl-C (KeyboardInterrupt) in the consuming thread is
seen at once; the loader's cleanup then stops and joins its threads. Threads only; no process,
no shared-memory segment.

One lock guards an iteration's state. Threads of different roles may wait on conditions of
their own on that lock (:meth:`Runtime.condition`), so that an event wakes only the threads it
concerns: on few cores, waking every thread of the loader for every event (a run read, a batch
taken) takes CPU from the copies. Errors and shutdown wake every condition.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from actcache.errors import ActCacheError, BatchTimeoutError, LoaderError

SLICE_S = 0.05
log = logging.getLogger(__name__)

try:
    import ctypes

    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _name_thread(name: str) -> None:
    """Name the OS thread (top -H, perf, py-spy show it): 'ac-' + the role, 15 bytes at most."""
    if _prctl is not None:
        _prctl(15, ("ac-" + name).encode()[:15], 0, 0, 0)  # PR_SET_NAME


class Stopped(Exception):
    """Raised inside a loader thread when the loader is shutting down."""


@dataclasses.dataclass
class LoaderStats:
    """Metrics of a loader (cumulative over its iterations; ``reset()`` to start over).

    wait_s: time the consumer spent waiting for data inside ``next()`` (0 means the loader kept
    up); read_bytes: bytes made resident from the shards (only the selected layers' bytes);
    cold_read_bytes: of the shards' bytes (whole 2 MiB blocks), those the shuffled loader found
    outside the page cache and read from the disk itself (``cold_read="read"``);
    first_batch_s: time from the start of the iteration to the first batch.
    """

    batches: int = 0
    examples: int = 0
    wait_s: float = 0.0
    elapsed_s: float = 0.0
    read_bytes: int = 0
    cold_read_bytes: int = 0  # bytes found outside the page cache and read with preadv (shuffled, cold_read="read")
    peak_held_bytes: int = 0  # most shard bytes held resident at once (shuffled: <= buffer_bytes)
    first_batch_s: float | None = None
    started: float | None = None
    thread_cpu_s: dict = dataclasses.field(default_factory=dict)  # CPU seconds per thread role
    buffer_sets: int = 0  # batch buffer sets allocated (more than max(3, read_ahead + 1) per pass
    #                       only when the consumer keeps batches: they are its memory then)
    arena_slots: int = 0  # io="read" arena slots allocated (shuffled; more than fit buffer_bytes only
    #                       where a slot on 4 KiB pages was replaced by one on 2 MiB pages: SMALL_SET_USES)
    prefetch: str | None = None  # the copy kernel's prefetch scheme in use (shuffled; None: not chosen yet)
    prefetch_GBps: dict = dataclasses.field(default_factory=dict)  # GB per copy CPU-second, per scheme tried

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def read_MBps(self) -> float:
        return self.read_bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("started")
        d["examples_per_s"] = self.examples_per_s
        d["read_MBps"] = self.read_MBps
        return d

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            missing = f.default_factory is dataclasses.MISSING
            setattr(self, f.name, f.default if missing else f.default_factory())


class Runtime:
    def __init__(self, name: str):
        self.name = name
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # the default condition (every role, unless split)
        self._conds: list[threading.Condition] = [self.cond]
        # what the consumer waits on, what it wakes when it enters a wait (a plain loop has just
        # dropped its batch before last: a thread waiting for a free buffer may go on) and when it
        # has taken a batch
        self.consumer_cond = self.cond
        self.on_consumer_wait: list[threading.Condition] = [self.cond]
        self.on_consumed: list[threading.Condition] = [self.cond]
        self.stopping = False
        self.error: tuple[str, str, BaseException] | None = None  # (thread name, what it was doing, exception)
        self.threads: list[threading.Thread] = []
        self._status: dict[str, tuple[str, float]] = {}
        self.consumer_waiting = False  # the consumer is inside consumer_wait()
        self.cpu_s: dict[str, float] = {}  # CPU seconds each finished thread used (diagnostics)
        self.progress_at = time.monotonic()  # when a reader last finished a read (see progressed)

    def condition(self) -> threading.Condition:
        """A further condition on this runtime's lock (woken, like every one, on errors and stop)."""
        c = threading.Condition(self.lock)
        self._conds.append(c)
        return c

    def wake_all(self) -> None:
        """Notify every condition (call with the lock held)."""
        for c in self._conds:
            c.notify_all()

    def consumed(self) -> None:
        """The consumer took a batch (call with the lock held)."""
        for c in self.on_consumed:
            c.notify_all()

    # ---- threads ------------------------------------------------------------------------------
    def spawn_all(self, roles: list[tuple[str, Callable[[], None]]]) -> None:
        """Start a thread per (name, fn), all held until the last has started. Thread.start()
        returns only once the new thread runs, and a thread that went straight to its work (the
        planner's Python) kept the GIL from the one starting the next for up to a switch
        interval, delaying the others' start. Held, each new thread gives the GIL back at once."""
        go = threading.Event()
        try:
            for name, fn in roles:
                self.spawn(name, fn, go)
        finally:
            go.set()

    def spawn(self, name: str, fn: Callable[[], None], go: threading.Event | None = None) -> None:
        """Start a thread running ``fn`` (after ``go`` is set, if given); its exception, other
        than Stopped, stops the runtime and reaches the consumer (its traceback: the debug log)."""

        def run():
            _name_thread(name)
            if go is not None:
                go.wait()
            try:
                fn()
            except Stopped:
                pass
            except BaseException as err:  # noqa: BLE001 - everything reaches the consumer
                doing = self._status.get(name, ("?", 0.0))[0]
                log.debug("%s: thread %r failed while %s", self.name, name, doing, exc_info=err)
                with self.cond:
                    if self.error is None and not self.stopping:
                        self.error = (name, doing, err)
                    self.stopping = True
                    self.wake_all()
            finally:
                self.status(name, "finished")
                self.cpu_s[name] = time.thread_time()

        t = threading.Thread(target=run, name=f"{self.name}-{name}", daemon=True)
        self.threads.append(t)
        self.status(name, "starting")
        t.start()

    def status(self, who: str, what: str) -> None:
        self._status[who] = (what, time.monotonic())

    def progressed(self) -> None:
        """A reader finished a read: the loader is moving, even if no batch is ready yet."""
        self.progress_at = time.monotonic()

    def describe(self) -> str:
        now = time.monotonic()
        return "\n".join(
            f"  {who}: {what} (for {now - since:.1f} s)" for who, (what, since) in sorted(self._status.items())
        )

    # ---- waiting (inside loader threads) ------------------------------------------------------
    def wait(
        self,
        ready: Callable[[], bool],
        poll: Callable[[], float | None] | None = None,
        cond: threading.Condition | None = None,
    ) -> None:
        """Block (the lock held by the caller) until ``ready()``; raise Stopped when stopping.

        ``poll()``, if given, may return a shorter time to look again after (for conditions that
        change without a notify, e.g. the consumer dropping a batch). ``cond``: the condition to
        wait on (default ``self.cond``); every wait also looks again after SLICE_S * 4 at most."""
        c = self.cond if cond is None else cond
        while not ready():
            if self.stopping:
                raise Stopped
            p = poll() if poll is not None else None
            c.wait(p if p is not None else SLICE_S * 4)
        if self.stopping:
            raise Stopped

    def check(self) -> None:
        if self.stopping:
            raise Stopped

    # ---- waiting (consumer) -------------------------------------------------------------------
    def raise_error(self) -> None:
        if self.error is not None:
            who, doing, err = self.error
            raise LoaderError(f"{self.name}: thread '{who}' failed while {doing}: {one_line(err)}") from err

    def consumer_wait(
        self,
        ready: Callable[[], object],
        timeout_s: float | None,
        what: str,
    ):
        """Wait (``cond`` NOT held) until ``ready()`` returns something not None, and return it.

        Raises LoaderError if a thread failed, BatchTimeoutError once it has waited ``timeout_s``
        and no read has finished for ``timeout_s`` either (None or <= 0: no limit). Waits in
        short slices so that KeyboardInterrupt is seen promptly.
        On entry it wakes the loader threads: a plain loop has just dropped the batch before its
        last, so a thread waiting for a free buffer may go on. ``consumer_waiting`` is True
        meanwhile (loader threads read it with ``cond`` held).
        """
        start = time.monotonic()
        with self.lock:
            for c in self.on_consumer_wait:
                c.notify_all()
            self.consumer_waiting = True
            try:
                return self._consumer_wait(ready, timeout_s, what, start)
            finally:
                self.consumer_waiting = False

    def _consumer_wait(self, ready, timeout_s, what: str, start: float):  # cond held
        while True:
            self.raise_error()
            got = ready()
            if got is not None:
                return got
            if self.stopping:
                raise LoaderError(f"{self.name}: the loader was stopped")
            now = time.monotonic()
            if timeout_s and timeout_s > 0 and now - max(start, self.progress_at) > timeout_s:
                raise BatchTimeoutError(
                    f"{self.name}: no batch and no finished read for batch_timeout_s={timeout_s:g} s "
                    f"(waited {now - start:.1f} s) for {what}. What each thread is doing:\n{self.describe()}\n"
                    "A reader stuck on one shard points at the filesystem (slow or hung); raise "
                    "batch_timeout_s if a single read can take that long there."
                )
            self.consumer_cond.wait(SLICE_S)

    # ---- shutdown -----------------------------------------------------------------------------
    def shutdown(self, join_s: float = 3.0) -> list[str]:
        """Stop and join all threads; returns the names of threads that did not finish in time
        (e.g. a reader stuck on a hung filesystem: it is a daemon thread and is left behind)."""
        with self.lock:
            self.stopping = True
            self.wake_all()
        deadline = time.monotonic() + join_s
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]


def one_line(err: BaseException) -> str:
    """An exception as one line: its text (our own errors say what to do), or its type and text."""
    text = " ".join(str(err).split()) or "(no message)"
    return text if isinstance(err, ActCacheError) else f"{type(err).__name__}: {text}"
