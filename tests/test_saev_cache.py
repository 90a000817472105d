"""saev 2.1 caches, written by the test from the format facts, read with v1's guarantees and
never written into; their pickled ``data`` field is never unpickled."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

from actcache.cache import ActivationCache
from actcache.errors import ProtocolError
from actcache.formats import load_metadata
from actcache.loaders import IndexedDataset, OrderedLoader, ShuffledLoader
from actcache.saev import SaevMetadata
from actcache.validate import check_dir
from actcache.writer import gather
from saev_fixture import tree_state, write_saev_cache

LAYOUTS = {
    "ragged": dict(n=7, E=3),
    "exact-multiple": dict(n=8, E=4),
    "no-cls": dict(n=7, E=3, cls=False),
    "three-layers": dict(n=10, E=4, layers=(-2, 3, 11), P=3),
    "one-layer-labels": dict(n=5, E=2, layers=(6,), labels=True),
}


@pytest.fixture(params=list(LAYOUTS))
def saev(request, tmp_path):
    return write_saev_cache(tmp_path, **LAYOUTS[request.param])


def test_read_value_for_value(saev):
    path, doc, acts = saev
    cache = ActivationCache.open(path)
    md = cache.metadata
    assert isinstance(md, SaevMetadata) and md.hash == os.path.basename(path)
    assert (md.n_imgs, list(md.layers), md.d_vit) == (doc["n_examples"], doc["layers"], doc["d_model"])
    assert cache.shape == acts.shape
    np.testing.assert_array_equal(cache[0 : len(acts)], acts)
    for i in range(len(acts)):
        np.testing.assert_array_equal(cache[i], acts[i])
    last, layer = len(acts) - 1, doc["layers"][-1]
    np.testing.assert_array_equal(cache[last, layer, 0], acts[last, -1, 0])


def test_exact_multiple_lists_an_empty_trailing_shard_that_is_ignored(tmp_path):
    path, _, acts = write_saev_cache(tmp_path, n=8, E=4)
    assert [s["n_examples"] for s in json.load(open(os.path.join(path, "shards.json")))] == [4, 4, 0]
    cache = ActivationCache.open(path)
    assert [s.n_imgs for s in cache.shards] == [4, 4]
    assert check_dir(path).warnings == []


def _keys(batches, cls):
    return sorted(
        (int(i), int(la), int(p))
        for b in batches
        for i, la, p in zip(b["image_i"], b["layer"], b["patch_i"], strict=True)
    )


def _check_values(batches, doc, acts):
    for b in batches:
        li = np.array([doc["layers"].index(int(v)) for v in b["layer"]])
        np.testing.assert_array_equal(
            b["act"].numpy(), acts[b["image_i"].numpy(), li, b["patch_i"].numpy() + int(doc["cls_token"])]
        )


def test_every_example_exactly_once_by_each_loader(saev):
    path, doc, acts = saev
    n, L, T, _ = acts.shape
    P = doc["content_tokens_per_example"]
    want = sorted((i, la, p) for i in range(n) for la in doc["layers"] for p in range(P))
    ds = IndexedDataset(path, patches="image", layer="all")
    items = [ds[i] for i in range(len(ds))]
    assert sorted((it["image_i"], it["layer"], it["patch_i"]) for it in items) == want
    for it in items[:: max(1, len(items) // 17)]:
        li = doc["layers"].index(it["layer"])
        np.testing.assert_array_equal(it["act"].numpy(), acts[it["image_i"], li, it["patch_i"] + int(doc["cls_token"])])
    for loader in (
        OrderedLoader(path, batch_size=7, patches="image", layer="all"),
        ShuffledLoader(path, batch_size=7, patches="image", layer="all", seed=1, buffer_bytes=4000, run_bytes=500),
    ):
        batches = list(loader)
        assert _keys(batches, doc["cls_token"]) == want
        _check_values(batches, doc, acts)


def test_verify_deep_accepts_and_reads_every_byte(saev):
    path, _, _ = saev
    rep = check_dir(path, deep=True)
    assert rep.ok, rep.problems
    assert rep.n_nonfinite == 0
    assert rep.bytes_read == sum(os.path.getsize(os.path.join(path, s.name)) for s in rep.shards)


def test_cli_inspect_and_verify_deep_accept_a_saev_cache(tmp_path):
    path, doc, _ = write_saev_cache(tmp_path, n=8, E=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for args in (["verify", "--deep", path], ["inspect", path]):
        proc = subprocess.run([sys.executable, "-m", "actcache.cli", *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert os.path.basename(path) in proc.stdout


def test_truncated_shard_is_rejected(tmp_path):
    path, _, _ = write_saev_cache(tmp_path, n=7, E=3)
    with open(os.path.join(path, "acts000002.bin"), "r+b") as fd:
        fd.truncate(40)
    with pytest.raises(ProtocolError, match=r"acts000002\.bin.*truncated"):
        ActivationCache.open(path)


def test_shard_counts_that_do_not_add_up_to_n_examples_are_rejected(tmp_path):
    path, _, _ = write_saev_cache(tmp_path, n=7, E=3)
    sh = os.path.join(path, "shards.json")
    table = json.load(open(sh))
    table[-1]["n_examples"] = 0  # an interrupted write: the last shard never got listed
    open(sh, "w").write(json.dumps(table, indent=2))
    with pytest.raises(ProtocolError, match="n_examples add up to 6.*n_examples=7"):
        ActivationCache.open(path)


def test_verify_reports_a_directory_name_that_does_not_match_the_metadata(tmp_path):
    path, doc, _ = write_saev_cache(tmp_path)
    moved = os.path.join(os.path.dirname(path), "0badc0de")
    shutil.move(path, moved)
    rep = check_dir(moved)
    assert any("0badc0de" in p and doc_hash in p for p in rep.problems for doc_hash in [os.path.basename(path)])


def test_directory_hash_follows_field_order_and_raw_utf8(tmp_path):
    path, doc, _ = write_saev_cache(tmp_path, ckpt="hf-hub:ünïcode/vit")
    assert load_metadata(path).hash == os.path.basename(path)
    assert check_dir(path).ok


def test_a_metadata_of_neither_format_names_what_it_found(tmp_path):
    path, _, _ = write_saev_cache(tmp_path)
    open(os.path.join(path, "metadata.json"), "w").write(json.dumps({"model": "x", "protocol": "3.0"}))
    rep = check_dir(path)
    assert len(rep.problems) == 1
    assert "neither a protocol-v1" in rep.problems[0] and "model, protocol" in rep.problems[0]
    assert "'3.0'" in rep.problems[0]


def test_an_unknown_saev_protocol_or_extra_key_is_rejected(tmp_path):
    path, doc, _ = write_saev_cache(tmp_path)
    md_path = os.path.join(path, "metadata.json")
    open(md_path, "w").write(json.dumps({**doc, "protocol": "3.0"}))
    assert "'protocol'" in check_dir(path, check_hash=False).problems[0]
    open(md_path, "w").write(json.dumps({**doc, "extra": 1}))
    assert "unknown: extra" in check_dir(path, check_hash=False).problems[0]


def test_labels_bin_of_the_wrong_size_is_rejected(tmp_path):
    path, _, _ = write_saev_cache(tmp_path, labels=True)
    with open(os.path.join(path, "labels.bin"), "ab") as fd:
        fd.write(b"\0")
    assert any("labels.bin" in p for p in check_dir(path).problems)


class _RunsCode:
    """Unpickling this creates a marker file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_data_is_never_loaded_and_nothing_is_written(tmp_path):
    marker = str(tmp_path / "unpickled")
    evil = base64.b64encode(pickle.dumps(_RunsCode(marker))).decode()
    path, _, acts = write_saev_cache(tmp_path / "c", n=9, E=4, data=evil)
    before = tree_state(tmp_path / "c")
    cache = ActivationCache.open(path)
    assert cache.metadata.data == evil
    np.testing.assert_array_equal(cache[3], acts[3])
    assert check_dir(path, deep=True).ok
    for ld in (OrderedLoader(path, batch_size=16, layer=7, scale_norm=True),
               ShuffledLoader(path, batch_size=16, layer=3, scale_norm=True, seed=0)):  # fmt: skip
        assert sum(len(b["act"]) for b in ld) == 9 * 4
    with pytest.raises(ProtocolError, match="saev cache"):
        gather(path)
    assert not os.path.exists(marker)
    assert tree_state(tmp_path / "c") == before
    pickle.loads(base64.b64decode(evil)).close()  # the string is live: loading it would have run code
    assert os.path.exists(marker)
