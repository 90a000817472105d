"""ActivationCache reads agree with a naive in-memory reference; bad caches give clear errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import make_cache, make_metadata

from actcache import ActCacheError, ActivationCache
from actcache.errors import CacheIncompleteError, ConfigError, ProtocolError, VersionError
from actcache.index import ActIndex
from actcache.protocol import Metadata, shard_name

params = st.fixed_dictionaries(
    {
        "n_imgs": st.integers(1, 17),
        "n_layers": st.integers(1, 4),
        "n_patches": st.integers(1, 5),
        "cls": st.booleans(),
        "d": st.integers(1, 4),
        "imgs_per_shard": st.integers(1, 6),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params, st.data())
def test_reads_match_reference(tmp_path_factory, p, data):
    root = tmp_path_factory.mktemp("c")
    layers = tuple(range(-1, -1 - p["n_layers"], -1))  # negative layer values, as the seed records them
    path, md, ref = make_cache(
        root,
        seed=p["n_imgs"],
        layers=layers,
        n_patches=p["n_patches"],
        cls=p["cls"],
        d=p["d"],
        n_imgs=p["n_imgs"],
        imgs_per_shard=p["imgs_per_shard"],
    )
    cache = ActivationCache.open(path)
    n, T = md.n_imgs, md.n_tokens_per_img
    assert cache.shape == ref.shape
    img = data.draw(st.integers(0, n - 1))
    li = data.draw(st.integers(0, len(layers) - 1))
    tok = data.draw(st.integers(0, T - 1))
    np.testing.assert_array_equal(cache[img], ref[img])
    np.testing.assert_array_equal(cache[img, layers[li], tok], ref[img, li, tok])
    np.testing.assert_array_equal(cache[img, layers[li]], ref[img, li])
    np.testing.assert_array_equal(cache[img, "all", tok], ref[img, :, tok])
    # Byte offsets from the spec's coordinate math read the same vector from the raw file.
    loc = md.locate(img, layers[li], tok)
    with open(os.path.join(path, loc.shard), "rb") as fd:
        fd.seek(loc.offset_bytes)
        raw = np.frombuffer(fd.read(md.d_vit * 4), np.float32)
    np.testing.assert_array_equal(raw, ref[img, li, tok])
    # Slices and lists across shard boundaries.
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    np.testing.assert_array_equal(cache[a:b], ref[a:b])
    np.testing.assert_array_equal(cache[::-2], ref[::-2])
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=8))
    np.testing.assert_array_equal(cache[idx], ref[np.asarray(idx, dtype=np.int64)] if idx else ref[:0])
    np.testing.assert_array_equal(
        cache[idx, layers[li], tok], ref[np.asarray(idx, dtype=np.int64), li, tok] if idx else ref[:0, li, tok]
    )
    np.testing.assert_array_equal(cache.select(ActIndex(image="all", layer=layers[li], token=tok)), ref[:, li, tok])


def test_single_reads_are_views_multi_reads_copies(small_cache):
    path, md, ref = small_cache
    cache = ActivationCache.open(path)
    one = cache[0]
    assert not one.flags.writeable
    many = cache[[0, 5]]
    many[:] = 0  # a copy: the cache is untouched
    np.testing.assert_array_equal(cache[5], ref[5])


def test_act_index_json_roundtrip(small_cache):
    path, md, ref = small_cache
    cache = ActivationCache.open(path)
    for ix in [ActIndex(), ActIndex(image=3, layer=7, token=0), ActIndex(image="all", layer=3, token=2, dim=5)]:
        back = ActIndex.from_json(ix.to_json())
        assert back == ix and hash(back) == hash(ix)
    got = cache.select(ActIndex(image=3, layer=7, token="all"))
    np.testing.assert_array_equal(got, ref[3, 1])
    assert got.ndim == ActIndex(image=3, layer=7, token="all").ndim
    np.testing.assert_array_equal(cache[ActIndex(image="all", layer=3, token=2, dim=5)], ref[:, 0, 2, 5])
    with pytest.raises(ConfigError, match="layer"):
        ActIndex(layer="last")
    with pytest.raises(ConfigError, match="unknown key"):
        ActIndex.from_dict({"img": 3})
    with pytest.raises(ConfigError, match="image"):
        ActIndex(image=-1)


def test_labels_and_class_selection(tmp_path):
    labels = np.array([0, 1, 0, 2, 1, 0, 2, 2, 1, 0])
    path, md, ref = make_cache(tmp_path, labels=labels, class_names=["cat", "dog", "owl"])
    cache = ActivationCache.open(path)
    assert cache.class_names == ["cat", "dog", "owl"]
    np.testing.assert_array_equal(cache.labels, labels)
    got = cache[{"cat": 3}]
    assert got.shape == (3,) + ref.shape[1:]
    chosen = cache.images_by_class({"cat": 3})
    assert set(chosen) <= {0, 2, 5, 9} and len(set(chosen)) == 3
    np.testing.assert_array_equal(got, ref[chosen])
    np.testing.assert_array_equal(cache[{"owl": [0, 2], "dog": [1]}], ref[[3, 7, 4]])
    sup = cache.query({"dog": 2}, form="supervised")
    assert set(sup) == {"act", "label", "image_i"} and (sup["label"] == 1).all()
    uns = cache.query(slice(0, 4), form="unsupervised")
    np.testing.assert_array_equal(uns["target"], ref[:4])
    with pytest.raises(ConfigError, match="unknown class 'fox'"):
        cache[{"fox": 1}]
    with pytest.raises(ConfigError, match="has 3 images; cannot draw 5"):
        cache[{"owl": 5}]
    with pytest.raises(ConfigError, match="unknown query form"):
        cache.query(0, form="weird")
    # Labels and checksums are extra files: the hash and the v1 files are unchanged.
    assert sorted(os.listdir(path)) == sorted(
        ["metadata.json", "shards.json", "labels.json", "labels.npy", ".checksums"] + [shard_name(i) for i in range(3)]
    )


def test_no_labels_is_a_clear_error(small_cache):
    cache = ActivationCache.open(small_cache[0])
    assert cache.labels is None
    with pytest.raises(ConfigError, match="no labels"):
        cache[{"cat": 1}]


def test_index_errors(small_cache):
    path, md, ref = small_cache
    cache = ActivationCache.open(path)
    with pytest.raises(IndexError, match="out of range"):
        cache[md.n_imgs]
    with pytest.raises(IndexError, match="out of range"):
        cache[[0, 99]]
    with pytest.raises(ProtocolError, match=r"layer 5 is not recorded.*\[3, 7\]"):
        cache[0, 5]
    with pytest.raises(KeyError):  # also a KeyError, for code that expects one
        cache[0, 5]
    with pytest.raises(IndexError, match="token index"):
        cache[0, 3, 99]


# ---- caches written by the seed's own writer -------------------------------------------------


def write_seed_style(root, md: Metadata, acts: np.ndarray, trailing_zero: bool):
    """Mimic the seed writer: every shard memmapped at full size (zero padding), and on an exact
    multiple an extra all-zero shard listed with n_imgs 0."""
    path = os.path.join(root, md.hash)
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as fd:
        json.dump(md.to_dict(), fd, indent=4)
    S = md.n_imgs_per_shard
    entries = []
    n_files = md.n_shards + (1 if trailing_zero else 0)
    for i in range(n_files):
        mm = np.memmap(os.path.join(path, shard_name(i)), np.float32, "w+", shape=md.shard_shape)
        chunk = acts[i * S : (i + 1) * S]
        mm[: len(chunk)] = chunk
        mm.flush()
        del mm
        entries.append({"name": shard_name(i), "n_imgs": len(chunk)})
    with open(os.path.join(path, "shards.json"), "w") as fd:
        json.dump(entries, fd)
    return path


def test_seed_padded_last_shard(tmp_path):
    md = make_metadata(n_imgs=10, imgs_per_shard=4)
    acts = np.random.default_rng(1).standard_normal((10, 2, 5, 8), dtype=np.float32)
    path = write_seed_style(tmp_path, md, acts, trailing_zero=False)
    cache = ActivationCache.open(path)
    np.testing.assert_array_equal(cache[0:10], acts)
    assert cache.report.shards[-1].padded


def test_seed_trailing_zero_shard_warns(tmp_path):
    md = make_metadata(n_imgs=12, imgs_per_shard=4)
    acts = np.random.default_rng(2).standard_normal((12, 2, 5, 8), dtype=np.float32)
    path = write_seed_style(tmp_path, md, acts, trailing_zero=True)
    with pytest.warns(UserWarning, match="n_imgs 0"):
        cache = ActivationCache.open(path)
    np.testing.assert_array_equal(cache[:], acts)
    assert len(cache.shards) == 3


def test_our_caches_open_in_a_seed_style_reader(small_cache):
    """The seed's readers memmap every shard at full shape (n_imgs_per_shard, L, T, D)."""
    path, md, ref = small_cache
    for i in range(md.n_shards):
        mm = np.memmap(os.path.join(path, shard_name(i)), np.float32, "r", shape=md.shard_shape)
        s, e = md.shard_img_range(i)
        np.testing.assert_array_equal(mm[: e - s], ref[s:e])
        assert not mm[e - s :].any()  # zero tail


