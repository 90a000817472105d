"""Loaders never crash on a damaged shard: a LoaderError naming it (loaders/integrity.py,
the C kernel's SIGBUS guard, loaders/faults.py)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from actcache.errors import LoaderError
from actcache.loaders import IndexedDataset, kernels
from actcache.loaders.faults import DAMAGES, LOADERS, damage_shard, run_trials
from actcache.loaders.maps import ShardMaps
from conftest import make_cache


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """6 shards of 4 images of 17 tokens x 256 floats (70 KiB each: many pages to lose)."""
    return make_cache(tmp_path_factory.mktemp("faults"), n_imgs=24, layers=(3,), n_patches=16, d=256, imgs_per_shard=4)


def test_shards_damaged_while_shuffled_and_ordered_loaders_read_them_give_a_loader_error(big_shards, tmp_path):
    """In a child process: each damage during each loader's reading is a one-line LoaderError
    naming the damaged shard; the child never dies (SIGBUS would be rc -7)."""
    path, _, _ = big_shards
    trials = [(kind, damage) for kind in LOADERS for damage in DAMAGES]
    results = run_trials(path, trials, str(tmp_path), timeout_s=300)
    for r in results:
        assert r["rc"] == 0, r
        assert r["outcome"] == "LoaderError", r
        assert r["shard"] in r["message"] and "\n" not in r["message"] and "Traceback" not in r["message"]
    why = {(r["loader"], r["damage"]): r["message"] for r in results}
    assert "truncated" in why["ordered", "truncate"] and "replaced" in why["shuffled", "replace"]
    assert "Permission denied" in why["ordered", "unreadable"]


def test_a_copy_out_of_a_mapping_truncated_under_it_raises_instead_of_sigbus(big_shards, tmp_path):
    """The C kernel's guard: threads copying out of a shard cut after it was mapped and made
    resident each get BusError (the process, here pytest with faulthandler on, lives on), and
    ShardMaps.read_error names the shard and says it was truncated."""
    src, md, _ = big_shards
    name = "acts000002.bin"
    path = str(tmp_path)
    with open(os.path.join(src, name), "rb") as fh, open(os.path.join(path, name), "wb") as out:
        out.write(fh.read())
    size = os.path.getsize(os.path.join(path, name))
    maps = ShardMaps(path, [name], [size], mode="pte")
    try:
        rows_D = maps.view(0, (size // (md.d_vit * 4), md.d_vit))
        maps.make_resident(0, np.array([0]), np.array([size]))
        damage_shard(os.path.join(path, name), "truncate")
        errors = []

        def copy():
            out = np.empty((len(rows_D), md.d_vit), np.float32)
            rows = np.arange(len(rows_D), dtype=np.int64)[::-1].copy()
            try:
                kernels.take_multi([rows_D], np.zeros(len(rows), np.int64), rows, out)
            except OSError as err:
                errors.append(err)

        threads = [threading.Thread(target=copy) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        if not kernels.native_info()["native"]:
            pytest.fail("the C kernel is not built: only it survives a SIGBUS")  # (never reached: numpy dies)
        assert len(errors) == 3 and all(getattr(e, "address", None) for e in errors)
        err = maps.read_error(errors[0])
        assert isinstance(err, LoaderError) and name in str(err) and "truncated" in str(err)
    finally:
        maps.close()


def test_a_widening_copy_out_of_a_truncated_mapping_raises_instead_of_sigbus(big_shards, tmp_path):
    """The same guard around the 16-bit widening copy (gather_widen): the shard's bytes read as
    float16 rows, the file cut under the copy, a BusError with the faulting address."""
    src, md, _ = big_shards
    if not kernels.native_info()["native"]:
        pytest.fail("the C kernel is not built: only it survives a SIGBUS")
    name = "acts000003.bin"
    with open(os.path.join(src, name), "rb") as fh, open(os.path.join(tmp_path, name), "wb") as out:
        out.write(fh.read())
    size = os.path.getsize(os.path.join(tmp_path, name))
    maps = ShardMaps(str(tmp_path), [name], [size], mode="pte")
    try:
        rows_D = maps.view(0, (size // (md.d_vit * 2), md.d_vit), "<f2")
        maps.make_resident(0, np.array([0]), np.array([size]))
        damage_shard(os.path.join(tmp_path, name), "truncate")
        out = np.empty((len(rows_D), md.d_vit), np.float32)
        rows = np.arange(len(rows_D), dtype=np.int64)[::-1].copy()
        with pytest.raises(OSError) as err:
            kernels.take_multi([rows_D], np.zeros(len(rows), np.int64), rows, out)
        assert getattr(err.value, "address", None) and "gather_widen" in str(err.value)
        assert name in str(maps.read_error(err.value))
    finally:
        maps.close()


def test_indexed_dataset_reports_a_truncated_or_replaced_shard(big_shards, tmp_path):
    src, md, acts = big_shards
    import shutil

    path = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, path)
    ds = IndexedDataset(path, layer=3)
    per = len(ds) // md.n_imgs
    np.testing.assert_array_equal(ds[per * 4 + 5]["act"].numpy(), acts[4, 0, 1 + 5])  # shard 1 opened
    damage_shard(os.path.join(path, "acts000001.bin"), "truncate")
    with pytest.raises(LoaderError, match=r"acts000001.bin .*truncated"):
        ds[per * 8 - 1]
    damage_shard(os.path.join(path, "acts000003.bin"), "replace")  # not opened yet: refused on open
    with pytest.raises(LoaderError, match=r"acts000003.bin .*replaced"):
        ds[per * 12]
    np.testing.assert_array_equal(ds[0]["act"].numpy(), acts[0, 0, 1])  # the others read on
    ds.close()


def test_a_shard_cut_between_the_check_and_the_copy_is_a_loader_error_from_the_copy(big_shards, tmp_path):
    """The whole cache fits the shuffle buffer: once every run is read, no reader looks at the
    files again, and the shard cut just before a batch's copy (after its check) is found by the
    copy itself (one gather thread: no other checks it first; the "copy" hook runs after the
    batch's check), as a SIGBUS the C kernel turns into a LoaderError."""
    import shutil

    from actcache.loaders import ShuffledLoader

    src, _, _ = big_shards
    path = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, path)
    ld = ShuffledLoader(path, batch_size=64, layer=3, buffer_bytes=2**22, run_bytes=2**14, n_threads=1)
    cut = []

    def hook(stage, info):
        if stage == "copy" and info["batch"] == 1 and not cut:
            it, deadline = ld._it, time.monotonic() + 20
            while (it.loads or it.unloaded) and time.monotonic() < deadline:  # every run read
                time.sleep(0.01)
            cut.append(ld.cache.shards[info["shards"][0]].name)
            damage_shard(os.path.join(path, cut[0]), "truncate")

    ld.debug_hook = hook
    with pytest.raises(LoaderError) as err:
        for _ in ld:
            pass
    msg = str(err.value)
    assert cut and cut[0] in msg and "truncated" in msg and "BusError" in msg and "gather" in msg, msg
