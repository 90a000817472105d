"""The HTML page of `actcache visuals`: latent cards, their top images with patch heatmaps, histograms.

Everything the page shows lives next to it (relative paths, no external resources), so the
``visuals/`` folder can be copied anywhere:

    index.html           the page: a grid of ``.latent-card`` elements, sortable (inline JS)
    img/<image>.jpg      each top image once, cropped as the ViT saw it (the checkpoint's resize + crop)
    img/heat/<latent>.png  one sprite per latent: the patch-grid heatmaps of its top images side by side
    curves.png, freq.png training curves and the firing-frequency plot (written by actcache.visuals)

A heatmap is drawn in the browser over its image (CSS background, ``image-rendering: pixelated``
so each cell is one ViT patch); colour and opacity grow with the activation relative to the
latent's largest one. Histograms are inline SVG.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import html
import logging
import os

import numpy as np
import PIL.Image

from actcache.topk import LatentSummary

log = logging.getLogger(__name__)

MAX_SIDE = 224  # images are stored at most this large
MIN_HIST_BINS = 8
# Anchors of matplotlib's "inferno" colormap (0 .. 1), interpolated linearly.
_CMAP = np.array([(0, 0, 4), (87, 16, 110), (188, 55, 84), (249, 142, 9), (252, 255, 164)], np.float64)
SORTS = (("freq-desc", "frequency, most frequent first"), ("freq-asc", "frequency, rarest first"),
         ("mean-desc", "mean activation, largest first"), ("max-desc", "max activation, largest first"),
         ("id-asc", "latent id"))  # fmt: skip
SELECTIONS = ("spread", "frequent", "rare", "strongest")


def select_latents(res: LatentSummary, n: int, how: str = "spread", ids: list[int] | None = None) -> np.ndarray:
    """Latents to show, ordered by frequency (most frequent first).

    ``spread``: ``n`` latents evenly spaced over the frequency ranking of the latents that fire
    (rare to common); ``frequent`` / ``rare``: the ``n`` most / least frequent ones that fire;
    ``strongest``: the ``n`` with the largest max activation. ``ids`` overrides the selection.
    """
    freq = res.freq
    if ids is not None:
        chosen = np.asarray(sorted(set(ids)), np.int64)
    else:
        alive = np.flatnonzero(res.fire_count > 0)
        by_freq = alive[np.argsort(-freq[alive], kind="stable")]
        if how == "spread":
            chosen = (
                by_freq[np.unique(np.linspace(0, len(by_freq) - 1, min(n, len(by_freq))).round().astype(int))]
                if len(by_freq)
                else by_freq
            )
        elif how == "frequent":
            chosen = by_freq[:n]
        elif how == "rare":
            chosen = by_freq[::-1][:n]
        elif how == "strongest":
            chosen = alive[np.argsort(-res.max_act[alive], kind="stable")][:n]
        else:
            raise ValueError(f"unknown selection {how!r}; use one of {SELECTIONS}")
    return chosen[np.argsort(-freq[chosen], kind="stable")]


def colormap(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> RGB uint8 (inferno-like)."""
    pos = np.clip(x, 0, 1) * (len(_CMAP) - 1)
    lo = np.minimum(pos.astype(int), len(_CMAP) - 2)
    t = (pos - lo)[..., None]
    return np.round(_CMAP[lo] * (1 - t) + _CMAP[lo + 1] * t).astype(np.uint8)


def heat_sprite(acts_KT: np.ndarray, patch_of_token: np.ndarray, grid: int, vmax: float) -> np.ndarray:
    """(grid, K * grid, 4) RGBA: the patch-grid heatmap of each top image side by side."""
    K = acts_KT.shape[0]
    is_patch = patch_of_token >= 0
    cells = np.zeros((K, grid * grid), np.float64)
    cells[:, patch_of_token[is_patch]] = acts_KT[:, is_patch]
    rel = np.clip(cells / vmax, 0, 1) if vmax > 0 else np.zeros_like(cells)
    rgba = np.zeros((K, grid * grid, 4), np.uint8)
    rgba[..., :3] = colormap(0.25 + 0.75 * rel)
    rgba[..., 3] = np.where(rel > 0, np.round(255 * (0.25 + 0.5 * rel)), 0).astype(np.uint8)
    return rgba.reshape(K, grid, grid, 4).transpose(1, 0, 2, 3).reshape(grid, K * grid, 4)