# ---- bad caches ------------------------------------------------------------------------------


def _err(path, cls=ProtocolError) -> str:
    with pytest.raises(cls) as info:
        ActivationCache.open(path)
    assert isinstance(info.value, ActCacheError)
    return str(info.value)


def test_missing_dir_and_files(tmp_path, small_cache):
    assert "directory not found" in _err(tmp_path / "nope")
    path = small_cache[0]
    os.unlink(os.path.join(path, shard_name(1)))
    msg = _err(path)
    assert shard_name(1) in msg and "missing" in msg and "re-run the dump" in msg.lower()


def test_missing_shards_json_is_incomplete(small_cache):
    path = small_cache[0]
    os.unlink(os.path.join(path, "shards.json"))
    msg = _err(path, CacheIncompleteError)
    assert "shards.json" in msg and "actcache gather" in msg


def test_missing_metadata(small_cache):
    path = small_cache[0]
    os.unlink(os.path.join(path, "metadata.json"))
    assert "metadata.json: file not found" in _err(path)


def test_truncated_shard(small_cache):
    path, md, _ = small_cache
    fpath = os.path.join(path, shard_name(0))
    with open(fpath, "r+b") as fd:
        fd.truncate(md.shard_nbytes - 4)
    msg = _err(path)
    assert shard_name(0) in msg and "truncated" in msg


