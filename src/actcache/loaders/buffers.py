"""Reusable batch buffers, and faulting in the fresh memory they (and io="read" arena slots) use.

:class:`BatchPool` hands out batch-sized numpy buffers and takes them back for reuse once the
consumer no longer references them (the torch tensors given to the consumer hold a reference to
their numpy array, so a reference count at its baseline means nobody uses it any more). A
consumer that keeps old batches keeps their memory; the pool then allocates new buffers and never
writes into one that is still referenced. The sets outlive an iteration: the loader's next one
starts with them (``BatchPool.handover``), until ``close()``. :class:`FreshPages` chooses the page
size of new buffers and faults them in (see HUGE_FAULT_MIN_BPS).

The shard mappings the copies read from are in ``maps.py``.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from actcache.loaders import kernels
from actcache.loaders.maps import HUGE, PAGE, _madvise, _page_span

FIELDS = ("act", "image_i", "patch_i", "layer")


MADV_POPULATE_WRITE = 23
# prefault(stop=...) looks at stop() after each piece this large: fresh memory can fault in
# slowly (a VM host backing it again), so a whole batch buffer may take a while, and a loader
# that has finished (or was stopped) should not wait for that to end.
STOP_CHECK_BYTES = 4 * 2**20
# populate_small: one madvise call per this much (the mmap lock is held meanwhile, so the calls
# are kept short)
POPULATE_CHUNK = 2**20
# Batch buffer sets start on 2 MiB pages (huge_empty): copies into them run faster than into
# 4 KiB pages. But where a VM host must back the memory again (free page reporting hands free
# 2 MiB blocks back to the host), a 2 MiB page faults in slower than 4 KiB pages (the kernel takes
# those from smaller free blocks, which it does not report). So the pool times each
# STOP_CHECK_BYTES piece of a set it prefills (thread CPU time: host faults count as the guest's
# CPU); once one is slower than this many bytes per second, the rest of that set and the next
# sets go on 4 KiB pages. Where memory is still backed no piece is slow and nothing changes.
HUGE_FAULT_MIN_BPS = 2e9
# ... and a set on 4 KiB pages is replaced by one on 2 MiB pages once it has been used this many
# times (ski rental: by then its slower copies have cost about what one slow 2 MiB set costs to
# fault in), so a long run loses nothing. The io="read" arena's slots follow the same rules
# (FreshPages; ShuffledLoader._arena_slot).
SMALL_SET_USES = 128


def populate_small(a: np.ndarray, chunk: int = POPULATE_CHUNK) -> bool:
    """Fault in a fresh writable array with MADV_POPULATE_WRITE, one call per ``chunk`` bytes (no
    GIL: ctypes); -> False where that is not available (the caller then touches the pages). The
    edges not on whole pages are written to. The default chunk suits 4 KiB pages (faster than
    touching them: no page-fault exception per page); see prefault for 2 MiB ones."""
    if _madvise is None or a.nbytes < 4 * PAGE or not a.flags.c_contiguous:
        return False
    addr = a.ctypes.data
    lo, hi = _page_span(addr, 0, a.nbytes, inner=True)
    for s in range(lo, hi, chunk):
        if _madvise(s, min(chunk, hi - s), MADV_POPULATE_WRITE) != 0:
            return False
    flat = a.reshape(-1).view(np.uint8)
    flat[: lo - addr] = 0
    flat[hi - addr :] = 0
    return True


def prefault(
    a: np.ndarray,
    chunk: int = HUGE,
    stop: Callable[[], bool] | None = None,
    watch: Callable[[int, np.ndarray, float], None] | None = None,
    small: Callable[[], bool] | None = None,
) -> bool:
    """Fault in (zero-filled) the pages of a fresh writable array, without the GIL; -> False
    when ``stop()`` turned true between two STOP_CHECK_BYTES pieces (the rest is left untouched).
    ``watch(nbytes, rest, seconds)``, if given, is called after each piece with its size, the
    part of the array still untouched and the thread CPU time the piece took.

    With the C kernel: by writing to them (kernels.touch). Page faults lock only their memory
    area, while madvise(MADV_POPULATE_WRITE) holds the process's mmap lock, and any thread that
    maps or unmaps memory meanwhile (numpy allocating an array: the planner, the index) waits
    for it; zeroing fresh memory is slow where a VM host must back it, so populating batch
    buffers that way stalled the first batch's plan. Without the kernel: one madvise per ``chunk``.
    ``small()``, if given and true for a piece: that piece lies on 4 KiB pages and is populated
    with MADV_POPULATE_WRITE in small calls (populate_small), which is faster there: no 2 MiB
    page for the host to back, and no page-fault exception per 4 KiB page."""
    if (stop is not None or watch is not None or small is not None) and a.flags.c_contiguous:
        flat = a.reshape(-1).view(np.uint8)
        for i in range(0, flat.nbytes, STOP_CHECK_BYTES):
            if stop is not None and stop():
                return False
            piece = flat[i : i + STOP_CHECK_BYTES]
            if small is not None and small() and populate_small(piece):
                continue
            if watch is None:
                prefault(piece, chunk)
                continue
            c0 = time.thread_time()
            prefault(piece, chunk)
            watch(piece.nbytes, flat[i + STOP_CHECK_BYTES :], time.thread_time() - c0)
        return True
    if kernels.touch(a) or populate_small(a, chunk):
        return True
    a.reshape(-1)[:: max(1, PAGE // a.itemsize)] = 0
    return True


class FreshPages:
    """The page size fresh buffers of one loader iteration go on (batch buffer sets, io="read"
    arena slots), and faulting them in: 2 MiB pages until a piece of one faults in slower than
    HUGE_FAULT_MIN_BPS, 4 KiB pages from then on (``huge``; set back to True by whoever replaces a
    buffer on 4 KiB pages after SMALL_SET_USES uses)."""

    def __init__(self):
        self.huge = True

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A new uninitialised buffer on the page size in use (huge_empty)."""
        return huge_empty(shape, dtype, self.huge)

    def fault_in(
        self, a: np.ndarray, huge: bool, stop: Callable[[], bool] | None = None, nbytes: int | None = None
    ) -> tuple[bool, bool]:
        """prefault a fresh array made with ``huge_empty(..., huge)`` (its first ``nbytes`` bytes
        only, if given: the rest faults in when first written), timing each piece while it is on
        2 MiB pages: once one is slower than HUGE_FAULT_MIN_BPS, the rest of the array goes on
        4 KiB pages (MADV_NOHUGEPAGE) and so do later buffers (``self.huge``). Every piece is
        timed: the first may come from memory freed just before, the next from memory the host
        let go. -> (done: False when ``stop()`` turned true, whether it is still all on 2 MiB
        pages)."""
        state = {"huge": huge}
        part = a if nbytes is None or nbytes >= a.nbytes else a.reshape(-1).view(np.uint8)[: max(0, nbytes)]
        end = a.ctypes.data + a.nbytes
        after = -(-(a.ctypes.data + part.nbytes) // PAGE) * PAGE  # the first page past ``part``

        def watch(n: int, rest: np.ndarray, dt: float) -> None:
            start = rest.ctypes.data if rest.nbytes else after  # all of the array not faulted in yet
            if state["huge"] and end > start and dt > 0 and n / dt < HUGE_FAULT_MIN_BPS:
                if _madvise(start, end - start, mmap.MADV_NOHUGEPAGE) == 0:
                    state["huge"] = self.huge = False

        timed = huge and _madvise is not None and a.ctypes.data % HUGE == 0
        ok = prefault(part, stop=stop, watch=watch if timed else None, small=lambda: not state["huge"])
        return ok, state["huge"]

    def worn(self, buf) -> bool:
        """Count one more use of a buffer (with ``huge`` and ``uses`` attributes); True when it is
        on 4 KiB pages and has now cost what one on 2 MiB pages would (SMALL_SET_USES): the caller
        replaces it, and new buffers go on 2 MiB pages again."""
        if buf.huge:
            return False
        buf.uses += 1
        if buf.uses <= SMALL_SET_USES:
            return False
        self.huge = True
        return True


def _refcounts(arrays: list[np.ndarray]) -> list[int]:
    return [sys.getrefcount(a) for a in arrays]


def huge_empty(shape: tuple[int, ...], dtype=np.float32, huge: bool = True) -> np.ndarray:
    """An uninitialised array in anonymous memory advised to use transparent huge pages (fewer
    TLB misses when copying into it, faster first touch where the memory is backed); plain
    np.empty where unsupported. ``huge=False``: the same, on 4 KiB pages (MADV_NOHUGEPAGE, also
    where THP is "always"; see HUGE_FAULT_MIN_BPS for when that is worth it)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < 4 * HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    except OSError:
        pass
    raw = np.frombuffer(mm, np.uint8)
    skip = (-raw.ctypes.data) % HUGE  # start on a 2 MiB boundary
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``'s memory; bfloat16's raw bits (uint16, dtypes.py) become torch.bfloat16."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class BatchBuffers:
    """One batch's numpy arrays: act (B, D) float32 (or a 16-bit cache's stored type), image_i /
    patch_i / layer (B,) int64."""

    def __init__(self, batch_size: int, d: int, huge: bool = True, act_dtype=np.float32):
        self.act = huge_empty((batch_size, d), act_dtype, huge)
        self.huge = huge  # act on 2 MiB pages (False: 4 KiB, see HUGE_FAULT_MIN_BPS)
        self.uses = 0  # batches copied into it while on 4 KiB pages (see SMALL_SET_USES)
        self.faulted = False  # its memory faulted in (prefill, or a first copy that populated it)
        self.image_i = np.empty(batch_size, np.int64)
        self.patch_i = np.empty(batch_size, np.int64)
        self.layer = np.empty(batch_size, np.int64)
        self.n = 0
        self.key = None  # (epoch, batch)
        self.shards = None  # the shards the batch was copied from (None: unknown, check every open one)
        self._base = _refcounts(self.arrays())

    def arrays(self) -> list[np.ndarray]:
        return [self.act, self.image_i, self.patch_i, self.layer]

    def in_use(self) -> bool:
        return any(c > b for c, b in zip(_refcounts(self.arrays()), self._base, strict=True))

    def to_torch(self) -> dict:
        n = self.n
        full = n == self.act.shape[0]
        return {name: as_tensor(a if full else a[:n]) for name, a in zip(FIELDS, self.arrays(), strict=True)}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class BatchPool:
    """At most ``max_sets`` reusable BatchBuffers owned by the loader (see the module docstring)."""

    def __init__(
        self, make: Callable[[bool], BatchBuffers], max_sets: int, cond: threading.Condition, spare: list | None = None
    ):
        self.make, self.max_sets, self.cond = make, max_sets, cond  # make(huge): a new set
        self.pages = FreshPages()  # new sets on 2 MiB pages until they fault in slowly (HUGE_FAULT_MIN_BPS)
        self.free: list[BatchBuffers] = []
        # sets left by the loader's previous iteration (see handover): the consumer may still hold
        # some of them, so they start as lent and are taken once their arrays are unreferenced
        self.lent: list[BatchBuffers] = list(spare or [])[:max_sets]
        self.n_owned = len(self.lent)
        self.n_allocated = 0

    def try_acquire(self, grow: bool = True) -> BatchBuffers | None:
        """A free buffer set, or None when all are busy (call with ``cond`` held). ``grow``: may
        allocate one more set (up to ``max_sets``) when none is free."""
        if not self.free and self.lent:
            self.all_lent()  # moves the sets the consumer let go of to the free list
        if self.free:
            b = self.free.pop()
            if self.pages.worn(b):  # on 4 KiB pages long enough: replaced by a set on 2 MiB pages
                self.n_allocated += 1
                return self._new()
            return b
        if self.n_owned < self.max_sets and grow:
            self.n_owned += 1
            self.n_allocated += 1
            return self._new()
        if self.n_owned >= self.max_sets and len(self.lent) > 2:
            # The consumer keeps old batches: they are its memory now; the loader allocates anew.
            # (The last two lent are spared: while next() hands out batch k+1, a plain loop
            # still holds batch k in its loop variable.)
            self.lent.pop(0)
            self.n_allocated += 1
            return self._new()
        return None

    @property
    def huge(self) -> bool:
        """Whether new sets go on 2 MiB pages (FreshPages)."""
        return self.pages.huge

    def _new(self) -> BatchBuffers:
        return self.make(self.pages.huge)

    def all_lent(self) -> bool:
        """Whether every set owned is lent to the consumer and still used by it (call with
        ``cond`` held)."""
        still = []
        for b in self.lent:
            (still if b.in_use() else self.free).append(b)
        self.lent = still
        return len(still) == self.n_owned

    def prefill(self, stop: Callable[[], bool] | None = None) -> None:
        """Allocate one more set ahead of use and fault its memory in (call WITHOUT ``cond``
        held; gather threads do this while the first runs are being read, so first touch of
        fresh memory, slow where a VM host must back it, is off the critical path). ``stop()`` true (the
        loader is done or stopping): give up the set half-way (prefault) rather than make the
        loader's end wait for it."""
        with self.cond:
            if self.n_owned >= self.max_sets or (stop is not None and stop()):
                return
            self.n_owned += 1
            self.n_allocated += 1
            b = self._new()
        if not self._fault_in(b, stop):
            with self.cond:
                self.n_owned -= 1
            return
        with self.cond:
            self.free.append(b)
            self.cond.notify_all()

    def _fault_in(self, b: BatchBuffers, stop: Callable[[], bool] | None) -> bool:
        """prefault every array of a fresh set, act through FreshPages.fault_in (which may move the
        rest of it, and the next sets, to 4 KiB pages). False when ``stop()`` turned true."""
        ok, b.huge = self.pages.fault_in(b.act, b.huge, stop)
        ok = ok and all(prefault(a, stop=stop, small=lambda: not b.huge) for a in b.arrays()[1:])
        b.faulted = ok
        return ok

    def give_back(self, b: BatchBuffers) -> None:
        """A set the consumer never saw (or that is known free) goes straight back."""
        self.free.append(b)

    def lend(self, b: BatchBuffers) -> None:
        """A set handed to the consumer: reused once its arrays are no longer referenced."""
        self.lent.append(b)

    def clear(self) -> None:
        self.free.clear()
        self.lent.clear()

    def handover(self, unseen: list[BatchBuffers]) -> list[BatchBuffers]:
        """Every set this pool still tracks, for the loader's next iteration (call once its
        threads have stopped; ``unseen``: sets filled but never handed out). Reusing them spares
        the next pass fresh memory: under free page reporting, memory freed a while before is
        given back to the VM host and faults in again far slower than memory freed just before."""
        sets = self.free + unseen + self.lent
        self.clear()
        return sets
