"""The loaders' C copy kernel (actcache._native, through loaders.kernels) against numpy: the
same bytes on every path (plain and streaming stores, each instruction set the machine has,
scaled rows), bad rows refused before anything is copied, and whole loaders giving identical
batches with and without it."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import time

import numpy as np
import pytest

from actcache.loaders import OrderedLoader, ShuffledLoader, kernels
from actcache.loaders.buffers import huge_empty
from conftest import evict_fd, make_cache, resident


@pytest.fixture
def native(monkeypatch):
    """The C kernel, also when ACTCACHE_NATIVE=0 turned it off for the loaders. The install builds
    it (setup.py); the loaders would still work without it, only slower, so an install that
    silently lost it fails here."""
    try:
        mod = importlib.import_module("actcache._native")
    except ImportError as err:
        pytest.fail(f"actcache._native was not built ({err}): is a C compiler installed? pip install -e . builds it")
    monkeypatch.setattr(kernels, "_native", mod)
    return mod


def test_the_kernel_is_built(native):
    assert kernels.native_info() == {"native": True, "isa": native.isa}
    assert native.isa in ("avx512f", "avx2", "sse2", "generic")


def test_the_copy_loops_prefetch_rows(native):
    """The source rows are prefetched ahead of the copy (random rows miss every cache: see
    _native.c). gcc once compiled every prefetch out of the module without a warning (it judged
    the helper const and dropped its calls), so look for the instructions in the built file."""
    if platform.machine() not in ("x86_64", "AMD64"):
        assert native.isa == "generic"  # no x86 copy loops to look at
        return
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with gcc) is needed to inspect the built kernel"
    text = subprocess.run([objdump, "-d", native.__file__], capture_output=True, text=True, check=True).stdout
    # both schemes (kernels.PREFETCH_SCHEMES): whole rows into L2 (t1), row heads into L3 (t2),
    # and the first bytes of long rows (nta)
    for insn in ("prefetchnta", "prefetcht1", "prefetcht2"):
        assert text.count(insn) >= 1, f"{native.__file__} has no {insn} instruction"


def aligned(shape, dtype=np.float32, offset=0):
    """An array whose data starts ``offset`` bytes after a 64-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 128, np.uint8)
    skip = (-raw.ctypes.data) % 64 + offset
    return raw[skip : skip + n].view(dtype).reshape(shape)


@pytest.mark.parametrize("d", [768, 100, 16, 3])  # pieces that are / are not multiples of 64 bytes
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("offset", [0, 4])  # destination 64-byte aligned or not
def test_take_equals_numpy(native, d, stream, offset):
    rng = np.random.default_rng(d)
    src = rng.standard_normal((500, d), dtype=np.float32)
    rows = rng.integers(0, 500, 333)
    one = np.zeros(333, np.int64)  # a single source
    out = aligned((333, d), offset=offset)
    kernels.take_multi([src], one, rows, out, stream=stream)
    np.testing.assert_array_equal(out, src[rows])
    # scaled: the same float32 products numpy computes
    kernels.take_multi([src], one, rows, out, stream=stream, scale=1.7)
    np.testing.assert_array_equal(out, src[rows] * np.float32(1.7))
    per = rng.uniform(0.5, 2, 333).astype(np.float32)
    kernels.take_multi([src], one, rows, out, stream=stream, scales=per)
    np.testing.assert_array_equal(out, src[rows] * per[:, None])


@pytest.mark.parametrize("d", [768, 1024, 40, 3])  # rows longer and shorter than a prefetched head
@pytest.mark.parametrize("stream", [False, True])
def test_both_prefetch_schemes_copy_the_same_rows(native, d, stream):
    """The prefetch scheme changes only the speed: whole rows, row heads and numpy agree."""
    rng = np.random.default_rng(d)
    sources = [rng.standard_normal((m, d), dtype=np.float32) for m in (700, 90)]
    srcs = rng.integers(0, 2, 1000)
    rows = np.array([rng.integers(0, len(sources[s])) for s in srcs])
    want = np.stack([sources[s][r] for s, r in zip(srcs, rows, strict=True)])
    for scheme in range(len(kernels.PREFETCH_SCHEMES)):
        out = aligned((1000, d))
        kernels.take_multi(sources, srcs, rows, out, stream=stream, prefetch=scheme)
        np.testing.assert_array_equal(out, want)
        kernels.take_multi(sources, srcs, rows, out, stream=stream, prefetch=scheme, scale=0.5)
        np.testing.assert_array_equal(out, want * np.float32(0.5))
    with pytest.raises(ValueError, match="prefetch must be 0 .whole rows. or 1 .row heads., not 2"):
        kernels.take_multi(sources, srcs, rows, aligned((1000, d)), prefetch=2)