def test_last_shard_other_size(small_cache):
    path, md, _ = small_cache
    fpath = os.path.join(path, shard_name(md.n_shards - 1))
    with open(fpath, "r+b") as fd:
        fd.truncate(md.shard_nbytes + md.bytes_per_img)
    assert "too large" in _err(path)


def test_non_json(small_cache):
    path = small_cache[0]
    with open(os.path.join(path, "shards.json"), "w") as fd:
        fd.write("[{'name': oops")
    msg = _err(path)
    assert "shards.json: not valid JSON" in msg and "line 1" in msg
    with open(os.path.join(path, "metadata.json"), "wb") as fd:
        fd.write(b"\xff\xfe")
    assert "metadata.json: not UTF-8" in _err(path)


def test_unknown_major_version(small_cache):
    path, md, _ = small_cache
    doc = dict(md.to_dict(), protocol="2.0.0")
    with open(os.path.join(path, "metadata.json"), "w") as fd:
        json.dump(doc, fd)
    msg = _err(path, VersionError)
    assert "2.0.0" in msg and "1.0.0" in msg


def test_config_drift(small_cache):
    path, md, _ = small_cache
    doc = dict(md.to_dict(), vit_ckpt="something/else")
    with open(os.path.join(path, "metadata.json"), "w") as fd:
        json.dump(doc, fd)
    msg = _err(path)
    assert "config drift" in msg and Metadata.from_dict(doc).hash in msg


def test_shard_table_errors(small_cache, tmp_path):
    path, md, _ = small_cache
    table_path = os.path.join(path, "shards.json")
    good = json.load(open(table_path))

    def with_table(t):
        with open(table_path, "w") as fd:
            json.dump(t, fd)
        return _err(path)

    assert "add up to" in with_table([dict(good[0]), dict(good[1]), dict(good[2], n_imgs=1)])
    bad = [dict(good[0], n_imgs=3), dict(good[1], n_imgs=5), good[2]]
    assert "every shard but the last" in with_table(bad)
    assert "entry 1 is named" in with_table([good[0], dict(good[1], name="acts000009.bin"), good[2]])
    assert "entry 0 must be an object" in with_table([1, 2])
    assert "expected a JSON array" in with_table({"shards": good})


def test_renamed_dir_without_hash_name_warns(small_cache, tmp_path):
    path = small_cache[0]
    other = tmp_path / "my-experiment"
    shutil.copytree(path, other)
    with pytest.warns(UserWarning, match="not a content hash"):
        ActivationCache.open(other)
