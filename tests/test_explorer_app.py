"""The explorer app (src/actcache/explorer_app) in a real browser: Playwright driving Debian's
Chromium over a 16,384-wide explorer (tests/explorer_data.py writes its data, contract
docs/explorer-format.md) and a second, narrower SAE of the same sweep.

Every latent page shows that latent's data, search and best-latent links open the latent they
name, a clicked patch lists the latents written for it (1e-4), sorting and filtering agree with
numpy, and a crawler finds no dead link, broken image or console error on any page it reaches.
One browser per module; each test opens its own page.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse

import numpy as np
import pytest
from playwright import sync_api as playwright_api  # the dev extra (pyproject.toml): a missing one fails
from tests.explorer_data import write_synthetic_explorer

WIDTH, OTHER_WIDTH, TOL = 16384, 1024, 1e-4


@pytest.fixture(scope="module")
def explorers(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorers")
    a, b = str(root / "a" / "explorer"), str(root / "b" / "explorer")
    sweep_b = [{"sae_id": "saeB", "title": "SAE B", "href": "../../b/explorer/index.html", "width": OTHER_WIDTH}]
    sweep_a = [{"sae_id": "saeA", "title": "SAE A", "href": "../../a/explorer/index.html", "width": WIDTH}]
    main = write_synthetic_explorer(a, WIDTH, sae_id="saeA", sweep=sweep_b, seed=0)
    other = write_synthetic_explorer(b, OTHER_WIDTH, sae_id="saeB", sweep=sweep_a, seed=1)
    return main, other


@pytest.fixture(scope="module")
def browser(chromium):
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


GO = """async h => {
  location.hash = h;
  let want = h;
  try { want = decodeURIComponent(h); } catch (e) { /* as the app: the hash as typed */ }
  for (let i = 0; i < 3000 && document.body.dataset.rendered !== want; i++) await new Promise(r => setTimeout(r, 5));
}"""
ALL_IMAGES = """async () => {  // the srcs of images that do not load (a broken one is retried once, afresh)
  const fresh = src => new Promise(r => { const x = new Image(); x.onload = () => r(null); x.onerror = () => r(src); x.src = src; });
  const done = i => i.complete ? (i.naturalWidth > 0 ? Promise.resolve(null) : fresh(i.src))
    : new Promise(r => { i.addEventListener("load", () => r(null)); i.addEventListener("error", () => r(fresh(i.src))); });
  return (await Promise.all([...document.images].map(done))).filter(Boolean);
}"""


class Tab:
    """One page of the explorer; console errors and uncaught exceptions are collected."""

    def __init__(self, browser, folder: str):
        self.page = browser.new_page(viewport={"width": 1300, "height": 1000})
        self.base = "file://" + os.path.join(folder, "index.html")
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, hash_: str = "", url: str | None = None) -> None:
        self.page.goto((url or self.base) + hash_)
        self.wait(hash_ or "#")

    def go(self, hash_: str) -> None:
        """A view of the page already open (a hash change, as a link click does), once rendered."""
        self.page.evaluate(GO, hash_)

    def wait(self, hash_: str) -> None:
        self.page.wait_for_function(
            "h => document.body.dataset.rendered === h", arg=urllib.parse.unquote(hash_), timeout=15000
        )

    def values(self, selector: str) -> list[float]:
        return [float(v) for v in self.page.eval_on_selector_all(selector, "es => es.map(e => e.dataset.value)")]

    def ids(self, selector: str) -> list[int]:
        return [int(v) for v in self.page.eval_on_selector_all(selector, "es => es.map(e => e.dataset.id)")]

    def close(self) -> None:
        self.page.close()
        assert not self.errors, self.errors


@pytest.fixture
def tab(browser, explorers):
    t = Tab(browser, explorers[0]["dir"])
    yield t
    t.close()


def close(a, b) -> bool:
    return np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=TOL, atol=TOL)


# ---- the table ------------------------------------------------------------------------------


def test_opens_with_one_page_of_rows_after_loading_meta_and_one_table_chunk(tab, explorers):
    tab.open()
    cols = explorers[0]["table"]
    assert tab.ids("table.latents tbody tr") == list(range(50))
    assert close(tab.values("table.latents tbody [data-key=freq]"), cols["freq"][:50])
    assert close(tab.values("table.latents tbody [data-key=max_act]"), cols["max_act"][:50])
    loaded = tab.page.evaluate("[...__explorer.tables.keys()]")
    assert sorted(loaded) == ["latents/table-0000", "meta"]  # nothing else until needed
    assert tab.page.evaluate("typeof window.__explorerReady") == "number"
    assert tab.page.evaluate("document.querySelectorAll('script[data-key]').length") == 0  # chunks' scripts dropped


def test_sorting_by_frequency_and_filtering_by_class_agree_with_numpy(tab, explorers):
    tab.open()
    cols = explorers[0]["table"]
    tab.page.click("th[data-sort=freq]")
    tab.page.wait_for_function("document.body.dataset.table.startsWith('freq:desc:0')")
    assert close(tab.values("table.latents tbody [data-key=freq]"), np.sort(cols["freq"])[::-1][:50])
    tab.page.select_option("select[data-filter=cls]", "3")
    tab.page.wait_for_function("document.body.dataset.table.startsWith('freq:desc:0:') && "
                               "+document.body.dataset.table.split(':')[3] < 16384")  # fmt: skip
    total = int(tab.page.evaluate("document.body.dataset.table.split(':')[3]"))
    assert total == int((cols["best_class"] == 3).sum())
    want = np.flatnonzero(cols["best_class"] == 3)
    want = want[np.lexsort((want, -cols["freq"][want]))][:50]
    assert tab.ids("table.latents tbody tr") == [int(i) for i in want]
    assert set(tab.page.eval_on_selector_all("table.latents tbody td.l", "es => es.map(e => e.textContent)")) == {
        "class-3"
    }


# ---- latent pages ---------------------------------------------------------------------------


SNAPSHOT = """() => {
  const vals = s => [...document.querySelectorAll(s)].map(e => +e.dataset.value);
  return {h2: document.querySelector("h2").textContent, freq: vals(".stats [data-key=freq]"),
    max_act: vals(".stats [data-key=max_act]"), top_acts: vals(".top [data-key=act]"),
    top_imgs: [...document.querySelectorAll(".top figure")].map(e => +e.dataset.img),
    bin_acts: [...document.querySelectorAll(".bins [data-key=act]")].map(e => +e.dataset.value),
    neighbours: [...document.querySelectorAll(".neighbours a.latent")].map(e => +e.dataset.id),
    heats: document.querySelectorAll(".top canvas.heat").length, bars: document.querySelectorAll("svg.hist rect").length};
}"""


def latent_matches(tab, ex, i: int) -> None:
    """The latent page on screen shows latent ``i``'s data (one round trip to the browser)."""
    d, cols, got = ex["detail"][i], ex["table"], tab.page.evaluate(SNAPSHOT)
    assert got["h2"] == f"Latent {i}"
    assert close(got["freq"], [cols["freq"][i]]) and close(got["max_act"], [cols["max_act"][i]])
    assert close(got["top_acts"], [e["act"] for e in d["top"]])
    assert got["top_imgs"] == [e["img"] for e in d["top"]]
    assert close(got["bin_acts"], [e["act"] for q in d["quantiles"] for e in q["examples"]])
    assert got["neighbours"] == [n["id"] for n in d["neighbours"]]
    if d["top"]:  # a heatmap over every top image that has one, and the histogram's bars
        assert got["heats"] == sum(e["heat"] is not None for e in d["top"]) > 0
        nz = np.flatnonzero(d["hist"])  # bars from the first to the last non-zero bin
        assert got["bars"] == (nz[-1] - nz[0] + 1 if len(nz) else len(d["hist"]))