def svg_histogram(counts: np.ndarray, edges: np.ndarray, width: int = 300, height: int = 56) -> str:
    """An inline SVG bar chart of one latent's activation histogram (log-spaced bins, trimmed)."""
    nz = np.flatnonzero(counts)
    if not len(nz):
        return '<svg class="hist" width="0" height="0"></svg>'
    a, b = max(0, nz[0] - 1), min(len(counts), nz[-1] + 2)
    while b - a < MIN_HIST_BINS and (a > 0 or b < len(counts)):  # at least two decades of context
        a, b = max(0, a - 1), min(len(counts), b + 1)
    c = counts[a:b].astype(np.float64)
    bw = width / len(c)
    top = c.max()
    bars = "".join(
        f'<rect x="{i * bw:.1f}" y="{height - 14 - h:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}"/>'
        for i, h in enumerate((height - 16) * c / top)
        if h > 0
    )
    lo, hi = _num(edges[a]), _num(edges[b])
    return (
        f'<svg class="hist" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="activation histogram">{bars}'
        f'<text x="0" y="{height - 2}">{lo}</text><text x="{width}" y="{height - 2}" text-anchor="end">{hi}</text>'
        f'<text x="{width / 2}" y="{height - 2}" text-anchor="middle">activation (log scale)</text></svg>'
    )


def _num(x: float) -> str:
    x = float(x)
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def id_ranges(ids: np.ndarray) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    ids = np.asarray(ids, np.int64)
    if not len(ids):
        return ""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    parts = []
    for run in np.split(ids, breaks):
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


@dataclasses.dataclass
class ImageSource:
    """Where the page's images come from: a dataset (``ds[i] -> (PIL, label)``) and a display
    transform (an ImageTransform: the checkpoint's resize + crop; the page uses ``geometry_image``)."""

    dataset: object | None
    transform: object | None
    note: str = ""


def page_workers() -> int:
    """Threads (or processes) that write the page's images: the cores, 4 to 32."""
    return max(4, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 4))


# From this many images on, the page's images are written by forked processes instead of threads.
# Each image (decode or generate, resize, crop, JPEG encode) spends part of its CPU time in Python
# between PIL's calls, which holds the GIL, so threads stop scaling with the cores, while forking
# a worker costs little next to a large page. Where fork is not available, threads.
FORK_MIN_IMAGES = 256
_FORKED_SOURCE: ImageSource | None = None  # the image source forked workers inherit (set around the fork)


def _render_one(src: ImageSource, i: int, img_dir: str) -> tuple[int, str]:
    """Write ``img_dir/<i>.jpg``; returns (image, caption label)."""
    img, label = src.dataset[int(i)]
    out = src.transform.geometry_image(img)  # the checkpoint's resize + crop, as the ViT saw it
    if max(out.size) > MAX_SIDE:
        out.thumbnail((MAX_SIDE, MAX_SIDE), PIL.Image.Resampling.BICUBIC)
    out.save(os.path.join(img_dir, f"{int(i)}.jpg"), quality=88)
    names = getattr(src.dataset, "class_names", None)
    text = names[label] if names and 0 <= label < len(names) else ("" if label < 0 else f"label {label}")
    return int(i), text


def _render_chunk(image_ids: list[int], img_dir: str) -> list[tuple[int, str]]:
    """In a forked worker: the source it inherited."""
    return [_render_one(_FORKED_SOURCE, i, img_dir) for i in image_ids]


