"""ShuffledLoader on small real caches: exactly once, values, determinism, resume, partitions,
failures (reader crash, timeout, Ctrl-C), memory bound, scale_norm."""

from __future__ import annotations

import _thread
import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from actcache.errors import BatchTimeoutError, ConfigError, LoaderError
from actcache.loaders import ShuffledLoader, kernels
from actcache.loaders.runtime import Stopped
from actcache.stats import STATS_FILE
from conftest import evict_dir, make_cache

from .test_buffers import vm_flags


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # 37 images in shards of 10 (last one partial), 2 layers, CLS + 6 patches, D=8
    return make_cache(tmp_path_factory.mktemp("shuf"), n_imgs=37, layers=(3, 7), n_patches=6, d=8, imgs_per_shard=10)


@pytest.fixture(scope="module")
def nocls(tmp_path_factory):
    return make_cache(
        tmp_path_factory.mktemp("nocls"),
        n_imgs=9,
        layers=(5,),
        n_patches=4,
        cls=False,
        d=4,
        imgs_per_shard=4,
        vit_family="dinov2",
    )


SMALL = dict(buffer_bytes=6000, run_bytes=700)  # a few images per run, several runs held


def collect(loader):
    out = []
    for b in loader:
        out.append({k: v.numpy().copy() for k, v in b.items()})
    return out


def check_values(batches, md, acts):
    for b in batches:
        li = np.array([md.layers.index(v) for v in b["layer"]], dtype=np.int64)
        tok = b["patch_i"] + int(md.cls_token)
        np.testing.assert_array_equal(b["act"], acts[b["image_i"], li, tok])


def keys(batches):
    return [(i, la, p) for b in batches for i, la, p in zip(b["image_i"], b["layer"], b["patch_i"], strict=True)]


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("ShuffledLoader-", "OrderedLoader-"))]


@pytest.mark.parametrize("patches", ["image", "all", "cls"])
@pytest.mark.parametrize("layer", [3, 7, "all"])
@pytest.mark.parametrize("io", ["mmap", "read"])
def test_every_example_exactly_once_with_right_values(cache, patches, layer, io):
    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=23, patches=patches, layer=layer, seed=3, io=io, **SMALL)
    batches = collect(ld)
    check_values(batches, md, acts)
    k = keys(batches)
    assert len(k) == len(set(k)) == ld.n_examples == ld.sel.n_examples
    assert len(batches) == len(ld) == math.ceil(ld.n_examples / 23)
    assert all(len(b["act"]) == 23 for b in batches[:-1])
    assert batches[0]["act"].dtype == np.float32 and batches[0]["image_i"].dtype == np.int64
    # memory: the buffer, what readers may load ahead, and at most a batch of over-admission
    assert ld.stats.peak_held_bytes <= SMALL["buffer_bytes"] + ld.read_ahead_bytes + 23 * 8 * 4 * 2


@pytest.mark.parametrize(
    "opts",
    [dict(n_strips=3), dict(n_strips=3, evict=True), dict(io="read", evict=True), dict(n_strips=2, run_bytes=100)],
)
def test_options_keep_exactly_once_and_the_memory_bound(cache, opts):
    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=16, layer="all", seed=4, **{**SMALL, **opts})
    batches = collect(ld)
    check_values(batches, md, acts)
    assert len(set(keys(batches))) == len(keys(batches)) == ld.n_examples
    assert ld.stats.peak_held_bytes <= SMALL["buffer_bytes"] + ld.read_ahead_bytes + 16 * 8 * 4 * 2


def test_cls_without_cls_token_is_a_config_error(nocls):
    path, md, acts = nocls
    with pytest.raises(ConfigError, match="no CLS token"):
        ShuffledLoader(path, patches="cls", layer=5)
    batches = collect(ShuffledLoader(path, batch_size=5, patches="all", layer=5, **SMALL))
    check_values(batches, md, acts)
    assert len(set(keys(batches))) == 9 * 4


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(patches="patch"), "patches"),
        (dict(layer=99), "layer 99"),
        (dict(buffer_bytes=0), "buffer_bytes"),
        (dict(io="odirect"), "io"),
        (dict(cold_read="direct"), "cold_read='direct'.*read, fault"),
        (dict(prefetch="fast"), "prefetch='fast'.*auto, whole, heads"),
        (dict(start_at=(1,)), "start_at"),
        (dict(end_at=("step", 3)), "end_at"),
        (dict(n_epochs=-1), "n_epochs"),
        (dict(rank=2, world_size=2), "rank"),
        (dict(drop_last="yes"), "drop_last"),
    ],
)
def test_bad_options_name_the_option(cache, kw, match):
    with pytest.raises(ConfigError, match=match):
        ShuffledLoader(cache[0], **{"layer": 3, **kw})


def test_the_prefetch_scheme_does_not_change_the_batches(cache):
    """prefetch= only changes how the copy kernel asks for rows ahead: the batches are the same,
    and stats.prefetch says which scheme was used ("auto" times both, then keeps one)."""
    path, md, acts = cache
    runs = {}
    for pf in ("whole", "heads", "auto"):
        ld = ShuffledLoader(path, batch_size=16, layer=3, seed=5, prefetch=pf, **SMALL)
        runs[pf] = collect(ld)
        if not kernels.native_info()["native"]:  # numpy copies: no scheme
            assert ld.stats.prefetch is None and ld.stats.prefetch_GBps == {}
        elif pf != "auto":
            assert ld.stats.prefetch == pf
        else:
            assert set(ld.stats.prefetch_GBps) == {"whole", "heads"}  # both were timed
    check_values(runs["auto"], md, acts)
    for pf in ("whole", "heads"):
        assert len(runs[pf]) == len(runs["auto"])
        for a, b in zip(runs[pf], runs["auto"], strict=True):
            for name in ("act", "image_i", "patch_i", "layer"):
                np.testing.assert_array_equal(a[name], b[name])