def test_fifty_random_latents_each_show_their_own_data_with_bounded_chunks(tab, explorers):
    ex = explorers[0]
    tab.open("#latent=0")
    ids = np.random.default_rng(7).choice(WIDTH, 50, replace=False)
    for i in [0, WIDTH - 1, *ids]:
        tab.go(f"#latent={i}")
        latent_matches(tab, ex, int(i))
    assert tab.page.evaluate("__explorer.lru.size") <= 8  # detail chunks kept: an LRU, not all of them


def test_search_by_latent_id_opens_that_latent(tab, explorers):
    tab.open()
    tab.page.fill("#jump-id", "12345")
    tab.page.press("#jump-id", "Enter")
    tab.wait("#latent=12345")
    latent_matches(tab, explorers[0], 12345)
    tab.page.keyboard.press("ArrowRight")  # the arrow keys step to the neighbouring ids
    tab.wait("#latent=12346")
    latent_matches(tab, explorers[0], 12346)


def test_a_latent_id_out_of_range_says_which_ids_exist(tab):
    tab.open("#latent=99999")
    assert "ids run from 0 to 16383" in tab.page.inner_text(".error")
    tab.go("#latent=%zz")  # not valid percent-encoding: said, not thrown
    assert 'no latent "%zz"' in tab.page.inner_text(".error")


