"""The explorer of an SAE: static files under RUN_DIR/visuals/explorer/ (docs/explorer-format.md).

    plan = ExplorerPlan.of(res)                          # quantile examples, images to show
    write_explorer(out_dir, res, plan, ExplorerInfo(...))  # data/*.js, app files, img/ links

Every latent is covered: its columns in a table chunk (CHUNK latents), its top images, quantile
examples, histogram and decoder neighbours in a detail chunk (DETAIL_CHUNK latents); each
explorable image (:func:`explore_images`) has its per-token latents. Values come from the pass
(actcache.topk), so they are the SAE's ``encode`` of the stored activations, rounded to 6
significant digits. The app (index.html, app.js) is package data in actcache/explorer_app/,
copied as is. Size: heat maps are kept for the first TOP_HEAT top images of each latent (width x
TOP_HEAT x T bytes before base64), the rest is about 1-2 KB per latent.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import shutil

import numpy as np

from actcache.errors import ActCacheError
from actcache.explorer_app import copy_app
from actcache.topk import LatentSummary, median_act, quantile_examples

FORMAT = 1
CHUNK = 1024
DETAIL_CHUNK = 256
TOP_HEAT = 8  # top examples per latent with a per-token heat map
N_NEIGHBOURS = 8
N_SWEEP_NEIGHBOURS = 3
MAX_EXPLORE = 256  # explorable images per SAE
FORK_MIN_CHUNKS = 16  # from this many detail chunks on, forked processes write them (one per core, 16 at most)
MATMUL_ELEMS = 2**25  # cosines computed at once (a chunk of rows against all of the other decoder)
APP_FILES = ("index.html", "app.js")
DEFINITIONS = {
    "freq": "fraction of this pass's tokens (meta.n_tokens) on which the latent is > 0",
    "max_act": "largest activation of the latent on any token of the pass",
    "mean_act": "mean activation over the tokens where the latent is > 0 (0 if it never fires)",
    "dec_norm": "L2 norm of the latent's decoder row",
    "best_class": "class with the highest mean per-image max of the latent on the eval's probed held-out images",
    "best_ap": "test-half average precision of the latent for best_class where it is that class's best "
    "latent in the eval (95% bootstrap interval best_ap_lo..best_ap_hi); chance = the class's prevalence",
    "quantiles": "5 equal-width bins from the median (from the histogram, exact to a factor 10^0.25) to the "
    "max of the latent's firing activations, each with up to 3 tokens sampled uniformly from it",
    "neighbours": "latents with the largest cosine between decoder rows",
    "patches": "per token: its top 16 latents > 0 by activation; image top: 32 latents by max over its tokens",
}


@dataclasses.dataclass
class ExplorerInfo:
    """What the explorer says about its SAE, beside the pass's statistics."""

    sae_id: str
    title: str
    d_model: int
    objective: str
    k: int | None
    patch_of_token: np.ndarray  # (T,) patch index per token, -1 for CLS / registers
    grid: int | None
    dec_W: np.ndarray  # (S, D) decoder rows
    probes: dict | None = None
    labels: np.ndarray | None = None  # (n_imgs,) label ids of the cache, or None
    class_names: list[str] = dataclasses.field(default_factory=list)
    images_dir: str | None = None  # the folder with <image>.jpg (None: no images)
    explore_source: str = "spread"
    sweep: list[dict] = dataclasses.field(default_factory=list)  # {"sae_id", "title", "href", "dec_W"}
    device: str = "cpu"  # where the decoder cosines are computed


@dataclasses.dataclass
class ExplorerPlan:
    """What the explorer shows, decided before its images are written."""

    quantiles: list[list[dict]]  # per latent, quantile_examples()
    image_ids: list[int]  # every image any view shows

    @classmethod
    def of(cls, res: LatentSummary) -> ExplorerPlan:
        med, mx = median_act(res.hist, res.hist_edges).tolist(), res.max_act.tolist()
        q = [quantile_examples(res, s, median=med[s], max_act=mx[s]) for s in range(res.width)]
        ids = set(res.top_img[res.top_img >= 0].tolist()) | set(res.ex_img.tolist())
        ids |= {e["img"] for bins in q for b in bins for e in b["examples"]}
        return cls(q, sorted(int(i) for i in ids))