def test_deterministic_regardless_of_threads(cache):
    path = cache[0]
    a = collect(ShuffledLoader(path, batch_size=17, layer="all", seed=5, n_threads=1, n_readers=1, **SMALL))
    b = collect(
        ShuffledLoader(path, batch_size=17, layer="all", seed=5, n_threads=3, n_readers=3, read_ahead=1, **SMALL)
    )
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    c = collect(ShuffledLoader(path, batch_size=17, layer="all", seed=6, **SMALL))
    assert not all(np.array_equal(x["image_i"], y["image_i"]) for x, y in zip(a, c, strict=True))
    # batches are well mixed: a batch draws from many images, not one run after another
    assert np.mean([len(np.unique(x["image_i"])) for x in a[:-1]]) > 8
    # non-deterministic mode: the same batches (perhaps reordered)
    d = collect(ShuffledLoader(path, batch_size=17, layer="all", seed=5, deterministic=False, **SMALL))
    assert sorted(keys(d)) == sorted(keys(a))
    # io="read" (one arena slot per run) too: the same batches run after run
    r1, r2 = (
        collect(ShuffledLoader(path, batch_size=17, layer="all", seed=5, io="read", n_threads=n, **SMALL))
        for n in (1, 3)
    )
    assert all(np.array_equal(x["image_i"], y["image_i"]) for x, y in zip(r1, r2, strict=True))


@pytest.mark.parametrize("io", ["mmap", "read"])
def test_batches_copied_in_parts_by_several_threads_are_the_same(cache, monkeypatch, io):
    """Big batches are copied by all gather threads at once (each takes a share of the rows):
    the batches must be exactly those one thread copies whole, values and scale_norm included."""
    import actcache.loaders.shuffled as shuffled

    path, md, acts = cache
    opts = dict(batch_size=17, layer="all", seed=5, io=io, **SMALL)
    whole = collect(ShuffledLoader(path, n_threads=1, **opts))
    monkeypatch.setattr(shuffled, "MIN_PART_ROWS", 4)  # 17 rows in 4 parts (of 4, 4, 4 and 5 rows) for 3 threads
    parts = []
    ld = ShuffledLoader(path, n_threads=3, **opts)
    ld.debug_hook = lambda stage, info: parts.append(info["batch"]) if stage == "gather" else None
    split = collect(ld)
    assert len(split) == len(whole)
    for x, y in zip(whole, split, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    check_values(split, md, acts)
    n_full = sum(len(b["act"]) == 17 for b in split)
    assert sum(parts.count(k) == 4 for k in set(parts)) >= n_full  # every full batch went in 4 parts
    scaled = [
        collect(ShuffledLoader(path, n_threads=n, scale_norm=True, **opts)) for n in (1, 3)
    ]  # MIN_PART_ROWS is still 4: the second run copies and scales in parts
    for x, y in zip(*scaled, strict=True):
        np.testing.assert_array_equal(x["act"], y["act"])
    assert not np.array_equal(scaled[0][0]["act"], whole[0]["act"])


def test_epochs_resume_and_end_at(cache):
    path = cache[0]
    kw = dict(batch_size=19, layer=3, seed=9, **SMALL)
    full = collect(ShuffledLoader(path, n_epochs=3, **kw))
    nb = len(ShuffledLoader(path, **kw))
    assert len(full) == 3 * nb
    for e in range(3):  # every epoch exactly once, each epoch in a different order
        assert len(set(keys(full[e * nb : (e + 1) * nb]))) == 37 * 6
    assert keys(full[:nb]) != keys(full[nb : 2 * nb])
    # resume at (epoch, batch): the tail of the uninterrupted run, without reading skipped data
    reads = []
    ld = ShuffledLoader(path, n_epochs=3, start_at=(1, 5), **kw)
    ld.debug_hook = lambda stage, info: reads.append(info["images"]) if stage == "read" else None
    tail = collect(ld)
    assert len(tail) == 3 * nb - (nb + 5)
    for x, y in zip(tail, full[nb + 5 :], strict=True):
        np.testing.assert_array_equal(x["act"], y["act"])
        np.testing.assert_array_equal(x["image_i"], y["image_i"])
    small = {**kw, "buffer_bytes": 1500, "run_bytes": 300}  # holds about a fifth of the data
    one = ShuffledLoader(path, n_epochs=2, start_at=(1, 0), **small)
    collect(one)
    resumed = ShuffledLoader(path, n_epochs=2, start_at=(1, nb - 2), **small)
    assert len(collect(resumed)) == 2
    assert resumed.stats.read_bytes < one.stats.read_bytes / 3  # only what the last batches use
    # a batch index past the epoch skips epochs
    again = collect(ShuffledLoader(path, n_epochs=3, start_at=(0, nb + 5), **kw))
    assert keys(again) == keys(tail)
    # end_at is absolute
    assert len(collect(ShuffledLoader(path, end_at=("batch", nb + 3), **kw))) == nb + 3
    assert len(collect(ShuffledLoader(path, start_at=(1, 0), end_at=("epoch", 2), **kw))) == nb
    assert keys(collect(ShuffledLoader(path, start_at=(2, 0), end_at=("epoch", 3), **kw))) == keys(full[2 * nb :])
    # infinite: stop whenever
    ld = ShuffledLoader(path, n_epochs=None, **kw)
    it = iter(ld)
    assert len([next(it) for _ in range(4 * nb)]) == 4 * nb
    ld.close()
    assert not loader_threads()


def test_each_for_loop_runs_the_configured_span_and_start_at_picks_the_next(cache):
    """README: a second ``for`` over the same loader gives the same batches again (the order is a
    function of (seed, epoch) only); a loop per epoch sets ``start_at`` and ``n_epochs`` before
    each one and then gets exactly the epochs of one loop over all of them."""
    path = cache[0]
    kw = dict(batch_size=19, layer=3, seed=9, **SMALL)
    full = collect(ShuffledLoader(path, n_epochs=3, **kw))
    ld = ShuffledLoader(path, **kw)
    nb = len(ld)
    assert keys(collect(ld)) == keys(collect(ld)) == keys(full[:nb])
    assert ld.position == (0, nb - 1)
    for e in range(3):
        ld.start_at, ld.n_epochs = (e, 0), e + 1
        got = collect(ld)
        assert keys(got) == keys(full[e * nb : (e + 1) * nb]) and ld.position == (e, nb - 1)
        for x, y in zip(got, full[e * nb : (e + 1) * nb], strict=True):
            np.testing.assert_array_equal(x["act"], y["act"])
    ld.close()


@pytest.mark.parametrize("world_size,n_workers", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (8, 1)])
def test_partitions_cover_every_example_once_with_equal_batch_counts(cache, world_size, n_workers):
    path = cache[0]
    for epoch in (0, 1):
        seen, per_rank = [], {}
        for rank in range(world_size):
            for w in range(n_workers):
                ld = ShuffledLoader(
                    path,
                    batch_size=10,
                    layer="all",
                    seed=2,
                    start_at=(epoch, 0),
                    n_epochs=epoch + 1,
                    rank=rank,
                    world_size=world_size,
                    worker_id=w,
                    n_workers=n_workers,
                    **SMALL,
                )
                batches = collect(ld)
                assert len(batches) == len(ld)
                per_rank[rank] = per_rank.get(rank, 0) + len(batches)
                assert sum(len(b["act"]) % 10 != 0 for b in batches) <= 1
                seen += keys(batches)
        assert len(set(per_rank.values())) == 1
        n = 37 * 2 * 6
        assert len(seen) == len(set(seen))
        assert len(seen) >= n - world_size + 1  # see partition.py: < world_size may be left out
        if n % (world_size * 10) == 0 or n % (world_size * 10) >= world_size:
            assert len(seen) == n


