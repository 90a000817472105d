"""No silent wrong answers from a shard changed under a reader (actcache/shardguard.py): a rewrite
in place (the change time moves), a rename over it, a cut, or a flipped bit on a sealed cache
read with verify_reads="first" is a one-line error naming the shard, in every reader; seal and
verify --deep never record a read of a shard that changed under them."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

from actcache import checksums, deepscan
from actcache.cache import ActivationCache
from actcache.errors import LoaderError
from actcache.loaders import OrderedLoader
from actcache.loaders.faults import READERS, damage_shard, run_trials
from actcache.seal import seal
from actcache.shardguard import ShardChangedError
from actcache.validate import check_dir
from conftest import make_cache


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """6 shards of 4 images of 17 tokens x 256 floats, with checksum records (the dump writes them)."""
    path, md, acts = make_cache(
        tmp_path_factory.mktemp("guard"), n_imgs=24, layers=(3,), n_patches=16, d=256, imgs_per_shard=4
    )
    assert all(checksums.read_record(checksums.record_dir(path), s).blocks for s in _names(path))
    return path, md, acts


def _names(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("acts"))


def _copy(src: str, dst) -> str:
    path = os.path.join(str(dst), os.path.basename(src))
    shutil.copytree(src, path)
    return path


def test_rewrites_in_place_and_flipped_bits_under_every_reader_are_one_line_errors_never_wrong_rows(sealed, tmp_path):
    """A bit flipped before the reader opens the cache (only the checksum tells), a shard copied
    over by another or cut and re-extended while it is read (the change time tells): under both
    loaders, ActivationCache and IndexedDataset, a LoaderError naming the shard, in one line."""
    path, _, _ = sealed
    trials = [(kind, damage, when) for kind in READERS for damage, when in
              (("flip", "before"), ("rewrite", "during"), ("regrow", "before"))]  # fmt: skip
    results = run_trials(path, trials, str(tmp_path), timeout_s=300, verify_reads="first", seed=7)
    for r in results:
        assert r["rc"] == 0 and r["outcome"] == "LoaderError", r
        assert r["shard"] in r["message"] and "\n" not in r["message"] and "Traceback" not in r["message"]
    why = {(r["loader"], r["damage"]): r["message"] for r in results}
    assert "checksum" in why["ordered", "flip"] and "written to after it was opened" in why["shuffled", "rewrite"]


def test_activation_cache_reads_a_shard_replaced_cut_or_rewritten_as_an_error_not_values(sealed, tmp_path):
    path = _copy(sealed[0], tmp_path)
    acts = sealed[2]
    cache = ActivationCache.open(path)
    assert np.array_equal(cache[5], acts[5]) and not cache[5].flags.writeable
    damage_shard(os.path.join(path, "acts000002.bin"), "replace")
    with pytest.raises(ShardChangedError, match=r"acts000002\.bin .* was replaced"):
        cache[9]
    damage_shard(os.path.join(path, "acts000001.bin"), "truncate")
    with pytest.raises(ShardChangedError, match=r"acts000001\.bin .*truncated"):
        cache[4:6, 3]
    assert np.array_equal(cache[[0, 23, 1]], acts[[0, 23, 1]])  # untouched shards still read
    damage_shard(os.path.join(path, "acts000005.bin"), "rewrite", seed=1)  # same size, same inode
    with pytest.raises(ShardChangedError, match=r"acts000005\.bin .*written to"):
        cache[[22]]


def test_without_verify_reads_a_flip_before_opening_is_read_but_with_it_is_refused(sealed, tmp_path):
    path = _copy(sealed[0], tmp_path)
    md = sealed[1]
    damage_shard(os.path.join(path, "acts000003.bin"), "flip", 4 * md.bytes_per_img, seed=3)
    assert not np.array_equal(ActivationCache.open(path, verify_reads="off")[12:16], sealed[2][12:16])
    with pytest.raises(ShardChangedError, match=r"acts000003\.bin.*do not match their checksum record"):
        ActivationCache.open(path, verify_reads="first")[13]
    with pytest.raises(LoaderError, match=r"acts000003\.bin.*checksum"):
        list(OrderedLoader(path, batch_size=64, layer="all", verify_reads="first"))


def test_an_older_record_without_block_digests_still_catches_a_flip_and_seal_adds_them(sealed, tmp_path):
    path = _copy(sealed[0], tmp_path)
    directory = checksums.record_dir(path)
    for name in _names(path):  # records as written before they listed blocks
        rec = checksums.read_record(directory, name)
        with open(checksums.record_path(directory, name), "w") as fh:
            json.dump({k: v for k, v in rec.to_dict().items() if k != "blocks"}, fh)
    rep, new = seal(path)
    assert rep.ok and new == _names(path)
    assert all(checksums.read_record(directory, n).blocks for n in new)
    rec = checksums.read_record(directory, "acts000000.bin")
    with open(checksums.record_path(directory, "acts000000.bin"), "w") as fh:
        json.dump({k: v for k, v in rec.to_dict().items() if k != "blocks"}, fh)
    damage_shard(os.path.join(path, "acts000000.bin"), "flip", 1000, seed=2)
    with pytest.raises(ShardChangedError, match=r"acts000000\.bin in .*: bytes 0-69,632 do not match"):
        ActivationCache.open(path, verify_reads="first")[3]


def test_a_block_list_that_does_not_combine_into_the_digest_is_not_a_record(sealed, tmp_path):
    path = _copy(sealed[0], tmp_path)
    directory = checksums.record_dir(path)
    doc = checksums.read_record(directory, "acts000001.bin").to_dict()
    doc["blocks"] = "0" * len(doc["blocks"])
    with open(checksums.record_path(directory, "acts000001.bin"), "w") as fh:
        json.dump(doc, fh)
    with pytest.raises(Exception, match=r"not a checksum record"):
        checksums.read_record(directory, "acts000001.bin")


@pytest.mark.parametrize("how", ["shrink", "rewrite"])
def test_seal_and_deep_verify_record_nothing_for_a_shard_that_changed_during_the_scan(
    sealed, tmp_path, monkeypatch, how
):
    """The shard is cut (or rewritten in place, same size) just after the scan read its first
    piece: a problem naming it, and no record written."""
    path = _copy(sealed[0], tmp_path)
    shutil.rmtree(checksums.record_dir(path))
    victim = os.path.join(path, "acts000004.bin")
    read = deepscan._read_exactly
    done = []

    def read_then_damage(fd, view, at, fpath, size):
        read(fd, view, at, fpath, size)
        if fpath == victim and not done:
            done.append(1)
            damage_shard(victim, "truncate" if how == "shrink" else "rewrite", seed=4)

    monkeypatch.setattr(deepscan, "_read_exactly", read_then_damage)
    rep, new = seal(path)
    assert not rep.ok and new == [] and not os.path.isdir(checksums.record_dir(path))
    assert any("acts000004.bin" in p and "changed while it was read" in p for p in rep.problems), rep.problems
    done.clear()
    shutil.copyfile(os.path.join(path, "acts000000.bin"), victim)  # whole again (a duplicate: a problem of its own)
    rep = check_dir(path, deep=True)
    assert any("acts000004.bin" in p and "changed while it was read" in p for p in rep.problems), rep.problems


def test_train_says_once_in_one_line_that_reads_are_unverified_and_how_to_seal(sealed, tmp_path, caplog):
    from actcache.sae import train

    path = _copy(sealed[0], tmp_path)
    shutil.rmtree(checksums.record_dir(path))
    loader = OrderedLoader(path, batch_size=64, layer="all")
    with caplog.at_level(logging.WARNING, logger=train.log.name):
        train._say_read_checks(loader, "off")
        train._say_read_checks(loader, "off")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in ln for ln in lines), lines
    assert "unverified (verify_reads: off)" in lines[0] and f"`actcache seal {path}`" in lines[1]


def test_convert_of_a_source_cut_mid_run_is_one_line_naming_the_shard(sealed, tmp_path, monkeypatch):
    from actcache import convert as conv

    path = _copy(sealed[0], tmp_path / "src")
    opened = ActivationCache.open

    def open_then_cut(*args, **kw):  # the source shard is cut after convert opened the cache
        cache = opened(*args, **kw)
        damage_shard(os.path.join(path, "acts000003.bin"), "truncate")
        return cache

    monkeypatch.setattr(conv.ActivationCache, "open", open_then_cut)
    with pytest.raises(ShardChangedError) as err:
        conv.convert(path, "float16", tmp_path / "out")
    assert "acts000003.bin" in str(err.value) and "truncated" in str(err.value) and "\n" not in str(err.value)


def test_a_cache_dropped_without_close_keeps_no_shard_open(sealed):
    import gc

    path = sealed[0]
    gc.collect()  # (what earlier tests dropped, closed before counting)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        cache = ActivationCache.open(path)
        cache[0], cache[cache.n_imgs - 1]
        del cache
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
