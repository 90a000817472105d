"""The visuals page as one small file (RUN_DIR/visuals.html), for `snakemake --report`.

A Snakemake report embeds each HTML result as a ``data:`` URL, and Chromium refuses URLs longer
than 2 MiB (the frame stays blank). So the one-file page is built to a byte budget: every image
it uses is inlined (heatmap sprites and plots as they are, top images as small thumbnails), and
it shows as many of the full page's latent cards as fit, evenly spread over the frequency
ranking, with a note naming the full page. At PAGE_BUDGET bytes a page stays under Chromium's
limit after base64 (4/3), and a sweep of 20 SAEs gives a report of about 35 MB.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re

import numpy as np
import PIL.Image

from actcache.topk import LatentSummary
from actcache.visuals_html import render_page
from actcache.visuals_probes import annotate_page

PAGE_BUDGET = 1_250_000  # bytes of one page; its data: URL (base64) stays under Chromium's 2 MiB
THUMB_SIDE = 64  # top images are inlined at most this large
THUMB_QUALITY = 70
_ASSET = re.compile(r'(src="|url\()((?:img/)?[A-Za-z0-9_./-]+\.(?:png|jpg))(?="|\))')
_TOP_IMG = re.compile(r'<img src="(img/[0-9]+\.jpg)"')
# Sets each top image's src from one table, so an image shown on several cards is inlined once.
_SET_SRC = (
    "<script>(function () {var T = %s; Array.prototype.forEach.call(document.querySelectorAll('img[data-img]'), "
    "function (i) { if (T[i.dataset.img]) { i.src = T[i.dataset.img]; } });})();</script>"
)
_MIME = {"png": "image/png", "jpg": "image/jpeg"}
# The explorer from RUN_DIR/visuals.html (opened from disk; a report's data: URL cannot follow it).
EXPLORER_FROM_RUN = "visuals/explorer/index.html"
MAX_ASSET_BYTES = 64 * 2**20  # a plot or a top image is kilobytes; a larger file is left out of the page


class InlineAssets:
    """Relative image paths of a page -> ``data:`` URIs, each file read (and thumbnailed) once."""

    def __init__(self, base_dir: str, thumb_side: int | None = THUMB_SIDE):
        self.base_dir, self.thumb_side = base_dir, thumb_side
        self.uris: dict[str, str | None] = {}

    def uri(self, rel: str) -> str | None:
        if rel not in self.uris:
            path = os.path.join(self.base_dir, rel)
            self.uris[rel] = None
            if os.path.isfile(path) and os.path.getsize(path) <= MAX_ASSET_BYTES:  # a regular file, bounded
                data = self._thumbnail(path) if self._is_top_image(rel) else _read(path)
                self.uris[rel] = f"data:{_MIME[rel.rsplit('.', 1)[1]]};base64,{base64.b64encode(data).decode()}"
        return self.uris[rel]

    def _is_top_image(self, rel: str) -> bool:
        return self.thumb_side is not None and rel.startswith("img/") and rel.endswith(".jpg")

    def _thumbnail(self, path: str) -> bytes:
        with PIL.Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((self.thumb_side, self.thumb_side), PIL.Image.Resampling.BICUBIC)
            out = io.BytesIO()
            im.save(out, "JPEG", quality=THUMB_QUALITY, optimize=True)
        return out.getvalue()

    def inline(self, page: str) -> str:
        """``page`` with every relative image it names replaced by its data: URI (a missing file
        keeps its path, so the page reports it as broken); top images from one table, each once."""
        table: dict[str, str] = {}

        def top(m: re.Match) -> str:
            got = self.uri(m.group(1))
            if got is None:
                return m.group(0)
            table[m.group(1)] = got
            return f'<img data-img="{m.group(1)}"'

        def sub(m: re.Match) -> str:
            got = self.uri(m.group(2))
            return m.group(0) if got is None else m.group(1) + got

        page = _ASSET.sub(sub, _TOP_IMG.sub(top, page))
        if table:
            page = page.replace("</body>", _SET_SRC % json.dumps(table, sort_keys=True) + "\n</body>", 1)
        return page


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def spread(latents: np.ndarray, m: int) -> np.ndarray:
    """``m`` of ``latents`` (ordered by frequency) evenly spaced over that order."""
    if m >= len(latents):
        return latents
    if m <= 0:
        return latents[:0]
    return latents[np.unique(np.linspace(0, len(latents) - 1, m).round().astype(int))]


def one_file_page(res: LatentSummary, latents: np.ndarray, info: dict, labels: dict[int, str],
                  patch_of_token: np.ndarray, heat: bool, images: bool, plots: list[str], notes: list[str],
                  base_dir: str, full_page: str, budget: int | None = None,
                  probes: dict | None = None, dense_frac: float = 0.1,
                  explorer: bool = True) -> tuple[str, np.ndarray]:  # fmt: skip
    """(page, latents shown): the page of ``base_dir`` (a visuals folder) in one file of at most
    ``budget`` bytes (default PAGE_BUDGET) where that is possible, with as many of ``latents`` as
    fit (the page's size grows with the count of cards). ``probes`` (eval.json "probes") adds each
    card's best class and the best-latent table, as on the full page."""
    budget = PAGE_BUDGET if budget is None else budget
    href = EXPLORER_FROM_RUN if explorer else None
    assets = InlineAssets(base_dir)

    def build(m: int) -> tuple[str, np.ndarray]:
        shown = spread(latents, m)
        extra = []
        if len(shown) < len(latents):
            extra.append(
                f"This one-file copy of the page shows {len(shown):,} of its {len(latents):,} latent cards, with "
                f"small images, so that a browser can open it inside a report; the full page is {full_page}."
            )
        page = render_page(res, shown, info, labels, patch_of_token, heat, images, plots, [*notes, *extra], lazy=False,
                           dense_frac=dense_frac, explorer=href)  # fmt: skip
        return assets.inline(annotate_page(page, probes, href)), shown

    def fits(got: tuple[str, np.ndarray]) -> bool:
        return len(got[0].encode("utf-8")) <= budget

    # Doubling from a few cards, then halving: only the images of the pages tried are thumbnailed.
    n = len(latents)
    lo, hi, best = 0, n + 1, None  # a page of lo cards fits (best), one of hi cards does not
    m = min(8, n)
    while lo < m < hi:
        got = build(m)
        if fits(got):
            lo, best, m = m, got, min(2 * m, n)
        else:
            hi = m
    while lo < hi - 1:
        mid = (lo + hi) // 2
        got = build(mid)
        if fits(got):
            lo, best = mid, got
        else:
            hi = mid
    return best or build(0)