def explore_images(split: dict | None, n_imgs: int, limit: int = MAX_EXPLORE) -> tuple[np.ndarray, str]:
    """(image ids, source): up to ``limit`` of the eval's held-out images (run.json "split"), else
    of all images, evenly spaced; the same for every SAE of a cache with the same split."""
    held = (split or {}).get("heldout_images")
    pool, source = (np.asarray(held, np.int64), "held-out") if held else (np.arange(n_imgs, dtype=np.int64), "spread")
    pool = pool[(pool >= 0) & (pool < n_imgs)]
    if len(pool) > limit:
        pool = pool[np.unique(np.linspace(0, len(pool) - 1, limit).round().astype(np.int64))]
    return pool, source


def decoder_neighbours(a_SD: np.ndarray, b_RD: np.ndarray, k: int, same: bool,
                       device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(ids (S, k), cos (S, k)): for each row of ``a_SD`` the ``k`` rows of ``b_RD`` with the largest
    cosine, best first (``same``: a row is not its own neighbour), computed on ``device``. Chunks
    of rows, so an S x R matrix never exists at once; a zero row has cosine 0 with everything."""
    import torch

    a = torch.nn.functional.normalize(torch.as_tensor(a_SD, dtype=torch.float32, device=device), dim=1)
    b = torch.nn.functional.normalize(torch.as_tensor(b_RD, dtype=torch.float32, device=device), dim=1)
    k = min(k, b.shape[0] - (1 if same else 0))
    ids = np.zeros((a.shape[0], max(k, 0)), np.int64)
    cos = np.zeros((a.shape[0], max(k, 0)), np.float32)
    if k <= 0:
        return ids, cos
    step = max(1, MATMUL_ELEMS // b.shape[0])
    for i in range(0, a.shape[0], step):
        c = a[i : i + step] @ b.T
        if same:
            rows = torch.arange(c.shape[0], device=c.device)
            c[rows, rows + i] = -torch.inf
        v, j = c.topk(k, dim=1)
        ids[i : i + step], cos[i : i + step] = j.cpu().numpy(), v.cpu().numpy()
    return ids, cos


# ---------------------------------------------------------------------------------------------
# Writing


def _num(v):
    """A finite number rounded to 6 significant digits, else None."""
    return float(f"{v:.6g}") if isinstance(v, (int, float)) and np.isfinite(v) else None


def _r6(values) -> list:
    """float32 values rounded to 6 significant digits, as JSON numbers."""
    return [float(f"{v:.6g}") for v in np.asarray(values, np.float64).tolist()]


def _write_chunk(data_dir: str, name: str, doc) -> int:
    path = os.path.join(data_dir, name + ".js")
    try:
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity: the SAE's activations are not finite
        raise ActCacheError(
            f"{path}: the explorer's data hold a non-finite number (NaN or inf): the SAE's activations are not "
            "finite on this cache; check its weights (`actcache eval` reports NaN losses) and retrain or pick an "
            "earlier checkpoint"
        ) from None
    text = f"actcache_chunk({json.dumps(name)}, {body});\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return len(text)


def _heats(res: LatentSummary, a: int, b: int) -> np.ndarray:
    """(b - a, TOP_HEAT, T) uint8: latents a..b-1's top heat maps, act / the latent's max * 255."""
    vmax = res.max_act[a:b, None, None].astype(np.float32)
    rel = np.divide(res.top_acts[a:b, :TOP_HEAT], vmax, out=np.zeros_like(res.top_acts[a:b, :TOP_HEAT]), where=vmax > 0)
    return np.round(np.clip(rel, 0, 1) * 255).astype(np.uint8)


def _best(res: LatentSummary, probes: dict | None) -> dict:
    """Per latent: best class, its AP and interval (see DEFINITIONS)."""
    S = res.width
    cls_S = np.full(S, -1, np.int64)
    ap = [[None] * S for _ in range(3)]
    if probes and "latent_best_class" in probes:
        got = np.asarray(probes["latent_best_class"][:S], np.int64)
        cls_S[: len(got)] = got
        for b in probes.get("best_latent_per_class", []):
            s, c = int(b["latent"]), int(b["class"])
            if 0 <= s < S and cls_S[s] == c and _num(b.get("ap")) is not None:
                ci = b.get("ci95") or [None, None]
                ap[0][s], ap[1][s], ap[2][s] = _num(b["ap"]), _num(ci[0]), _num(ci[1])
    return {"best_class": cls_S.tolist(), "best_ap": ap[0], "best_ap_lo": ap[1], "best_ap_hi": ap[2]}


def _tables(data_dir: str, res: LatentSummary, dec_norm: np.ndarray, best: dict) -> int:
    n = 0
    freq, mx, mean = res.freq, res.max_act, res.mean_act
    for c, a in enumerate(range(0, res.width, CHUNK)):
        b = min(a + CHUNK, res.width)
        doc = {"start": a, "freq": _r6(freq[a:b]), "max_act": _r6(mx[a:b]), "mean_act": _r6(mean[a:b]),
               "dec_norm": _r6(dec_norm[a:b]), **{k: v[a:b] for k, v in best.items()}}  # fmt: skip
        n += _write_chunk(data_dir, f"latents/table-{c:04d}", doc)
    return n


def _latent_detail(res: LatentSummary, s: int, quantiles: list[dict], nb: tuple, sweep_nb: list,
                   heat_KT: np.ndarray) -> dict:  # fmt: skip
    top = []
    for r, (i, act) in enumerate(zip(res.top_img[s].tolist(), res.top_score[s].tolist(), strict=True)):
        if i < 0:
            break
        heat = base64.b64encode(heat_KT[r].tobytes()).decode() if r < TOP_HEAT else None
        top.append({"img": i, "act": float(f"{act:.6g}"), "heat": heat})
    q = [{"lo": float(f"{b['lo']:.6g}"), "hi": float(f"{b['hi']:.6g}"),
          "examples": [{"img": e["img"], "act": float(f"{e['act']:.6g}"), "tok": e["tok"], "heat": None}
                       for e in b["examples"]]} for b in quantiles]  # fmt: skip
    return {
        "top": top,
        "quantiles": q,
        "hist": res.hist[s].tolist(),
        "neighbours": _near(nb, s),
        "sweep_neighbours": [{"sae_id": sid, **n} for sid, other in sweep_nb for n in _near(other, s)],
    }


def _near(nb: tuple, s: int) -> list[dict]:
    ids, cos = nb
    return [{"id": j, "cos": float(f"{v:.6g}")} for j, v in zip(ids[s].tolist(), cos[s].tolist(), strict=True)]


def _details(data_dir: str, res: LatentSummary, plan: ExplorerPlan, info: ExplorerInfo) -> int:
    nb = decoder_neighbours(info.dec_W, info.dec_W, N_NEIGHBOURS, same=True, device=info.device)
    sweep_nb = [(o["sae_id"], decoder_neighbours(info.dec_W, o["dec_W"], N_SWEEP_NEIGHBOURS, False, info.device))
                for o in info.sweep if o.get("dec_W") is not None and o["dec_W"].shape[1] == info.dec_W.shape[1]]  # fmt: skip
    state = (data_dir, res, plan, nb, sweep_nb)
    chunks = list(range(-(-res.width // DETAIL_CHUNK)))
    workers = min(_cores(), 16, len(chunks))
    if workers < 2 or len(chunks) < FORK_MIN_CHUNKS or "fork" not in multiprocessing.get_all_start_methods():
        return _detail_chunks(state, chunks)
    return _forked_details(state, chunks, workers)


def _detail_chunks(state: tuple, chunks: list[int]) -> int:
    """Write the given detail chunks; returns their bytes."""
    data_dir, res, plan, nb, sweep_nb = state
    n = 0
    for c in chunks:
        a, b = c * DETAIL_CHUNK, min((c + 1) * DETAIL_CHUNK, res.width)
        heat = _heats(res, a, b)
        lat = [_latent_detail(res, s, plan.quantiles[s], nb, sweep_nb, heat[s - a]) for s in range(a, b)]
        n += _write_chunk(data_dir, f"latents/detail-{c:04d}", {"start": a, "latents": lat})
    return n


_FORKED: tuple | None = None  # what forked writers inherit (set around the fork)


def _forked_chunks(chunks: list[int]) -> int:
    return _detail_chunks(_FORKED, chunks)


def _forked_details(state: tuple, chunks: list[int], workers: int) -> int:
    """The detail chunks by ``workers`` forked processes, which inherit the statistics (nothing
    is pickled but chunk numbers): building the records is Python, so threads would not scale.
    The children use numpy, json and base64 only, never torch."""
    global _FORKED
    parts = [p.tolist() for p in np.array_split(np.asarray(chunks), 2 * workers) if len(p)]
    _FORKED = state
    try:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            return sum(pool.map(_forked_chunks, parts))
    finally:
        _FORKED = None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _label(info: ExplorerInfo, i: int):
    return int(info.labels[i]) if info.labels is not None and info.labels[i] >= 0 else None


def _file(info: ExplorerInfo, i: int) -> str | None:
    return f"img/{i}.jpg" if info.images_dir is not None else None


def _images(data_dir: str, res: LatentSummary, info: ExplorerInfo) -> int:
    n = 0
    for e, i in enumerate(res.ex_img.tolist()):
        ids, acts = res.ex_ids[e], res.ex_acts[e]
        patches = [{"ids": ids[t][ids[t] >= 0].tolist(), "acts": _r6(acts[t][ids[t] >= 0])} for t in range(len(ids))]
        top = res.ex_top_ids[e] >= 0
        doc = {"id": i, "label": _label(info, i), "file": _file(info, i), "patches": patches,
               "top": {"ids": res.ex_top_ids[e][top].tolist(), "acts": _r6(res.ex_top_acts[e][top])}}  # fmt: skip
        n += _write_chunk(data_dir, f"images/{i:04d}", doc)
    return n


def _meta(res: LatentSummary, plan: ExplorerPlan, info: ExplorerInfo) -> dict:
    probes = info.probes or {}
    best = probes.get("best_latent_per_class", [])
    return {
        "format": FORMAT, "sae_id": info.sae_id, "title": info.title, "width": res.width, "d_model": info.d_model,
        "objective": info.objective, "k": info.k, "n_imgs": res.n_imgs, "n_tokens": res.n_tokens,
        "tokens_per_img": int(res.top_acts.shape[2]), "grid": info.grid,
        "patch_of_token": [int(p) for p in info.patch_of_token], "chunk": CHUNK, "detail_chunk": DETAIL_CHUNK,
        "top_heat": TOP_HEAT, "hist_edges": [float(f"{e:.6g}") for e in res.hist_edges],
        "classes": {str(c): n for c, n in enumerate(info.class_names)}, "probe_n": probes.get("n_test"),
        "probe_prevalence": {str(b["class"]): _num(b.get("chance")) for b in best},
        "images": [{"id": i, "label": _label(info, i), "file": _file(info, i)} for i in res.ex_img.tolist()],
        "image_thumbs": {str(i): _file(info, i) for i in plan.image_ids} if info.images_dir else {},
        "explore_source": info.explore_source,
        "sweep": [{k: o[k] for k in ("sae_id", "title", "href")} for o in info.sweep],
        "definitions": DEFINITIONS,
    }  # fmt: skip


def _link_images(out_dir: str, plan: ExplorerPlan, images_dir: str) -> None:
    """The explorer's img/ holds the images it shows, hard links to images_dir's (a copy where
    links are not possible)."""
    dst = os.path.join(out_dir, "img")
    os.makedirs(dst, exist_ok=True)
    for i in plan.image_ids:
        src = os.path.join(images_dir, f"{i}.jpg")
        try:
            os.link(src, os.path.join(dst, f"{i}.jpg"))
        except OSError:
            shutil.copyfile(src, os.path.join(dst, f"{i}.jpg"))


def write_explorer(out_dir: str, res: LatentSummary, plan: ExplorerPlan, info: ExplorerInfo) -> int:
    """Write the explorer into ``out_dir`` (a new folder); returns the bytes of its data files."""
    if not res.has_explorer_stats:
        raise ValueError("the summary lacks the explorer's statistics (made before STATS_VERSION 2): recompute it")
    data_dir = os.path.join(out_dir, "data")
    for sub in ("latents", "images"):
        os.makedirs(os.path.join(data_dir, sub), exist_ok=True)
    dec_norm = np.linalg.norm(np.asarray(info.dec_W, np.float64), axis=1)
    n = _tables(data_dir, res, dec_norm, _best(res, info.probes))
    n += _details(data_dir, res, plan, info)
    n += _images(data_dir, res, info)
    n += _write_chunk(data_dir, "meta", _meta(res, plan, info))
    copy_app(out_dir)
    if info.images_dir is not None:
        _link_images(out_dir, plan, info.images_dir)
    return n