def test_best_latent_link_of_a_class_opens_that_latent_with_that_class(tab, explorers):
    cols = explorers[0]["table"]
    tab.open("#classes")
    link = tab.page.locator("tr[data-class='4'] a.best").first
    i = int(link.get_attribute("data-id"))
    ap = cols["best_ap"][cols["best_class"] == 4]
    assert close([cols["best_ap"][i]], [np.nanmax(ap)])
    link.click()
    tab.wait(f"#latent={i}")
    latent_matches(tab, explorers[0], i)
    assert tab.page.inner_text(".best-class") == "class-4"


# ---- image -> patch -> latents --------------------------------------------------------------


def test_clicking_a_patch_lists_its_latents_and_activations(tab, explorers):
    ex = explorers[0]
    img = ex["meta"]["images"][3]["id"]
    tab.open(f"#image={img}")
    data = ex["images"][img]
    assert tab.ids("table.image-latents tbody tr") == data["top"]["ids"]
    assert close(tab.values("table.image-latents [data-key=act]"), data["top"]["acts"])
    for p in (0, 5, 15):
        tab.page.click(f".cell[data-patch='{p}']")
        tab.page.wait_for_function("p => document.querySelector('.patch-panel').dataset.patch === String(p)", arg=p)
        token = ex["meta"]["patch_of_token"].index(p)
        want = data["patches"][token]
        assert tab.ids("table.patch-latents tbody tr") == want["ids"]
        assert close(tab.values("table.patch-latents [data-key=act]"), want["acts"])
    assert tab.page.evaluate("location.hash") == f"#patch={img}/15"
    a = tab.page.locator("table.patch-latents a.latent").first
    if a.count():
        i = int(a.get_attribute("data-id"))
        a.click()
        tab.wait(f"#latent={i}")
        latent_matches(tab, ex, i)


def test_sweep_view_shows_the_image_top_latents_of_every_sae(tab, explorers):
    main, other = explorers
    img = main["meta"]["images"][1]["id"]
    tab.open(f"#sweep={img}")
    for ex, sae in ((main, "saeA"), (other, "saeB")):
        col = f".sweep-col[data-sae={sae}] "
        assert tab.ids(col + "a.latent") == ex["images"][img]["top"]["ids"]
        assert close(tab.values(col + "[data-key=act]"), ex["images"][img]["top"]["acts"])
    href = tab.page.locator(".sweep-col[data-sae=saeB] a.latent").first.get_attribute("href")
    tab.page.goto(urllib.parse.urljoin(tab.page.url, href))
    tab.wait(href[href.index("#") :])
    assert tab.page.inner_text("h2") == "Latent " + href.split("=")[1]


# ---- every link -----------------------------------------------------------------------------


def is_explorer(url: str) -> bool:
    return urllib.parse.urldefrag(url)[0].endswith("/explorer/index.html")