def test_kept_batches_are_never_overwritten(cache):
    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=7, layer=3, read_ahead=1, **SMALL)
    kept = list(ld)  # the consumer keeps every batch: the loader must not reuse their memory
    check_values([{k: v.numpy() for k, v in b.items()} for b in kept], md, acts)
    assert ld.stats.buffer_sets > 3


def test_a_slow_consumer_gets_a_deeper_queue(cache):
    """Two batch buffers while the consumer waits on the loader; a third (read_ahead + 1) once
    the loader waits on the consumer, so that batches are prepared ahead of it."""
    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=7, layer=3, **SMALL)
    batches = []
    for b in ld:
        batches.append({k: v.numpy().copy() for k, v in b.items()})
        time.sleep(0.03)  # a training step
    assert ld.stats.buffer_sets == 3
    check_values(batches, md, acts)
    assert len(keys(batches)) == len(set(keys(batches))) == ld.n_examples
    assert ld.stats.wait_s < 0.5 * len(batches) * 0.03  # the loader kept ahead of the consumer


def test_io_read_runs_fill_their_arena_slots_and_batch_0_waits_for_half_the_first_fill(cache):
    """io="read": runs of one length, each in a slot of exactly its size (but a shard's last run,
    which is shorter), so the arena holds buffer_bytes' worth of images, where runs of random
    length in slots that fit the longest held ~2/3 of it; the slots stay within buffer_bytes.
    When the data does not fit, batch 0 draws from the first half of the first fill only (plan
    FILL_RAMP), so it does not wait for all of it to be read into fresh memory."""
    path, md, acts = cache
    buffer_bytes = 13_000
    ld = ShuffledLoader(path, batch_size=17, layer="all", seed=5, io="read", buffer_bytes=buffer_bytes, run_bytes=1300)
    g = ld.geom
    assert ld.run_imgs > 1 and ld.slot_bytes == ld.run_imgs * g.img_bytes
    assert ld.n_slots * ld.slot_bytes == ld.plan_budget <= buffer_bytes < (ld.n_slots + 1) * ld.slot_bytes
    for epoch in range(2):
        plan = ld.epoch_plan(epoch)
        runs = plan.runs
        last = np.zeros(len(runs), bool)  # each shard's last run
        for shard in np.unique(runs[:, 0]):
            i = np.flatnonzero(runs[:, 0] == shard)
            last[i[np.argmax(runs[i, 1])]] = True
        np.testing.assert_array_equal(runs[~last, 2], ld.run_imgs)
        assert (runs[last, 2] <= ld.run_imgs).all()
        assert ((runs[:, 4] - runs[:, 3]) * g.vec_bytes <= ld.slot_bytes).all()
        assert len(runs) * ld.slot_bytes > ld.plan_budget  # the data does not fit: a ramp
        held = [int(spec.plan_bytes) for spec in plan.batches()]
        assert held[0] <= ld.plan_budget // 2 < held[1] <= ld.plan_budget == max(held)
    assert sorted(keys(collect(ld))) == sorted(keys(collect(ShuffledLoader(path, batch_size=17, layer="all", seed=5))))


