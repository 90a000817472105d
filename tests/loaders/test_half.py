"""16-bit caches (protocol 2.0) through the copy kernel and every loader: float32 batches equal to
the exact widening of the stored values, with the C kernel and with numpy; out_dtype="stored"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actcache.dtypes import to_float32, to_stored
from actcache.errors import ConfigError
from actcache.loaders import IndexedDataset, OrderedLoader, ShuffledLoader, kernels
from conftest import make_cache

HALVES = ("float16", "bfloat16")
SMALL = dict(buffer_bytes=3000, run_bytes=350)


@pytest.fixture(scope="module", params=HALVES)
def half(request, tmp_path_factory):
    """A 16-bit cache (D=12: a row is one 8-value vector step plus a scalar tail) and its float32 values."""
    dt = request.param
    path, md, acts = make_cache(
        tmp_path_factory.mktemp(dt), n_imgs=17, layers=(3, 7), n_patches=6, d=12, imgs_per_shard=5, dtype=dt
    )
    return path, md, to_float32(to_stored(acts, dt), dt)


@pytest.fixture(params=["native", "numpy"])
def kernel(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "_native", None)
    elif kernels._native is None:
        raise AssertionError("the C kernel is not built: run `python setup.py build_ext --inplace`")
    return request.param


@pytest.mark.parametrize("dtype", HALVES)
def test_widening_kernel_equals_numpy_for_all_65536_bit_patterns(dtype):
    assert kernels._native is not None, "the C kernel is not built"
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    src = bits.view("<f2" if dtype == "float16" else "<u2")
    want = to_float32(src, dtype)
    # vector steps only (streaming stores too: 64-byte aligned output rows); a scalar tail
    for width, stream in ((64, False), (64, True), (13, False)):
        n = len(src) // width
        rows = src[: n * width].reshape(n, width)
        raw = np.empty(n * width + 16, np.float32)
        skip = (-raw.ctypes.data % 64) // 4
        out = raw[skip : skip + n * width].reshape(n, width)  # 64-byte aligned: streaming stores apply
        kernels.take_multi([rows], np.zeros(n, np.int64), np.arange(n, dtype=np.int64), out, stream=stream)
        assert out.view(np.uint32).tobytes() == want[: n * width].view(np.uint32).tobytes()
    finite = np.isfinite(want)
    ref = torch.from_numpy(bits.view(np.int16)).view(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(want[finite], ref[finite]) and np.array_equal(np.isnan(want), np.isnan(ref))


@pytest.mark.parametrize("dtype", HALVES)
def test_scaled_widening_is_the_same_bytes_in_c_and_numpy(dtype, monkeypatch):
    rng = np.random.default_rng(1)
    src = to_stored(rng.standard_normal((40, 21), dtype=np.float32) * 50, dtype)
    scales = rng.uniform(0.1, 3, 40).astype(np.float32)
    got = {}
    for name in ("native", "numpy"):
        if name == "numpy":
            monkeypatch.setattr(kernels, "_native", None)
        out = np.empty((40, 21), np.float32)
        kernels.widen_rows(src, out, scales=scales)
        got[name] = out.tobytes()
    assert got["native"] == got["numpy"]
    assert got["numpy"] == (to_float32(src, dtype) * scales[:, None]).tobytes()


@pytest.mark.parametrize("io", ["read", "mmap"])
def test_ordered_loader_gives_the_exact_float32_values(half, kernel, io):
    path, md, want = half
    ld = OrderedLoader(path, batch_size=11, patches="all", layer="all", io=io)
    got = np.concatenate([b["act"].numpy() for b in ld])
    assert got.dtype == np.float32
    assert np.array_equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("io", ["read", "mmap"])
def test_shuffled_loader_gives_the_exact_float32_values(half, kernel, io):
    path, md, want = half
    seen = 0
    for b in ShuffledLoader(path, batch_size=13, patches="all", layer="all", io=io, seed=2, **SMALL):
        li = np.searchsorted(md.layers, b["layer"].numpy())
        assert b["act"].dtype == torch.float32
        assert np.array_equal(b["act"].numpy(), want[b["image_i"].numpy(), li, b["patch_i"].numpy() + 1])
        seen += len(b["act"])
    assert seen == want.shape[0] * want.shape[1] * want.shape[2]


def test_scale_norm_on_a_16_bit_cache_equals_scaling_the_widened_values(half, kernel):
    path, md, want = half
    fp = OrderedLoader(path, batch_size=50, patches="image", layer=7, io="read", scale_norm=True)
    got = np.concatenate([b["act"].numpy() for b in fp])
    assert np.array_equal(got, want[:, 1, 1:].reshape(-1, md.d_vit) * np.float32(fp.scale[0]))
    mm = OrderedLoader(path, batch_size=50, patches="image", layer=7, io="mmap", scale_norm=True)
    assert np.array_equal(np.concatenate([b["act"].numpy() for b in mm]), got)
    both = {}  # every layer: a factor per row's layer
    for io in ("read", "mmap"):
        ld = OrderedLoader(path, batch_size=23, patches="all", layer="all", io=io, scale_norm=True)
        both[io] = np.concatenate([b["act"].numpy() for b in ld])
    scales = np.asarray(ld.scale, np.float32)[None, :, None, None]
    assert np.array_equal(both["read"], both["mmap"])
    assert np.array_equal(both["read"].reshape(want.shape), want * scales)


def test_out_dtype_stored_hands_over_the_16_bit_values(half):
    path, md, want = half
    tdt = getattr(torch, md.dtype)
    b = next(iter(OrderedLoader(path, batch_size=7, patches="all", layer=3, out_dtype="stored")))
    assert b["act"].dtype == tdt and np.array_equal(b["act"].float().numpy(), want[0, 0, :7])
    for io in ("read", "mmap"):
        ld = ShuffledLoader(path, batch_size=9, patches="all", layer=3, seed=1, io=io, out_dtype="stored", **SMALL)
        b = next(iter(ld))
        assert b["act"].dtype == tdt
        assert np.array_equal(b["act"].float().numpy(), want[b["image_i"].numpy(), 0, b["patch_i"].numpy() + 1])
    item = IndexedDataset(path, "all", 7, out_dtype="stored")[5]
    assert item["act"].dtype == tdt and np.array_equal(item["act"].float().numpy(), want[0, 1, 5])
    assert IndexedDataset(path, "all", 7)[5]["act"].dtype == torch.float32
    with pytest.raises(ConfigError, match="scale_norm=True.*out_dtype='stored'"):
        OrderedLoader(path, out_dtype="stored", scale_norm=True)
    with pytest.raises(ConfigError, match="out_dtype='half'"):
        ShuffledLoader(path, out_dtype="half")
