"""OrderedLoader: batches in storage order (image-major, then layer, then token), fast.

    for batch in OrderedLoader("<dump_to>/<HASH>", batch_size=16384, patches="image", layer=-2):
        batch["act"]      # (B, D) float32; batch["image_i"], ["patch_i"], ["layer"]: (B,) int64

Invariants: example ``i`` of the loader is example ``i`` of
:class:`~actcache.loaders.indexed.IndexedDataset` (restricted to images [start_img, end_img));
batches span shard boundaries with no gap or duplicate and are yielded in order whatever the
thread timing; partitioning (rank/world_size/worker_id/n_workers) gives each part a contiguous
range with the same number of batches (:mod:`.partition`).

Design: reader threads start the reads of the next batches (``read_ahead + 2`` ahead; the first
batch's alone, before any other's: FIRST_ALONE); copy threads fill each batch, a part each when it
is cached (MIN_PART_ROWS), into ``max(3, read_ahead + 1)`` reused batch buffer sets.

``io="read"``: readers ask the kernel to read the batches' byte ranges ahead (posix_fadvise
WILLNEED); a copy thread reads its batch's ranges with preadv straight into the batch buffer
(ranges up to MERGE_GAP apart in one call). One copy, made by the kernel, nothing mapped (a cut
file is a LoaderError, not SIGBUS). The right way for caches larger than memory, read cold,
often from a network filesystem, which is what this project is for.

``io="mmap"``: readers make the ranges resident in memory-mapped shards (MADV_POPULATE_READ);
copy threads copy whole images out of the mappings with the C kernel (kernels.copy_blocks,
non-temporal stores); the bytes behind the consumer are unmapped in whole 2 MiB blocks.

``io="auto"`` (default): a batch not in the page cache yet is read as with "read". A cached one
is mapped or read, whichever has cost less CPU per byte lately (_PathCost, EXPLORE_EVERY): that
depends on the folios the page cache holds the bytes in, which the loader cannot see (2 MiB
folios map almost for free; 4 KiB ones make every page a mapping, and preadv wins). Where the
kernel cannot tell what is cached (no RWF_NOWAIT, e.g. tmpfs), "auto" reads. Figures for each
way, cold and warm: BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time

import numpy as np

from actcache.dtypes import to_float32
from actcache.errors import ConfigError, LoaderError
from actcache.loaders import kernels
from actcache.loaders.base import BaseLoader, Iteration
from actcache.loaders.options import DEFAULT_VERIFY_READS, LoaderOptions, check_number
from actcache.loaders.partition import Partition
from actcache.loaders.runtime import Stopped

SCALE_IMGS = 2  # whole images copied then scaled while still in the CPU cache
IO_MODES = ("auto", "read", "mmap")
# io="read": byte ranges closer than this are read in one preadv call, the gap into a scratch
# buffer (the CLS vector between two images' patches: 3 KiB); farther ones (the other layers of a
# multi-layer cache) are read separately. One call reads at most CALL_BYTES (SCALE_CALL_BYTES
# with scale_norm, so that the rows are scaled while still in the CPU cache) and IOV_MAX pieces.
MERGE_GAP = 64 * 2**10
CALL_BYTES = 8 * 2**20
SCALE_CALL_BYTES = 2 * 2**20
IOV_MAX = 1024
# The readers request the first batch's byte ranges before any other batch's: started together,
# four readers' requests interleave at the disk and the first batch arrives with the fourth.
# Only the first: requesting every batch strictly in order is slower, as later batches gain from
# parallel requests.
FIRST_ALONE = True
# Every copy thread works on the same cached batch, a part each (>= MIN_PART_ROWS examples, cut
# on image boundaries), rather than a batch each: a batch is ready in half the time, and 3 batch
# buffer sets keep both threads busy where a batch each needed 4 (read_ahead + 2), which a fresh
# process must fault in (slow where a VM host backs the memory again: see BatchPool.handover).
# A batch whose bytes the readers did not find cached is still read by one thread: split, the
# parts' reads compete at the disk and a cold pass is slower.
MIN_PART_ROWS = 2048
# io="auto", a batch whose bytes the readers found in the page cache: copied out of the mappings
# or read with preadv, whichever cost less CPU per byte lately (_PathCost: the reader's mapping
# plus the copy threads' copy, per batch). Until both costs are known cached batches are mapped,
# but for the second, which is read (again every EXPLORE_EVERY-th while reading's cost is
# unknown): one read is enough to learn its cost, and reading every batch chosen until then
# slowed a warm first pass. Then the cheaper way, and the other one every EXPLORE_EVERY-th batch
# to follow changes. One layer of several (4 KiB mappings) is mapped only when each image's range
# of a layer is MAP_MIN_RANGE or more (one layer's patch tokens at a usual d_vit; a CLS vector
# alone is always read).
EXPLORE_EVERY = 16
MAP_MIN_RANGE = 64 * 2**10
# Mapping is kept unless reading costs less than 1 / MAP_BIAS of it: per-batch costs are noisy,
# and where mapping lost it lost by far (after the loader's own cold pass: small folios).
MAP_BIAS = 1.1


class OrderedLoader(BaseLoader):
    """Storage-order batches of a cache's selected vectors.

    Args: path (directory or ActivationCache), batch_size, patches ("cls" | "image" | "all"),
    layer (a recorded layer value or "all"), drop_last, start_img / end_img (image range; default
    all), batch_timeout_s (BatchTimeoutError when no batch arrives and no read finishes for that
    long; None: wait forever), token_labels (a saev cache's labels.bin: batch["token_label"], int64,
    -1 for CLS),
    scale_norm, rank / world_size / worker_id / n_workers, n_threads (copy threads), n_readers
    (default 4), read_ahead (batches prepared ahead of the consumer), evict (also drop released
    bytes from the page cache), io ("auto", the default: per batch, "read" when its bytes are
    not cached yet, else "mmap" or "read", whichever has cost less CPU per byte lately; "read":
    preadv into the batch buffers; "mmap": copies out of memory-mapped shards; see the module doc),
    verify_reads ("first": each checksum block checked the first time this process reads it;
    "off"; see actcache.shardguard).
    """

    kind = "OrderedLoader"

    def __init__(
        self,
        path,
        batch_size: int = 16384,
        patches: str = "image",
        layer=-2,
        *,
        drop_last: bool = False,
        start_img: int = 0,
        end_img: int | None = None,
        batch_timeout_s: float | None = 30.0,
        scale_norm: bool = False,
        out_dtype: str = "float32",
        token_labels: bool = False,
        verify_reads: str = DEFAULT_VERIFY_READS,
        rank: int = 0,
        world_size: int = 1,
        worker_id: int = 0,
        n_workers: int = 1,
        n_threads: int = 2,
        n_readers: int | None = None,
        read_ahead: int = 2,
        evict: bool = False,
        io: str = "auto",
    ):
        check_number("start_img", start_img, 0, integer=True)
        if io not in IO_MODES:
            raise ConfigError(f"io={io!r} is not allowed; use one of {', '.join(IO_MODES)}")
        check_number("end_img", end_img, 0, integer=True, allow_none=True)
        options = LoaderOptions(
            batch_size=batch_size,
            patches=patches,
            layer=layer,
            drop_last=drop_last,
            batch_timeout_s=batch_timeout_s,
            scale_norm=scale_norm,
            out_dtype=out_dtype,
            token_labels=token_labels,
            verify_reads=verify_reads,
            rank=rank,
            world_size=world_size,
            worker_id=worker_id,
            n_workers=n_workers,
            n_threads=n_threads,
            n_readers=n_readers,
            read_ahead=read_ahead,
            evict=evict,
        )
        super().__init__(path, options=options)
        n = self.metadata.n_imgs
        end_img = n if end_img is None else end_img
        if not start_img <= end_img <= n:
            raise ConfigError(f"start_img={start_img}, end_img={end_img}: need 0 <= start_img <= end_img <= {n}")
        self.start_img, self.end_img = start_img, end_img
        self.io = io
        self.n_readers = n_readers or 4  # several batches' reads in flight: faster cold than 2
        # io="auto": a cached batch may be mapped (see EXPLORE_EVERY); the costs outlive a pass
        self.may_map = self.map_mode == "huge" or self.geom.n_tokens * self.geom.vec_bytes >= MAP_MIN_RANGE
        # without the C kernel a copy out of a mapping cut meanwhile would kill the process
        # (SIGBUS in numpy): io="auto" then always reads
        self.may_map = self.may_map and kernels.native_info()["native"]
        self.path_cost = _PathCost()
        self._stages = threading.local()  # _stage's buffers
        per = self.geom.per_img
        self.partition = Partition((end_img - start_img) * per, self.world, batch_size, drop_last)
        s, e = self.partition.part_range(self.world)
        self.ex_start, self.ex_end = start_img * per + s, start_img * per + e

    def __len__(self) -> int:
        return self.partition.n_batches(self.world)

    @property
    def n_examples(self) -> int:
        return self.ex_end - self.ex_start

    def batch_range(self, k: int) -> tuple[int, int]:
        """[a, b): global example indices (IndexedDataset numbering) of batch k."""
        a = self.ex_start + k * self.batch_size
        return a, min(a + self.batch_size, self.ex_end)

    # ---- threads ------------------------------------------------------------------------------
    def _make_iteration(self) -> Iteration:
        it = Iteration(self, "OrderedLoader", 0, len(self), max(3, self.read_ahead + 1))
        it.next_read = it.next_copy = it.frontier = 0
        it.parts = collections.deque()  # _CopyPart: parts of batches other copy threads started
        it.first_requested = False  # batch 0's reads have been requested (see FIRST_ALONE)
        # batch -> (mapped: copied out of the mappings; cached: all in the page cache at request;
        # CPU seconds the reader spent mapping it)
        it.resident = {}
        it.done = set()
        it.released_img = self.ex_start // self.geom.per_img
        it.held = 0  # bytes of the images read ahead and not released yet
        return it

    def _start(self, it: Iteration) -> None:
        if len(self) == 0:
            return
        roles = [(f"reader-{i}", lambda i=i: self._reader(it, f"reader-{i}")) for i in range(self.n_readers)]
        roles += [(f"copy-{i}", lambda i=i: self._copier(it, f"copy-{i}")) for i in range(self.n_threads)]
        it.rt.spawn_all(roles)

    def _spans(self, a: int, b: int):
        """(shard, first image in shard, n images) covering examples [a, b)."""
        per = self.geom.per_img
        img, last = a // per, (b - 1) // per
        while img <= last:
            shard = int(np.searchsorted(self.shard_start, img, side="right")) - 1
            simg = img - int(self.shard_start[shard])
            n = min(last + 1 - img, self.shard_imgs[shard] - simg)
            yield shard, simg, n
            img += n

    def _extents(self, shard: int, simg: int, n: int):
        z = np.zeros(n, np.int64)
        return self.geom.token_extents(np.arange(simg, simg + n, dtype=np.int64), z, z + self.geom.n_tokens)

    def _reader(self, it: Iteration, name: str) -> None:
        while True:
            with it.cond:
                it.rt.status(name, "waiting (read-ahead is full)")
                it.rt.wait(lambda: it.next_read < it.stop and it.next_read < it.n_consumed + self.read_ahead + 2)
                k = it.next_read
                it.next_read += 1
            a, b = self.batch_range(k)
            per = self.geom.per_img
            owned = -(-b // per) - -(-a // per)  # images whose first example is in this batch
            spans = [(shard, simg, n, self._extents(shard, simg, n)) for shard, simg, n in self._spans(a, b)]
            cached = True
            ask = self.io != "mmap"  # start the reads; the copy threads' preadv waits for them
            if ask and k > 0 and FIRST_ALONE:
                with it.cond:
                    it.rt.status(name, f"waiting to request batch {k}: batch 0's reads go first")
                    it.rt.wait(lambda: it.first_requested)
            try:
                for shard, simg, n, ext in spans:
                    it.rt.status(name, f"reading {self.cache.shards[shard].name} images {simg}-{simg + n} (batch {k})")
                    self._hook("read", shard=shard, images=(simg, simg + n), batch=k)
                    it.maps.check_intact(shard)  # removed, replaced or cut since the loader was made
                    it.maps.verify(shard, ext[0].min(), ext[1].max())  # verify_reads: before any copy
                    if ask:
                        cached = it.maps.prefetch(shard, *ext, gap=MERGE_GAP) and cached
            finally:
                if ask and k == 0:
                    with it.cond:
                        it.first_requested = True
                        it.cond.notify_all()
            mapped = self.io == "mmap" or (self.io == "auto" and cached and self.may_map and self.path_cost.choose())
            t = time.thread_time()
            if mapped:  # the copy thread copies out of the mappings (see the module doc)
                for shard, _, _, ext in spans:
                    it.maps.make_resident(shard, *ext)
            mapping_s = time.thread_time() - t
            with it.cond:
                it.rt.progressed()
                nbytes = owned * self.geom.img_bytes
                self.stats.read_bytes += nbytes
                it.held += nbytes
                self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, it.held)
                it.resident[k] = (mapped, cached, mapping_s)
                it.cond.notify_all()

    def _next_task(self, it: Iteration, w: _CopyWait) -> bool:
        """A copy thread's wait predicate (lock held): puts its next task in ``w.task``."""
        if it.parts:  # a part of a batch another thread has started
            w.task = it.parts.popleft()
            return True
        k = it.next_copy
        if k >= it.stop:
            raise Stopped
        if k >= it.n_consumed + self.read_ahead or k not in it.resident:
            return False
        buf = it.pool.try_acquire()
        if buf is None:
            return False
        w.task = _NewBatch(k, buf)
        return True

    def _start_batch(self, it: Iteration, task: _NewBatch) -> _Job:
        """The job of a batch whose data is resident (lock held); its other parts go to ``it.parts``."""
        mapped, cached, mapping_s = it.resident.pop(task.k)
        a, b = self.batch_range(task.k)
        # a batch still to be read from disk stays with one thread (see MIN_PART_ROWS)
        job = _Job(task.k, task.buf, mapped, self._cuts(a, b) if cached else [a, b])
        job.cost = mapping_s if cached and self.io == "auto" else None  # see EXPLORE_EVERY
        if len(job.cuts) > 2:
            it.parts.extend(_CopyPart(job, p) for p in range(1, len(job.cuts) - 1))
            it.cond.notify_all()
        return job

    def _copier(self, it: Iteration, name: str) -> None:
        it.rt.status(name, "allocating batch buffers")
        # all sets up front (lazily, as the shuffled loader does, was slower with a batch per
        # thread, and no faster with shared batches)
        for _ in range(-(-it.pool.max_sets // self.n_threads)):
            it.pool.prefill(stop=lambda: it.rt.stopping)
        w = _CopyWait()
        ready = lambda: self._next_task(it, w)  # noqa: E731 - made once per thread
        while True:
            with it.cond:
                it.rt.status(name, "waiting for data or a free buffer")
                w.task = None
                it.rt.wait(ready)
                task = w.task
                if isinstance(task, _NewBatch):
                    it.next_copy += 1
                    task = _CopyPart(self._start_batch(it, task), 0)
            job, part = task.job, task.part
            k, buf = job.k, job.buf
            a0 = job.cuts[0]
            a, b = job.cuts[part], job.cuts[part + 1]
            it.rt.status(name, f"copying batch {k} (part {part + 1} of {len(job.cuts) - 1})")
            if self.debug_hook is not None:
                self._hook("gather", batch=k, shards=[s for s, _, _ in self._spans(a, b)], part=part)
            t = time.thread_time()
            if job.mapped:
                self._fill(it, a, b, buf, a - a0)
            else:
                self._read_fill(it, a, b, buf, a - a0)
            with it.cond:
                if job.cost is not None:
                    job.cost += time.thread_time() - t
                job.left -= 1
                if job.left:
                    continue  # the thread copying the last part publishes the batch
            if job.cost is not None:
                self.path_cost.record(job.mapped, job.cost, (job.cuts[-1] - a0) * self.geom.vec_bytes)
            buf.n, buf.key = job.cuts[-1] - a0, (0, k)
            buf.shards = [shard for shard, _, _ in self._spans(a0, job.cuts[-1])]  # (checked before it goes out)
            with it.cond:
                it.ready[k] = buf
                it.done.add(k)
                while it.frontier in it.done:
                    it.done.discard(it.frontier)
                    it.frontier += 1
                upto = self.batch_range(it.frontier)[0] // self.geom.per_img if it.frontier < it.stop else None
                lo, it.released_img = it.released_img, upto if upto is not None else it.released_img
                it.cond.notify_all()
            if upto is not None and upto > lo:
                for shard, simg, n in self._spans(lo * self.geom.per_img, upto * self.geom.per_img):
                    ext = self._extents(shard, simg, n) if self.evict else (None, None)
                    if it.maps.mapped(shard):
                        # every byte of the shard before image simg + n (huge-page blocks: maps.py)
                        it.maps.release_before(shard, (simg + n) * self.metadata.bytes_per_img, *ext)
                    elif self.evict:  # nothing mapped: only evict, if asked
                        it.maps.evict_ranges(shard, *ext)
                with it.cond:
                    it.held -= (upto - lo) * self.geom.img_bytes

    def _cuts(self, a: int, b: int) -> list[int]:
        """Where batch [a, b) is cut into parts, one per copy thread (MIN_PART_ROWS): [a, ..., b],
        inner cuts moved to the nearest image boundary (whole images copy fastest); a cut that
        lands on another, or on an end of the batch, is left out (fewer parts)."""
        n_parts = max(1, min(self.n_threads, (b - a) // MIN_PART_ROWS))
        per = self.geom.per_img
        cuts = [a]
        for i in range(1, n_parts):
            c = a + (b - a) * i // n_parts
            c = (c + per // 2) // per * per
            if cuts[-1] < c < b:
                cuts.append(c)
        return cuts + [b]

    def _copy_native(self, it: Iteration, shard: int, simg: int, n: int, dst: np.ndarray, stream: bool) -> bool:
        """Images [simg, simg + n) of a shard, their selected layers' selected tokens, into dst with
        the C kernel (one block per image and layer; kernels.copy_blocks); False if not built."""
        g = self.geom
        vb = g.vec_bytes
        imgs = np.arange(simg, simg + n, dtype=np.int64)
        scale = scales = None
        if len(g.layer_idx) == 1:  # one block per image
            rows, stride, offset = imgs, g.L * g.T * vb, (g.layer_idx[0] * g.T + g.token_start) * vb
            scale = None if self.scale is None else self.scale[0]
        else:  # every layer (layer="all"): one block per image and layer
            lidx = np.asarray(g.layer_idx, np.int64)
            rows, stride, offset = (imgs[:, None] * g.L + lidx[None, :]).ravel(), g.T * vb, g.token_start * vb
            if self.scale is not None:
                scales = np.tile(np.asarray(self.scale, np.float32), n)
        return kernels.copy_blocks(
            it.maps.array(shard), rows, dst, stride=stride, offset=offset, stream=stream, scale=scale, scales=scales,
            widen=self.widen,
        )  # fmt: skip

    def _batch_extents(self, a: int, b: int):
        """(shard, starts, ends, lpos) of examples [a, b): the selected byte ranges in each shard,
        in storage order (= example order), with the selected-layer position of each range."""
        per = self.geom.per_img
        for shard, simg, n in self._spans(a, b):
            gimg = np.arange(n, dtype=np.int64) + (simg + int(self.shard_start[shard]))
            ea, eb = np.clip(a - gimg * per, 0, per), np.clip(b - gimg * per, 0, per)
            yield shard, *self.geom.example_extents(np.arange(simg, simg + n, dtype=np.int64), ea, eb, with_lpos=True)

    def _read_fill(self, it: Iteration, a: int, b: int, buf, off: int = 0) -> None:
        """io="read": examples [a, b)'s byte ranges straight from the shard files into the batch
        buffer from row ``off`` on (preadv: nearby ranges in one call, the gaps into a scratch
        buffer; module doc)."""
        g = self.geom
        stage = self._stage(b - a) if self.widen else None  # a 16-bit cache: read, then widen
        act = memoryview((buf.act if stage is None else stage).reshape(-1).view(np.uint8))
        scratch = memoryview(bytearray(MERGE_GAP))
        limit = CALL_BYTES if self.scale is None else SCALE_CALL_BYTES
        pos = (off if stage is None else 0) * g.vec_bytes
        for shard, starts, ends, lpos in self._batch_extents(a, b):
            fd = it.maps.fd(shard)
            S, E = starts.tolist(), ends.tolist()
            i, m = 0, len(S)
            while i < m:
                iov, want, j, p = [], 0, i, pos
                while j < m and len(iov) < IOV_MAX - 1 and want < limit:
                    if j > i:
                        gap = S[j] - E[j - 1]
                        if gap > MERGE_GAP:
                            break
                        if gap:
                            iov.append(scratch[:gap])
                            want += gap
                    iov.append(act[p : p + E[j] - S[j]])
                    want += E[j] - S[j]
                    p += E[j] - S[j]
                    j += 1
                try:
                    got = os.preadv(fd, iov, S[i])
                except OSError as err:
                    raise it.maps.read_error(err, [shard]) from err
                if got != want:
                    raise it.maps.read_error(
                        LoaderError(
                            f"short read of {self.cache.shards[shard].name} at byte {S[i]:,}: {got:,} of {want:,} bytes"
                        ),
                        [shard],
                    )
                it.rt.progressed()  # a slow filesystem is not a stalled one (runtime module doc)
                if self.scale is not None and stage is None:  # the rows just read, while still in the CPU cache
                    rows = buf.act[pos // g.vec_bytes : p // g.vec_bytes]
                    if len(self.scale) == 1:
                        rows *= np.float32(self.scale[0])
                    else:
                        n_rows = (np.asarray(E[i:j]) - np.asarray(S[i:j])) // g.vec_bytes
                        rows *= np.repeat(np.asarray(self.scale, np.float32)[lpos[i:j]], n_rows)[:, None]
                pos, i = p, j
        if stage is not None:
            self._widen_into(a, b, stage[: b - a], buf.act[off : off + b - a])
        self._fill_indices(a, b, buf, off)

    def _stage(self, n: int) -> np.ndarray:
        """This thread's buffer for n rows of stored 16-bit values (io="read" of a 16-bit cache)."""
        got = getattr(self._stages, "a", None)
        if got is None or len(got) < n:
            got = self._stages.a = np.empty((max(n, self.batch_size), self.geom.D), self.metadata.storage)
        return got

    def _widen_into(self, a: int, b: int, stage: np.ndarray, dst: np.ndarray) -> None:
        """Examples [a, b) read as stored values into ``stage`` -> float32 ``dst`` (scaled as asked)."""
        kw = {}
        if self.scale is not None and len(self.scale) == 1:
            kw["scale"] = self.scale[0]
        elif self.scale is not None:
            img, e = np.divmod(np.arange(a, b, dtype=np.int64), self.geom.per_img)
            kw["scales"] = np.asarray(self.scale, np.float32)[self.geom.decode(img, e)[3]]
        kernels.widen_rows(stage, dst, stream=dst.nbytes >= kernels.STREAM_MIN_BYTES, **kw)

    def _put(self, dst: np.ndarray, src: np.ndarray) -> None:
        """numpy copy of stored values into the batch (widened to float32 for a 16-bit cache)."""
        if self.widen:
            to_float32(src, self.widen, out=dst)
        else:
            np.copyto(dst, src)

    def _fill_indices(self, a: int, b: int, buf, off: int) -> None:
        ex = np.arange(a, b, dtype=np.int64)
        img, e = np.divmod(ex, self.geom.per_img)
        _, layer, patch, _ = self.geom.decode(img, e)
        z = slice(off, off + b - a)
        buf.image_i[z], buf.patch_i[z], buf.layer[z] = img, patch, layer

    def _fill(self, it: Iteration, a: int, b: int, buf, off: int = 0) -> None:
        """Examples [a, b) out of the mappings into the batch buffer from row ``off`` on. A shard
        damaged meanwhile is a LoaderError naming it: each shard is checked first, and the C
        kernel's copies stop at a SIGBUS (without the C kernel only the check remains: see
        ShuffledLoader._copy)."""
        shards = [shard for shard, _, _ in self._spans(a, b)]
        for shard in shards:
            it.maps.check_intact(shard)
        try:
            self._fill_mapped(it, a, b, buf, off)
        except OSError as err:  # a BusError (SIGBUS in a copy): which shard, what happened to it
            raise it.maps.read_error(err, shards) from err

    def _copy_range(self, it: Iteration, shard: int, src: np.ndarray, dst: np.ndarray) -> None:
        """dst = src (a contiguous piece of the shard's mapping), by the C kernel where built (a
        SIGBUS then raises BusError instead of killing the process)."""
        offset = src.__array_interface__["data"][0] - kernels.address(it.maps.array(shard))
        one = np.zeros(1, np.int64)
        if not kernels.copy_blocks(it.maps.array(shard), one, dst, stride=max(1, dst.nbytes), offset=offset):
            np.copyto(dst, src)

    def _fill_mapped(self, it: Iteration, a: int, b: int, buf, off: int = 0) -> None:
        g, per, nT = self.geom, self.geom.per_img, self.geom.n_tokens
        ts, one = g.token_start, len(g.layer_idx) == 1
        li0 = g.layer_idx[0]
        stream = buf.act.nbytes >= kernels.STREAM_MIN_BYTES
        pos, x = off, a
        while x < b:
            img, e0 = divmod(x, per)
            shard = int(np.searchsorted(self.shard_start, img, side="right")) - 1
            simg = img - int(self.shard_start[shard])
            src = it.maps.view(shard, (self.shard_imgs[shard], g.L, g.T, g.D), self.metadata.storage)
            if e0 == 0 and b - x >= per:  # a run of whole images within this shard
                n = min((b - x) // per, self.shard_imgs[shard] - simg)
                if not self._copy_native(it, shard, simg, n, buf.act[pos : pos + n * per], stream):
                    step = SCALE_IMGS if self.scale is not None else n
                    for c in range(0, n, step):
                        m = min(step, n - c)
                        blk = src[simg + c : simg + c + m]
                        dst = buf.act[pos + c * per : pos + (c + m) * per]
                        if one:
                            self._put(dst.reshape(m, nT, g.D), blk[:, li0, ts : ts + nT])
                        else:
                            self._put(dst.reshape(m, g.L, nT, g.D), blk[:, :, ts : ts + nT])
                        if self.scale is not None:
                            self._scale_rows(dst, np.tile(np.repeat(np.arange(len(g.layer_idx)), nT), m))
                pos += n * per
                x += n * per
            else:  # part of one image: contiguous token ranges, one per selected layer
                e1 = min(per, e0 + b - x)
                for lp in range(e0 // nT, (e1 - 1) // nT + 1):
                    t0, t1 = max(e0, lp * nT) - lp * nT, min(e1, (lp + 1) * nT) - lp * nT
                    dst = buf.act[pos : pos + t1 - t0]
                    piece = src[simg, g.layer_idx[lp], ts + t0 : ts + t1]
                    if self.widen:  # a 16-bit cache: numpy widens (the guarded kernel copies bytes)
                        self._put(dst, piece)
                    else:
                        self._copy_range(it, shard, piece, dst)
                    self._scale_rows(dst, np.full(t1 - t0, lp))
                    pos += t1 - t0
                x += e1 - e0
        self._fill_indices(a, b, buf, off)


class _Job:
    """A batch being copied in parts (OrderedLoader._copier)."""

    __slots__ = ("k", "buf", "mapped", "cuts", "left", "cost")

    def __init__(self, k: int, buf, mapped: bool, cuts: list[int]):
        self.k, self.buf, self.mapped, self.cuts = k, buf, mapped, cuts
        self.left = len(cuts) - 1
        self.cost = None  # io="auto", a cached batch: CPU seconds spent mapping and copying it


@dataclasses.dataclass(slots=True)
class _CopyPart:
    """Copy task: part ``part`` of a batch (its buffer in job.buf)."""

    job: _Job
    part: int


@dataclasses.dataclass(slots=True)
class _NewBatch:
    """Copy task: batch ``k`` is resident and got buffer ``buf``."""

    k: int
    buf: object


@dataclasses.dataclass(slots=True)
class _CopyWait:
    """One copy thread's wait: the task its predicate found."""

    task: _CopyPart | _NewBatch | None = None


class _PathCost:
    """io="auto": which way to copy a batch found in the page cache (see EXPLORE_EVERY). ``cost``:
    moving averages of the CPU seconds per byte of each way (True: mapped, False: preadv)."""

    def __init__(self):
        self.cost: dict[bool, float | None] = {True: None, False: None}
        self.samples = {True: 0, False: 0}
        self.n = 0
        self.lock = threading.Lock()

    def choose(self) -> bool:
        """Whether to map the next cached batch."""
        with self.lock:
            self.n += 1
            mapped, read = self.cost[True], self.cost[False]
            if mapped is None or read is None:  # learning: map (see EXPLORE_EVERY), read one batch
                return not (read is None and self.n % EXPLORE_EVERY == 2)
            best = mapped <= read * MAP_BIAS
            return not best if self.n % EXPLORE_EVERY == 0 else best

    def record(self, mapped: bool, cpu_s: float, nbytes: int) -> None:
        if nbytes <= 0:
            return
        x = cpu_s / nbytes
        with self.lock:
            # the mean of the first samples, then a moving average over ~10: one batch's cost is
            # noisy, and the two ways differ by less than that noise when both are warm
            self.samples[mapped] += 1
            old = self.cost[mapped]
            self.cost[mapped] = x if old is None else old + max(0.1, 1 / self.samples[mapped]) * (x - old)
