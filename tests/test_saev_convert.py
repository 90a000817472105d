"""`actcache convert --to-format saev` writes caches that a reader written from saev 2.1's format
accepts value for value, and a saev cache converts to protocol v1 (float32 or 16-bit) and back to
the very same saev directory; the ``data`` pickle is written without saev and never loaded."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pathlib
import pickle
import sys
import types

import numpy as np
import pytest

from actcache.cache import ActivationCache
from actcache.cli import main as actcache_main
from actcache.dtypes import to_float32, to_stored
from actcache.protocol import Metadata
from actcache.saev_pickle import describe_pickle
from actcache.writer import synthetic_fill, synthetic_metadata, write_cache_from_array
from saev_fixture import read_saev_cache, tree_state, write_saev_cache


def v1_cache(root, n=7, E=3, layers=(-2, 5), P=4, D=6, dtype="float32", data=None):
    md = synthetic_metadata(n, layers=layers, n_patches_per_img=P, d_vit=D, max_patches_per_shard=E * (P + 1) * 2,
                            dtype=dtype)  # fmt: skip
    if data is not None:
        md = dataclasses.replace(md, data=data)
    acts = synthetic_fill(md)(0, n)
    return write_cache_from_array(root, md, acts), acts


def error_lines(err: str) -> list[str]:
    """stderr's lines, without the ResourceWarnings a collected file object of another test prints."""
    return [ln for ln in err.strip().splitlines() if not ln.startswith("warning: unclosed file")]