def test_prefetch_chooser_tries_both_then_keeps_the_faster_and_looks_again():
    ch = kernels.PrefetchChooser()
    assert ch.describe() is None
    picks = []
    for i in range(2 * ch.TRIAL_COPIES):  # trials alternate; "heads" copies twice as fast
        k = ch.pick()
        picks.append(k)
        slow = i == 0  # one copy slowed down (a page fault storm): medians shrug it off
        ch.record(k, 10**9, (0.5 if k == 1 else 1.0) * (20 if slow else 1))
    assert picks.count(0) == picks.count(1) == ch.TRIAL_COPIES
    assert ch.describe() == "heads" and ch.rates() == pytest.approx([1e9, 2e9])
    later = [ch.pick() for _ in range(4 * ch.RECHECK_EVERY)]
    assert later.count(0) == 4 and later.count(1) == len(later) - 4  # one look at "whole" per RECHECK_EVERY
    # "whole" has become faster: once most of its recent looks say so, it takes over
    for _ in range(ch.WINDOW // 2 - 1):
        ch.record(0, 10**9, 0.2)
    assert ch.describe() == "heads"  # most of its window is still the old, slower copies
    ch.record(0, 10**9, 0.2)
    assert ch.describe() == "whole"
    # within SWITCH_BY of each other: no flapping
    ch2 = kernels.PrefetchChooser()
    for _ in range(ch2.TRIAL_COPIES):
        ch2.record(0, 10**9, 1.0)
        ch2.record(1, 10**9, 1.0 / 1.01)
    assert ch2.describe() == "heads"
    for _ in range(ch2.WINDOW):
        ch2.record(0, 10**9, 1.0 / 1.02)  # faster now, but by less than SWITCH_BY
    assert ch2.describe() == "heads"
    fixed = kernels.PrefetchChooser(fixed=0)
    assert {fixed.pick() for _ in range(50)} == {0} and fixed.describe() == "whole"


def test_take_from_a_huge_page_buffer_into_one(native):
    src = huge_empty((4096, 768))
    src[:] = np.arange(4096, dtype=np.float32)[:, None]
    out = huge_empty((2048, 768))
    rows = np.random.default_rng(0).permutation(4096)[:2048]
    kernels.take_multi([src], np.zeros(2048, np.int64), rows, out, stream=True)
    np.testing.assert_array_equal(out[:, 0], rows.astype(np.float32))
    np.testing.assert_array_equal(out, src[rows])


@pytest.mark.parametrize("bad", [-1, 500, 10**12])
def test_bad_rows_are_refused_before_copying(native, bad):
    src = np.ones((500, 8), np.float32)
    rows = np.array([3, 4, bad, 5])
    out = np.zeros((4, 8), np.float32)
    with pytest.raises(IndexError, match=rf"row {bad} of source 0 at position 2 is outside \[0, 500\)"):
        kernels.take_multi([src], np.zeros(4, np.int64), rows, out)
    assert not out.any()  # nothing copied


@pytest.mark.parametrize("stream", [False, True])
def test_copy_blocks_equals_strided_numpy(native, stream):
    """Blocks as the ordered loader copies them: one layer's patch tokens of consecutive images,
    or every layer's, out of a shard's bytes."""
    rng = np.random.default_rng(1)
    n, L, T, D = 9, 3, 5, 32
    shard = rng.standard_normal((n, L, T, D), dtype=np.float32)
    raw = shard.reshape(-1).view(np.uint8)
    vb = D * 4
    # layer 1, tokens 1..4 of images 2..7
    out = aligned((6 * 4, D))
    assert kernels.copy_blocks(
        raw, np.arange(2, 8), out, stride=L * T * vb, offset=(1 * T + 1) * vb, stream=stream, scale=0.5
    )
    np.testing.assert_array_equal(out.reshape(6, 4, D), shard[2:8, 1, 1:5] * np.float32(0.5))
    # every layer of images 0..8, one scale per layer
    rows = (np.arange(n)[:, None] * L + np.arange(L)[None, :]).ravel()
    scales = np.tile(np.array([1, 2, 3], np.float32), n)
    out = aligned((n * L * 4, D))
    assert kernels.copy_blocks(raw, rows, out, stride=T * vb, offset=vb, stream=stream, scales=scales)
    want = shard[:, :, 1:5] * np.array([1, 2, 3], np.float32)[None, :, None, None]
    np.testing.assert_array_equal(out.reshape(n, L, 4, D), want)
    # a block reaching past the end of the source
    with pytest.raises(IndexError):
        kernels.copy_blocks(raw, np.array([n]), aligned((4, D)), stride=L * T * vb, offset=vb)


@pytest.mark.parametrize("stream", [False, True])
def test_take_multi_equals_numpy_and_refuses_bad_rows(native, monkeypatch, stream):
    rng = np.random.default_rng(4)
    sources = [rng.standard_normal((m, 64), dtype=np.float32) for m in (50, 7, 300)]
    srcs = rng.integers(0, 3, 400)
    rows = np.array([rng.integers(0, len(sources[s])) for s in srcs])
    want = np.stack([sources[s][r] for s, r in zip(srcs, rows, strict=True)])
    out = aligned((400, 64))
    kernels.take_multi(sources, srcs, rows, out, stream=stream, scale=2.0)
    np.testing.assert_array_equal(out, want * np.float32(2))
    monkeypatch.setattr(kernels, "_native", None)
    out2 = aligned((400, 64))
    kernels.take_multi(sources, srcs, rows, out2, scale=2.0)
    np.testing.assert_array_equal(out2, out)
    monkeypatch.setattr(kernels, "_native", native)
    bad = rows.copy()
    bad[9] = len(sources[srcs[9]])  # one past the end of its source
    with pytest.raises(IndexError, match=r"row \d+ of source \d at position 9"):
        kernels.take_multi(sources, srcs, bad, out)
    with pytest.raises(IndexError, match="source 3 at position 0"):
        kernels.take_multi(sources, np.full(400, 3), rows, out)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 16384])
