"""The explorer's files (docs/explorer-format.md) as `actcache visuals` writes them, on the small
real world of tests/test_visuals.py (coloured-shape images, a CLIP preprocessing checkpoint, a
cache of colour activations, a saved SAE): every file the meta implies exists, every latent is in
exactly one table and one detail chunk, image -> patch -> latents equals a direct ``encode`` of
the cached rows, decoder neighbours equal a brute-force cosine. Chunks are made small here
(CHUNK 16, DETAIL_CHUNK 8 for 48 latents) so that several of each exist.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from tests.test_visuals import WIDTH, D, colour_activations, save_run, write_checkpoint

from actcache import cli, explorer
from actcache.demo import make_image_folder
from actcache.images import ImageFolder, metadata_data, open_dataset
from actcache.loaders import OrderedLoader
from actcache.protocol import Metadata
from actcache.sae.modeling import SAE
from actcache.writer import write_cache_from_array

_CHUNK = re.compile(r'^actcache_chunk\("([^"]+)", (.*)\);\n$', re.S)


def read_chunk(data_dir, name: str) -> dict:
    with open(os.path.join(data_dir, name + ".js"), encoding="utf-8") as fh:
        m = _CHUNK.match(fh.read())
    assert m and m.group(1) == name
    return json.loads(m.group(2))


@pytest.fixture(scope="module")
def explored(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer")
    images = make_image_folder(str(root / "images"), n_per_class=4)
    ckpt = write_checkpoint(root / "ckpt")
    cfg = ImageFolder(images)
    ds = open_dataset(cfg)
    labels = np.asarray([ds[i][1] for i in range(len(ds))], np.int64)
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=16, cls_token=True, d_vit=D,
                  n_imgs=len(ds), max_patches_per_shard=10 * 17, data=metadata_data(cfg))  # fmt: skip
    acts = colour_activations(ds, ckpt)
    cache = write_cache_from_array(root / "cache", md, acts, labels=labels, class_names=list(ds.class_names))
    run = save_run(root / "runs" / md.hash / "sae1", cache, md, acts, sae_id="sae1")
    held = [1, 4, 6, 9, 11]
    with open(os.path.join(run, "run.json")) as fh:
        doc = json.load(fh)
    doc["split"] = {"rule": "test", "heldout_images": held}
    with open(os.path.join(run, "run.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(run, "eval.json")) as fh:
        ev = json.load(fh)
    ev["probes"] = {"n_test": 3, "class_names": list(ds.class_names), "latent_best_class": [s % 2 for s in range(WIDTH)],
                    "best_latent_per_class": [{"class": 1, "name": "b", "latent": 5, "ap": 0.75, "ci95": [0.5, 1.0],
                                               "chance": 0.25, "n_images": 1, "n": 3}]}  # fmt: skip
    with open(os.path.join(run, "eval.json"), "w") as fh:
        json.dump(ev, fh)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(explorer, "CHUNK", 16)
        mp.setattr(explorer, "DETAIL_CHUNK", 8)
        mp.setattr(explorer, "FORK_MIN_CHUNKS", 2)  # the detail chunks by forked writers (2 cores or more)
        assert cli.main(["visuals", run, "--latents", "4", "--device", "cpu"]) == 0
    out = os.path.join(run, "visuals", "explorer")
    return {"run": run, "cache": cache, "out": out, "data": os.path.join(out, "data"), "held": held, "md": md,
            "acts": acts}  # fmt: skip


def test_every_file_the_meta_implies_exists_and_every_latent_is_covered(explored):
    data = explored["data"]
    meta = read_chunk(data, "meta")
    assert (meta["format"], meta["width"], meta["chunk"], meta["detail_chunk"]) == (1, WIDTH, 16, 8)
    assert meta["tokens_per_img"] == 16 and meta["grid"] == 4 and meta["patch_of_token"] == list(range(16))
    assert meta["explore_source"] == "held-out" and [m["id"] for m in meta["images"]] == explored["held"]
    tables = sorted(os.listdir(os.path.join(data, "latents")))
    assert tables == [f"detail-{c:04d}.js" for c in range(6)] + [f"table-{c:04d}.js" for c in range(3)]
    seen_t, seen_d = [], []
    for c in range(3):
        t = read_chunk(data, f"latents/table-{c:04d}")
        n = len(t["freq"])
        assert all(len(t[k]) == n for k in ("max_act", "mean_act", "dec_norm", "best_class", "best_ap"))
        seen_t += range(t["start"], t["start"] + n)
        if t["start"] <= 5 < t["start"] + n:  # latent 5 is class 1's best latent (and its best class is 1)
            assert t["best_ap"][5 - t["start"]] == 0.75 and t["best_class"][5 - t["start"]] == 1
    for c in range(6):
        d = read_chunk(data, f"latents/detail-{c:04d}")
        seen_d += range(d["start"], d["start"] + len(d["latents"]))
        for lat in d["latents"]:
            assert len(lat["hist"]) == len(meta["hist_edges"]) - 1 and len(lat["quantiles"]) == (5 if lat["top"] else 0)
            assert len(lat["neighbours"]) == 8 and lat["sweep_neighbours"] == []
            for e in lat["top"]:
                assert os.path.isfile(os.path.join(explored["out"], meta["image_thumbs"][str(e["img"])]))
                if e["heat"] is not None:
                    assert len(base64.b64decode(e["heat"])) == 16
    assert seen_t == seen_d == list(range(WIDTH))
    for im in meta["images"]:
        assert os.path.isfile(os.path.join(data, "images", f"{im['id']:04d}.js"))
        assert os.path.isfile(os.path.join(explored["out"], im["file"]))
    assert os.path.isfile(os.path.join(explored["out"], "index.html"))
    with open(os.path.join(explored["run"], "visuals", "summary.json")) as fh:
        summary = json.load(fh)
    assert summary["explorer"]["data_bytes"] > 0 and "explorer_s" in summary["seconds"]


def test_image_patch_latents_equal_a_direct_encode_of_the_cached_rows(explored):
    sae = SAE.load(explored["run"]).eval()
    loader = OrderedLoader(explored["cache"], batch_size=10**6, patches="image", layer=-2)
    (batch,) = list(loader)
    with torch.no_grad():
        f = sae.encode(batch["act"]).numpy().reshape(explored["md"].n_imgs, 16, WIDTH)
    for i in explored["held"]:
        doc = read_chunk(explored["data"], f"images/{i:04d}")
        assert doc["id"] == i and len(doc["patches"]) == 16
        for t, p in enumerate(doc["patches"]):
            want = np.argsort(-f[i, t], kind="stable")[:16]
            want = want[f[i, t, want] > 0]
            assert len(p["ids"]) == len(want) > 0
            np.testing.assert_allclose(p["acts"], f[i, t, want], atol=1e-4)
            np.testing.assert_allclose(f[i, t, p["ids"]], p["acts"], atol=1e-4)
        np.testing.assert_allclose(doc["top"]["acts"], f[i].max(0)[doc["top"]["ids"]], atol=1e-4)


def test_decoder_neighbours_equal_brute_force_cosines(explored, monkeypatch):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 6)), rng.standard_normal((29, 6))
    monkeypatch.setattr(explorer, "MATMUL_ELEMS", 64)  # chunks of 2 rows
    for x, y, same in ((a, a, True), (a, b, False)):
        ids, cos = explorer.decoder_neighbours(x, y, 5, same)
        c = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (y / np.linalg.norm(y, axis=1, keepdims=True)).T
        if same:
            np.fill_diagonal(c, -np.inf)
        np.testing.assert_array_equal(ids, np.argsort(-c, axis=1, kind="stable")[:, :5])
        np.testing.assert_allclose(cos, np.take_along_axis(c, ids, 1), atol=1e-6)
    # and in the written detail chunks, for the run's SAE
    W = SAE.load(explored["run"]).W_dec.detach().numpy()
    ids, _ = explorer.decoder_neighbours(W, W, 8, True)
    d = read_chunk(explored["data"], "latents/detail-0001")
    assert [[n["id"] for n in lat["neighbours"]] for lat in d["latents"]] == ids[8:16].tolist()


def crawl(page: str, width: int) -> list[str]:
    """Every href of ``page`` (a file): a relative file that exists, an anchor the page has, or a
    #latent=ID into an explorer with 0 <= ID < width. Returns the hrefs."""
    with open(page, encoding="utf-8") as fh:
        text = fh.read()
    hrefs = re.findall(r'href="([^"]+)"', text)
    for h in hrefs:
        path, _, frag = h.partition("#")
        assert "://" not in h and not h.startswith("/"), h
        if path:
            assert os.path.isfile(os.path.join(os.path.dirname(page), path)), h
        if frag.startswith("latent="):
            assert path.endswith("explorer/index.html") and 0 <= int(frag[7:]) < width, h
        elif frag and not path:
            assert f'id="{frag}"' in text, h
    return hrefs