def test_arena_slots_go_on_small_pages_while_huge_ones_fault_in_slowly_and_back_later(cache, monkeypatch):
    """io="read": a new arena slot goes on the page size fresh memory faults in fastest, as batch
    buffer sets do (buffers.FreshPages: one per iteration, shared with the sets), and a slot on
    4 KiB pages is replaced by one on 2 MiB pages after SMALL_SET_USES reads into it."""
    from actcache.loaders import buffers, maps
    from actcache.loaders.buffers import STOP_CHECK_BYTES
    from actcache.loaders.maps import HUGE

    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=17, layer="all", seed=5, io="read", **SMALL)
    ld.slot_bytes = 3 * STOP_CHECK_BYTES  # 12 MiB slots: three timed pieces each
    it = ld._make_iteration()
    try:
        monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", 0.0)  # never slow
        s1 = ld._arena_slot(it, ld.slot_bytes)
        a1 = s1.arr.ctypes.data
        assert s1.huge and it.pool.huge and a1 % HUGE == 0
        assert "hg" in vm_flags(a1) and "hg" in vm_flags(a1 + s1.arr.nbytes - 1)

        monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", float("inf"))  # every piece slow
        s2 = ld._arena_slot(it, ld.slot_bytes)
        a2 = s2.arr.ctypes.data
        assert not s2.huge and not it.pool.huge  # new batch buffer sets follow
        assert "hg" in vm_flags(a2)  # the first piece, timed, stays as it was
        for off in (STOP_CHECK_BYTES, s2.arr.nbytes - 1):
            assert "nh" in vm_flags(a2 + off) and "hg" not in vm_flags(a2 + off)
        s3 = ld._arena_slot(it, ld.slot_bytes)  # the next one on 4 KiB pages from the start
        assert not s3.huge and "nh" in vm_flags(s3.arr.ctypes.data)
        assert ld.stats.arena_slots == 3

        monkeypatch.setattr(buffers, "SMALL_SET_USES", 2)
        monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", 0.0)
        for uses in (1, 2):
            it.slots.append(s3)
            assert ld._arena_slot(it, ld.slot_bytes) is s3 and s3.uses == uses
        it.slots.append(s1)
        assert ld._arena_slot(it, ld.slot_bytes) is s1 and s1.uses == 0  # on 2 MiB pages: not counted
        it.slots.append(s3)
        s4 = ld._arena_slot(it, ld.slot_bytes)  # s3's third read: replaced by a slot on 2 MiB pages
        assert s4 is not s3 and s4.huge and it.pool.huge and ld.stats.arena_slots == 4
        assert "hg" in vm_flags(s4.arr.ctypes.data + s4.arr.nbytes - 1)
        # a new slot has only the run's bytes faulted in; after a slow piece, the rest of the slot
        # goes on 4 KiB pages as well (it faults in when a larger run is read into it)
        monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", float("inf"))
        s5 = ld._arena_slot(it, STOP_CHECK_BYTES)
        a5 = s5.arr.ctypes.data
        assert not s5.huge and not it.pool.huge
        assert "hg" in vm_flags(a5) and "nh" in vm_flags(a5 + STOP_CHECK_BYTES)
        vec = np.zeros(s5.arr.nbytes // maps.PAGE, np.uint8)
        assert maps._mincore(a5, s5.arr.nbytes, vec.ctypes.data) == 0
        n_run = STOP_CHECK_BYTES // maps.PAGE
        assert (vec[:n_run] & 1).all() and not (vec[n_run:] & 1).any()
        # a loader stopping meanwhile: the reader gives the slot up rather than fault it all in
        it.rt.stopping = True
        with pytest.raises(Stopped):
            ld._arena_slot(it, ld.slot_bytes)
    finally:
        it.shutdown()


@pytest.mark.parametrize("kind", ["shuffled", "ordered"])
def test_a_batch_is_never_free_for_reuse_while_it_is_being_handed_out(cache, monkeypatch, kind):
    """A gather thread may look for a free set at any moment, in particular just after next()
    lends the set it is handing out. The set must already count as used then (its tensors exist):
    before, they were made after lend(), and a gather thread could write the next batch into it
    while the consumer read it (once in ~30 runs: examples repeated and missing in an epoch)."""
    from actcache.loaders import OrderedLoader
    from actcache.loaders.buffers import BatchPool

    path, md, acts = cache
    orig = BatchPool.lend
    checked = []

    def lend(self, b):  # called with the loader's lock held, as try_acquire is
        orig(self, b)
        got = self.try_acquire(grow=False)
        checked.append(got is b)
        if got is not None:
            self.free.append(got)

    monkeypatch.setattr(BatchPool, "lend", lend)
    if kind == "shuffled":
        ld = ShuffledLoader(path, batch_size=16, layer=3, seed=1, **SMALL)
    else:
        ld = OrderedLoader(path, batch_size=16, layer=3)
    batches = collect(ld)
    assert len(checked) == len(batches) > 2
    assert not any(checked)
    check_values(batches, md, acts)
    assert len(keys(batches)) == len(set(keys(batches)))


@pytest.mark.parametrize("kind", ["shuffled", "ordered"])
def test_a_second_pass_reuses_the_first_passs_buffers_but_never_a_batch_still_held(cache, kind):
    """Batch buffer sets outlive an iteration (fresh memory is slow on VMs that give freed memory
    back to the host): the next ``for b in loader`` makes none beyond the pool's cap, yet the
    last batch the consumer kept from the first pass stays intact; close() lets the sets go."""
    from actcache.loaders import OrderedLoader

    path, md, acts = cache
    if kind == "shuffled":
        ld = ShuffledLoader(path, batch_size=16, layer=3, seed=1, **SMALL)
    else:
        ld = OrderedLoader(path, batch_size=16, layer=3)
    first = collect(ld)
    allocated = ld.stats.buffer_sets
    second = []
    for b in ld:  # the loop variable keeps the last batch's tensors after the loop
        second.append({k: v.numpy().copy() for k, v in b.items()})
    # the second pass reuses them: the pool's cap (3 sets) holds over both passes (a pass that
    # needed only 2 may leave the next to make the third, by thread timing)
    assert ld.stats.buffer_sets <= max(allocated, 3)
    kept, before = b, second[-1]
    third = collect(ld)  # while `kept` still refers to one of the sets
    for got in (first, second, third):
        check_values(got, md, acts)
        assert len(keys(got)) == len(set(keys(got))) == ld.n_examples
    for k, v in kept.items():  # the batch still held was never written into
        np.testing.assert_array_equal(v.numpy(), before[k])
    ld.close()
    assert ld._spare_sets == []
    collect(ld)
    assert ld.stats.buffer_sets > allocated  # after close(), a pass allocates again


def test_io_read_a_second_pass_reuses_the_arena_slots_and_close_frees_them(cache):
    """io="read": the arena slots a pass leaves are reused by the loader's next pass (a loop per
    epoch, README) instead of faulting in buffer_bytes of fresh memory again; a pass stopped
    early hands over only its free slots; close() lets them go. Every pass still gives the right
    values, every example once."""
    path, md, acts = cache
    kw = dict(batch_size=17, layer="all", seed=5, io="read", buffer_bytes=13_000, run_bytes=1300)
    ld = ShuffledLoader(path, **kw)
    first = collect(ld)
    made = ld.stats.arena_slots
    assert made > 1 and len(ld._spare_slots) == made  # the whole arena came back
    ld.start_at, ld.n_epochs = (1, 0), 2
    second = collect(ld)
    assert ld.stats.arena_slots - made <= made // 4  # a few more at most (thread timing), not a new arena
    ld.start_at, ld.n_epochs = (0, 0), 1
    it = iter(ld)
    early = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(2)]
    ld._end_iteration()  # stopped after two batches: runs still held keep their slots
    assert len(ld._spare_slots) <= made
    third = collect(ld)
    assert ld.stats.arena_slots >= made
    for got in (first, second, early, third):
        check_values(got, md, acts)
    for got in (first, second, third):
        assert len(keys(got)) == len(set(keys(got))) == ld.n_examples
    assert keys(first) == keys(third) and keys(early) == keys(first[:2]) and keys(second) != keys(first)
    ld.close()
    assert ld._spare_slots == [] and ld._spare_sets == []
    collect(ld)
    assert ld.stats.arena_slots > made  # after close(), a pass faults its arena in again