def files(path) -> dict:
    return {name: pathlib.Path(path, name).read_bytes() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize(("n", "E"), [(7, 3), (8, 4)], ids=["ragged", "exact-multiple"])
def test_converted_cache_reads_value_for_value_in_a_saev_reader(tmp_path, capsys, n, E):
    src, acts = v1_cache(tmp_path / "v1", n=n, E=E, data={"__class__": "ImageFolder", "root": "/data/imgs"})
    assert actcache_main(["convert", src, "--to-format", "saev", "--to", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    dest = out[0]
    assert dest.startswith(str(tmp_path / "out" / "saev" / "shards") + os.sep)
    assert any("open_clip" in line for line in out[1:])  # the clip family difference is said
    doc, got = read_saev_cache(dest)
    np.testing.assert_array_equal(got, acts)
    assert (doc["family"], doc["layers"], doc["cls_token"], doc["dataset"]) == ("clip", [-2, 5], True, "/data/imgs")
    shown = describe_pickle(base64.b64decode(doc["data"]))
    assert shown == {"class": "saev.data.datasets.ImgFolder", "fields": {"root": "/data/imgs"}}
    np.testing.assert_array_equal(ActivationCache.open(dest)[0:n], acts)  # and actcache reads it back
    readers = {}
    for path in (src, dest):
        assert actcache_main(["inspect", "--json", path]) == 0
        readers[path] = json.loads(capsys.readouterr().out)["format"]["readers"]
    assert "not saev's current release" in readers[src] and "--to-format saev" in readers[src]
    assert readers[dest].startswith("saev's current release")


def test_data_unpickles_to_saevs_own_dataset_class(tmp_path, monkeypatch):
    """saev's tools unpickle ``data`` into saev.data.datasets.ImgFolder(root: Path): a stand-in module
    of that name (only in this test) receives exactly that."""

    @dataclasses.dataclass(frozen=True)
    class ImgFolder:
        root: pathlib.Path

    module = types.ModuleType("saev.data.datasets")
    ImgFolder.__module__, module.ImgFolder = module.__name__, ImgFolder
    for name in ("saev", "saev.data", "saev.data.datasets"):
        monkeypatch.setitem(sys.modules, name, module if name.endswith("datasets") else types.ModuleType(name))
    src, _ = v1_cache(tmp_path / "v1", data={"__class__": "ImageFolder", "root": "/data/ïmgs"})
    from actcache.saev_convert import to_saev

    dest, _ = to_saev(src, tmp_path / "out")
    doc, _ = read_saev_cache(dest)
    assert pickle.loads(base64.b64decode(doc["data"])) == ImgFolder(pathlib.Path("/data/ïmgs"))


def test_16_bit_cache_converts_to_saev_float32_exactly(tmp_path, capsys):
    src, acts = v1_cache(tmp_path / "v1", dtype="bfloat16")
    assert actcache_main(["convert", src, "--to-format", "saev", "--to", str(tmp_path / "out")]) == 0
    dest, *notes = capsys.readouterr().out.splitlines()
    _, got = read_saev_cache(dest)
    np.testing.assert_array_equal(got, to_float32(to_stored(acts, "bfloat16"), "bfloat16"))
    assert any("bfloat16 widened exactly to float32" in note for note in notes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saev_to_v1_and_back_gives_the_same_saev_directory(tmp_path, capsys, dtype):
    path, doc, acts = write_saev_cache(tmp_path / "s", n=8, E=4, layers=(3, -2), P=3, D=5)
    before = tree_state(tmp_path / "s")
    assert actcache_main(["convert", path, "--dtype", dtype, "--to", str(tmp_path / "v1")]) == 0
    v1 = capsys.readouterr().out.strip()
    cache = ActivationCache.open(v1)
    assert type(cache.metadata) is Metadata and cache.metadata.dtype == dtype
    want = acts if dtype == "float32" else to_float32(to_stored(acts, dtype), dtype)
    np.testing.assert_array_equal(cache[0:8], want)
    assert cache.metadata.data == {"__class__": "SaevDataset", "data": doc["data"], "dataset": "fake",
                                   "pixel_agg": "majority"}  # fmt: skip
    assert actcache_main(["convert", v1, "--to-format", "saev", "--to", str(tmp_path / "back")]) == 0
    back = capsys.readouterr().out.splitlines()[0]
    assert os.path.basename(back) == os.path.basename(path)
    if dtype == "float32":
        assert files(back) == files(path)  # byte for byte: metadata, shards.json, padding, empty shard
    else:
        got_doc, got = read_saev_cache(back)
        assert got_doc == doc
        np.testing.assert_array_equal(got, want)
    assert tree_state(tmp_path / "s") == before  # nothing written into the source


def test_conversions_that_cannot_be_made_are_one_line_errors(tmp_path, capsys):
    path, _, _ = write_saev_cache(tmp_path / "s", family="fake-clip")
    assert actcache_main(["convert", path, "--to", str(tmp_path / "v1")]) == 2
    err = capsys.readouterr().err
    assert "'fake-clip'" in err and "train --cache" in err and len(error_lines(err)) == 1
    src, _ = v1_cache(tmp_path / "v1")
    for args in (["--to-format", "saev", "--dtype", "float16"], []):
        assert actcache_main(["convert", src, *args, "--to", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert "--dtype" in err and len(error_lines(err)) == 1
    assert not os.path.exists(tmp_path / "x")


class _RunsCode:
    """Unpickling this creates a marker file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_inspect_shows_the_pickled_dataset_from_its_opcodes_without_loading_it(tmp_path, capsys):
    from actcache.saev_pickle import dataset_pickle

    marker = str(tmp_path / "unpickled")
    datas = {
        "saev.data.datasets.ImgFolder(root='/imgs', n=3)": dataset_pickle(
            "saev.data.datasets", "ImgFolder", {"root": pathlib.PurePosixPath("/imgs"), "n": 3}
        ),
        "dict(root='fake')": pickle.dumps({"root": "fake"}),
        "opaque pickle": pickle.dumps(_RunsCode(marker)),
    }
    for i, (want, raw) in enumerate(datas.items()):
        path, _, _ = write_saev_cache(tmp_path / str(i), data=base64.b64encode(raw).decode())
        assert actcache_main(["inspect", path]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data "))
        assert want in line and ("never loaded" in line or "not loaded" in line), line
    assert not os.path.exists(marker)


def test_repair_advice_for_a_saev_cache_never_asks_for_a_dump_or_gather(tmp_path):
    from actcache.validate import check_dir

    path, _, _ = write_saev_cache(tmp_path, n=7, E=3)
    np.zeros(os.path.getsize(os.path.join(path, "acts000001.bin")) // 4, np.float32).tofile(
        os.path.join(path, "acts000001.bin")
    )  # an all-zero shard: a deep problem
    deep = check_dir(path, deep=True).problems
    os.remove(os.path.join(path, "acts000002.bin"))
    os.remove(os.path.join(path, "shards.json"))
    problems = deep + check_dir(path).problems
    assert len(problems) == 2, problems
    for p in problems:
        assert "re-create it with saev" in p and "dump" not in p.split(":", 1)[1].replace("the dump is", ""), p
        assert "gather" not in p.replace("never gathered", ""), p


@pytest.mark.parametrize("cls", [True, False], ids=["cls", "no-cls"])
def test_token_labels_reach_every_token_through_every_loader(tmp_path, capsys, cls):
    from actcache.errors import ConfigError
    from actcache.loaders import IndexedDataset, OrderedLoader, ShuffledLoader

    path, doc, _ = write_saev_cache(tmp_path / "s", n=7, E=3, layers=(3, 7), P=4, cls=cls, labels=True)
    labels_NP = np.fromfile(os.path.join(path, "labels.bin"), np.uint8).reshape(7, 4)
    assert len(np.unique(labels_NP)) > 5
    patches = "all" if cls else "image"
    want_n = 7 * 2 * (4 + int(cls))
    for loader in (
        OrderedLoader(path, batch_size=5, patches=patches, layer="all", token_labels=True),
        ShuffledLoader(path, batch_size=5, patches=patches, layer="all", seed=3, buffer_bytes=4000, run_bytes=500,
                       token_labels=True),
    ):  # fmt: skip
        got = [
            (int(i), int(p), int(lab))
            for b in loader
            for i, p, lab in zip(b["image_i"], b["patch_i"], b["token_label"], strict=True)
        ]
        assert len(got) == want_n
        assert all(lab == (labels_NP[i, p] if p >= 0 else -1) for i, p, lab in got)
    ds = IndexedDataset(path, patches=patches, layer="all", token_labels=True)
    items = [ds[i] for i in range(len(ds))]
    assert all(it["token_label"] == (labels_NP[it["image_i"], it["patch_i"]] if it["patch_i"] >= 0 else -1)
               for it in items)  # fmt: skip
    assert actcache_main(["inspect", path]) == 0
    assert "labels    labels.bin: saev's per-patch labels" in capsys.readouterr().out
    src, _ = v1_cache(tmp_path / "v1")
    with pytest.raises(ConfigError, match="no labels.bin; token_labels=True needs a saev cache"):
        OrderedLoader(src, layer=5, token_labels=True)


def test_a_conversion_is_never_written_inside_its_source(tmp_path, capsys):
    path, _, _ = write_saev_cache(tmp_path / "s")
    before = tree_state(tmp_path / "s")
    assert actcache_main(["convert", path, "--to", path]) == 2
    assert "inside its source" in capsys.readouterr().err
    assert tree_state(tmp_path / "s") == before


def test_label_probes_use_a_saev_caches_patch_labels(tmp_path):
    """Each patch's activation is the one-hot of its label (labels.bin, 3 classes), so with an
    identity SAE the best latent of class c is latent c with AP 1: only if the probe rows are the
    patch tokens keyed by their own labels."""
    import torch

    from actcache.sae.evaluate import evaluate_many
    from actcache.sae.modeling import SAE
    from actcache.sae.probes import probe_labels
    from actcache.sae.spec import SAEConfig
    from actcache.sae.split import HeldoutBatches

    n, E, P, D = 10, 4, 4, 6
    path, _, _ = write_saev_cache(tmp_path, n=n, E=E, layers=(5,), P=P, D=D, labels=True)
    labels_NP = np.random.default_rng(3).integers(0, 3, (n, P), dtype=np.uint8)
    labels_NP.tofile(os.path.join(path, "labels.bin"))
    acts = np.zeros((n, 1, P + 1, D), np.float32)
    acts[:, 0, 0] = 1.0  # CLS: no label
    acts[np.arange(n)[:, None], 0, np.arange(1, P + 1)[None, :], labels_NP] = 3.0
    for s in range(n // E + 1):
        block = np.zeros((E, 1, P + 1, D), np.float32)
        part = acts[s * E : (s + 1) * E]
        block[: len(part)] = part
        block.tofile(os.path.join(path, f"acts{s:06d}.bin"))
    cache = ActivationCache.open(path)
    held = np.arange(2, n)
    found = probe_labels(cache, held)
    assert found is not None and found[2] == "patch"
    sae = SAE(SAEConfig(d_vit=D, width=D, activation="relu"))
    with torch.no_grad():
        for name in ("W_enc", "W_dec"):
            getattr(sae, name).copy_(torch.eye(D))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    batches = HeldoutBatches(cache, held, "all", 5, False, 7)
    (res,) = evaluate_many([sae], batches, dense_frac=[0.1], labels=(*found, P))
    probes = res["probes"]
    assert probes["unit"] == "patch"
    best = {b["class"]: (b["latent"], b["ap"]) for b in probes["best_latent_per_class"]}
    assert best == {c: (c, 1.0) for c in range(3)}
    # every patch of the held-out images is probed; the APs are scored on the test half, where
    # each patch is a positive of exactly one class
    assert probes["n_images"] == len(held) * P
    assert sum(b["n_images"] for b in probes["best_latent_per_class"]) == probes["n_test"]