def test_every_link_on_the_page_opens_the_latent_it_names(explored):
    page = os.path.join(explored["run"], "visuals", "index.html")
    hrefs = crawl(page, WIDTH)
    with open(page, encoding="utf-8") as fh:
        text = fh.read()
    on_page = {int(s) for s in re.findall(r'class="latent-card" id="latent-(\d+)"', text)}
    assert len(on_page) == 4 and f"Showing 4 of {WIDTH} latents." in text
    assert "explorer/index.html" in hrefs  # "Showing N of M": the explorer holds every latent
    assert ("#latent-5" if 5 in on_page else "explorer/index.html#latent=5") in hrefs  # class 1's best latent
    assert {f"explorer/index.html#latent={s}" for s in on_page} <= set(hrefs)
    crawl(os.path.join(explored["run"], "visuals.html"), WIDTH)  # the one-file page, from RUN_DIR


def test_no_explorer_writes_none_and_links_only_the_cards(explored, tmp_path):
    run = str(tmp_path / "sae1")
    shutil.copytree(explored["run"], run, ignore=shutil.ignore_patterns("visuals*"))
    assert cli.main(["visuals", run, "--latents", "4", "--device", "cpu", "--no-explorer", "--no-images"]) == 0
    assert not os.path.exists(os.path.join(run, "visuals", "explorer"))
    hrefs = crawl(os.path.join(run, "visuals", "index.html"), WIDTH)
    assert all("explorer" not in h for h in hrefs)
    with np.load(os.path.join(run, "visuals", "latents.npz")) as z:
        assert "q_img" not in z.files


