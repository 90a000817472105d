"""What the ordered and shuffled loaders share: options, the consumer side of an iteration
(waiting, errors, timeouts, Ctrl-C, metrics) and the loader's lifecycle (close, ``with``)."""

from __future__ import annotations

import abc
import os
import time
import warnings

import numpy as np

from actcache.cache import ActivationCache
from actcache.errors import ConfigError
from actcache.loaders import integrity
from actcache.loaders.buffers import BatchBuffers, BatchPool
from actcache.loaders.common import Selection
from actcache.loaders.maps import ShardMaps
from actcache.loaders.options import LoaderOptions
from actcache.loaders.partition import World
from actcache.loaders.plan import Geometry
from actcache.loaders.runtime import LoaderStats, Runtime
from actcache.protocol import LayerNotRecordedError
from actcache.shardguard import ReadVerifier


class Iteration:
    """State of one pass of ``for batch in loader`` (threads fill ``ready``; the consumer takes)."""

    def __init__(self, loader: BaseLoader, name: str, start: int, stop: int | None, max_sets: int):
        self.loader = loader
        self.rt = Runtime(name)
        self.cond = self.rt.cond
        self.start, self.stop = start, stop  # global batch indices [start, stop)
        self.ready: dict[int, BatchBuffers] = {}
        self.next_key = start  # next batch the consumer takes (deterministic order)
        self.n_consumed = 0
        g = loader.geom
        rows = max(1, min(loader.batch_size, loader.n_examples))  # no bigger than one epoch
        spare, loader._spare_sets = loader._spare_sets, []
        act = loader.act_dtype
        self.pool = BatchPool(lambda huge: BatchBuffers(rows, g.D, huge, act), max_sets, self.cond, spare)
        self.maps = ShardMaps(
            loader.cache.path,
            [s.name for s in loader.cache.shards],
            loader.shard_sizes,
            evict=loader.evict,
            mode=loader.map_mode,
            cold_read=loader.cold_read,
            identities=loader.shard_ids,
            verifier=loader.verifier,
        )
        self.closed = False
        self.on_close: list = []  # loader-specific state to drop before unmapping (may hold views)
        self.on_handover: list = []  # called when no thread is left behind, before on_close

    @property
    def finished(self) -> bool:
        return self.stop is not None and self.n_consumed >= self.stop - self.start

    def _take_ready(self):
        if not self.ready:
            return None
        if self.loader.deterministic:
            return self.ready.pop(self.next_key, None)
        return self.ready.pop(min(self.ready))

    def next_batch(self) -> dict:
        """The next batch as torch tensors over its buffer set's arrays."""
        t0 = time.perf_counter()
        what = f"batch {self.loader._describe_key(self.next_key)}"
        buf = self.rt.consumer_wait(self._take_ready, self.loader.batch_timeout_s, what)
        self.maps.unchanged(buf.shards)  # a shard written to while the batch was copied: refused, not handed out
        # Everything read from the set, and the tensors that mark it as used, comes before it is
        # lent: from then on the pool may hand it to a gather thread as soon as no tensor refers
        # to it (that check could run between lend() and to_torch() and see it unused).
        batch, n, key = buf.to_torch(), buf.n, buf.key
        with self.cond:
            self.pool.lend(buf)
            self.n_consumed += 1
            if self.loader.deterministic:
                self.next_key += 1
            self.rt.consumed()
        st = self.loader.stats
        now = time.perf_counter()
        st.wait_s += now - t0
        st.batches += 1
        st.examples += n
        st.elapsed_s = now - st.started
        if st.first_batch_s is None:
            st.first_batch_s = now - st.started
        self.loader.position = key
        return batch

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        alive = self.rt.shutdown()
        for who, cpu in self.rt.cpu_s.items():
            role = who.rstrip("0123456789").rstrip("-")
            self.loader.stats.thread_cpu_s[role] = self.loader.stats.thread_cpu_s.get(role, 0.0) + cpu
        with self.cond:
            self.loader.stats.buffer_sets += self.pool.n_allocated
            unseen = list(self.ready.values())
            self.ready.clear()
            if alive:  # a thread left behind may still write into a set: keep none
                self.pool.clear()
            else:  # the loader's next iteration reuses the sets (BatchPool.handover)
                self.loader._spare_sets = self.pool.handover(unseen)
                for keep in self.on_handover:  # loader-specific memory its next iteration reuses
                    keep()
            for drop in self.on_close:
                drop()
        if not alive:  # never unmap while a thread might still copy out of a mapping
            self.maps.close()
        else:
            warnings.warn(
                f"{self.rt.name}: threads still busy after stopping (left behind): {', '.join(alive)}",
                RuntimeWarning,
                stacklevel=3,
            )


def token_label_tensor(labels_NP: np.ndarray, image_i, patch_i):
    """Each token's per-patch label (int64; -1 for CLS, which labels.bin has no slot for)."""
    import torch

    img, patch = np.asarray(image_i, np.int64), np.asarray(patch_i, np.int64)
    out = np.full(len(img), -1, np.int64)
    keep = patch >= 0
    out[keep] = labels_NP[img[keep], patch[keep]]
    return torch.from_numpy(out)