def kind(url: str) -> tuple[str, str]:
    """A view's kind: (its file, the view's name: "" for the table, "latent", "image=" for the image
    browser, "image" for one image, ...; "" off explorers)."""
    base, frag = urllib.parse.urldefrag(url)
    name, eq, arg = frag.partition("=")
    return base, name + ("=" if eq and not arg else "") if is_explorer(base) else ""  # "image=": the browser


def crawl(tab, home: str, max_views: int) -> tuple[int, int, int]:
    """Breadth-first over the pages and explorer views reachable from ``home``, a view of each kind
    before more of a kind seen. On every visited one, every link is checked (its file exists; an
    anchor on the same page exists; a latent it names exists), every image loaded, no error and no
    "null", "undefined" or "NaN" shown.
    Returns (views, kinds of view, links checked)."""
    seen, queue, kinds, widths, visited, checked = {home}, [home], set(), {}, 0, 0
    while queue and visited < max_views:
        url = queue.pop(next((j for j, u in enumerate(queue) if kind(u) not in kinds), 0))
        kinds.add(kind(url))
        base, frag = urllib.parse.urldefrag(url)
        if is_explorer(base):
            tab.open("#" + frag if frag else "", url=base)
            assert not tab.page.locator(".error").count(), f"{url}: {tab.page.inner_text('.error')}"
            widths.setdefault(base, tab.page.evaluate("__explorer.meta.width"))
            shown = re.search(r"\b(null|undefined|NaN|\[object \w+\])", tab.page.inner_text("#app"))
            assert not shown, f"{url} shows {shown.group(0)!r}"
        else:
            tab.page.goto(base)
        visited += 1
        broken = tab.page.evaluate(ALL_IMAGES)
        assert not broken, f"broken images on {url}: {broken}"
        for href in tab.page.eval_on_selector_all("a[href]", "es => es.map(e => e.href)"):
            checked += 1
            target, tfrag = urllib.parse.urldefrag(href)
            assert target.startswith("file://"), f"a link off the disk on {url}: {href}"
            assert os.path.isfile(urllib.parse.unquote(urllib.parse.urlparse(target).path)), (
                f"dead link on {url}: {href}"
            )
            if is_explorer(target):
                m = re.fullmatch(r"latent=(\d+)", tfrag)
                if m and target in widths:
                    assert int(m.group(1)) < widths[target], f"{href} on {url} names no latent of that SAE"
            elif tfrag and target == base:
                assert tab.page.locator(f"[id='{tfrag}']").count(), f"dead anchor on {url}: {href}"
            follow = href if is_explorer(target) else target if target.endswith(".html") else None
            if follow and follow not in seen:
                seen.add(follow)
                queue.append(follow)
    return visited, len(kinds), checked


def test_crawler_finds_no_dead_link_broken_image_or_error_on_any_view(tab, explorers):
    visited, kinds, checked = crawl(tab, tab.base, max_views=20)
    assert visited == 20 and kinds >= 10 and checked > 300, (visited, kinds, checked)


def test_a_folder_without_data_says_how_to_open_the_explorer(browser, tmp_path):
    from actcache.explorer_app import copy_app

    copy_app(str(tmp_path))
    t = Tab(browser, str(tmp_path))
    t.page.goto(t.base)
    t.page.wait_for_selector(".error")
    assert "cannot load data/meta.js" in t.page.inner_text(".error")
    assert t.errors  # reported on the console too
    t.page.close()