def image_jobs(src: ImageSource, image_ids: list[int], img_dir: str,
               pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:  # fmt: skip
    """Submit to ``pool`` (threads) the writing of ``img_dir/<i>.jpg`` for every image; each
    future's result is (image, caption label)."""
    os.makedirs(img_dir, exist_ok=True)
    return [pool.submit(_render_one, src, i, img_dir) for i in image_ids]


class ForkedImages:
    """The page's images written by ``workers`` forked processes, which inherit the image source
    (a dataset of any size, nothing pickled but image ids and labels). ``futures``: each a list of
    (image, caption label); ``close()`` waits for the workers to exit (``cancel=True``: drops what
    has not started). Made only where fork exists and for at least FORK_MIN_IMAGES images
    (:func:`image_writer`)."""

    def __init__(self, src: ImageSource, image_ids: list[int], img_dir: str, workers: int):
        import multiprocessing

        global _FORKED_SOURCE
        os.makedirs(img_dir, exist_ok=True)
        n = min(workers, max(1, len(image_ids) // 64))
        chunks = [c.tolist() for c in np.array_split(np.asarray(image_ids, np.int64), 4 * n) if len(c)]
        self.pool = concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
        _FORKED_SOURCE = src
        try:  # with fork, the first submit starts every worker
            self.futures = [self.pool.submit(_render_chunk, c, img_dir) for c in chunks]
        except BaseException:
            self.pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            _FORKED_SOURCE = None

    def labels(self) -> dict[int, str]:
        return dict(x for f in self.futures for x in f.result())

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)


def image_writer(src: ImageSource, image_ids: list[int], img_dir: str, pool: concurrent.futures.Executor):
    """Start writing the page's images: forked processes (:class:`ForkedImages`) for a page of
    FORK_MIN_IMAGES or more where fork exists, else ``pool``'s threads. Returns ``(labels, stop)``:
    ``labels()`` waits and gives {image: caption label}; ``stop()`` cancels what has not started."""
    import multiprocessing

    if len(image_ids) >= FORK_MIN_IMAGES and "fork" in multiprocessing.get_all_start_methods():
        forked = ForkedImages(src, image_ids, img_dir, page_workers())

        def labels() -> dict[int, str]:
            try:
                return forked.labels()
            finally:
                forked.close()

        return labels, lambda: forked.close(cancel=True)
    jobs = image_jobs(src, image_ids, img_dir, pool)

    def stop() -> None:
        for job in jobs:
            job.cancel()

    return (lambda: dict(job.result() for job in jobs)), stop


def write_sprites(res: LatentSummary, latents: np.ndarray, patch_of_token: np.ndarray, grid: int, heat_dir: str,
                  pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:  # fmt: skip
    """Submit to ``pool`` the writing of ``heat_dir/<latent>.png`` for every latent; returns the futures."""
    os.makedirs(heat_dir, exist_ok=True)
    max_act = res.max_act

    def one(s: int) -> None:
        sprite = heat_sprite(res.top_acts[s], patch_of_token, grid, float(max_act[s]))
        PIL.Image.fromarray(sprite, "RGBA").save(os.path.join(heat_dir, f"{int(s)}.png"), optimize=False)

    return [pool.submit(one, s) for s in latents]


# ---------------------------------------------------------------------------------------------
# The page

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:18px 0 6px}
table.info{border-collapse:collapse;font-size:13px} table.info td{padding:1px 10px 1px 0;vertical-align:top}
table.info td:first-child{color:#666}
.plots img{max-width:100%;height:auto;margin-right:12px;border:1px solid #ddd;background:#fff}
.controls{margin:12px 0;display:flex;gap:12px;align-items:center;flex-wrap:wrap}
#grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:12px}
.latent-card{min-width:0}
.latent-card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px}
.card-head{display:flex;gap:10px;flex-wrap:wrap;align-items:baseline;margin-bottom:6px}
.card-head b{font-size:15px} .card-head span{color:#555;font-size:12px}
.tops{display:grid;grid-template-columns:repeat(4,minmax(0,1fr));gap:4px}
.tops figure{margin:0;min-width:0}
.tops figcaption{font-size:10px;line-height:1.25;color:#555;overflow-wrap:anywhere}
.tops figcaption span{display:block}
.thumb{position:relative;width:100%;aspect-ratio:1;background:#888;overflow:hidden}
.thumb img{position:absolute;inset:0;width:100%;height:100%;object-fit:cover}
.heat{position:absolute;inset:0;background-image:var(--heat);background-repeat:no-repeat;image-rendering:pixelated}
.thumb:hover .heat{opacity:0}
svg.hist{display:block;margin-top:6px;overflow:visible} svg.hist rect{fill:#4a6fa5} svg.hist text{font-size:9px;fill:#666}
.note{color:#8a5a00} details{margin:6px 0} .ids{font-family:monospace;font-size:12px;word-break:break-word}
"""

_JS = """
(function () {
  var grid = document.getElementById('grid'), sel = document.getElementById('sort');
  function sortBy(v) {
    var parts = v.split('-'), key = parts[0], sign = parts[1] === 'asc' ? 1 : -1;
    var cards = Array.prototype.slice.call(grid.children);
    cards.sort(function (a, b) {
      return sign * (parseFloat(a.dataset[key]) - parseFloat(b.dataset[key])) ||
        parseInt(a.dataset.id, 10) - parseInt(b.dataset.id, 10);
    });
    cards.forEach(function (c) { grid.appendChild(c); });
    sel.value = v;
  }
  sel.addEventListener('change', function () {
    sortBy(sel.value);
    history.replaceState(null, '', '#sort=' + sel.value);
  });
  var m = location.hash.match(/sort=([a-z]+-(?:asc|desc))/);
  if (m && sel.querySelector('option[value="' + m[1] + '"]')) { sortBy(m[1]); }
  window.addEventListener('load', function () {
    var bad = Array.prototype.filter.call(document.images, function (i) {
      return i.complete && i.naturalWidth === 0;
    }).length;
    document.body.dataset.brokenImages = String(bad);
    if (bad) {
      var note = document.getElementById('broken');
      note.textContent = bad + ' image(s) failed to load: copy the whole visuals/ folder, img/ included.';
      note.hidden = false;
    }
  });
})();
"""


def _card(s: int, res: LatentSummary, labels: dict[int, str], patch_of_token: np.ndarray, heat: bool,
          images: bool, lazy: bool = True, explorer: str | None = None) -> str:  # fmt: skip
    freq, mean, mx = float(res.freq[s]), float(res.mean_act[s]), float(res.max_act[s])
    K = res.top_img.shape[1]
    cls_tok = np.flatnonzero(patch_of_token < 0)
    load = ' loading="lazy"' if lazy else ""
    figs = []
    for r in range(K):
        i = int(res.top_img[s, r])
        if i < 0:
            break
        score = float(res.top_score[s, r])
        inner = f'<img src="img/{i}.jpg" alt="image {i}"{load}>' if images else ""
        if heat:  # the sprite is named once per card (--heat on .tops), each cell shows its slice
            x = 100.0 * r / (K - 1) if K > 1 else 0.0
            inner += f'<div class="heat" style="background-size:{K * 100}% 100%;background-position:{x:.4f}% 0"></div>'
        extra = f" CLS {_num(res.top_acts[s, r, cls_tok[0]])}" if len(cls_tok) else ""
        label = html.escape(labels.get(i, ""))
        where = f"#{i}{(' · ' + label) if label else ''}"
        figs.append(
            f'<figure title="{_num(score)}{extra} · {where}"><div class="thumb">{inner}</div>'
            f"<figcaption><span>{_num(score)}{extra}</span><span>{where}</span></figcaption></figure>"
        )
    tops_style = f' style="--heat:url(img/heat/{s}.png)"' if heat else ""
    more = f'<a href="{html.escape(explorer)}#latent={s}">explore</a>' if explorer else ""
    return (
        f'<div class="latent-card" id="latent-{s}" data-id="{s}" data-freq="{freq:.6e}" data-mean="{mean:.6e}" '
        f'data-max="{mx:.6e}"><div class="card-head"><b>latent {s}</b><span>freq {freq:.2e}</span>'
        f"<span>mean {_num(mean)}</span><span>max {_num(mx)}</span>{more}</div>"
        f'<div class="tops"{tops_style}>{"".join(figs)}</div>{svg_histogram(res.hist[s], res.hist_edges)}</div>'
    )


def render_page(res: LatentSummary, latents: np.ndarray, info: dict, labels: dict[int, str],
                patch_of_token: np.ndarray, heat: bool, images: bool, plots: list[str], notes: list[str],
                lazy: bool = True, dense_frac: float = 0.1,
                explorer: str | None = "explorer/index.html") -> str:  # fmt: skip
    """The whole index.html as a string (``info``: rows of the header table; ``lazy``: images load
    as they scroll into view; ``dense_frac``: the run's, for the list of dense latents;
    ``explorer``: the href of the SAE's explorer, which holds every latent, or None)."""
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in info.items())
    dead = np.flatnonzero(res.fire_count == 0)
    dense = np.flatnonzero(res.freq > dense_frac)
    cards = "\n".join(_card(int(s), res, labels, patch_of_token, heat, images, lazy, explorer) for s in latents)
    every = (f' Every latent, with search, quantile examples, neighbours and image -> patch -> latents: '
             f'<a id="explorer" href="{esc(explorer)}">the explorer</a>.' if explorer else "")  # fmt: skip
    options = "".join(f'<option value="{v}">{esc(t)}</option>' for v, t in SORTS)
    plot_html = "".join(f'<img src="{esc(p)}" alt="{esc(p)}">' for p in plots)
    note_html = "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
    title = f"SAE {info.get('SAE', '')}" + (f" ({info['what']})" if info.get("what") else "") + " latents"
    dead_html = (
        f"<details><summary>{len(dead):,} latents silent in this page's pass (no firing on its {res.n_tokens:,} "
        f"tokens of {res.n_imgs:,} images; the dead and almost-dead counts above are eval.json's, over their "
        "window)</summary>"
        f'<div class="ids">{esc(id_ranges(dead))}</div></details>'
        if len(dead) else f"<p>Every latent fired on this page's {res.n_tokens:,} tokens.</p>"
    )  # fmt: skip
    dense_html = (
        f"<details><summary>{len(dense):,} latents firing on more than {dense_frac:g} of this page's "
        f"{res.n_tokens:,} tokens (the run's dense_frac)</summary>"
        f'<div class="ids">{esc(id_ranges(dense))}</div></details>'
        if len(dense) else ""
    )  # fmt: skip
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>{esc(title)}</title><style>{_CSS}</style></head>
<body data-n-cards="{len(latents)}">
<h1>{esc(title)}</h1>
<table class="info">{rows}</table>
{note_html}<p class="note" id="broken" hidden></p>
<div class="plots">{plot_html}</div>
<h2>Latents</h2>
{dead_html}{dense_html}
<div class="controls"><span>Showing {len(latents):,} of {res.width:,} latents.{every}</span>
<label>Sort by <select id="sort">{options}</select></label>
<span>Heatmap: activation per patch, relative to the latent's max (hover an image to hide it).</span></div>
<div id="grid">
{cards}
</div>
<script>{_JS}</script>
</body></html>
"""


def write_page(path: str, page: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