def test_reader_crash_reaches_the_consumer_as_one_line_with_the_traceback_in_the_debug_log(cache, tmp_path, caplog):
    path, md, _ = make_cache(tmp_path, n_imgs=12, layers=(3,), n_patches=4, d=8, imgs_per_shard=4)
    ld = ShuffledLoader(path, batch_size=5, layer=3, buffer_bytes=1000, run_bytes=200)
    os.unlink(os.path.join(path, "acts000002.bin"))
    with pytest.raises(LoaderError) as err:
        collect(ld)
    msg = str(err.value)
    assert "reader" in msg and "acts000002.bin" in msg and "No such file" in msg and "\n" not in msg
    assert "Traceback" not in msg
    assert not loader_threads()

    def boom(stage, info):
        if stage == "read" and info["shard"] == 1:
            raise RuntimeError("disk on\nfire")

    ld = ShuffledLoader(cache[0], batch_size=5, layer=3, **SMALL)
    ld.debug_hook = boom
    with caplog.at_level(logging.DEBUG, logger="actcache.loaders.runtime"):
        with pytest.raises(LoaderError, match=r"reading acts000001.bin .*: RuntimeError: disk on fire$") as err:
            collect(ld)
    assert "\n" not in str(err.value) and isinstance(err.value.__cause__, RuntimeError)
    assert any(r.exc_info and "Traceback" not in r.getMessage() for r in caplog.records)
    assert "disk on\nfire" in caplog.text and "Traceback" in caplog.text