# ---- on real data: `actcache visuals` of two saved SAEs (a sweep) over a real cache ------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The small real world of tests/test_visuals.py (coloured shapes, a CLIP preprocessing
    checkpoint, a cache of colour activations), two saved SAEs on it with a held-out split, and
    `actcache visuals` of both (a sweep: explorers that link each other, the sweep page); with each
    SAE's encode of every cached patch row (n_imgs, 16, width)."""
    import torch
    from tests.test_visuals import D, colour_activations, save_run, write_checkpoint

    from actcache import cli, explorer
    from actcache.demo import make_image_folder
    from actcache.images import ImageFolder, metadata_data, open_dataset
    from actcache.loaders import OrderedLoader
    from actcache.protocol import Metadata
    from actcache.sae.modeling import SAE
    from actcache.writer import write_cache_from_array

    root = tmp_path_factory.mktemp("real")
    cfg = ImageFolder(make_image_folder(str(root / "images"), n_per_class=4))
    ds = open_dataset(cfg)
    ckpt = write_checkpoint(root / "ckpt")
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=16, cls_token=True, d_vit=D,
                  n_imgs=len(ds), max_patches_per_shard=10 * 17, data=metadata_data(cfg))  # fmt: skip
    acts = colour_activations(ds, ckpt)
    labels = [ds[i][1] for i in range(len(ds))]
    cache = write_cache_from_array(
        root / "cache", md, acts, labels=np.asarray(labels), class_names=list(ds.class_names)
    )
    held, runs = [1, 4, 6, 9, 11], []
    for seed, k in ((1, 4), (2, 6)):
        run = save_run(root / "runs" / md.hash / f"sae{seed}", cache, md, acts, seed=seed, k=k, sae_id=f"sae{seed}")
        with open(os.path.join(run, "run.json")) as fh:
            doc = json.load(fh)
        doc["split"] = {"rule": "test", "heldout_images": held}
        with open(os.path.join(run, "run.json"), "w") as fh:
            json.dump(doc, fh)
        runs.append(run)
    with pytest.MonkeyPatch.context() as mp:  # several table and detail chunks
        mp.setattr(explorer, "CHUNK", 16)
        mp.setattr(explorer, "DETAIL_CHUNK", 8)
        assert cli.main(["visuals", *runs, "--latents", "4", "--device", "cpu"]) == 0
    (batch,) = list(OrderedLoader(cache, batch_size=10**6, patches="image", layer=-2))
    encoded = {}
    for run in runs:
        with torch.no_grad():
            encoded[run] = SAE.load(run).eval().encode(batch["act"]).numpy().reshape(md.n_imgs, 16, -1)
    return {"runs": runs, "held": held, "encoded": encoded,
            "explorers": [os.path.join(r, "visuals", "explorer") for r in runs],
            "sweep_page": os.path.join(root, "runs", md.hash, "visuals", "index.html")}  # fmt: skip


def test_real_explorer_patch_click_lists_the_sae_encode_of_that_patch(browser, real):
    t = Tab(browser, real["explorers"][0])
    for n, img in enumerate(real["held"]):
        t.open(f"#image={img}")
        for p in range(16) if n == 0 else (0, 7, 15):
            t.page.click(f".cell[data-patch='{p}']")
            t.page.wait_for_function("p => document.querySelector('.patch-panel').dataset.patch === String(p)", arg=p)
            f = real["encoded"][real["runs"][0]][img, p]  # patches "image": token t is patch t
            want = np.argsort(-f, kind="stable")[:10]
            want = want[f[want] > 0]
            assert t.ids("table.patch-latents tbody tr")[:10] == want.tolist()
            assert close(t.values("table.patch-latents [data-key=act]")[:10], f[want])
    t.close()


def test_real_sweep_view_shows_each_sae_top_latents_of_the_image(browser, real):
    t = Tab(browser, real["explorers"][0])
    img = real["held"][2]
    t.open(f"#sweep={img}")
    for run in real["runs"]:
        f = real["encoded"][run][img].max(0)  # the image's top latents: by max over its tokens
        want = np.argsort(-f, kind="stable")[:32]
        want = want[f[want] > 0]
        col = f".sweep-col[data-sae={os.path.basename(run)}] "
        got = t.ids(col + "a.latent")
        assert got[:10] == want[:10].tolist()
        assert close(t.values(col + "[data-key=act]"), f[got])
    t.close()


def test_real_sweep_page_and_explorers_have_no_dead_link_broken_image_or_error(browser, real):
    t = Tab(browser, real["explorers"][0])
    visited, kinds, checked = crawl(t, "file://" + real["sweep_page"], max_views=16)
    assert visited == 16 and kinds >= 10 and checked > 50, (visited, kinds, checked)
    t.close()