class BaseLoader(abc.ABC):
    """Options and lifecycle shared by OrderedLoader and ShuffledLoader."""

    kind = "loader"
    cold_read = "fault"  # how uncached huge-mapped ranges are read (ShardMaps); ShuffledLoader has an option

    def __init__(self, path, *, options: LoaderOptions):
        o = self.options = options
        self.world = World(o.rank, o.world_size, o.worker_id, o.n_workers)
        if isinstance(path, ActivationCache):
            self.cache = path
        elif isinstance(path, (str, os.PathLike)):
            self.cache = ActivationCache.open(path)
        else:
            raise ConfigError(f"path={path!r} must be a cache directory or an ActivationCache")
        self.metadata = self.cache.metadata
        md = self.metadata
        # a 16-bit cache: batches hold float32 (widened in the copy kernel) or, with
        # out_dtype="stored", its stored values
        stored = o.out_dtype == "stored" or md.dtype == "float32"
        self.widen = None if stored else md.dtype
        self.act_dtype = np.dtype(md.storage if stored else np.float32)
        try:
            self.sel = Selection(self.metadata, o.patches, o.layer)
        except LayerNotRecordedError as err:
            raise ConfigError(f"layer={o.layer!r}: {err}") from None
        self.geom = Geometry.from_selection(self.sel)
        self.batch_size, self.patches, self.layer = o.batch_size, o.patches, o.layer
        self.drop_last, self.batch_timeout_s, self.scale_norm = o.drop_last, o.batch_timeout_s, o.scale_norm
        self.n_threads, self.read_ahead, self.evict = o.n_threads, o.read_ahead, o.evict
        self.deterministic = True
        md = self.metadata
        self.shard_imgs = [s.n_imgs for s in self.cache.shards]
        self.shard_sizes = [n * md.bytes_per_img for n in self.shard_imgs]
        self.shard_start = np.r_[0, np.cumsum(self.shard_imgs)].astype(np.int64)
        # each shard's identity now: a shard replaced or written to later is an error, never read (integrity.py)
        names = [s.name for s in self.cache.shards]
        self.shard_ids = integrity.identities(self.cache.path, names)
        # verify_reads: each checksum block checked the first time this process reads it
        self.verifier = ReadVerifier(self.cache.path, names, self.shard_ids, md.hash, self.shard_sizes, o.verify_reads)
        # Reading a small part of each image (one layer of several, or CLS only): no read-around.
        self.random_access = self.geom.img_bytes * 2 < md.bytes_per_img
        self.map_mode = "random" if self.random_access else "huge"  # see ShardMaps
        self.scale = None
        if o.scale_norm:
            from actcache.stats import scale_factors

            self.scale = scale_factors(self.cache, self.sel)  # per selected layer
        self.token_labels_NP = None
        if o.token_labels:
            from actcache.saev import read_token_labels

            self.token_labels_NP = read_token_labels(self.cache.path, md)
        self.stats = LoaderStats()
        self.position: tuple[int, int] | None = None
        self.interrupted = False
        self.debug_hook = None  # tests/diagnostics: called as hook(stage, info) in loader threads
        self._it: Iteration | None = None
        self._spare_sets: list[BatchBuffers] = []  # batch buffer sets a finished iteration left

    @property
    def d_vit(self) -> int:
        return self.metadata.d_vit

    def _describe_key(self, key: int) -> str:
        return str(key)

    def _hook(self, stage: str, **info) -> None:
        if self.debug_hook is not None:
            self.debug_hook(stage, info)

    def _scale_rows(self, act: np.ndarray, lpos: np.ndarray | None) -> None:
        """scale_norm: multiply rows by sqrt(d) / mean norm of their layer (lpos: selected-layer position)."""
        if self.scale is None:
            return
        if len(self.scale) == 1:
            act *= np.float32(self.scale[0])
        else:
            act *= np.asarray(self.scale, np.float32)[lpos][:, None]

    # ---- iteration ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _make_iteration(self) -> Iteration:  # pragma: no cover - abstract
        raise NotImplementedError

    def __iter__(self):
        self._end_iteration()
        it = self._make_iteration()
        self._it = it
        return self._generate(it)

    def _generate(self, it: Iteration):
        self.stats.started = time.perf_counter() - self.stats.elapsed_s
        try:
            self._start(it)
            while not it.finished:
                batch = it.next_batch()
                if self.token_labels_NP is not None:
                    batch["token_label"] = token_label_tensor(self.token_labels_NP, batch["image_i"], batch["patch_i"])
                yield batch
        except KeyboardInterrupt:
            self.interrupted = True
            raise
        finally:
            it.shutdown()
            if self._it is it:
                self._it = None

    @abc.abstractmethod
    def _start(self, it: Iteration) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Stop the running iteration (if any): threads joined, mappings released; and free the
        batch buffers kept for the next iteration."""
        self._end_iteration()
        self._spare_sets = []

    def _end_iteration(self) -> None:
        it, self._it = self._it, None
        if it is not None:
            it.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