def test_truncated_shard_is_an_error_not_a_crash(tmp_path):
    path, md, _ = make_cache(tmp_path, n_imgs=12, layers=(3,), n_patches=4, d=8, imgs_per_shard=4)
    ld = ShuffledLoader(path, batch_size=5, layer=3, buffer_bytes=1000, run_bytes=200)
    os.truncate(os.path.join(path, "acts000001.bin"), 100)
    with pytest.raises(LoaderError, match="truncated"):
        collect(ld)


def test_a_shard_truncated_while_a_cold_run_is_read_is_an_error_naming_it(tmp_path):
    """read_uncached (cold_read="read"): a file that ends before the range it reads (truncated
    after its size was checked) is a LoaderError naming the file and the bytes, not a hang or a
    silent short read."""
    from actcache.loaders.maps import ShardMaps

    path, md, _ = make_cache(tmp_path, n_imgs=8, layers=(3,), n_patches=4, d=8, imgs_per_shard=4)
    name = "acts000001.bin"
    size = os.path.getsize(os.path.join(path, name))
    maps = ShardMaps(path, ["acts000000.bin", name], [size, size], cold_read="read")
    try:
        maps.fd(1)  # opened, size checked
        os.truncate(os.path.join(path, name), 100)
        with pytest.raises(LoaderError, match=rf"bytes 100-{size:,} of {name}.*ended early"):
            maps.read_uncached(1, np.array([0]), np.array([size]))
    finally:
        maps.close()


def test_stalled_reader_raises_batch_timeout_naming_it(cache):
    release = threading.Event()
    ld = ShuffledLoader(cache[0], batch_size=5, layer=3, batch_timeout_s=0.5, **SMALL)
    ld.debug_hook = lambda stage, info: release.wait(20) if stage == "read" and info["shard"] == 2 else None
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="left behind"):  # the stuck reader cannot be joined
        with pytest.raises(BatchTimeoutError, match=r"(?s)reader-\d: reading acts000002.bin"):
            collect(ld)
    assert time.monotonic() - t0 < 8
    release.set()
    for t in loader_threads():
        t.join(5)
    assert not loader_threads()


def test_a_slow_first_fill_is_not_a_stall(cache):
    """The first batch waits for the whole first fill; readers that keep finishing reads are slow,
    not stalled, so batch_timeout_s (measured from the last finished read) does not fire."""
    ref = collect(ShuffledLoader(cache[0], batch_size=5, layer=3, **SMALL))
    ld = ShuffledLoader(cache[0], batch_size=5, layer=3, batch_timeout_s=0.4, n_readers=1, **SMALL)
    reads = itertools.count()
    ld.debug_hook = lambda stage, info: time.sleep(0.15) if stage == "read" and next(reads) < 6 else None
    got = collect(ld)
    assert ld.stats.first_batch_s > 0.4  # longer than the timeout: a wait since the start would have failed
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_ctrl_c_stops_promptly_and_cleanly(cache, sigint_raises):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for slow_consumer in (True, False):
        ld = ShuffledLoader(cache[0], batch_size=3, layer="all", n_epochs=None, **SMALL)
        if not slow_consumer:  # the consumer waits inside the loader when Ctrl-C comes
            ld.debug_hook = lambda stage, info: time.sleep(0.05) if stage == "gather" else None
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        t0 = time.monotonic()
        n = 0
        with pytest.raises(KeyboardInterrupt):
            for _ in ld:
                n += 1
                if slow_consumer:
                    time.sleep(0.001)
        assert time.monotonic() - t0 < 2.0 and n > 0
        assert ld.interrupted or slow_consumer
        assert not loader_threads()
    assert multiprocessing.active_children() == []
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm_before


def test_close_unmaps_the_shards_with_work_pending(cache, monkeypatch):
    """Stopped while the next batch is indexed ahead (every buffer held by the consumer) or
    while parts of batches are queued, close() leaves no shard mapped in the process."""
    import actcache.loaders.shuffled as shuffled

    def mapped():
        with open("/proc/self/maps") as f:
            return [line for line in f if os.path.basename(cache[0]) in line]

    monkeypatch.setattr(shuffled, "GROW_AFTER_S", 1e9)  # the pool stays at MIN_SETS sets
    monkeypatch.setattr(shuffled, "MIN_PART_ROWS", 2)  # batches go in parts
    ld = ShuffledLoader(cache[0], batch_size=7, layer=3, **SMALL)
    it = iter(ld)
    # the consumer keeps 2 batches; the last set fills and the gather threads can only index the next
    kept = [next(it), next(it)]
    deadline = time.monotonic() + 10
    while not ld._it.indexed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ld._it.indexed  # the state this test is about
    ld.close()
    assert not mapped()
    for stop in range(1, 8):
        ld = ShuffledLoader(cache[0], batch_size=7, layer=3, n_threads=3, **SMALL)
        it = iter(ld)
        for _ in range(stop):
            next(it)
        ld.close()
        assert not mapped(), stop
    assert len(kept) == 2


def test_loader_threads_carry_their_role_in_the_os_thread_name(cache):
    """top -H, perf and py-spy show each loader thread's role (ac-planner, ac-reader-0, ...)."""
    ld = ShuffledLoader(cache[0], batch_size=4, layer=3, n_epochs=None, **SMALL)
    it = iter(ld)
    next(it)
    want = {"ac-planner", "ac-reader-0", "ac-reader-1", "ac-gather-0", "ac-gather-1"}
    # a thread names itself once it runs: on a loaded machine one may not have run by the first batch
    deadline = time.monotonic() + 10
    while True:
        names = set()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        if want <= names or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    ld.close()
    assert want <= names