def test_permutation_is_the_same_with_numpy_and_a_function_of_the_key(native, monkeypatch, n):
    key = kernels.permutation_key(17, 3, 0, n, 7)
    got = kernels.permutation(n, key)
    assert sorted(got.tolist()) == list(range(n))
    np.testing.assert_array_equal(kernels.permutation(n, key), got)  # the key alone decides
    monkeypatch.setattr(kernels, "_native", None)
    np.testing.assert_array_equal(kernels.permutation(n, key), got)  # numpy: the same order
    if n >= 1000:
        assert not np.array_equal(kernels.permutation(n, key + 1), got)
        assert abs(np.corrcoef(np.arange(n), got)[0, 1]) < 0.1  # no trace of the identity


def test_permutation_is_uniform(native):
    """Where each element lands, over many keys: every position equally often (chi-square)."""
    n, trials = 6, 12000
    counts = np.zeros((n, n))
    for s in range(trials):
        counts[np.arange(n), kernels.permutation(n, kernels.permutation_key(s))] += 1
    chi2 = ((counts - trials / n) ** 2 / (trials / n)).sum()
    assert chi2 < 60, chi2  # 25 degrees of freedom: p(chi2 > 60) ~ 1e-4


def test_concat_ranges_is_the_same_with_numpy_and_refuses_bad_sizes(native, monkeypatch):
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 10**9, n) for n in (0, 5, 1000, 17)]
    addrs = np.array([kernels.address(a) for a in arrays], np.int64)
    starts, counts = np.array([0, 2, 100, 0]), np.array([0, 3, 900, 17])
    want = np.concatenate([a[s : s + c] for a, s, c in zip(arrays, starts, counts, strict=True)])
    np.testing.assert_array_equal(kernels.concat_ranges(lambda: arrays, addrs, starts, counts), want)
    with pytest.raises(ValueError, match="negative start or count"):
        kernels.concat_ranges(lambda: arrays, addrs, starts, np.array([0, -1, 900, 17]))
    with pytest.raises(ValueError, match="one int64 per array"):
        native.concat_ranges(addrs, starts[:3], counts, np.empty(920, np.int64))
    with pytest.raises(ValueError, match="sum\\(counts\\)"):
        native.concat_ranges(addrs, starts, counts, np.empty(919, np.int64))
    monkeypatch.setattr(kernels, "_native", None)  # numpy: the arrays, from the callable
    np.testing.assert_array_equal(kernels.concat_ranges(lambda: arrays, addrs, starts, counts), want)