def test_an_sae_made_alone_links_its_siblings_explorers_with_their_nearest_latents(explored, tmp_path):
    """As the workflow makes them, one SAE at a time: the second links the first's explorer."""
    first = tmp_path / "HASH" / "sae1"
    shutil.copytree(explored["run"], first, symlinks=True)
    second = save_run(tmp_path / "HASH" / "sae2", explored["cache"], explored["md"], explored["acts"], seed=7,
                      sae_id="sae2")  # fmt: skip
    assert cli.main(["visuals", second, "--latents", "2", "--device", "cpu", "--no-images"]) == 0
    ex = os.path.join(second, "visuals", "explorer")
    (other,) = read_chunk(os.path.join(ex, "data"), "meta")["sweep"]
    assert other["sae_id"] == "sae1" and os.path.isfile(os.path.join(ex, other["href"]))
    lat = read_chunk(os.path.join(ex, "data"), "latents/detail-0000")["latents"][0]
    W1, W2 = (SAE.load(str(d)).W_dec.detach().numpy() for d in (first, second))
    ids, _ = explorer.decoder_neighbours(W2, W1, 3, same=False)
    assert [(n["sae_id"], n["id"]) for n in lat["sweep_neighbours"]] == [("sae1", int(j)) for j in ids[0]]


def test_a_non_finite_number_is_one_error_naming_the_file(tmp_path):
    from actcache.errors import ActCacheError
    from actcache.explorer import _write_chunk

    with pytest.raises(ActCacheError, match=r"latents/detail-0000\.js: .*non-finite"):
        os.makedirs(tmp_path / "latents")
        _write_chunk(str(tmp_path), "latents/detail-0000", {"acts": [1.0, float("nan")]})
    assert not (tmp_path / "latents" / "detail-0000.js").exists()