def test_close_and_context_manager(cache):
    with ShuffledLoader(cache[0], batch_size=4, layer=3, n_epochs=None, **SMALL) as ld:
        for i, _ in enumerate(ld):
            if i == 3:
                break
        ld.close()
        assert not loader_threads()
        assert len(collect(ShuffledLoader(cache[0], batch_size=4, layer=3, **SMALL))) == math.ceil(37 * 6 / 4)
    assert ld.stats.batches >= 4 and ld.stats.examples >= 16 and ld.stats.wait_s >= 0
    assert ld.stats.as_dict()["examples_per_s"] > 0


def test_scale_norm_gives_mean_norm_sqrt_d_and_stores_the_statistic_once(tmp_path, monkeypatch):
    path, md, acts = make_cache(tmp_path, n_imgs=20, layers=(1, 2), n_patches=9, d=16, imgs_per_shard=8)
    import actcache.stats as stats

    calls = []
    real = stats.compute
    monkeypatch.setattr(stats, "compute", lambda *a, **k: calls.append(1) or real(*a, **k))
    for layer in (1, "all"):
        ld = ShuffledLoader(path, batch_size=64, layer=layer, scale_norm=True)
        act = np.concatenate([b["act"].numpy() for b in ld])
        assert abs(np.linalg.norm(act, axis=1).mean() - 4.0) < 0.05
    assert len(calls) == 1 and os.path.exists(os.path.join(path, STATS_FILE))


def test_balanced_order_spreads_a_batch_over_the_runs_images(cache):
    """Within a run, a batch takes the same number (+-1) of examples from each of its images."""
    path, md, acts = cache
    ld = ShuffledLoader(path, batch_size=16, layer="all", seed=6, buffer_bytes=10**6, run_bytes=5 * 12 * 8 * 4)
    plan = ld.epoch_plan(0)
    checked = 0
    for spec in plan.batches():
        for r, x in spec.takes:
            img = x // ld.geom.per_img
            full = (r.lo, r.hi) == (r.j0 * ld.geom.per_img, r.j1 * ld.geom.per_img)
            if full and len(x) >= r.j1 - r.j0:
                c = np.bincount(img - r.j0, minlength=r.j1 - r.j0)
                assert c.max() - c.min() <= 1, c
                checked += 1
    assert checked > 0


