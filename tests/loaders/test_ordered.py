"""OrderedLoader on small real caches: IndexedDataset order, shard boundaries, ranges, partitions,
failures, scale_norm."""

from __future__ import annotations

import _thread
import os
import threading
import time

import numpy as np
import pytest

from actcache.errors import BatchTimeoutError, ConfigError, LoaderError
from actcache.loaders import IndexedDataset, OrderedLoader, ordered
from conftest import evict, evict_fd, make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("ord"), n_imgs=23, layers=(3, 7), n_patches=6, d=8, imgs_per_shard=5)


def expected(ds):
    items = [ds[i] for i in range(len(ds))]
    return (
        np.stack([it["act"].numpy() for it in items]),
        np.array([it["image_i"] for it in items]),
        np.array([it["patch_i"] for it in items]),
        np.array([it["layer"] for it in items]),
    )


def concat(loader):
    batches = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
    return batches, [np.concatenate([b[k] for b in batches]) for k in ("act", "image_i", "patch_i", "layer")]


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("OrderedLoader-")]


@pytest.mark.parametrize("patches,layer", [("image", 3), ("image", "all"), ("all", 7), ("cls", 3), ("cls", "all")])
@pytest.mark.parametrize("batch_size", [1, 11, 64, 5000])
@pytest.mark.parametrize("io", ["auto", "read", "mmap"])
def test_equals_indexed_dataset_order(cache, patches, layer, batch_size, io):
    path = cache[0]
    want = expected(IndexedDataset(path, patches, layer))
    ld = OrderedLoader(path, batch_size=batch_size, patches=patches, layer=layer, io=io)
    batches, got = concat(ld)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert len(batches) == len(ld) == -(-len(want[0]) // batch_size)
    assert all(len(b["act"]) == batch_size for b in batches[:-1])


def test_drop_last_range_and_threads(cache):
    path = cache[0]
    act, img, patch, layer = expected(IndexedDataset(path, "image", 7))
    batches, got = concat(OrderedLoader(path, batch_size=10, layer=7, drop_last=True, n_threads=3, n_readers=2))
    assert len(batches) == len(act) // 10
    np.testing.assert_array_equal(got[0], act[: len(batches) * 10])
    # an image range: [4, 17) crosses shard boundaries at 5, 10, 15
    _, got = concat(OrderedLoader(path, batch_size=7, layer=7, start_img=4, end_img=17, read_ahead=1))
    sel = (img >= 4) & (img < 17)
    np.testing.assert_array_equal(got[0], act[sel])
    np.testing.assert_array_equal(got[1], img[sel])
    with pytest.raises(ConfigError, match="end_img"):
        OrderedLoader(path, layer=7, start_img=5, end_img=99)
    with pytest.raises(ConfigError, match="batch_size"):
        OrderedLoader(path, layer=7, batch_size=-1)
    with pytest.raises(ConfigError, match="layer"):
        OrderedLoader(path, layer=-2)
    with pytest.raises(ConfigError, match="io='pread' is not allowed; use one of auto, read, mmap"):
        OrderedLoader(path, layer=7, io="pread")


def test_read_mode_reads_few_large_pieces_and_reports_truncation(tmp_path, monkeypatch):
    """io="read": neighbouring images' patch tokens come in one preadv call (the CLS vector
    between them into a scratch buffer); ranges far apart (another layer) in calls of their own;
    a shard cut short after opening is an error naming it, not garbage."""
    import actcache.loaders.ordered as ordered

    path, md, acts = make_cache(tmp_path, n_imgs=12, layers=(3, 5), n_patches=4, d=8, imgs_per_shard=6)
    calls = []
    real = os.preadv

    def spy(fd, iov, off, *flags):
        if not flags:  # the readers' cache probes pass RWF_NOWAIT
            calls.append(len(iov))
        return real(fd, iov, off, *flags)

    monkeypatch.setattr(ordered.os, "preadv", spy)
    monkeypatch.setattr(ordered, "MERGE_GAP", 200)  # the CLS vector: 32 bytes; the other layer: 160
    ld = OrderedLoader(path, batch_size=48, layer=5, patches="image", io="read")
    got = np.concatenate([b["act"].numpy() for b in ld])
    np.testing.assert_array_equal(got, acts[:, 1, 1:].reshape(-1, 8))
    assert len(calls) == 2 and calls[0] == 6 * 2 - 1  # one call per shard: 6 images, 5 gaps
    calls.clear()
    monkeypatch.setattr(ordered, "MERGE_GAP", 64)  # the other layer's 160 bytes are now too far
    list(OrderedLoader(path, batch_size=48, layer=5, patches="image", io="read"))
    assert len(calls) == 12 and set(calls) == {1}
    ld = OrderedLoader(path, batch_size=8, layer=5, io="read", read_ahead=1)  # 3 batches a shard
    it = iter(ld)
    next(it)  # batch 0; batches 1 and 2 may be copied ahead, none of the second shard
    deadline = time.monotonic() + 10
    while 1 not in ld._it.maps._fds and time.monotonic() < deadline:  # a reader opened shard 1
        time.sleep(0.005)
    with open(os.path.join(path, "acts000001.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(LoaderError, match=r"acts000001.bin .*truncated"):
        list(it)


@pytest.mark.parametrize("layers,layer,maps", [((5,), 5, True), ((3, 5), "all", True), ((3, 5), 5, False)])
def test_auto_io_reads_what_is_not_cached_and_tries_both_ways_for_what_is(tmp_path, monkeypatch, layers, layer, maps):
    """io="auto" (the default): a batch whose bytes are not in the page cache is read with
    preadv (as io="read"); once they are cached, it is copied out of the mappings (as io="mmap")
    or read, whichever cost less CPU per byte lately: until both costs are known the cached
    batches are mapped but for the second, which is read (ordered._PathCost). A loader reading a
    small part of each image (one layer of two, 128-byte ranges: below MAP_MIN_RANGE) always
    reads. The same batches every way."""
    path, md, acts = make_cache(tmp_path, n_imgs=12, layers=layers, n_patches=4, d=8, imgs_per_shard=6)
    want = expected(IndexedDataset(path, "image", layer))  # (reads every shard)
    files = [os.path.join(path, f"acts00000{i}.bin") for i in range(2)]
    evict(*files)
    used = []
    for name in ("_fill", "_read_fill"):
        real = getattr(OrderedLoader, name)
        monkeypatch.setattr(
            OrderedLoader,
            name,
            lambda self, it, a, *args, real=real, name=name: used.append((a, name)) or real(self, it, a, *args),
        )
    ways = lambda: [name for _, name in sorted(used)]  # noqa: E731  (in batch order: 2 copy threads)
    learning = []  # per cached batch, in the order chosen (one reader): both costs still unknown?
    real_choose = ordered._PathCost.choose
    monkeypatch.setattr(
        ordered._PathCost,
        "choose",
        lambda self: learning.append(None in self.cost.values()) or real_choose(self),
    )
    per = len(layers) * 4 if layer == "all" else 4
    ld = OrderedLoader(path, batch_size=per * 2, layer=layer, patches="image", read_ahead=1, n_readers=1)
    assert ld.io == "auto" and len(ld) == 6 and ld.may_map == maps
    cold = concat(ld)[1]
    assert ways()[0] == "_read_fill"  # batch 0 was not cached
    used.clear()
    learning.clear()
    ld = OrderedLoader(path, batch_size=per * 2, layer=layer, patches="image", read_ahead=1, n_readers=1)
    warm = concat(ld)[1]  # the first pass left every byte cached; a new loader knows no costs yet
    assert len(used) == len(ld)
    if maps:
        # while both costs are unknown (usually batches 0-2: the reader runs read_ahead + 2
        # ahead), batch 0 is mapped, batch 1 read, batch 2 mapped; a batch chosen once both are
        # known takes the cheaper way (when the copies got ahead of the reader); both costs are
        # known at the end
        assert learning[:2] == [True, True] and ways()[:2] == ["_fill", "_read_fill"]
        if learning[2]:
            assert ways()[2] == "_fill"
        assert all(c is not None for c in ld.path_cost.cost.values())
    else:
        assert ways() == ["_read_fill"] * len(ld)
    third = concat(ld)[1]
    for c, w, t, x in zip(cold, warm, third, want, strict=True):
        np.testing.assert_array_equal(c, x)
        np.testing.assert_array_equal(w, x)
        np.testing.assert_array_equal(t, x)
    assert not ld._it and not loader_threads()


def test_cached_batches_go_the_cheaper_way_and_the_other_is_tried_now_and_then():
    from actcache.loaders.ordered import EXPLORE_EVERY, _PathCost

    pc = _PathCost()
    assert pc.choose() is True  # nothing known: map the first
    assert pc.choose() is False  # and read the second, to learn both costs
    assert pc.choose() is True  # still nothing known (their copies have not finished): map
    pc.record(True, 2.0, 1000)
    # reading's cost still unknown (say its batch was never copied: the loader stopped): mapped,
    # and reading tried again at the next EXPLORE_EVERY-th choice
    picks = [pc.choose() for _ in range(EXPLORE_EVERY)]
    assert picks.count(False) == 1 and pc.n % EXPLORE_EVERY == 3 and picks[-2] is False
    pc.record(False, 1.0, 1000)
    picks = [pc.choose() for _ in range(4 * EXPLORE_EVERY)]
    assert picks.count(True) == 4  # the dearer way: every EXPLORE_EVERY-th choice
    assert all(p is True for i, p in enumerate(picks, start=pc.n - len(picks) + 1) if i % EXPLORE_EVERY == 0)
    for _ in range(8):  # mapping gets cheaper (e.g. the page cache now holds 2 MiB folios)
        pc.record(True, 0.5, 1000)
    assert pc.cost[True] < pc.cost[False]
    picks = [pc.choose() for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(False) == 2 and picks.count(True) == 2 * EXPLORE_EVERY - 2
    pc.record(False, 1.0, 0)  # an empty batch teaches nothing
    assert pc.cost[False] == 1.0 / 1000


@pytest.mark.parametrize("world_size,n_workers", [(1, 1), (2, 1), (3, 1), (2, 2), (8, 1)])
def test_partitions_are_contiguous_and_lockstep(cache, world_size, n_workers):
    path = cache[0]
    act = expected(IndexedDataset(path, "all", "all"))[0]
    pieces, per_rank = [], {}
    for r in range(world_size):
        for w in range(n_workers):
            ld = OrderedLoader(
                path,
                batch_size=9,
                patches="all",
                layer="all",
                rank=r,
                world_size=world_size,
                worker_id=w,
                n_workers=n_workers,
            )
            batches, got = concat(ld)
            per_rank[r] = per_rank.get(r, 0) + len(batches)
            pieces.append((ld.ex_start, got[0]))
    assert len(set(per_rank.values())) == 1
    pieces.sort(key=lambda p: p[0])
    allgot = np.concatenate([p[1] for p in pieces])
    assert len(allgot) >= len(act) - world_size + 1
    np.testing.assert_array_equal(allgot, act[: len(allgot)])  # parts are consecutive pieces
    seen = {tuple(row) for row in allgot}
    assert len(seen) == len(allgot)


def test_kept_batches_stay_valid(cache):
    path = cache[0]
    act = expected(IndexedDataset(path, "image", 3))[0]
    kept = list(OrderedLoader(path, batch_size=4, layer=3, read_ahead=1))
    np.testing.assert_array_equal(np.concatenate([b["act"].numpy() for b in kept]), act)


def test_crash_timeout_and_ctrl_c(cache, tmp_path, sigint_raises):
    path, _, _ = make_cache(tmp_path, n_imgs=12, layers=(3,), n_patches=4, d=8, imgs_per_shard=4)
    ld = OrderedLoader(path, batch_size=5, layer=3)
    os.unlink(os.path.join(path, "acts000001.bin"))
    with pytest.raises(LoaderError, match=r"reader-\d.*acts000001.bin.*No such file"):
        list(ld)
    assert not loader_threads()

    gate = threading.Event()
    ld = OrderedLoader(cache[0], batch_size=5, layer=3, batch_timeout_s=0.3)
    ld.debug_hook = lambda stage, info: gate.wait(20) if stage == "read" and info["batch"] == 3 else None
    with pytest.warns(RuntimeWarning, match="left behind"):
        with pytest.raises(BatchTimeoutError, match=r"reader-\d: reading acts000000.bin"):
            list(ld)
    gate.set()
    for t in loader_threads():
        t.join(5)

    ld = OrderedLoader(cache[0], batch_size=2, layer=3)
    ld.debug_hook = lambda stage, info: time.sleep(0.05) if stage == "gather" else None
    threading.Timer(0.2, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in ld:
            pass
    assert time.monotonic() - t0 < 2 and ld.interrupted
    assert not loader_threads()


@pytest.mark.parametrize("io", ["read", "mmap"])
@pytest.mark.parametrize("patches,layer,batch_size", [("image", 7, 40), ("image", "all", 29), ("all", 3, 64)])
def test_copy_threads_share_each_batch_in_parts(cache, monkeypatch, io, patches, layer, batch_size):
    """Every copy thread copies a part of the same cached batch (cut on image boundaries; the
    batches themselves start inside images): the batches and their scaling are those of one
    copy. (A batch still to be read from disk is read by one thread.)"""
    from actcache.loaders import ordered

    monkeypatch.setattr(ordered, "MIN_PART_ROWS", 5)
    path = cache[0]
    ds = IndexedDataset(path, patches, layer)
    want = expected(ds)  # (reads every shard: cached batches are the ones split)
    for scale_norm in (False, True):
        parts = []
        ld = OrderedLoader(
            path, batch_size=batch_size, patches=patches, layer=layer, io=io, n_threads=3, scale_norm=scale_norm
        )
        ld.debug_hook = lambda stage, info, parts=parts: parts.append(info["batch"]) if stage == "gather" else None
        batches, got = concat(ld)
        assert len(parts) > len(batches) and sorted(set(parts)) == list(range(len(batches)))  # in parts
        if scale_norm:  # one factor per layer: the same for every part
            f = got[0][:, 0] / want[0][:, 0]
            for v in np.unique(got[3]):
                np.testing.assert_allclose(f[got[3] == v], f[got[3] == v][0], rtol=1e-5)
            continue
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        assert [len(b["act"]) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)


def test_scale_norm(tmp_path):
    path, md, acts = make_cache(tmp_path, n_imgs=15, layers=(1, 2), n_patches=9, d=16, imgs_per_shard=4)
    for layer in (2, "all"):
        ld = OrderedLoader(path, batch_size=50, layer=layer, scale_norm=True)
        act = np.concatenate([b["act"].numpy() for b in ld])
        assert abs(np.linalg.norm(act, axis=1).mean() - 4.0) < 0.05


@pytest.mark.parametrize("native", [True, False])
def test_prefetch_asks_only_for_ranges_not_cached(tmp_path, monkeypatch, native):
    """Readers skip posix_fadvise for ranges already in the page cache (a probe of their first
    and last byte that must not block); evicted ones are asked for. With the C kernel the
    probes and requests are made in C (kernels.probe), without it from Python."""
    from actcache.loaders import kernels
    from actcache.loaders.maps import ShardMaps

    if native:
        import actcache._native as mod

        monkeypatch.setattr(kernels, "_native", mod)
    else:
        monkeypatch.setattr(kernels, "_native", None)

    path, md, acts = make_cache(tmp_path, n_imgs=8, layers=(3,), n_patches=4, d=1024, imgs_per_shard=8)
    name = "acts000000.bin"
    size = os.path.getsize(os.path.join(path, name))
    asked = []
    real = os.posix_fadvise

    def spy(fd, off, n, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((off, n))
        return real(fd, off, n, advice)

    maps = ShardMaps(path, [name], [size])
    fd = maps.fd(0)
    with open(os.path.join(path, name), "rb") as f:
        f.read()  # cached
    monkeypatch.setattr(os, "posix_fadvise", spy)
    assert size == 8 * 5 * 1024 * 4
    starts, ends = np.array([0, 2**16]), np.array([2**14, 2**16 + 2**14])
    assert maps.prefetch(0, starts, ends) is True
    assert asked == []
    evict_fd(fd, size)
    assert maps.prefetch(0, starts, ends) is False
    if not native:
        assert asked == [(0, 2**14), (2**16, 2**14)]
    # asked for (in C with the kernel): the ranges come in without anyone reading them
    deadline = time.monotonic() + 10
    while not all(maps._probe_cached(fd, int(s), int(e)) for s, e in zip(starts, ends, strict=True)):
        assert time.monotonic() < deadline, "the ranges asked for never came into the page cache"
        time.sleep(0.01)
    assert maps.prefetch(0, starts, ends) is True
    maps.close()


def test_random_mode_leaves_cached_ranges_to_the_copies_and_releases_per_stretch(tmp_path, monkeypatch):
    """Mode "random" (one layer of several): ranges found cached are not populated (the copies
    map them as they touch them), ranges not cached are; release(whole=True) widens the ranges to
    2 MiB blocks and unmaps each stretch of touching blocks with one call, not one per range."""
    from actcache.loaders import maps
    from actcache.loaders.maps import HUGE, MADV_DONTNEED, MADV_POPULATE_READ, ShardMaps

    name, size = "acts000000.bin", 8 * HUGE
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    with open(tmp_path / name, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: posix_fadvise DONTNEED can drop them below
    with open(tmp_path / name, "rb") as f:
        f.read()  # cached
    calls = []
    real = maps._madvise

    def spy(addr, n, advice):
        calls.append((advice, addr, n))
        return real(addr, n, advice)

    monkeypatch.setattr(maps, "_madvise", spy)
    maps = ShardMaps(str(tmp_path), [name], [size], mode="random")
    kib = 1024
    starts = np.arange(4, dtype=np.int64) * 2400 * kib  # ~600 KB ranges 2.4 MB apart: one layer of four
    starts = np.r_[starts, 15 * HUGE // 2]  # and one far from them
    ends = starts + 600 * kib
    assert maps.make_resident(0, starts, ends) == 0
    assert [c for c in calls if c[0] == MADV_POPULATE_READ] == []  # cached: left to the copies
    arr = maps.array(0)
    for s, e in zip(starts, ends, strict=True):
        assert np.array_equal(arr[s:e], data[s:e])
    os.posix_fadvise(maps.fd(0), 0, 0, os.POSIX_FADV_DONTNEED)  # evicted (what the mapping does not hold)
    maps.release(0, starts, ends, whole=True)
    dontneed = [(a, n) for advice, a, n in calls if advice == MADV_DONTNEED]
    assert len(dontneed) == 2, dontneed  # the four touching stretches as one, the far range alone
    addr = arr.ctypes.data
    for a, n in dontneed:
        assert (a % HUGE == 0 or a == addr) and ((a + n) % HUGE == 0 or a + n >= addr + size)
    for s, e in zip(starts, ends, strict=True):
        assert any(a <= addr + s and addr + e <= a + n for a, n in dontneed)
    evict_fd(maps.fd(0), size)  # (the released ranges are no longer mapped)
    calls.clear()
    maps.make_resident(0, starts[:2], ends[:2])
    assert len([c for c in calls if c[0] == MADV_POPULATE_READ]) == 2  # not cached: populated (and read)
    assert np.array_equal(arr[starts[1] : ends[1]], data[starts[1] : ends[1]])
    maps.close()


@pytest.mark.parametrize("io", ["auto", "read"])
def test_first_batch_is_requested_before_any_other(tmp_path, io):
    """The readers ask for the first batch's byte ranges before any later batch's (their requests
    would otherwise interleave at the disk and the first batch arrive with the last): a slow
    request of batch 0 holds the others back; the batches still come whole and in order."""
    path, _, _ = make_cache(tmp_path, n_imgs=24, layers=(3,), n_patches=6, d=8, imgs_per_shard=5)
    want = expected(IndexedDataset(path, "image", 3))
    ld = OrderedLoader(path, batch_size=36, layer=3, io=io, n_readers=4)  # batch 0: 5 + 1 images
    events, lock = [], threading.Lock()

    def hook(stage, info):
        if stage != "read":
            return
        with lock:
            events.append((info["batch"], info["shard"]))
        if info["batch"] == 0 and info["shard"] == 0:
            time.sleep(0.3)  # the other readers are free meanwhile: they must wait

    ld.debug_hook = hook
    _, got = concat(ld)
    np.testing.assert_array_equal(got[0], want[0])
    first_others = next(i for i, (k, _) in enumerate(events) if k > 0)
    assert events[:first_others] == [(0, 0), (0, 1)]
    assert sorted({k for k, _ in events}) == list(range(len(ld)))
