"""`actcache visuals`: the page renders in headless Chromium (cards, images from relative paths,
no console errors, sortable), the arrays and plots are written, sweeps give NMSE-L0 plots, and
bad input fails with an actionable message.

The test world is real and small: an image folder (actcache.demo's coloured shapes), a local
CLIP checkpoint directory (its config.json and preprocessor_config.json, which is all the page
needs: the crop), a cache whose activations are computed from each patch's colour (so latents
respond to colours, and the heatmaps in the screenshot mean something), and SAEs saved with
SAE.save plus the run.json that `actcache train` writes (one test trains real ones).

Chromium: tests/browser.py (installed when missing; a failure to install fails the test).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from tests.browser import DevTools, browse

from actcache import cli
from actcache.demo import make_image_folder
from actcache.images import ImageFolder, metadata_data, open_dataset
from actcache.models import load_transform
from actcache.protocol import Metadata
from actcache.sae.modeling import SAE, SAEConfig
from actcache.topk import N_BINS, LatentSummary
from actcache.visuals_report import one_file_page
from actcache.writer import synthetic_fill, synthetic_metadata, write_cache, write_cache_from_array
from conftest import in_mount_namespace

D, WIDTH, K_SAE, N_PER_CLASS = 16, 48, 4, 8
SAE_ID = "abc123def456"


# ---- helpers ---------------------------------------------------------------------------------


def jload(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def read_text(path) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def card_ids(dom: str) -> list[int]:
    return [int(m) for m in re.findall(r'class="latent-card" id="latent-(\d+)"', dom)]


# ---- the test world --------------------------------------------------------------------------


def write_checkpoint(directory) -> str:
    """A local CLIP checkpoint directory as far as preprocessing goes (32x32 input, 8x8 patches)."""
    os.makedirs(directory, exist_ok=True)
    cfg = {
        "model_type": "clip_vision_model",
        "hidden_size": D,
        "num_hidden_layers": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    proc = {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 32},
        "crop_size": {"height": 32, "width": 32},
    }
    for name, doc in (("config.json", cfg), ("preprocessor_config.json", proc)):
        with open(os.path.join(directory, name), "w") as fh:
            json.dump(doc, fh)
    return str(directory)


def colour_activations(ds, ckpt: str, seed: int = 0) -> np.ndarray:
    """(N, 1, 17, D): patch token = its mean colour (after the model's crop) projected to D, CLS = mean."""
    t = load_transform("clip", ckpt)
    rng = np.random.default_rng(seed)
    R = rng.standard_normal((3, D)).astype(np.float32)
    acts = np.empty((len(ds), 1, 17, D), np.float32)
    for i in range(len(ds)):
        x = t(ds[i][0])  # (3, 32, 32)
        cells = x.reshape(3, 4, 8, 4, 8).mean((2, 4)).reshape(3, 16).T
        a = cells @ R + 0.05 * rng.standard_normal((16, D)).astype(np.float32)
        acts[i, 0, 1:], acts[i, 0, 0] = a, a.mean(0)
    return acts


def save_run(run_dir, cache_dir, md: Metadata, acts, seed: int = 1, k: int = K_SAE, sae_id: str = SAE_ID, metrics=True):
    """An SAE run directory as `actcache train` leaves it (weights, config, run.json, metrics, eval)."""
    sae = SAE(SAEConfig(d_vit=D, width=WIDTH, activation="topk", k=k, seed=seed))
    with torch.no_grad():
        sae.b_dec.copy_(torch.from_numpy(acts[:, 0, 1:].reshape(-1, D).mean(0)))
    sae.save(run_dir)
    doc = {"sae_id": sae_id, "group_id": "L-2-image-test", "cache": os.path.abspath(cache_dir), "cache_hash": md.hash,
           "layer": -2, "d_vit": D, "width": WIDTH, "train_images": [0, md.n_imgs], "world_size": 1,
           "run": {"patches": "image", "scale_norm": False, "activation": "topk", "k": k}}  # fmt: skip
    with open(os.path.join(run_dir, "run.json"), "w") as fh:
        json.dump(doc, fh)
    if metrics:
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
            for s in range(10, 110, 10):
                fh.write(
                    json.dumps({"step": s, "nmse": 0.5 / s**0.3 + 0.01 * k, "l0": k, "n_dead": max(0, 20 - s // 5)})
                    + "\n"
                )
        with open(os.path.join(run_dir, "eval.json"), "w") as fh:
            json.dump({"nmse": 0.3 / k, "l0": float(k), "n_dead": 3}, fh)
    return str(run_dir)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("visuals")
    images = make_image_folder(str(root / "images"), n_per_class=N_PER_CLASS)
    ckpt = write_checkpoint(root / "ckpt")
    cfg = ImageFolder(images)
    ds = open_dataset(cfg)
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=16, cls_token=True, d_vit=D,
                  n_imgs=len(ds), max_patches_per_shard=10 * 17, data=metadata_data(cfg))  # fmt: skip
    acts = colour_activations(ds, ckpt)
    cache = write_cache_from_array(root / "cache", md, acts)
    run = save_run(root / "runs" / md.hash / SAE_ID, cache, md, acts)
    return {"root": root, "cache": cache, "md": md, "acts": acts, "run": run, "images": images}


@pytest.fixture(scope="module")
def page(world):
    """`actcache visuals RUN_DIR --latents 12` run once; returns the visuals folder."""
    rc = cli.main(["visuals", world["run"], "--latents", "12", "--device", "cpu"])
    assert rc == 0
    return os.path.join(world["run"], "visuals")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["visuals", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- the page --------------------------------------------------------------------------------


def referenced_files(index: str) -> list[str]:
    text = read_text(index)
    refs = re.findall(r'src="([^"]+)"', text) + re.findall(r"url\(([^)]+)\)", text)
    assert refs
    for r in refs:
        assert "://" not in r and not r.startswith("/"), f"not a relative path: {r}"
    return sorted(set(refs))


def test_page_renders_with_cards_images_heatmaps_and_no_console_errors(page, chromium, tmp_path):
    index = os.path.join(page, "index.html")
    summary = jload(os.path.join(page, "summary.json"))
    shown = summary["latents_shown"]
    assert len(shown) == 12
    with np.load(os.path.join(page, "latents.npz")) as z:
        n_top = (z["top_img"][shown] >= 0).sum(1)

    dom, console = browse(chromium, index)
    assert console == []
    assert sorted(card_ids(dom)) == sorted(shown)
    assert 'data-broken-images="0"' in dom
    for s, n in zip(shown, n_top, strict=True):  # one thumbnail (image + heatmap) per top image
        card = re.search(rf'id="latent-{s}".*?</svg></div>', dom, re.S).group(0)
        assert card.count('<img src="img/') == n == card.count('class="heat"')
        assert f"img/heat/{s}.png" in card and "<rect" in card
    refs = referenced_files(index)
    assert {"curves.png", "freq.png"} <= set(refs)
    for r in refs:
        assert os.path.isfile(os.path.join(page, r)), r

    shot = str(tmp_path / "page.png")
    _, console = browse(chromium, index, screenshot=shot)
    assert console == []
    with PIL.Image.open(shot) as im:
        assert im.size == (1300, 1600)
        px = np.asarray(im.convert("RGB"))
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 1000  # photos, plots and heatmaps, not a blank page

    # The folder works anywhere: copy it, render again; a missing image is reported on the page.
    moved = shutil.copytree(page, tmp_path / "elsewhere" / "visuals")
    dom, console = browse(chromium, os.path.join(moved, "index.html"))
    assert console == [] and len(card_ids(dom)) == 12 and 'data-broken-images="0"' in dom
    victim = next(r for r in refs if r.endswith(".jpg"))
    os.remove(os.path.join(moved, victim))
    dom, _ = browse(chromium, os.path.join(moved, "index.html"))
    assert re.search(r'data-broken-images="[1-9]', dom) and "failed to load" in dom


def test_standalone_page_is_one_file_that_renders_anywhere(page, chromium, tmp_path):
    """RUN_DIR/visuals.html (what `snakemake --report report.html` embeds): every image inlined."""
    alone = tmp_path / "alone.html"
    shutil.copy(os.path.join(os.path.dirname(page), "visuals.html"), alone)
    text = alone.read_text()
    assert 'src="img/' not in text and "url(img/" not in text and "data:image/jpeg;base64," in text
    dom, console = browse(chromium, str(alone))
    assert console == [] and len(card_ids(dom)) == 12 and 'data-broken-images="0"' in dom


def test_captions_show_their_whole_text_under_each_image(page, chromium):
    """Each caption (score, image number, class) wraps inside its image's column: nothing is cut
    off or drawn over the next image."""
    js = """Array.from(document.querySelectorAll('.tops figure')).map(f => {
      const c = f.querySelector('figcaption'), fb = f.getBoundingClientRect(), cb = c.getBoundingClientRect();
      return [c.scrollWidth <= c.clientWidth, cb.left >= fb.left - 0.5 && cb.right <= fb.right + 0.5,
              c.innerText.replace(/\\s+/g, ' ').trim()];
    })"""
    with DevTools(chromium) as browser:
        browser.open(os.path.join(page, "index.html"))
        caps = browser.eval(js)
    assert len(caps) >= 12 and all(fits and inside for fits, inside, _ in caps), caps[:4]
    assert all(re.fullmatch(r"[0-9.e+-]+ #[0-9]+ · (circles|squares|stripes)", text) for *_, text in caps), caps[:4]


def test_one_file_page_keeps_to_its_byte_budget_with_a_spread_of_the_cards(page, chromium, tmp_path):
    """A page too large for the budget shows fewer cards (the most and least frequent kept), says
    where the full page is, stays under the budget and still loads every image it shows."""
    res = LatentSummary.load(os.path.join(page, "latents.npz"))
    shown = np.asarray(jload(os.path.join(page, "summary.json"))["latents_shown"])
    args = (res, shown, {"SAE": SAE_ID}, {}, np.arange(16), True, True, ["curves.png", "freq.png"], [], page,
            "FULL-PAGE-PATH")  # fmt: skip
    whole, all_cards = one_file_page(*args)
    assert list(all_cards) == list(shown) and "FULL-PAGE-PATH" not in whole
    probes = {"latent_best_class": [1] * res.width, "class_names": ["circles", "squares"],
              "best_latent_per_class": [{"name": "squares", "latent": int(shown[0]), "ap": 0.9, "n_images": 4}]}  # fmt: skip
    with_probes, _ = one_file_page(*args, probes=probes)  # each card's best class and the table, as on the full page
    assert with_probes.count('<span class="best-class">best class: squares</span>') == len(shown)
    assert "Best latent per class" in with_probes and "best-class" not in whole
    bare, none = one_file_page(*args, budget=1)  # no card fits: the header and plots alone
    assert len(none) == 0 and "shows 0 of its" in bare
    budget = (len(whole.encode()) + len(bare.encode())) // 2
    small, kept = one_file_page(*args, budget=budget)
    assert len(small.encode()) <= budget and 2 <= len(kept) < len(shown)
    assert kept[0] == shown[0] and kept[-1] == shown[-1] and set(kept) <= set(shown)
    assert f"shows {len(kept)} of its {len(shown)} latent cards" in small and "FULL-PAGE-PATH" in small
    alone = tmp_path / "small.html"
    alone.write_text(small, encoding="utf-8")
    dom, console = browse(chromium, str(alone))
    assert console == [] and card_ids(dom) == list(kept) and 'data-broken-images="0"' in dom
    n_top = int((res.top_img[kept] >= 0).sum())
    assert dom.count('src="data:image/jpeg;base64,') == n_top  # each from the one table, inlined once
    assert small.count("data:image/jpeg;base64,") == len({int(i) for i in res.top_img[kept].ravel() if i >= 0})


def test_cards_sort_by_frequency(page, chromium):
    with np.load(os.path.join(page, "latents.npz")) as z:
        freq = z["freq"]
    shown = jload(os.path.join(page, "summary.json"))["latents_shown"]
    by_freq_desc = sorted(shown, key=lambda s: (-freq[s], s))
    by_freq_asc = sorted(shown, key=lambda s: (freq[s], s))
    assert card_ids(read_text(os.path.join(page, "index.html"))) == by_freq_desc  # as written
    dom, console = browse(chromium, os.path.join(page, "index.html"), hash="#sort=freq-asc")
    assert console == [] and card_ids(dom) == by_freq_asc


def test_console_errors_are_detected(chromium, tmp_path):
    """The check above would notice a broken script."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>notDefined();</script></body></html>")
    _, console = browse(chromium, str(bad))
    assert any("Uncaught ReferenceError" in ln for ln in console)


def test_arrays_summary_and_plots(world, page):
    md = world["md"]
    with np.load(os.path.join(page, "latents.npz")) as z:
        assert z["freq"].shape == z["mean_act"].shape == z["max_act"].shape == (WIDTH,)
        assert z["hist"].shape == (WIDTH, N_BINS) and z["hist_edges"].shape == (N_BINS + 1,)
        assert z["top_img"].shape == z["top_score"].shape == (WIDTH, 16)
        assert z["top_acts"].shape == (WIDTH, 16, 16) and z["top_acts"].dtype == np.float16
        assert int(z["n_tokens"]) == md.n_imgs * 16 and z["fire_count"].sum() == K_SAE * md.n_imgs * 16
        np.testing.assert_allclose(z["freq"].sum(), K_SAE)
    s = jload(os.path.join(page, "summary.json"))
    assert (s["cache_hash"], s["layer"], s["patches"], s["n_imgs"], s["width"]) == (
        md.hash,
        -2,
        "image",
        md.n_imgs,
        WIDTH,
    )
    for name in ("curves.png", "freq.png"):
        with PIL.Image.open(os.path.join(page, name)) as im:
            assert im.size[0] > 300
    # every shown top image exists once, cropped to the model input
    top = np.load(os.path.join(page, "latents.npz"))["top_img"][s["latents_shown"]]
    for i in np.unique(top[top >= 0]):
        with PIL.Image.open(os.path.join(page, "img", f"{i}.jpg")) as im:
            assert im.size == (32, 32)


def test_page_title_says_what_the_sae_is(page):
    with open(os.path.join(page, "index.html"), encoding="utf-8") as fh:
        text = fh.read()
    assert f"<title>SAE {SAE_ID} (topk k={K_SAE} width={WIDTH} layer -2) latents</title>" in text


def test_pass_over_the_cache_logs_its_progress(world, caplog):
    from actcache.cache import ActivationCache
    from actcache.visuals import compute_stats

    sae = SAE.load(world["run"])
    with caplog.at_level(logging.INFO, logger="actcache.progress"):
        compute_stats(ActivationCache.open(world["cache"]), [sae], "image", -2, False, batch_images=8)
    (line,) = [r.message for r in caplog.records if r.name == "actcache.progress"]
    n = -(-world["md"].n_imgs // 8)
    assert line.startswith(f"visuals: pass over the cache: {n}/{n} batch (100.0%)") and "ETA" in line, line


def test_reuse_skips_the_pass(world, page, capsys):
    before = jload(os.path.join(page, "summary.json"))
    rc, out, _ = run_cli(capsys, world["run"], "--reuse", "--latents", "5", "--select", "strongest")
    assert rc == 0 and out.strip().endswith("index.html")
    after = jload(os.path.join(page, "summary.json"))
    assert after["reused"] is True and len(after["latents_shown"]) == 5
    with np.load(os.path.join(page, "latents.npz")) as z:
        strongest = set(np.argsort(-z["max_act"], kind="stable")[:5].tolist())
    assert set(after["latents_shown"]) == strongest
    # a summary from before the explorer (no quantile samples, no explorable images) is not reused
    with np.load(os.path.join(page, "latents.npz")) as z:
        old = {n: z[n] for n in z.files if not n.startswith(("q_", "ex_"))}
    np.savez_compressed(os.path.join(page, "latents.npz"), **old)
    rc, _, _ = run_cli(capsys, world["run"], "--reuse", "--latents", "5")
    assert rc == 0 and jload(os.path.join(page, "summary.json"))["reused"] is False
    with np.load(os.path.join(page, "latents.npz")) as z:
        assert "q_img" in z.files and "ex_ids" in z.files
    rc, _, _ = run_cli(capsys, world["run"], "--latents", "12")  # restore the default page for other tests
    assert rc == 0 and before["latents_shown"] == jload(os.path.join(page, "summary.json"))["latents_shown"]


# ---- sweeps ----------------------------------------------------------------------------------


def test_full_disk_is_a_clear_error_and_keeps_the_page(world, page, tmp_path):
    # A real full disk: a copy of the run directory (with its page) on a tmpfs in the command's own
    # mount namespace (root), with 16 pages to spare. The new page does not fit: one clear error,
    # and the page already there is untouched, with no temporary folder left.
    run = tmp_path / "run"
    subprocess.run(["cp", "-a", str(world["run"]), str(run)], check=True)  # the explorer's hard links kept
    files = {os.stat(p).st_ino: p for p in (os.path.join(d, f) for d, _, fs in os.walk(run) for f in fs)}
    n_dirs = sum(1 for _ in os.walk(run))
    pages_used = sum(-(-os.path.getsize(f) // 4096) for f in files.values())
    page_bytes = sum(os.path.getsize(f) for f in files.values() if os.sep + "visuals" + os.sep in f)
    room = 16 + n_dirs  # pages
    assert page_bytes > room * 4096  # the page cannot fit again in the room left
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size={(pages_used + room) * 4096} tmpfs {mnt} || exit 99\n"
        f'cp -a {run} {mnt}/run || exit 98\n"$@" {mnt}/run; echo "rc=$?" >&2\n'
        f"diff -r {run} {mnt}/run && echo SAME\n"
    )
    cmd = [sys.executable, "-m", "actcache.cli", "visuals", "--latents", "12", "--device", "cpu"]
    out = in_mount_namespace(script, cmd)
    assert "rc=2" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "could not write the visuals of" in out.stderr and "No space left on device (ENOSPC)" in out.stderr
    assert "a page already there is kept" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SAME", out.stdout  # the page as it was, nothing added


def test_sweep_of_trained_saes(world, capsys, tmp_path):
    """Real `actcache train` output: two SAEs of one group, then visuals over the hash directory."""
    from actcache.sae.config import expand_train_section, groups
    from actcache.sae.train import train_group

    runs_to = tmp_path / "runs"
    section = {"batch_size": 64, "steps": 12, "log_every": 4, "exp_factor": 2.0, "eval_frac": 0.2,
               "sweep": {"k": [2, 6]}}  # fmt: skip
    runs = expand_train_section(section, "test.yaml")
    (members,) = groups(runs).values()
    dirs = train_group(world["cache"], members, str(runs_to), device="cpu")
    rc, out, err = run_cli(capsys, runs_to / world["md"].hash, "--latents", "4", "--no-images")
    assert rc == 0, err
    sweep = runs_to / world["md"].hash / "visuals"
    for d in dirs:
        assert (
            os.path.isfile(os.path.join(d, "visuals", "index.html")) and os.path.join(d, "visuals", "index.html") in out
        )
        with PIL.Image.open(os.path.join(d, "visuals", "curves.png")):
            pass
    points = jload(sweep / "sweep.json")["points"]
    assert sorted(p["sae_id"] for p in points) == sorted(r.sae_id for r in members)
    from tests.test_explorer import read_chunk

    for d in dirs:  # each explorer links the other SAE's and names its nearest latents by decoder cosine
        ex = os.path.join(d, "visuals", "explorer")
        (other,) = read_chunk(os.path.join(ex, "data"), "meta")["sweep"]
        assert other["sae_id"] != os.path.basename(d) and os.path.isfile(os.path.join(ex, other["href"]))
        lat = read_chunk(os.path.join(ex, "data"), "latents/detail-0000")["latents"][0]
        assert [n["sae_id"] for n in lat["sweep_neighbours"]] == [other["sae_id"]] * 3
    assert {p["source"] for p in points} == {"eval"}
    evals = {jload(os.path.join(d, "eval.json"))["l0"] for d in dirs}
    assert {p["l0"] for p in points} == evals
    for name in ("nmse_l0.png", "curves.png"):
        with PIL.Image.open(sweep / name) as im:
            assert im.size[0] > 300
    html = (sweep / "index.html").read_text()
    for link in re.findall(r'href="([^"]+)"', html):
        assert os.path.isfile(sweep / link)
    for d in dirs:  # every SAE's explorer, from its row and its Pareto point
        ex = os.path.relpath(os.path.join(d, "visuals", "explorer", "index.html"), sweep)
        assert html.count(f'href="{ex}"') == 2
    # one dead count: eval.json, the page header, the report's one-file page, summary.json and the
    # exported model card show the same dead and almost-dead counts under one definition string
    from actcache.export import export_saelens
    from actcache.rundir import VISUALS_PAGE

    for d in dirs:
        ev = jload(os.path.join(d, "eval.json"))
        definition = ev["dead_definition"]
        assert ev["definitions"]["n_dead"] == ev["definitions"]["n_almost_dead"] == definition
        assert f"{ev['dead_window_tokens']:,} tokens" in definition and "at least 1,000,000 tokens" in definition
        summary = jload(os.path.join(d, "visuals", "summary.json"))
        assert (summary["n_dead"], summary["n_almost_dead"], summary["dead_definition"]) == (
            ev["n_dead"], ev["n_almost_dead"], definition)  # fmt: skip
        line = f"{ev['n_dead']:,} dead, {ev['n_almost_dead']:,} almost dead ({definition})"
        for page in (os.path.join(d, "visuals", "index.html"), os.path.join(d, VISUALS_PAGE)):
            text = read_text(page)
            assert f"<td>dead / almost-dead latents</td><td>{line}</td>" in text
            assert ">dead latents<" not in text and "dead %" not in text
        card = read_text(os.path.join(export_saelens(d, tmp_path / "card" / os.path.basename(d)), "README.md"))
        assert f"| n_dead | {ev['n_dead']} |" in card and f"| n_almost_dead | {ev['n_almost_dead']} |" in card
        assert f"n_dead, n_almost_dead: {definition}." in card
    # the Pareto views, each with its caption
    pareto = jload(sweep / "sweep.json")["pareto_points"]
    assert {p["fvu"] for p in pareto} == {jload(os.path.join(d, "eval.json"))["fvu"] for d in dirs}
    for name in ("pareto_l0_fvu.png", "pareto_l0_spliced.png", "pareto_l0_probe.png"):
        with PIL.Image.open(sweep / name) as im:
            assert im.size[0] > 300
    assert "Pick from the line" in html

    # --plots-only into --out, with the last training metrics where there is no eval.json
    os.remove(os.path.join(dirs[0], "eval.json"))
    out_dir = tmp_path / "sweep-plots"
    rc, out, err = run_cli(capsys, *dirs, "--plots-only", "--out", out_dir)
    assert rc == 0, err
    points = jload(out_dir / "sweep.json")["points"]
    assert sorted(p["source"] for p in points) == ["eval", "train"]
    assert (out_dir / "nmse_l0.png").is_file() and (out_dir / "curves.png").is_file()


# ---- errors ----------------------------------------------------------------------------------


def test_missing_or_unfinished_run_dirs(capsys, tmp_path):
    rc, _, err = run_cli(capsys, tmp_path / "nope")
    assert rc == 2 and str(tmp_path / "nope") in err and "actcache train" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, tmp_path / "empty")
    assert rc == 2 and "not an SAE run directory" in err and str(tmp_path / "empty") in err
    unfinished = tmp_path / "runs" / "h" / "sae1"
    unfinished.mkdir(parents=True)
    (unfinished / "run.json").write_text(json.dumps({"sae_id": "sae1", "cache": "/x", "run": {}}))
    rc, _, err = run_cli(capsys, unfinished)
    assert rc == 2 and "no final SAE weights" in err and "done.json" in err and "--plots-only" in err
    rc, _, err = run_cli(capsys, unfinished, "--top-k", "0")
    assert rc == 2 and "--top-k" in err


def test_missing_or_different_cache(world, capsys, tmp_path):
    run = save_run(tmp_path / "run", tmp_path / "moved-cache", world["md"], world["acts"], metrics=False)
    rc, _, err = run_cli(capsys, run)
    assert rc == 2 and str(tmp_path / "moved-cache") in err and "--cache" in err and "does not exist" in err
    rc, out, err = run_cli(capsys, run, "--cache", world["cache"], "--no-images", "--latents", "3")
    assert rc == 0, err
    other, _ = make_other_cache(tmp_path / "other")
    rc, _, err = run_cli(capsys, run, "--cache", other)
    assert rc == 2 and world["md"].hash[:12] in err and other in err


def make_other_cache(root, data=None):
    md = synthetic_metadata(6, layers=(-2,), n_patches_per_img=16, d_vit=D, max_patches_per_shard=17 * 4)
    if data is not None:
        md = Metadata(**{**md.to_dict(), "layers": tuple(md.layers), "data": data})
    return write_cache(str(root), md, synthetic_fill(md)), md


def test_image_dataset_missing(world, capsys, tmp_path):
    images = shutil.copytree(world["images"], tmp_path / "images")
    cache, md = make_other_cache(tmp_path / "cache", data=metadata_data(ImageFolder(str(images))))
    run = save_run(tmp_path / "run", cache, md, np.zeros((md.n_imgs, 1, 17, D), np.float32), metrics=False)
    shutil.rmtree(images)
    rc, _, err = run_cli(capsys, run)
    assert rc == 2 and str(images) in err and "--no-images" in err and "restore" in err
    rc, _, err = run_cli(capsys, run, "--no-images", "--latents", "3")
    assert rc == 0, err
    html = read_text(os.path.join(run, "visuals", "index.html"))
    assert 'class="latent-card"' in html and ".jpg" not in html and "img/heat/" in html


def test_cache_without_image_dataset(capsys, tmp_path):
    cache, md = make_other_cache(tmp_path / "cache")  # data: SyntheticActivations
    run = save_run(tmp_path / "run", cache, md, np.zeros((md.n_imgs, 1, 17, D), np.float32), metrics=False)
    rc, _, err = run_cli(capsys, run)
    assert rc == 2 and "SyntheticActivations" in err and "--no-images" in err


def _clone_stage():
    import contextlib

    @contextlib.contextmanager
    def stage():
        yield lambda batch: (batch["act"].clone(), batch["image_i"].clone())

    return stage


def test_staged_feed_gives_the_loaders_batches_in_order_and_stops(tmp_path):
    # The thread that stages a GPU pass's batches (visuals.cuda_feed), here with a CPU stage that
    # copies: the same batches as the loader's own, in order; early close and errors.
    import threading

    from actcache.feed import StagedFeed
    from actcache.loaders import OrderedLoader

    md = synthetic_metadata(23, n_patches_per_img=16, d_vit=8, max_patches_per_shard=5 * 17)
    cache = write_cache(str(tmp_path), md, synthetic_fill(md))
    kw = dict(batch_size=3 * 16, patches="image", layer=-2)
    with OrderedLoader(cache, **kw) as ld:
        want = [(b["act"].clone(), b["image_i"].clone()) for b in ld]
    assert len(want) == 8
    with OrderedLoader(cache, **kw) as ld:
        taken = []
        feed = StagedFeed(ld, _clone_stage(), on_take=taken.append)
        got = list(feed)
        feed.close()
        assert not feed.thread.is_alive()
    assert len(got) == len(want) and taken == got
    for (a, i), (wa, wi) in zip(got, want, strict=True):
        assert torch.equal(a, wa) and torch.equal(i, wi)
    with pytest.raises(StopIteration):  # stays ended
        next(feed)

    # the consumer stops after one batch: close() ends the thread, which waits on a full queue
    with OrderedLoader(cache, **kw) as ld:
        feed = StagedFeed(ld, _clone_stage(), depth=1)
        assert torch.equal(next(feed)[0], want[0][0])
        feed.close()
        assert not feed.thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith(("ac-", "actcache-staged"))]

    # an error while staging batch 3 reaches the consumer after batches 0..2, and again after
    import contextlib

    @contextlib.contextmanager
    def failing():
        n = iter(range(100))

        def stage(batch):
            if next(n) == 3:
                raise OSError("staging failed on purpose")
            return batch["act"].clone()

        yield stage

    with OrderedLoader(cache, **kw) as ld:
        feed = StagedFeed(ld, failing)
        assert all(torch.equal(next(feed), want[j][0]) for j in range(3))
        for _ in range(2):
            with pytest.raises(OSError, match="staging failed on purpose"):
                next(feed)
        feed.close()
        assert not feed.thread.is_alive()


def test_page_images_from_forked_workers_equal_the_threads(world, page, capsys, monkeypatch):
    # A page of FORK_MIN_IMAGES images or more is written by forked processes (here: from 1 image):
    # the same files, byte for byte, as the threads write, and no process or shared memory left.
    import hashlib

    from actcache import visuals_html as vh

    def images(d):
        img = os.path.join(d, "img")
        out = {}
        for n in os.listdir(img):
            if n.endswith(".jpg"):
                with open(os.path.join(img, n), "rb") as fh:
                    out[n] = hashlib.sha256(fh.read()).hexdigest()
        return out

    threads = images(page)
    assert len(threads) >= 8
    forks = []
    real = vh.ForkedImages.__init__

    def counted(self, *a, **kw):
        real(self, *a, **kw)
        forks.append(len(self.futures))

    monkeypatch.setattr(vh, "FORK_MIN_IMAGES", 1)
    monkeypatch.setattr(vh.ForkedImages, "__init__", counted)
    rc, out, _ = run_cli(capsys, world["run"], "--reuse", "--latents", "12")
    assert rc == 0 and forks and forks[0] >= 1, forks
    assert images(page) == threads
    where = re.findall(
        r"<figcaption><span>[^<]*</span><span>([^<]*)</span>", read_text(os.path.join(page, "index.html"))
    )
    assert where and any(" · " in x for x in where)  # the captions' class names came back from the workers
    import multiprocessing

    assert not multiprocessing.active_children()
    monkeypatch.undo()