def test_the_next_epoch_maps_only_the_blocks_that_change(tmp_path, monkeypatch):
    """Whole runs on huge-page mappings (the default for whole images): at an epoch boundary the
    next epoch's first runs reuse the blocks the last epoch's runs still map, so far fewer bytes
    are mapped anew than the first fill holds; every example still comes once per epoch."""
    from actcache.loaders.maps import HUGE, ShardMaps

    # 1024 images of 4 patches x 2048 floats (32 KiB each, 64 per 2 MiB block: 32 MiB in all),
    # shards of 256 images
    path, md, acts = make_cache(tmp_path, n_imgs=1024, layers=(3,), n_patches=4, cls=False, d=2048, imgs_per_shard=256)
    mapped = [0, 0]  # bytes mapped anew for epoch 0's runs, epoch 1's runs
    orig = ShardMaps.make_resident
    local = threading.local()  # the batch a reader thread is loading a run for (debug hook)

    def spy(self, shard, starts, ends):
        mapped[local.batch // nb] += int((ends - starts).sum())
        return orig(self, shard, starts, ends)

    monkeypatch.setattr(ShardMaps, "make_resident", spy)
    import actcache.loaders.shuffled as shuffled

    monkeypatch.setattr(shuffled, "HUGE_MIN_RUN", 0)  # huge mappings for this small cache
    buffer_bytes = 12 * HUGE  # 3/4 of the data
    ld = ShuffledLoader(path, batch_size=512, layer=3, buffer_bytes=buffer_bytes, run_bytes=HUGE, n_epochs=2, seed=5)
    ld.debug_hook = lambda stage, info: setattr(local, "batch", info["batch"]) if stage == "read" else None
    assert ld.map_mode == "huge"
    nb = len(ld)
    # a consumer slower than the readers (as a training step is): each release reaches a waiting
    # reader before the next one, so what is reused does not depend on thread timing (consumed
    # as fast as possible, a reader could miss several releases: 15 of 16 blocks anew once in CI)
    batches = []
    for b in ld:
        batches.append({k: v.numpy().copy() for k, v in b.items()})
        time.sleep(0.05)
    for e in range(2):
        keys = np.concatenate([b["image_i"] * 4 + b["patch_i"] for b in batches[e * nb : (e + 1) * nb]])
        assert np.array_equal(np.sort(keys), np.arange(1024 * 4))
    assert mapped[0] >= 16 * HUGE  # every block at least once in epoch 0
    # epoch 1 finds blocks epoch 0's last runs still map (measured: 10 of 16 blocks mapped anew);
    # without that it would map all 16 again, 12 of them for its first fill alone
    assert mapped[1] <= 14 * HUGE


def test_the_next_epoch_keeps_the_blocks_its_first_fill_shares(tmp_path, monkeypatch):
    """At an epoch boundary the old epoch's last runs all end with its last batch, and the next
    epoch's first batch needs its whole first fill. Once that batch's runs are next in line, the
    readers hold (pin) the blocks of them that older runs still map, so that releasing the older
    runs does not unmap what must then be mapped again."""
    import actcache.loaders.shuffled as shuffled
    from actcache.loaders.maps import HUGE, ShardMaps, block_range

    path, md, acts = make_cache(tmp_path, n_imgs=1024, layers=(3,), n_patches=4, cls=False, d=2048, imgs_per_shard=256)
    monkeypatch.setattr(shuffled, "HUGE_MIN_RUN", 0)  # huge mappings for this small cache
    events = []  # ("map", shard, block) for the next epoch's first batch; ("unmap", shard, block)
    local = threading.local()
    make_resident, block_release = ShardMaps.make_resident, ShardMaps.block_release

    def spy_map(self, shard, starts, ends):
        if local.batch == nb:
            events.extend(("map", shard, int(s) // HUGE) for s in starts)
        return make_resident(self, shard, starts, ends)

    def spy_release(self, shard, start, end):
        out = block_release(self, shard, start, end)
        refs = self._block_refs(shard)
        events.extend(("unmap", shard, b) for b in range(*block_range(start, end)) if refs[b] == 0)
        return out

    def hook(stage, info):
        if stage == "read":
            local.batch = info["batch"]
            if info["batch"] == nb:
                events.append(("first read", None, None))

    monkeypatch.setattr(ShardMaps, "make_resident", spy_map)
    monkeypatch.setattr(ShardMaps, "block_release", spy_release)
    ld = ShuffledLoader(path, batch_size=512, layer=3, buffer_bytes=12 * HUGE, run_bytes=HUGE, n_epochs=2, seed=9)
    ld.debug_hook = hook
    assert ld.map_mode == "huge"
    nb = len(ld)
    # from the plan alone: epoch 1's first fill shares blocks with the runs epoch 0 holds to its end
    last = list(ld.epoch_plan(0).batches(0))[-1]
    held = {(r.shard, b) for r, _ in last.releases for b in range(*block_range(*r.span))}
    fill = next(iter(ld.epoch_plan(1).batches(0))).admit
    assert {(r.shard, b) for r in fill for b in range(*block_range(*r.span))} & held
    n = 0
    for b in ld:  # the pins change what is mapped when, never what a batch holds
        np.testing.assert_array_equal(b["act"], acts[b["image_i"], 0, b["patch_i"]])
        n += len(b["act"])
        time.sleep(0.02)  # a consumer slower than the readers (see the test above)
    assert n == 2 * 1024 * 4
    # no block mapped for epoch 1's first batch had been unmapped since its runs came next in line
    start = events.index(("first read", None, None))
    remapped, n_mapped = [], 0
    for j, (kind, s, b) in enumerate(events):
        if kind == "map":
            n_mapped += 1
            if ("unmap", s, b) in events[start:j]:
                remapped.append((s, b))
    assert n_mapped and not remapped, remapped


@pytest.mark.parametrize("probe", ["nowait", "mincore"])
def test_cold_runs_are_read_with_preadv_then_mapped_and_cached_ones_only_mapped(tmp_path, monkeypatch, probe):
    """cold_read="read" (the default, huge-page mappings): a run whose blocks are not in the page
    cache is read with preadv first, no block twice; a pass over cached data reads nothing
    that way. "fault" reads through the mapping. The batches are the same either way. Where
    preadv2's RWF_NOWAIT is not supported, the cache is probed with mincore instead."""
    import actcache.loaders.shuffled as shuffled
    from actcache.loaders.maps import ShardMaps

    if probe == "mincore":  # as on a kernel or filesystem without RWF_NOWAIT
        real_init = ShardMaps.__init__

        def init(self, *a, **k):
            real_init(self, *a, **k)
            self._nowait_ok = False

        monkeypatch.setattr(ShardMaps, "__init__", init)

    # 512 images of 4 patches x 2048 floats (32 KiB each, 64 per 2 MiB block), shards of 256
    path, md, acts = make_cache(tmp_path, n_imgs=512, layers=(3,), n_patches=4, cls=False, d=2048, imgs_per_shard=256)
    monkeypatch.setattr(shuffled, "HUGE_MIN_RUN", 0)  # huge mappings for this small cache
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin"))
    kw = dict(batch_size=500, layer=3, buffer_bytes=6 * 2**21, run_bytes=2**21, seed=3)
    ld = ShuffledLoader(path, **kw)
    assert ld.map_mode == "huge" and ld.cold_read == "read"
    evict_dir(path)
    cold = collect(ld)
    # whole 2 MiB blocks, none twice; a block the kernel's read-ahead brought in (after a
    # neighbouring run's reads) is found cached and only mapped: measured 6-7 of the 8 blocks
    # read by the loader, depending on thread timing
    got = ld.stats.cold_read_bytes
    assert got % 2**21 == 0 and 0 < got <= size
    ld.stats.reset()
    warm = collect(ld)
    assert ld.stats.cold_read_bytes == 0
    assert ld.stats.batches == len(warm) and ld.stats.thread_cpu_s  # reset() started the counts over
    evict_dir(path)
    fault = ShuffledLoader(path, cold_read="fault", **kw)
    by_fault = collect(fault)
    assert fault.stats.cold_read_bytes == 0
    for other in (warm, by_fault):
        assert len(other) == len(cold)
        for x, y in zip(cold, other, strict=True):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])
    check_values(cold, md, acts)
    assert sorted(keys(cold)) == sorted((i, 3, p) for i in range(512) for p in range(4))