def test_merged_ranges_join_touching_overlapping_and_near_ones():
    from actcache.loaders.maps import _merged, _merged_arrays

    assert _merged(np.array([], np.int64), np.array([], np.int64)) == []
    assert _merged(np.array([7]), np.array([9])) == [(7, 9)]
    s, e = np.array([50, 0, 10, 30, 20, 80]), np.array([60, 10, 15, 45, 31, 81])
    assert _merged(s, e) == [(0, 15), (20, 45), (50, 60), (80, 81)]
    assert _merged(s, e, gap=4) == _merged(s, e)
    assert _merged(s, e, gap=5) == [(0, 60), (80, 81)]  # ranges 5 bytes apart join
    assert _merged(s, e, gap=100) == [(0, 81)]
    a, b = _merged_arrays(np.array([4, 0]), np.array([8, 5]))
    assert a.dtype == b.dtype == np.int64 and a.tolist() == [0] and b.tolist() == [8]


def test_index_rows_refuses_what_does_not_fit(native):
    z = np.zeros(4, np.int64)
    g = type("G", (), dict(per_img=2, n_tokens=2, L=1, T=3, token_start=1, cls=True, layer_idx=(0,), layers=(5,)))
    out = kernels.index_rows(np.array([0, 1, 2, 3]), np.array([0, 4]), [0], [0], [0], None, np.arange(4), g)
    assert out["rows"].tolist() == [1, 2, 4, 5] and out["patch_i"].tolist() == [0, 1, 0, 1]
    assert out["image_i"].tolist() == [0, 0, 1, 1] and out["layer"].tolist() == [5] * 4
    with pytest.raises(ValueError, match="perm outside"):
        kernels.index_rows(z, np.array([0, 4]), [0], [0], [0], None, np.array([0, 1, 2, 9]), g)
    with pytest.raises(ValueError, match="run_start"):
        kernels.index_rows(z, np.array([0, 3]), [0], [0], [0], None, np.arange(4), g)


