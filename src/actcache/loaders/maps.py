"""Memory-mapped shards, made resident and released by byte range (the loaders' reads).

:class:`ShardMaps` maps each shard file read-only once and offers, per byte range of a shard:
``prefetch`` (posix_fadvise WILLNEED: the kernel starts large reads now; skipped for ranges
already cached), ``read_uncached`` (plain preadv into a small scratch buffer, for ranges not
cached yet: the default way the shuffled loader reads cold runs, see ``cold_read``),
``make_resident`` (madvise MADV_POPULATE_READ: returns when the pages are in
the page cache AND mapped in this process, so later copies out of them never wait for the disk;
in mode "random", ranges found cached are left for the copies to map as they touch them), and
``release`` (MADV_DONTNEED: unmap them from this process, so its resident memory shrinks;
optionally POSIX_FADV_DONTNEED as well, which also drops them from the page cache); for whole
2 MiB blocks with several users (the shuffled loader's runs, across epochs) ``block_acquire`` /
``block_release``, and ``block_pin`` (hold the blocks a run shares with others before it is
read); for a sequential reader ``release_before``. madvise is called through ctypes and fadvise
through ``os``, so the GIL is released while the kernel works (``mmap.madvise`` holds it).

Before touching a range, its file is stat'ed (integrity.py): a shard truncated, replaced or
removed after the loader was created is a LoaderError naming it. A shard truncated while a batch
is copied out of its mapping raises SIGBUS in the copy, which the C kernel turns into an error
(``read_error`` names the shard); without the C kernel only the checks before each copy remain.

The batch buffers the copies write into are in ``buffers.py``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import numpy as np

from actcache.errors import LoaderError
from actcache.loaders import integrity, kernels
from actcache.loaders.options import COLD_READS

PAGE = mmap.PAGESIZE
HUGE = 2 * 2**20  # x86-64 PMD size
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux >= 5.14
# huge mode, cold_read="read": uncached ranges are read with preadv calls of this size into a
# per-thread scratch buffer (it stays in the CPU cache; the kernel's read-ahead runs ahead of it)
READ_CHUNK = 2 * 2**20

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
    _mincore = _libc.mincore
    _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _mincore.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - non-Linux
    _madvise = _mincore = None


def _page_span(addr: int, start: int, end: int, inner: bool) -> tuple[int, int]:
    """Page-aligned [a, b) address span of bytes [start, end): covering (inner=False) or inside."""
    lo, hi = addr + start, addr + end
    if inner:
        lo = -(-lo // PAGE) * PAGE
        hi = hi // PAGE * PAGE
    else:
        lo = lo // PAGE * PAGE
        hi = -(-hi // PAGE) * PAGE
    return lo, hi


MODES = ("huge", "pte", "random")


def block_range(start: int, end: int) -> tuple[int, int]:
    """[a, b): the numbers of the 2 MiB blocks under the byte range [start, end) of a file."""
    return start // HUGE, -(-end // HUGE)


class ShardMaps:
    """Read-only mappings of a cache's shard files, with range-wise residency control.

    mode "huge": one MADV_HUGEPAGE mapping per shard. Loading through its fault path reads
    large chunks into large page-cache folios, which then map 2 MiB at a time: mapping cached
    data costs almost nothing, and random gathers out of it run faster than through 4 KiB
    page tables (fewer TLB misses). But a 2 MiB mapping is all-or-nothing: unmapping part of it
    drops all of it and the next access maps all of it again, so only whole runs can be released.

    mode "pte": the same loading through a huge-page *staging* mapping (then unmapped again),
    but copies go through a MADV_NOHUGEPAGE mapping populated with 4 KiB entries: any page range
    can then be released (the shuffled loader's strips), at the cost of slower gathers.

    mode "random" (only a small part of each image is read: one layer of several, or the CLS
    token): no read-around; exact ranges are requested with posix_fadvise WILLNEED, then mapped
    (ranges already cached are mapped by the copies' first touch: see make_resident).

    cold_read (huge mode): how ranges not yet in the page cache are read. "fault": through the
    mapping's fault path (2 MiB page-cache folios). "read": first with plain sequential preadv
    calls into a small per-thread scratch buffer (``read_uncached``), then mapped. "read" is
    faster cold where the memory the pages land in must first be backed again by a VM host:
    preadv makes that first touch in its own copy, as the data arrives, in a reader thread that
    waits on the disk anyway, not in the gather threads. But preadv at a random offset fills the
    page cache with smaller folios, so a later warm pass over the same pages gathers slower;
    "fault" keeps 2 MiB folios, for a cache read for many epochs. No pattern of preadv calls
    leaves 2 MiB folios reliably (BENCHMARKS.md, "Warm also means large folios").
    """

    def __init__(
        self,
        path: str,
        names: list[str],
        sizes: list[int],
        evict: bool = False,
        mode: str = "huge",
        cold_read: str = "fault",
        identities: list | None = None,
        verifier=None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        if cold_read not in COLD_READS:
            raise ValueError(f"cold_read {cold_read!r} not in {COLD_READS}")
        self.cold_read = cold_read
        self._scratch = threading.local()  # read_uncached: each thread's READ_CHUNK buffer
        self.path, self.names, self.sizes = path, list(names), list(sizes)
        self.evict, self.mode = evict, mode
        # identity of each shard when the loader was created: a shard opened later must match
        self.identities = identities if identities is not None else integrity.identities(path, self.names)
        self.verifier = verifier  # shardguard.ReadVerifier (verify_reads), or None
        self._fds: dict[int, int] = {}
        self._maps: dict[tuple[int, str], mmap.mmap] = {}
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self._lock = threading.Lock()
        self._populate_ok = _madvise is not None
        self._nowait_ok = hasattr(os, "RWF_NOWAIT")
        self._probe_buf = bytearray(1)
        self._unmapped: dict[int, int] = {}  # release_before: bytes of each shard unmapped so far
        self._refs: dict[int, np.ndarray] = {}  # block_*: users of each 2 MiB block of a shard
        self.closed = False

    def fd(self, shard: int) -> int:
        """An open read-only descriptor of the shard file (checked for its size)."""
        with self._lock:
            if self.closed:
                raise LoaderError("the loader was closed")
            fd = self._fds.get(shard)
            if fd is None:
                fd = integrity.open_shard(self.path, self.names[shard], self.identities[shard], self.sizes[shard])
                self._fds[shard] = fd
            return fd

    def check_intact(self, shard: int, need: int | None = None) -> None:
        """LoaderError naming the shard if it was removed, replaced or truncated (below ``need``
        bytes; default its size) since the loader was created (integrity.py)."""
        fd = self.fd(shard)
        need = self.sizes[shard] if need is None else need
        integrity.check(self.path, self.names[shard], fd, self.identities[shard], need)

    def verify(self, shard: int, start: int, end: int) -> None:
        """verify_reads: check the checksum blocks under bytes [start, end) of the shard not
        checked yet in this process (shardguard.ReadVerifier); call before their bytes are copied."""
        if self.verifier is not None and self.verifier.on:
            self.verifier.ensure(shard, self.fd(shard), int(start), int(end))

    def unchanged(self, shards=None) -> None:
        """LoaderError naming one of ``shards`` (default: every one opened so far) whose size or
        change time moved (it was written to): call after a batch is copied from them, before it is
        handed out. One fstat per shard."""
        fds = self._fds
        for shard, fd in list(fds.items()) if shards is None else [(s, fds.get(s)) for s in shards]:
            if fd is None:  # (not opened: nothing was read from it)
                continue
            bad = integrity.fd_change(fd, self.identities[shard], self.sizes[shard])
            if bad:
                raise integrity.ShardChangedError(f"shard {self.names[shard]} in {self.path} {bad}; {integrity.FIX}")

    def shard_at(self, address: int) -> int | None:
        """The shard whose mapping holds ``address`` (a BusError's), or None."""
        for (shard, _), arr in list(self._arrays.items()):
            a = arr.ctypes.data
            if a <= address < a + arr.nbytes:
                return shard
        return None

    def read_error(self, err: BaseException, shards=None) -> LoaderError:
        """The LoaderError for a copy or read that failed with ``err``: it names the shard the
        faulting address lies in (a BusError's ``address``), else the first of ``shards`` found
        damaged, else the first of them."""
        shard = self.shard_at(getattr(err, "address", -1))
        if shard is None:
            cands = list(shards or [])
            damaged = [s for s in cands if self._problem(s)]
            shard = (damaged or cands or [None])[0]
        if shard is None:
            return LoaderError(f"could not read a shard of {self.path} ({type(err).__name__}: {err}); {integrity.FIX}")
        return integrity.read_error(
            self.path, self.names[shard], self._fds.get(shard), self.identities[shard], self.sizes[shard], err
        )

    def _problem(self, shard: int) -> str | None:
        return integrity.problem(
            self.path, self.names[shard], self._fds.get(shard), self.identities[shard], self.sizes[shard]
        )

    def _open(self, shard: int, which: str) -> np.ndarray:
        fd = self.fd(shard)
        with self._lock:
            if self.closed:
                raise LoaderError("the loader was closed")
            arr = self._arrays.get((shard, which))
            if arr is not None:
                return arr
            mm = mmap.mmap(fd, self.sizes[shard], prot=mmap.PROT_READ)
            advice = {"huge": "MADV_HUGEPAGE", "nohuge": "MADV_NOHUGEPAGE", "random": "MADV_RANDOM"}[which]
            if hasattr(mmap, advice):
                try:
                    mm.madvise(getattr(mmap, advice))
                except OSError:  # e.g. no transparent huge pages: still correct, only slower
                    pass
            arr = np.frombuffer(mm, dtype=np.uint8)
            self._maps[shard, which], self._arrays[shard, which] = mm, arr
            return arr

    @property
    def _main(self) -> str:
        return {"huge": "huge", "pte": "nohuge", "random": "random"}[self.mode]

    def array(self, shard: int) -> np.ndarray:
        """The whole shard as a uint8 array (a view of the mapping copies are made from)."""
        arr = self._arrays.get((shard, self._main))
        return arr if arr is not None else self._open(shard, self._main)

    def view(self, shard: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The shard's first prod(shape) values of ``dtype`` (the stored type) with ``shape``."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.array(shard)[:n].view(dtype).reshape(shape)

    # ---- residency ----------------------------------------------------------------------------
    def prefetch(self, shard: int, starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> bool:
        """Start reading byte ranges into the page cache (asynchronous, exact); ranges ``gap``
        bytes apart or closer are requested as one. A range whose first and last bytes are
        cached already is skipped: posix_fadvise walks every page of a range even when all are
        cached, where the probe (two one-byte reads that must not block) costs next to nothing.
        Returns whether every range was
        found cached: False where the kernel cannot tell (no RWF_NOWAIT), so that the ordered
        loader's io="auto" then reads (see its module doc for why that is the right default).

        With the C kernel, one call probes (and asks for) all the ranges without the GIL
        (kernels.probe): from Python, the GIL changes hands around every system call, which
        costs the other threads far more than the calls themselves."""
        fd = self.fd(shard)
        if self._nowait_ok:  # in C when built: one call for all the ranges (see _native.c, probe)
            missing = kernels.probe(fd, *_merged_arrays(starts, ends, gap), advise=True)
            if missing is not None:
                return missing == 0
        cached = True
        for s, e in _merged(starts, ends, gap):
            if not self._probe_cached(fd, int(s), int(e)):
                os.posix_fadvise(fd, int(s), int(e - s), os.POSIX_FADV_WILLNEED)
                cached = False
        return cached

    def mapped(self, shard: int) -> bool:
        """Whether the shard has been mapped for copying (``array``)."""
        return (shard, self._main) in self._arrays

    def _probe_cached(self, fd: int, start: int, end: int) -> bool:
        """Whether the bytes at ``start`` and ``end - 1`` are in the page cache (preadv2 with
        RWF_NOWAIT fails rather than wait for the disk). False where the kernel cannot tell."""
        if not self._nowait_ok or end <= start:
            return False
        try:
            return all(os.preadv(fd, [self._probe_buf], off, os.RWF_NOWAIT) == 1 for off in (start, end - 1))
        except BlockingIOError:
            return False
        except (OSError, AttributeError):  # no RWF_NOWAIT here: always ask for the read-ahead
            self._nowait_ok = False
            return False

    def _resident(self, shard: int, start: int, end: int) -> bool:
        """Whether the first and last pages of bytes [start, end) are in the page cache, by
        mincore on the mapping (no I/O): the probe where RWF_NOWAIT is not supported."""
        if _mincore is None or end <= start:
            return False
        addr = self.array(shard).ctypes.data
        vec = np.zeros(1, np.uint8)
        for off in (start, end - 1):
            page = (addr + off) // PAGE * PAGE
            if _mincore(page, PAGE, vec.ctypes.data) != 0 or not vec[0] & 1:
                return False
        return True

    def cached(self, shard: int, starts: np.ndarray, ends: np.ndarray) -> bool:
        """Whether every page of the byte ranges is in the page cache (mincore; no I/O)."""
        if _mincore is None:
            return False
        arr = self.array(shard)
        addr = arr.ctypes.data
        for s, e in _merged(starts, ends):
            lo, hi = _page_span(addr, int(s), int(e), inner=False)
            vec = np.empty((hi - lo) // PAGE, np.uint8)
            if _mincore(lo, hi - lo, vec.ctypes.data) != 0 or not (vec & 1).all():
                return False
        return True

    def make_resident(self, shard: int, starts: np.ndarray, ends: np.ndarray) -> int:
        """Byte ranges in the page cache and mapped for copying before returning (see the modes).
        -> bytes read with preadv because they were not cached (``cold_read="read"``), else 0."""
        self.check_intact(shard, int(ends.max()) if len(ends) else 0)
        cold = 0
        if self.mode == "huge" and self.cold_read == "read":
            cold = self.read_uncached(shard, starts, ends, gap=HUGE)
        if self.mode == "random":
            if self.prefetch(shard, starts, ends):  # (else it asked for the reads: populate waits)
                # Every range found cached: not populated here. The copies map the pages as they
                # first touch them, 2 MiB at a time where the page cache holds 2 MiB folios, while
                # MADV_POPULATE_READ would cost a call per range (one layer of several: merging
                # the ranges would map, and on a miss read, the other layers' bytes). A page the
                # probe missed (it looks at the first and last byte of each range) is then read
                # by the copy's fault instead of here.
                return cold
        elif self.mode == "pte" and not self.cached(shard, starts, ends):
            # load through the huge-page staging mapping (large folios), then unmap it
            stage = self._arrays.get((shard, "huge"))
            stage = stage if stage is not None else self._open(shard, "huge")
            self._populate(shard, stage, starts, ends)
            self._unmap(stage, starts, ends, whole=True)
        # huge mappings map whole 2 MiB blocks anyway: one call per stretch of nearby ranges (a
        # run's images, split only by the CLS vectors it skips) instead of one per image
        self._populate(shard, self.array(shard), starts, ends, gap=HUGE if self.mode == "huge" else 0)
        return cold

    def read_uncached(self, shard: int, starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> int:
        """Read into the page cache, with sequential preadv calls of READ_CHUNK bytes into this
        thread's scratch buffer, each range (ranges ``gap`` bytes apart or closer taken as one)
        whose first or last byte is not cached (RWF_NOWAIT probe, else mincore). -> bytes read."""
        fd = self.fd(shard)
        done = 0
        for s, e in _merged(starts, ends, gap):
            if self._probe_cached(fd, s, e) if self._nowait_ok else self._resident(shard, s, e):
                continue
            buf = getattr(self._scratch, "buf", None)
            if buf is None:
                buf = self._scratch.buf = memoryview(np.empty(READ_CHUNK, np.uint8))
            o = s
            while o < e:
                n = os.preadv(fd, [buf[: min(READ_CHUNK, e - o)]], o)
                if n <= 0:
                    raise LoaderError(
                        f"could not read bytes {o:,}-{e:,} of {self.names[shard]} in {self.path}: the file "
                        "ended early (truncated or replaced after the cache was opened)"
                    )
                o += n
            done += e - s
        return done

    def _populate(self, shard: int, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> None:
        addr = arr.ctypes.data
        for s, e in _merged(starts, ends, gap):
            lo, hi = _page_span(addr, int(s), int(e), inner=False)
            if self._populate_ok:
                if _madvise(lo, hi - lo, MADV_POPULATE_READ) == 0:
                    continue
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.ENOSYS):  # kernel < 5.14: touch the pages instead
                    self._populate_ok = False
                else:  # EFAULT: the file ends before the range (truncated meanwhile); EIO: the disk
                    raise self.read_error(
                        OSError(err, f"reading bytes {int(s):,}-{int(e):,}: {os.strerror(err)}"), [shard]
                    )
            int(arr[int(s) : int(e) : PAGE].sum())  # touch one byte per page

    def release(self, shard: int, starts: np.ndarray, ends: np.ndarray, whole: bool = False) -> None:
        """Unmap byte ranges from this process (and drop them from the page cache if ``evict``).

        Only pages entirely inside the ranges are unmapped, unless ``whole``: then the ranges are
        widened to 2 MiB boundaries, which also unmaps what a huge-page mapping brought in around
        them (a neighbour still in use just faults it back in, cheaply, from the page cache).
        Only pages inside the ranges are ever evicted.
        """
        arr = self._arrays.get((shard, self._main))
        if arr is None or _madvise is None:
            return
        self._unmap(arr, starts, ends, whole)
        if self.evict:
            addr = arr.ctypes.data
            for s, e in _merged(starts, ends):
                lo, hi = _page_span(addr, int(s), int(e), inner=True)
                if hi > lo:
                    os.posix_fadvise(self._fds[shard], lo - addr, hi - lo, os.POSIX_FADV_DONTNEED)

    def release_before(self, shard: int, offset: int, starts=None, ends=None) -> None:
        """Sequential readers (the ordered loader): unmap everything of the shard before byte
        ``offset``, rounded down to a 2 MiB boundary (the rest goes with a later call, or with the
        shard's last call, ``offset`` = its size). Unmapping whole 2 MiB blocks never splits a
        huge-page mapping (unmapping exactly each image's bytes did, at a real CPU cost). With ``evict``, the byte ranges ``starts`` /
        ``ends`` are also dropped from the page cache."""
        arr = self._arrays.get((shard, self._main))
        if arr is None or _madvise is None:
            return
        addr, size = arr.ctypes.data, len(arr)
        end = size if offset >= size else offset // HUGE * HUGE
        with self._lock:
            lo = self._unmapped.get(shard, 0)
            if end <= lo:
                lo = end
            else:
                self._unmapped[shard] = end
        if end > lo:
            a, b = _page_span(addr, lo, end, inner=False)
            _madvise(a, b - a, MADV_DONTNEED)
        if self.evict and starts is not None:
            for s, e in _merged(starts, ends):
                a, b = _page_span(addr, int(s), int(e), inner=True)
                if b > a:
                    os.posix_fadvise(self._fds[shard], a - addr, b - a, os.POSIX_FADV_DONTNEED)

    def _unmap(self, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray, whole: bool) -> None:
        addr, size = arr.ctypes.data, len(arr)
        if whole:  # widened to 2 MiB blocks first, then merged: one madvise per stretch of blocks
            # (a run of one layer of several is ranges a few blocks apart whose blocks touch: one
            # call and one TLB flush for the run instead of one per image)
            top = _page_span(addr, 0, size, inner=False)[1] - addr  # (offsets from addr)
            lo = np.maximum((addr + np.asarray(starts, np.int64)) // HUGE * HUGE - addr, 0)
            hi = np.minimum(-(-(addr + np.asarray(ends, np.int64)) // HUGE) * HUGE - addr, top)
            for a, b in _merged(lo, hi):
                if b > a:
                    _madvise(addr + a, b - a, MADV_DONTNEED)
            return
        for s, e in _merged(starts, ends):
            lo, hi = _page_span(addr, int(s), int(e), inner=True)
            if hi > lo:
                _madvise(lo, hi - lo, MADV_DONTNEED)

    # ---- 2 MiB blocks with users (huge mode, whole runs: the shuffled loader) ------------------
    # A block stays mapped while some run uses it. Runs of consecutive epochs share most blocks
    # when the buffer holds most of the data (the next epoch's first fill overlaps what the last
    # one held), so at an epoch boundary only the blocks that change are unmapped and mapped.
    # Call these with the loader's lock held; they only count, except block_release, which
    # unmaps (fast: whole blocks, no split mappings).
    def _block_refs(self, shard: int) -> np.ndarray:
        r = self._refs.get(shard)
        if r is None:
            r = self._refs[shard] = np.zeros(-(-self.sizes[shard] // HUGE), np.int32)
        return r

    def _block_bytes(self, shard: int, blocks: np.ndarray) -> int:
        """Bytes of the given block numbers (the shard's last block may be short)."""
        return int((np.minimum((blocks + 1) * HUGE, self.sizes[shard]) - blocks * HUGE).sum())

    def block_new_bytes(self, shard: int, start: int, end: int) -> int:
        """Bytes of the blocks under [start, end) that no run maps yet (what acquiring adds)."""
        a, b = block_range(start, end)
        refs = self._block_refs(shard)[a:b]
        return self._block_bytes(shard, np.flatnonzero(refs == 0) + a)

    def block_pin(self, shard: int, start: int, end: int) -> np.ndarray:
        """Count one more user of those blocks under [start, end) that some run maps already, so
        that they stay mapped until the run is read (block_acquire with ``pinned``) and, later,
        released: this holds no new bytes. -> their block numbers."""
        a, b = block_range(start, end)
        refs = self._block_refs(shard)
        held = np.flatnonzero(refs[a:b] > 0) + a
        refs[held] += 1
        return held

    def block_acquire(
        self, shard: int, start: int, end: int, pinned: np.ndarray | None = None
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """Count one more user of the blocks under [start, end) (but the ``pinned`` ones, which
        block_pin counted already); -> (bytes newly held, starts, ends of the byte ranges of
        blocks that had none: the caller populates those)."""
        a, b = block_range(start, end)
        refs = self._block_refs(shard)
        if pinned is None or len(pinned) == 0:
            new = np.flatnonzero(refs[a:b] == 0) + a
            refs[a:b] += 1
        else:
            rest = np.setdiff1d(np.arange(a, b), pinned, assume_unique=True)
            new = rest[refs[rest] == 0]
            refs[rest] += 1
        if len(new) == 0:
            return 0, new, new
        s = new * HUGE
        e = np.minimum(s + HUGE, self.sizes[shard])
        return self._block_bytes(shard, new), s, e

    def block_release(self, shard: int, start: int, end: int) -> int:
        """One user fewer of the blocks under [start, end); the blocks left with none are
        unmapped. -> bytes unmapped."""
        a, b = block_range(start, end)
        refs = self._block_refs(shard)
        refs[a:b] -= 1
        free = np.flatnonzero(refs[a:b] == 0) + a
        arr = self._arrays.get((shard, self._main))
        if len(free) and arr is not None and _madvise is not None:
            s = free * HUGE
            self._unmap(arr, s, np.minimum(s + HUGE, self.sizes[shard]), whole=False)
        return self._block_bytes(shard, free)

    def evict_ranges(self, shard: int, starts: np.ndarray, ends: np.ndarray) -> None:
        """Drop the pages inside the byte ranges from the page cache (those no mapping holds)."""
        fd = self.fd(shard)
        for s, e in _merged(starts, ends):
            lo, hi = -(-int(s) // PAGE) * PAGE, int(e) // PAGE * PAGE
            if hi > lo:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Unmap everything. Call only when no thread copies out of the mappings any more."""
        with self._lock:
            self.closed = True
            arrays, maps, fds = self._arrays, self._maps, self._fds
            self._arrays, self._maps, self._fds = {}, {}, {}
        arrays.clear()
        for mm in maps.values():
            try:
                mm.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                pass
        for fd in fds.values():
            os.close(fd)


def _merged_arrays(starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, merged ranges as (starts, ends) int64 arrays: ranges ``gap`` bytes apart or
    closer (touching or overlapping: gap 0) joined."""
    n = len(starts)
    if n <= 1:  # (the readers' usual case: one stretch of 2 MiB blocks)
        return np.asarray(starts, np.int64).reshape(n), np.asarray(ends, np.int64).reshape(n)
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, np.int64)[order], np.asarray(ends, np.int64)[order]
    e = np.maximum.accumulate(e)
    brk = np.flatnonzero(s[1:] > e[:-1] + gap)  # range brk[i] ends a merged one, brk[i] + 1 starts the next
    first = np.empty(len(brk) + 1, np.intp)
    first[0], first[1:] = 0, brk + 1
    last = np.empty(len(brk) + 1, np.intp)
    last[:-1], last[-1] = brk, n - 1
    return s[first], e[last]


def _merged(starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) pairs (see _merged_arrays)."""
    s, e = _merged_arrays(starts, ends, gap)
    return list(zip(s.tolist(), e.tolist(), strict=True))
