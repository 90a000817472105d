"""ShuffledLoader: the training loader. Large sequential reads, uniform batches, bounded memory.

    loader = ShuffledLoader("<dump_to>/<HASH>", batch_size=16384, patches="image", layer=-2,
                            buffer_bytes=2**31, seed=17)
    for batch in loader:   # act (B, D) float32; image_i, patch_i, layer (B,) int64 tensors
        ...

Design. Warm, the CPU is the limit, so each vector is copied exactly once, page cache -> batch:
the page cache IS the shuffle buffer. Threads, each role waiting on a condition of its own
(runtime.py): a planner works out the epoch (plan.py: runs of ~run_bytes, which batch takes
which examples); readers make each run resident as soon as the plan admits it (maps.py:
MADV_POPULATE_READ on 2 MiB mappings, or preadv for runs not cached yet, ``cold_read``); gather
threads index a batch's rows (kernels.index_rows) and copy them out of the mappings into reused
batch buffers (buffers.py) with the C kernel (kernels.take_multi). All gather threads copy parts
of the same batch, so a batch is ready sooner and fewer buffers are in flight.

Invariants.
- The plan is a function of (seed, epoch, part) alone: deterministic whatever the thread timing,
  resumable at (epoch, batch) without reading skipped data, every example once per epoch. The
  rows of a batch come in one random order across its shards (a prefix is a random sample).
- Memory: the plan holds at most ``buffer_bytes`` of runs (a run is charged the 2 MiB blocks its
  mapping spans); readers may load ``read_ahead_bytes`` more; batch buffers add MIN_SETS batches,
  up to ``max(3, read_ahead + 1)`` for a slow consumer. Nothing else grows with the dataset.
- A 2 MiB block stays mapped while any run of this epoch or the next uses it (maps.ShardMaps
  block_*), and the runs next in line pin the blocks they share with older runs (PIN_SHARED).
- Python work in any thread holds the GIL and takes CPU from the copies: a batch's plan and
  index are worked out on numpy arrays or in C, not by Python loops over its runs or rows.

Other modes: ``io="read"`` reads runs with preadv into a private arena (memory is strictly the
arena, for filesystems whose client cache is small; each byte is copied twice), its runs all
``run_imgs`` long so each fills an arena slot. ``n_strips=3`` releases each image a third at a
time (more images mixed per batch, slower: 4 KiB mappings). ``prefetch`` picks the copy
kernel's prefetch scheme (kernels.PrefetchChooser). Options: :class:`ShuffledLoader`;
partitioning over ranks/workers: :mod:`.partition`; figures: BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import time

import numpy as np

from actcache.errors import ConfigError
from actcache.loaders import kernels
from actcache.loaders.base import BaseLoader, Iteration
from actcache.loaders.buffers import BatchBuffers, populate_small
from actcache.loaders.maps import HUGE, block_range
from actcache.loaders.options import COLD_READS, DEFAULT_VERIFY_READS, PREFETCH_SCHEMES, LoaderOptions, check_number
from actcache.loaders.partition import Partition
from actcache.loaders.plan import BatchSpec, EpochPlan, cut_points, epoch_runs, part_runs
from actcache.loaders.runtime import Stopped

IO_MODES = ("mmap", "read")
# A batch is copied in parts of >= MIN_PART_ROWS rows, PARTS_PER_THREAD per gather thread: all
# threads work on the same batch (fewer batch buffers in flight), and the one that computes the
# next batch's index (see _index) overlaps it with the others' last parts.
MIN_PART_ROWS = 2048
PARTS_PER_THREAD = 2
BUFFER_POLL_S = 0.002  # how often a gather thread waiting for a buffer the consumer holds looks again
# Batch buffer sets the pool grows to when none is free (more only for a slow or keeping consumer):
# with 2, the next batch could only start once the consumer had taken the last one and dropped
# the one before (both gather threads idle meanwhile); with 3 it starts at once.
MIN_SETS = 3
# Batch buffers (module doc): a third set only once the gather threads have waited this long for
# a free one while the consumer was not waiting for a batch (or at once when it waits holding
# every set: it keeps its batches).
GROW_AFTER_S = 0.005
# Runs smaller than this are read through 4 KiB mappings: a run also holds the 2 MiB blocks at
# its edges, which only pays for big runs.
HUGE_MIN_RUN = 8 * HUGE
# 2 MiB mappings: once a batch's runs are next in line to be read, each holds (block_pin) the
# blocks it shares with runs still mapped, and while the first waits for memory a reader may take
# one whose blocks are all held. Without this, at an epoch boundary (the old epoch's last runs all
# end with its last batch, and the next one's first batch needs its whole first fill) releasing
# the old runs unmapped blocks that the first fill then mapped again (a longer pause between
# epochs).
PIN_SHARED = True


class ShuffledLoader(BaseLoader):
    """Shuffled batches of a cache's selected vectors, every example once per epoch.

    Args (besides those of every loader: batch_size, patches, layer, drop_last, batch_timeout_s,
    scale_norm, rank/world_size/worker_id/n_workers, token_labels):
        buffer_bytes: bytes of shard data the batches are mixed from (the shuffle window). Memory
            used: buffer_bytes + about 2 batches read ahead + 2 to max(3, read_ahead + 1) batch buffers.
        seed: the epoch order is a function of (seed, epoch) only.
        n_epochs: stop before this epoch (None: run forever). end_at overrides it.
        start_at: (epoch, batch) to resume from; batch may exceed len(loader) (more epochs skipped).
        end_at: ("epoch", n) stops before epoch n; ("batch", n) before global batch n
            (epoch * len(loader) + batch). Absolute, not relative to start_at.
        deterministic: yield batches in plan order (True) or as soon as any is ready (False; same
            batches, possibly reordered).
        n_threads: gather threads; n_readers: reader threads (default 4); read_ahead: batches
            prepared ahead.
        run_bytes: bytes per run (the unit read sequentially and held; each run 0.5-1.5x that, at
            random).
        n_strips: 1 holds whole runs; 3 releases each image a third at a time (more mixing for
            the same buffer, slower: see the module docstring and plan.py).
        io: "mmap" (page cache as shuffle buffer) or "read" (private arena; see the module doc).
        cold_read: how io="mmap" loads runs of whole images that are not in the page cache yet:
            "read" (plain preadv into a small scratch buffer, then mapped; fastest cold) or
            "fault" (through the huge-page mapping: the pages land in 2 MiB folios, which later
            warm passes over the same cached data gather from faster). See the module doc.
        evict: also drop used-up bytes from the page cache.
        prefetch: how the copy kernel prefetches the next random rows: "whole" rows into L2,
            only their "heads" into L3, or "auto" (the default): the loader times both on its
            first copies and keeps the faster (kernels.PrefetchChooser; stats.prefetch says which).
            The batches are the same either way.
        skip_imgs: image indices left out of every epoch (a held-out split); runs holding them
            are split around them.
        verify_reads: "first" checks each checksum block the first time this process reads it
            (a run's blocks before it is gathered from); "off" does not (actcache.shardguard).
    """

    kind = "ShuffledLoader"

    def __init__(
        self,
        path,
        batch_size: int = 16384,
        patches: str = "image",
        layer=-2,
        buffer_bytes: int = 2**31,
        seed: int = 17,
        *,
        n_epochs: int | None = 1,
        start_at: tuple[int, int] = (0, 0),
        end_at: tuple[str, int] | None = None,
        drop_last: bool = False,
        deterministic: bool = True,
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
        run_bytes: int = 48 * 2**20,
        n_strips: int = 1,
        io: str = "mmap",
        cold_read: str = "read",
        evict: bool = False,
        prefetch: str = "auto",
        skip_imgs=None,
    ):
        check_number("buffer_bytes", buffer_bytes, 1, integer=True)
        check_number("seed", seed, integer=True)
        check_number("n_epochs", n_epochs, 0, integer=True, allow_none=True)
        check_number("run_bytes", run_bytes, 1, integer=True)
        check_number("n_strips", n_strips, 1, integer=True)
        if not isinstance(deterministic, bool):
            raise ConfigError(f"deterministic={deterministic!r} must be true or false")
        if io not in IO_MODES:
            raise ConfigError(f"io={io!r} is not allowed; use one of {', '.join(IO_MODES)}")
        if cold_read not in COLD_READS:
            raise ConfigError(f"cold_read={cold_read!r} is not allowed; use one of {', '.join(COLD_READS)}")
        if prefetch != "auto" and prefetch not in PREFETCH_SCHEMES:
            raise ConfigError(f"prefetch={prefetch!r} is not allowed; use one of auto, {', '.join(PREFETCH_SCHEMES)}")
        if not (isinstance(start_at, (tuple, list)) and len(start_at) == 2):
            raise ConfigError(f"start_at={start_at!r} must be (epoch, batch)")
        for v in start_at:
            check_number("start_at", v, 0, integer=True)
        if end_at is not None:
            if not (isinstance(end_at, (tuple, list)) and len(end_at) == 2 and end_at[0] in ("epoch", "batch")):
                raise ConfigError(f"end_at={end_at!r} must be ('epoch', n) or ('batch', n)")
            check_number("end_at", end_at[1], 0, integer=True)
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
        self.buffer_bytes, self.seed, self.n_epochs = buffer_bytes, seed, n_epochs
        self.start_at, self.end_at = tuple(start_at), end_at
        self.deterministic, self.io, self.cold_read = deterministic, io, cold_read
        self.prefetch = prefetch
        fixed = None if prefetch == "auto" else PREFETCH_SCHEMES.index(prefetch)
        if not kernels.native_info()["native"]:
            fixed = 0  # numpy copies: nothing to choose
        self._prefetch = kernels.PrefetchChooser(fixed)  # kept across iterations
        self.n_strips = n_strips if io == "mmap" else 1
        g = self.geom
        self._skip, n_skipped = self._skip_by_shard(skip_imgs)
        n_ex = self.sel.n_examples - n_skipped * g.per_img
        self.partition = Partition(n_ex, self.world, batch_size, drop_last)
        self.run_imgs = int(min(max(1, round(run_bytes / g.img_bytes)), max(1, buffer_bytes // (16 * g.img_bytes))))
        run_max = (self.run_imgs + self.run_imgs // 2 + 1) * g.img_bytes
        if io == "read":
            # Runs of one length (plan.cut_runs, equal), each read into an arena slot of exactly
            # that size: with runs of random length a slot must fit the longest, and the arena
            # then mixes fewer images than buffer_bytes could hold.
            run_max = self.run_imgs * g.img_bytes
        self.slot_bytes = run_max
        self._spare_slots: list[_Slot] = []  # io="read": free arena slots a finished iteration left
        # The plan mixes batches from up to buffer_bytes of runs; readers may load up to
        # read_ahead_bytes more (the next runs, before the plan releases room for them).
        self._points = None  # plan.cut_points per shard (huge mappings), computed once
        self.read_ahead_bytes = min(buffer_bytes // 4, max(2 * batch_size * g.vec_bytes, run_max))
        self.plan_budget = buffer_bytes
        if io == "read":
            self.n_slots = max(1, buffer_bytes // run_max)
            self.plan_budget = self.n_slots * run_max
        if self.random_access or io == "read":
            self.map_mode = "random"
        elif self.n_strips > 1 or run_max < HUGE_MIN_RUN:
            self.map_mode = "pte"  # strips need 4 KiB mappings; huge ones only pay for big runs
        else:
            self.map_mode = "huge"  # whole runs held: 2 MiB mappings, their edges charged to the run
        # cold, each reader waits on one run's reads at a time: 4 keep more of them in flight
        # (warm, the count makes no difference)
        self.n_readers = n_readers or 4

    def _skip_by_shard(self, skip_imgs) -> tuple[list[np.ndarray] | None, int]:
        """skip_imgs -> (shard-local sorted indices per shard, or None; how many are skipped)."""
        if skip_imgs is None or len(skip_imgs) == 0:
            return None, 0
        imgs = np.unique(np.asarray(skip_imgs, np.int64))
        if imgs[0] < 0 or imgs[-1] >= self.metadata.n_imgs:
            raise ConfigError(f"skip_imgs holds images outside [0, {self.metadata.n_imgs}) of {self.cache.path}")
        shard = np.searchsorted(self.shard_start, imgs, side="right") - 1
        out = [imgs[shard == i] - self.shard_start[i] for i in range(len(self.shard_imgs))]
        return out, len(imgs)

    # ---- sizes --------------------------------------------------------------------------------
    def close(self) -> None:
        """BaseLoader.close, and free the io="read" arena slots kept for the next iteration."""
        super().close()
        self._spare_slots = []

    def __len__(self) -> int:
        """Batches per epoch (for this rank/worker; the same on every rank)."""
        return self.partition.n_batches(self.world)

    @property
    def n_examples(self) -> int:
        """Examples per epoch for this rank/worker."""
        s, e = self.partition.part_range(self.world)
        return e - s

    def _bounds(self) -> tuple[int, int | None]:
        nb = len(self)
        e0, b0 = self.start_at
        start = e0 * nb + b0
        if self.end_at is not None:
            kind, n = self.end_at
            stop = n * nb if kind == "epoch" else n
        else:
            stop = None if self.n_epochs is None else self.n_epochs * nb
        if nb == 0:
            return 0, 0
        return start, (max(start, stop) if stop is not None else None)

    def _describe_key(self, key: int) -> str:
        nb = max(1, len(self))
        return f"{key} (epoch {key // nb}, batch {key % nb})"

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """The plan of one epoch for this part (no I/O)."""
        g = self.geom
        runs = epoch_runs(
            self.shard_imgs,
            self.run_imgs,
            g.per_img,
            self.seed,
            epoch,
            self._cut_points(),
            equal=self.io == "read",
            skip=self._skip,
        )
        s, e = self.partition.part_range(self.world)
        rng = np.random.default_rng([self.seed, epoch, self.world.part, 1])
        fixed = self.slot_bytes if self.io == "read" else None
        unit = HUGE if self.map_mode == "huge" else 0
        return EpochPlan(
            g,
            part_runs(runs, g.per_img, s, e),
            epoch,
            self.batch_size,
            e - s,
            self.plan_budget,
            self.n_strips,
            rng,
            fixed_run_bytes=fixed,
            map_unit=unit,
            ramp_fill=self.io == "read",
        )

    def _cut_points(self) -> list[np.ndarray] | None:
        """Huge-page mappings: where runs may be cut on 2 MiB boundaries (plan.cut_points)."""
        if self.map_mode != "huge":
            return None
        if self._points is None:
            pts = {n: cut_points(self.geom, n, HUGE) for n in set(self.shard_imgs)}
            self._points = [pts[n] for n in self.shard_imgs]
        return self._points

    # ---- threads ------------------------------------------------------------------------------
    def _make_iteration(self) -> Iteration:
        start, stop = self._bounds()
        it = Iteration(self, "ShuffledLoader", start, stop, max(3, self.read_ahead + 1))
        it.specs, it.loads, it.parts = {}, collections.deque(), collections.deque()
        it.indexed, it.indexing, it.buf_wait = {}, set(), None  # see _gatherer
        it.sources = {}  # shard -> its (rows, D) view (_shard_source)
        it.on_close += [it.indexed.clear, it.parts.clear, it.specs.clear, it.sources.clear]  # views of the maps
        it.on_close.append(self._note_prefetch)
        it.planned = it.next_gather = it.frontier = start
        it.outstanding = 0
        it.unloaded = collections.Counter()  # batch key -> runs it admits that are not resident yet
        it.pinned_key, it.pin_new = None, False  # the batch whose runs the readers pinned (_reader)
        it.done = set()
        # io="read": free arena slots; those the last iteration left (its whole arena when it ran
        # to its end) are reused, as batch buffer sets are, instead of faulting in new memory
        it.slots, self._spare_slots = self._spare_slots, []
        it.on_handover.append(lambda: setattr(self, "_spare_slots", it.slots))
        # who waits on what (runtime.py): the planner for the consumer to advance, readers for
        # runs to load (and memory), gather threads for plans, reads, parts and buffers
        rt = it.rt
        it.c_plan, it.c_read, it.c_gather = rt.condition(), rt.condition(), rt.condition()
        rt.consumer_cond = rt.condition()
        rt.on_consumer_wait = [it.c_gather]
        rt.on_consumed = [it.c_plan, it.c_gather]
        it.pool.cond = it.c_gather  # a set prefilled wakes gather threads
        return it

    def _note_prefetch(self) -> None:
        """stats.prefetch / prefetch_GBps from the chooser (at the end of each iteration)."""
        ch = self._prefetch
        if not kernels.native_info()["native"]:
            return
        self.stats.prefetch = ch.describe()
        self.stats.prefetch_GBps = {
            name: round(r / 1e9, 3) for name, r in zip(PREFETCH_SCHEMES, ch.rates(), strict=True) if r > 0
        }

    def _start(self, it: Iteration) -> None:
        if it.stop is not None and it.stop <= it.start:
            return
        roles = [("planner", lambda: self._planner(it))]
        roles += [(f"reader-{i}", lambda i=i: self._reader(it, f"reader-{i}")) for i in range(self.n_readers)]
        roles += [(f"gather-{i}", lambda i=i: self._gatherer(it, f"gather-{i}")) for i in range(self.n_threads)]
        it.rt.spawn_all(roles)

    def _planner(self, it: Iteration) -> None:
        nb, ahead = len(self), self.read_ahead + 12
        g = it.start

        def within(key: int) -> bool:  # the planner stays `ahead` batches ahead of the consumer
            return key < it.start + it.n_consumed + ahead

        while it.stop is None or g < it.stop:
            epoch, b = divmod(g, nb)
            it.rt.status("planner", f"planning epoch {epoch}")

            # Each run goes to the readers as soon as the plan admits it, before the plan draws
            # its example order and the batch's shares (EpochPlan.batches): the first batch
            # admits the whole first fill, which the readers then map while it is planned
            # instead of after.
            def admit(r, t, held, epoch=epoch):
                key = epoch * nb + t
                if it.stop is not None and key >= it.stop:
                    return
                with it.cond:
                    it.rt.wait(lambda: within(key), cond=it.c_plan)
                    it.loads.append((r, key, held))
                    it.unloaded[key] += 1
                    it.pin_new = True
                    it.c_read.notify_all()

            for spec in self.epoch_plan(epoch).batches(b, on_admit=admit):
                key = epoch * nb + spec.index
                if it.stop is not None and key >= it.stop:
                    return
                with it.cond:
                    it.rt.wait(lambda key=key: within(key), cond=it.c_plan)
                    it.specs[key] = spec
                    it.planned = key + 1
                    it.c_gather.notify_all()
            g = (epoch + 1) * nb

    def _reader(self, it: Iteration, name: str) -> None:
        shards = self.cache.shards
        blocks = self.map_mode == "huge"  # whole runs on 2 MiB blocks: blocks shared across epochs
        while True:
            with it.cond:
                it.rt.status(name, "waiting for a run to read (or for memory)")

                pick = [0]  # the index in it.loads of the run to read

                def ready(pick=pick):
                    if not it.loads:
                        return False
                    r, head_key, plan_bytes = it.loads[0]
                    pin = blocks and PIN_SHARED
                    if pin and (it.pinned_key != head_key or it.pin_new):
                        # the batch's runs are next in line: pin them (as the planner passes them on)
                        it.pinned_key, it.pin_new = head_key, False
                        for q, k, _ in it.loads:
                            if k != head_key:
                                break
                            if q.pinned is None:
                                q.pinned = it.maps.block_pin(q.shard, *q.span)
                    need = it.maps.block_new_bytes(r.shard, *r.span) if blocks else r.strip_bytes[r.first_strip :].sum()
                    limit = max(self.buffer_bytes, plan_bytes) + self.read_ahead_bytes
                    pick[0] = 0
                    if it.outstanding == 0 or it.outstanding + int(need) <= limit:
                        return True
                    if pin:  # while it waits for memory, another run of its batch whose blocks are all held
                        for i, (q, k, _) in enumerate(it.loads):
                            if k != head_key:
                                break
                            a, b = block_range(*q.span)
                            if i and len(q.pinned) == b - a:
                                pick[0] = i
                                return True
                    return False

                it.rt.wait(ready, cond=it.c_read)
                if pick[0]:
                    r, key, _ = it.loads[pick[0]]
                    del it.loads[pick[0]]
                else:
                    r, key, _ = it.loads.popleft()
                if blocks:  # only the blocks no run maps yet are new (maps.ShardMaps.block_*)
                    need, starts, ends = it.maps.block_acquire(r.shard, *r.span, pinned=r.pinned)
                else:
                    need = int(r.strip_bytes[r.first_strip :].sum())
                it.outstanding += need
                self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, it.outstanding)
            a, b = r.img0 + r.j0, r.img0 + r.j1
            it.rt.status(name, f"reading {shards[r.shard].name} images {a}-{b} (for batch {self._describe_key(key)})")
            self._hook("read", shard=r.shard, images=(a, b), batch=key)
            cold = 0
            if blocks:
                nbytes = (r.hi - r.lo) * self.geom.vec_bytes
                if len(starts):
                    cold = it.maps.make_resident(r.shard, starts, ends)
                else:  # all mapped already: still look whether the file was replaced or cut meanwhile
                    it.maps.check_intact(r.shard)
            else:
                starts, ends = r.extents(self.geom, range(r.first_strip, r.n_strips))
                nbytes = int((ends - starts).sum())
                if self.io == "read":
                    self._read_into_slot(it, r, starts, ends)
                else:
                    it.maps.make_resident(r.shard, starts, ends)
            # verify_reads: the run's checksum blocks, before a gather thread copies from it
            it.maps.verify(r.shard, *(r.span if r.span is not None else (starts.min(), ends.max())))
            with it.cond:
                it.unloaded[key] -= 1
                if not it.unloaded[key]:
                    del it.unloaded[key]
                it.rt.progressed()
                self.stats.read_bytes += nbytes
                self.stats.cold_read_bytes += cold
                # wake the gather threads only when the next batch has all it needs
                if it.next_gather in it.specs and self._reads_done(it, it.next_gather):
                    it.c_gather.notify_all()

    @staticmethod
    def _reads_done(it: Iteration, key: int) -> bool:
        """Whether every run batch ``key`` needs is resident (call with the lock held, once the
        batch's spec is out: the planner has passed on all of its runs by then)."""
        return not it.unloaded or min(it.unloaded) > key

    def _read_into_slot(self, it: Iteration, r, starts, ends) -> None:
        """io="read": the run's selected bytes, image-major, into a private arena slot."""
        import os

        slot = self._arena_slot(it, int((ends - starts).sum()))
        order = np.argsort(starts, kind="stable")
        it.maps.check_intact(r.shard)
        fd = it.maps.fd(r.shard)
        view = slot.arr.view(np.uint8)
        pos = 0
        for i in order.tolist():
            n = int(ends[i] - starts[i])
            try:
                got = os.preadv(fd, [view[pos : pos + n]], int(starts[i]))
                if got != n:
                    raise OSError(errno.EIO, f"short read at byte {int(starts[i]):,}: {got:,} of {n:,} bytes")
            except OSError as err:
                raise it.maps.read_error(err, [r.shard]) from err
            pos += n
        it.maps.check_intact(r.shard)  # written to during the read: refused before the slot is used
        if self.evict:
            os.posix_fadvise(fd, int(starts.min()), int(ends.max() - starts.min()), os.POSIX_FADV_DONTNEED)
        r.slot = slot

    def _arena_slot(self, it: Iteration, nbytes: int) -> _Slot:
        """io="read": a free arena slot, or a new one whose first ``nbytes`` (the run to be read
        into it; a slot fits a run, a shard's last run may be shorter) this reader faults in. New
        slots go on the page size the iteration's fresh memory uses (buffers.FreshPages, shared with
        the batch buffer sets): 2 MiB pages until they fault in slowly (a VM host backing the
        memory again), then 4 KiB ones; one on 4 KiB pages is replaced after SMALL_SET_USES reads
        into it, as batch sets are. Only the run's bytes are faulted in, not the whole slot."""
        pages = it.pool.pages
        with it.cond:
            slot = it.slots.pop() if it.slots else None
            if slot is not None and pages.worn(slot):  # replaced by a slot on 2 MiB pages
                slot = None
            if slot is None:
                self.stats.arena_slots += 1
        if slot is None:
            stored = np.dtype(self.metadata.storage)
            arr = pages.empty((self.slot_bytes // stored.itemsize,), stored)
            ok, huge = pages.fault_in(arr, pages.huge, stop=lambda: it.rt.stopping, nbytes=nbytes)
            if not ok:
                raise Stopped
            slot = _Slot(arr, huge)
        return slot

    def _gatherer(self, it: Iteration, name: str) -> None:
        it.rt.status(name, "allocating batch buffers")
        # one set each before the first batch; the pool allocates the rest when first needed, so
        # the first batch does not wait for all of them
        it.pool.prefill(stop=lambda: it.rt.stopping)
        w = _GatherWait()
        ready = lambda: self._next_task(it, name, w)  # noqa: E731 - made once per thread
        poll = lambda: BUFFER_POLL_S if w.poll else None  # noqa: E731
        while True:
            with it.cond:
                it.rt.status(name, "waiting for a batch plan")
                w.task, w.poll = None, False
                it.rt.wait(ready, poll, cond=it.c_gather)
                task = w.task
                if isinstance(task, _NewBatch):
                    it.next_gather += 1
            if isinstance(task, _IndexAhead):
                self._index_ahead(it, name, task)
            elif isinstance(task, _NewBatch):
                job = self._start_batch(it, name, task)
                self._copy_part(it, name, job, 0)
            else:
                self._copy_part(it, name, task.job, task.part)

    def _next_task(self, it: Iteration, name: str, w: _GatherWait) -> bool:
        """A gather thread's wait predicate (lock held): puts its next task in ``w.task`` and
        returns True, or returns False to wait on (``w.poll``: look again soon, since a buffer
        frees when the consumer drops it and nothing notifies that)."""
        w.poll = False
        if it.parts:  # a part of a batch another thread has started
            w.task = it.parts.popleft()
            return True
        k = it.next_gather
        if it.stop is not None and k >= it.stop:
            raise Stopped
        spec = it.specs.get(k)
        if spec is None or k >= it.start + it.n_consumed + self.read_ahead:
            return False
        if not self._reads_done(it, k):
            it.rt.status(name, f"waiting for reads for batch {self._describe_key(k)}")
            return False
        if k in it.indexing:  # another thread is indexing it (and notifies when done)
            return False
        buf = self._try_buffer(it)
        if buf is None:
            it.rt.status(name, f"waiting for a free batch buffer for batch {self._describe_key(k)}")
            w.poll = True
            if k not in it.indexed:  # meanwhile, work out the batch's rows
                it.indexing.add(k)
                w.task = _IndexAhead(spec, k)
                return True
            return False
        w.task = _NewBatch(buf, spec, k, it.indexed.pop(k, None))
        return True

    @staticmethod
    def _try_buffer(it: Iteration):
        """A free batch buffer set, or None (lock held). The pool grows past MIN_SETS only for a
        consumer that has been slow for GROW_AFTER_S, or that waits holding every set."""
        now = time.monotonic()
        if it.rt.consumer_waiting:  # the loader is the slow side: more buffers would not help
            it.buf_wait = None
        slow_consumer = it.buf_wait is not None and now - it.buf_wait >= GROW_AFTER_S
        kept = it.rt.consumer_waiting and it.pool.all_lent()  # it holds >= 2 while waiting
        buf = it.pool.try_acquire(grow=it.pool.n_owned < MIN_SETS or slow_consumer or kept)
        if buf is None:
            if it.buf_wait is None and not it.rt.consumer_waiting:
                it.buf_wait = now
        else:
            it.buf_wait = None
        return buf

    def _index_ahead(self, it: Iteration, name: str, task: _IndexAhead) -> None:
        it.rt.status(name, f"indexing batch {self._describe_key(task.key)} (ahead)")
        job = self._index(it, task.spec, task.key)
        with it.cond:
            it.indexed[task.key] = job
            it.indexing.discard(task.key)
            it.c_gather.notify_all()

    def _start_batch(self, it: Iteration, name: str, task: _NewBatch) -> _Job:
        """Index the batch (unless done ahead), attach its buffer and offer its other parts."""
        job = task.ahead
        if job is None:
            it.rt.status(name, f"indexing batch {self._describe_key(task.key)}")
            job = self._index(it, task.spec, task.key)
        job.attach(task.buf)
        if job.n_parts > 1:
            with it.cond:
                it.parts.extend(_CopyPart(job, p) for p in range(1, job.n_parts))
                it.c_gather.notify_all()
        return job

    def _copy_part(self, it: Iteration, name: str, job: _Job, part: int) -> None:
        """Copy one part of the batch; the thread that copies its last part publishes it and
        releases the runs that batches up to the new frontier used up."""
        key = job.key
        it.rt.status(name, f"copying batch {self._describe_key(key)} (part {part + 1} of {job.n_parts})")
        if self.debug_hook is not None:
            self._hook("gather", batch=key, shards=job.shards, part=part)
        if part == 0:  # once a batch: removed, replaced or cut since the loader was made (integrity.py)
            for shard in job.shards:
                it.maps.check_intact(shard)
        self._copy(it, job, part)
        with it.cond:
            job.left -= 1
            if job.left:
                return
            job.buf.faulted = True
            job.buf.shards = job.shards  # (checked before it goes out; arena slots: checked when read)
            it.ready[key] = job.buf
            it.done.add(key)
            rel = []
            while it.frontier in it.done:
                it.done.discard(it.frontier)
                rel.extend(it.specs.pop(it.frontier).releases)
                it.frontier += 1
            it.rt.consumer_cond.notify_all()
        if rel:
            freed = self._release(it, rel)
            with it.cond:
                it.outstanding -= freed
                it.c_read.notify_all()

    def _release(self, it: Iteration, releases) -> int:
        freed = 0
        for r, g in releases:
            last = g < 0
            g = r.n_strips - 1 if last else g
            if self.map_mode == "huge":  # blocks other runs still use stay mapped
                with it.cond:
                    freed += it.maps.block_release(r.shard, *r.span)
                if self.evict:
                    it.maps.evict_ranges(r.shard, *r.extents(self.geom, [0]))
                continue
            freed += int(r.strip_bytes[g])
            if self.io == "read":
                if last:
                    with it.cond:
                        it.slots.append(r.slot)
                    r.slot = None
                continue
            if not last:
                it.maps.release(r.shard, *r.extents(self.geom, [g]))
            elif r.n_strips == 1:  # the run's bytes, widened to the 2 MiB blocks mapped with them
                it.maps.release(r.shard, *r.extents(self.geom, [0]), whole=True)
            else:  # everything the run's images hold
                imgs = np.arange(r.j0, r.j1, dtype=np.int64) + r.img0
                z = np.zeros(len(imgs), np.int64)
                it.maps.release(r.shard, *self.geom.token_extents(imgs, z, z + self.geom.n_tokens), whole=True)
        return freed

    def _index(self, it: Iteration, spec, key: int) -> _Job:
        """Which row of which source (shard, or arena slot) goes where in the batch, and its
        image_i / patch_i / layer: the job whose parts copy the vectors once a buffer is attached
        (see :meth:`_copy`). The batch's rows come in one random order (kernels.index_rows)."""
        g = self.geom
        x, run_start, img0 = spec.x, spec.run_start, spec.run_img0
        cimg0 = img0 + self.shard_start[spec.run_shard]
        runs = spec.runs
        mapped: list[int] = []
        if self.io == "mmap":  # a source per shard of the batch
            shards, run_src = np.unique(spec.run_shard, return_inverse=True)
            mapped = shards.tolist()
            sources = [self._shard_source(it, s) for s in mapped]
            run_sub = None
        else:  # a source per run: its arena slot, the run's examples in order
            sources = [r.slot.arr[: (r.hi - r.lo) * g.D].reshape(-1, g.D) for r in runs]
            run_src = np.arange(len(runs), dtype=np.int64)
            run_sub = np.array([r.lo for r in runs], np.int64)
        # the batch's row order (kernels.permutation: a C Fisher-Yates, cheaper than numpy's
        # Generator.permutation)
        perm = kernels.permutation(
            len(x), kernels.permutation_key(self.seed, spec.epoch, self.world.part, spec.index, 7)
        )
        want_lpos = self.scale is not None and len(g.layer_idx) > 1
        out = kernels.index_rows(x, run_start, img0, cimg0, run_src, run_sub, perm, g, want_lpos)
        n = len(x)
        n_parts = max(1, min(PARTS_PER_THREAD * self.n_threads, n // MIN_PART_ROWS))
        return _Job(key, (spec.epoch, spec.index), n, sources, out, n_parts, mapped)

    def _shard_source(self, it: Iteration, shard: int) -> np.ndarray:
        """The shard's (n_imgs * L * T, D) view of stored values (made once per iteration)."""
        src = it.sources.get(shard)
        if src is None:
            g = self.geom
            shape = (self.shard_imgs[shard] * g.L * g.T, g.D)
            src = it.sources[shard] = it.maps.view(shard, shape, self.metadata.storage)
        return src

    def _copy(self, it: Iteration, job: _Job, part: int) -> None:
        """Copy part ``part`` of the batch's rows (an equal share of them) into its buffer. A
        shard truncated during the copy is a LoaderError naming it (maps.ShardMaps.read_error):
        the C kernel stops at the SIGBUS. (Without the C kernel only the check in _copy_part
        remains: a truncate during the copy itself then still kills the process.)"""
        a, b = part * job.n // job.n_parts, (part + 1) * job.n // job.n_parts
        if b <= a:
            return
        act = job.buf.act
        if not job.buf.faulted and not job.buf.huge:  # a set made on demand: populate its share
            populate_small(act[a:b])
        o = job.out
        kw = {"stream": act.nbytes >= kernels.STREAM_MIN_BYTES, "addresses": job.addresses, "counts": job.counts}
        if self.scale is not None:
            if o["lpos"] is None:  # one layer: one factor
                kw["scale"] = self.scale[0]
            else:
                kw["scales"] = np.asarray(self.scale, np.float32)[o["lpos"][a:b]]
        chooser = self._prefetch
        scheme = chooser.pick()
        if self.debug_hook is not None:
            self._hook("copy", batch=job.key, shards=job.shards, part=part)
        c0 = time.thread_time()
        try:
            kernels.take_multi(job.sources, o["src"][a:b], o["rows"][a:b], act[a:b], prefetch=scheme, **kw)
        except OSError as err:  # a BusError (SIGBUS in the copy): which shard, and what happened to it
            raise it.maps.read_error(err, job.shards) from err
        chooser.record(scheme, act[a:b].nbytes, time.thread_time() - c0)


@dataclasses.dataclass(slots=True)
class _CopyPart:
    """Gather task: copy part ``part`` of a batch another thread has started (job.buf attached)."""

    job: _Job
    part: int


@dataclasses.dataclass(slots=True)
class _IndexAhead:
    """Gather task: no batch buffer is free yet; work out batch ``key``'s rows meanwhile."""

    spec: BatchSpec
    key: int


@dataclasses.dataclass(slots=True)
class _NewBatch:
    """Gather task: batch ``key`` got buffer ``buf``; index it (unless ``ahead`` holds its job,
    indexed while waiting for the buffer) and copy its first part."""

    buf: BatchBuffers
    spec: BatchSpec
    key: int
    ahead: _Job | None


@dataclasses.dataclass(slots=True)
class _GatherWait:
    """One gather thread's wait: the task its predicate found, and whether to look again soon."""

    task: _CopyPart | _IndexAhead | _NewBatch | None = None
    poll: bool = False


class _Slot:
    """io="read": one arena slot (a run's selected bytes), whether it lies on 2 MiB pages, and how
    often it has been read into while on 4 KiB pages (see SMALL_SET_USES)."""

    __slots__ = ("arr", "huge", "uses")

    def __init__(self, arr: np.ndarray, huge: bool):
        self.arr, self.huge, self.uses = arr, huge, 0


class _Job:
    """A batch being copied by one or more gather threads: which row of which source goes where
    (``out``: kernels.index_rows), and how many of its ``n_parts`` are still being copied.
    Worked out before a buffer is free (``_index``), then attached to one."""

    __slots__ = ("key", "bkey", "n", "sources", "shards", "addresses", "counts", "out", "n_parts", "left", "buf")

    def __init__(
        self, key: int, bkey: tuple[int, int], n: int, sources: list, out: dict, n_parts: int, shards: list[int]
    ):
        self.key, self.bkey, self.n, self.sources, self.out = key, bkey, n, sources, out
        self.shards = shards  # the shards mapped sources come from (none for arena slots)
        self.addresses = np.array([kernels.address(s) for s in sources], np.int64)
        self.counts = np.array([s.shape[0] for s in sources], np.int64)
        self.n_parts = self.left = n_parts
        self.buf = None

    def attach(self, buf) -> None:
        """Write the batch's indices into ``buf``; its parts then copy the vectors into it."""
        n, o = self.n, self.out
        buf.image_i[:n] = o["image_i"]
        buf.patch_i[:n] = o["patch_i"]
        buf.layer[:n] = o["layer"]
        buf.n, buf.key = n, self.bkey
        self.buf = buf