def test_without_the_kernel_copy_blocks_and_probe_decline(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_native", None)
    assert kernels.native_info() == {"native": False, "isa": None}
    out = np.zeros((2, 4), np.float32)
    assert kernels.copy_blocks(np.ones(64, np.uint8), np.array([0, 1]), out, stride=16) is False
    assert not out.any()
    (tmp_path / "f").write_bytes(b"x" * 8192)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert kernels.probe(fd, np.array([0]), np.array([10]), advise=False) is None
    finally:
        os.close(fd)


def _wait_until(what, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_probe_counts_ranges_not_cached_and_asks_for_them(native, tmp_path):
    """probe: ranges whose first or last byte is not in the page cache are counted, and with
    advise asked for (they then come in without anyone reading them); cached ones are not.
    A probe that misses starts the kernel's own read-ahead too (a RWF_NOWAIT read does), so each
    count is taken on pages set up and confirmed with mincore just before."""
    path = tmp_path / "shard.bin"
    page = os.sysconf("SC_PAGE_SIZE")
    data = np.random.default_rng(1).integers(0, 255, 64 * page, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: posix_fadvise DONTNEED can drop them
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, data.nbytes)  # all cached
        starts = np.array([0, 10 * page + 5, 40 * page], np.int64)
        ends = np.array([3 * page, 20 * page, 41 * page], np.int64)
        assert kernels.probe(fd, starts, ends, advise=False) == 0
        evict_fd(fd, data.nbytes)
        assert kernels.probe(fd, starts, ends, advise=False) == 3
        # Cached: the first and last page of each range but the second range's last (page 19).
        # Read one page at a time with read-ahead off, so that nothing else comes in (a DONTNEED
        # of page 19 alone would not do: the kernel keeps a larger folio holding it whole).
        evict_fd(fd, data.nbytes)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for p in (0, 2, 10, 40):
            os.pread(fd, 1, p * page)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        assert list(np.flatnonzero(resident(fd, data.nbytes))) == [0, 2, 10, 40]
        assert kernels.probe(fd, starts, ends, advise=False) == 1
        evict_fd(fd, data.nbytes)
        assert kernels.probe(fd, starts, ends, advise=True) == 3
        assert _wait_until(lambda: kernels.probe(fd, starts, ends, advise=False) == 0)  # read ahead
        assert kernels.probe(fd, starts[:0], ends[:0], advise=True) == 0
        with pytest.raises(ValueError, match="3 starts but 2 ends"):
            kernels.probe(fd, starts, ends[:2], advise=False)
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # a closed descriptor
        kernels.probe(fd, starts, ends, advise=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # rows of 64 floats (256 bytes): the streaming path applies; 2 layers, CLS + 6 patches
    return make_cache(tmp_path_factory.mktemp("kern"), n_imgs=29, layers=(3, 7), n_patches=6, d=64, imgs_per_shard=8)


def batches(loader):
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("layer, io", [(7, "mmap"), ("all", "mmap"), (7, "read")])
@pytest.mark.parametrize("scale_norm", [False, True])
def test_loaders_give_the_same_batches_with_and_without_the_kernel(native, cache, monkeypatch, layer, io, scale_norm):
    path, md, acts = cache
    monkeypatch.setattr(kernels, "STREAM_MIN_BYTES", 0)  # small test batches take the streaming path
    opts = dict(batch_size=50, layer=layer, scale_norm=scale_norm)

    def both():
        return (
            batches(OrderedLoader(path, **opts)),
            batches(ShuffledLoader(path, buffer_bytes=20_000, run_bytes=3000, seed=3, io=io, **opts)),
        )

    with_kernel = both()
    monkeypatch.setattr(kernels, "_native", None)
    without = both()
    for a, b in zip(with_kernel, without, strict=True):
        assert len(a) == len(b) > 1
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    if not scale_norm:  # and they are the cache's values
        for b in with_kernel[0] + with_kernel[1]:
            li = np.array([md.layers.index(v) for v in b["layer"]])
            np.testing.assert_array_equal(b["act"], acts[b["image_i"], li, b["patch_i"] + 1])


@pytest.mark.parametrize(
    "n, per, j0, lo, hi", [(7, 5, 0, 0, 35), (9, 12, 3, 40, 140), (1, 4, 2, 9, 11), (30, 1, 0, 0, 30)]
)
def test_balanced_order_is_the_same_with_numpy_and_balanced(native, monkeypatch, n, per, j0, lo, hi):
    got = kernels.balanced_order(n, per, j0, lo, hi, np.random.default_rng(8))
    monkeypatch.setattr(kernels, "_native", None)
    want = kernels.balanced_order(n, per, j0, lo, hi, np.random.default_rng(8))
    np.testing.assert_array_equal(got, want)
    # every owned id once
    lo_, hi_ = max(lo, j0 * per), min(hi, (j0 + n) * per)
    assert sorted(got.tolist()) == list(range(lo_, hi_))
    # balanced: round by round, every whole image gives its k-th example before any gives its
    # (k+1)-th (images cut by [lo, hi) just miss some rounds)
    img = got // per
    whole = [m for m in set(img.tolist()) if (img == m).sum() == per]
    keep = np.isin(img, whole)
    rank = np.zeros(len(got), np.int64)
    seen: dict = {}
    for i, m in enumerate(img.tolist()):
        rank[i] = seen.get(m, 0)
        seen[m] = rank[i] + 1
    assert (np.diff(rank[keep]) >= 0).all()
    assert np.bincount(rank[keep]).tolist() == [len(whole)] * per if whole else True


def test_balanced_order_refuses_bad_parameters(native):
    z = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="wrong size"):
        native.balanced_order(3, 3, 0, 0, 9, z, z, z, z[:2], np.empty(9, np.int64))
    with pytest.raises(ValueError, match="out of range"):
        native.balanced_order(3, 3, 0, 0, 9, z, z + 5, z, z, np.empty(9, np.int64))
