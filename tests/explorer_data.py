"""A synthetic explorer data folder (docs/explorer-format.md, format 1) for tests and benchmarks.

``write_synthetic_explorer(out, width)`` writes the app (copied from the package) and a data folder
for any width from numpy: random, but internally consistent where a view or a test compares
(each latent's ``max_act`` is its top example's act, the examples are sorted, an image's ``top``
is the max over its tokens' lists, the quantile bins lie between the median and the max, the
probe's prevalence is the class share of the images). It returns the values written, so a test
compares what the browser shows with them. Not a stand-in for ``actcache visuals``: real data
comes from the visuals pass.
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import PIL.Image

from actcache.explorer_app import copy_app

N_CLASSES, N_TOP, TOP_HEAT, N_BINS, N_PER_BIN, N_NEIGHBOURS, PATCH_TOP, IMAGE_TOP = 10, 10, 8, 5, 3, 8, 16, 32


def r6(x) -> float:
    """float32 rounded to 6 significant digits, as the contract writes values."""
    return float(f"{float(np.float32(x)):.6g}")


def write_chunk(data_dir: str, name: str, payload) -> None:
    path = os.path.join(data_dir, name + ".js")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"actcache_chunk({json.dumps(name)}, {json.dumps(payload, separators=(',', ':'))});\n")


def thumbnails(img_dir: str, n: int, side: int, rng) -> dict[str, str]:
    """``n`` small PNGs (a colour per image, a brighter square somewhere) named by image id."""
    os.makedirs(img_dir, exist_ok=True)
    out = {}
    for i in range(n):
        a = np.empty((side, side, 3), np.uint8)
        a[:] = rng.integers(30, 200, 3)
        y, x = rng.integers(0, side // 2, 2)
        a[y : y + side // 3, x : x + side // 3] = 240
        PIL.Image.fromarray(a).save(os.path.join(img_dir, f"{i}.png"))
        out[str(i)] = f"img/{i}.png"
    return out


def r6s(x) -> list[float]:
    """``r6`` of every value of an array (a list, in order)."""
    return [float(f"{v:.6g}") for v in np.asarray(x, np.float32).astype(np.float64).ravel().tolist()]


def _table(width: int, chunk: int, rng, prevalence: np.ndarray):
    freq = rng.uniform(1e-5, 0.08, width)
    freq[rng.random(width) < 0.02] = 0.0  # dead latents
    max_act = rng.uniform(0.5, 20.0, width)
    mean_act = max_act * rng.uniform(0.1, 0.4, width)
    dec_norm = rng.uniform(0.8, 1.2, width)
    best_class = rng.integers(0, N_CLASSES, width)
    best_ap = np.minimum(1.0, prevalence[best_class] + rng.uniform(0, 0.9, width))
    best_class[freq == 0], best_ap[freq == 0] = -1, np.nan
    keep = [int(np.nanargmax(np.where(best_class == c, best_ap, np.nan))) for c in range(N_CLASSES)]
    best_ap[np.setdiff1d(np.arange(width), keep)] = np.nan  # AP only where the latent is its class's best
    half = rng.uniform(0.01, 0.08, width)
    cols = {"freq": freq, "max_act": max_act, "mean_act": mean_act, "dec_norm": dec_norm,
            "best_class": best_class, "best_ap": best_ap}  # fmt: skip
    chunks = []
    for start in range(0, width, chunk):
        s = slice(start, start + chunk)
        ap = [None if np.isnan(v) else r6(v) for v in best_ap[s]]
        chunks.append({
            "start": start, "freq": r6s(freq[s]), "max_act": r6s(max_act[s]),
            "mean_act": r6s(mean_act[s]), "dec_norm": r6s(dec_norm[s]),
            "best_class": [int(v) for v in best_class[s]], "best_ap": ap,
            "best_ap_lo": [None if v is None else r6(max(0, v - h)) for v, h in zip(ap, half[s], strict=True)],
            "best_ap_hi": [None if v is None else r6(min(1, v + h)) for v, h in zip(ap, half[s], strict=True)],
        })  # fmt: skip
    return cols, chunks


def _examples(rng, imgs, acts_NE: np.ndarray, m_N: np.ndarray, T: int, heats: int) -> list[list[dict]]:
    """Per latent, its examples {img, act, tok, heat}: ``tok`` is where the act was taken (never the
    CLS token 0); the first ``heats`` examples carry a heat (act / max * 255 at ``tok``, at most half
    that elsewhere), the others null."""
    N, E = acts_NE.shape
    tok = rng.integers(1, T, (N, E))
    b64 = [[None] * E for _ in range(N)]
    if heats:
        rel = acts_NE[:, :heats] / m_N[:, None]
        heat = (rng.random((N, heats, T)) * 127 * rel[..., None]).astype(np.uint8)
        heat[np.arange(N)[:, None], np.arange(heats)[None, :], tok[:, :heats]] = np.clip(np.round(rel * 255), 0, 255)
        for n in range(N):
            b64[n][:heats] = [base64.b64encode(h.tobytes()).decode() for h in heat[n]]
    acts, imgs_l, tok_l = np.asarray(r6s(acts_NE)).reshape(N, E).tolist(), imgs.tolist(), tok.tolist()
    return [
        [
            {"img": g, "act": a, "tok": t, "heat": h}
            for g, a, t, h in zip(imgs_l[n], acts[n], tok_l[n], b64[n], strict=True)
        ]
        for n in range(N)
    ]


def _details(
    rng,
    start: int,
    stop: int,
    width: int,
    cols: dict,
    n_imgs: int,
    T: int,
    n_hist: int,
    sweep_ids,
    n_top: int,
    per_bin: int,
):
    """Latents ``start .. stop``'s detail entries, vectorised over the chunk."""
    N = stop - start
    m_N = np.asarray(r6s(cols["max_act"][start:stop]), np.float64)
    top_NK = np.sort(rng.uniform(0.2, 1.0, (N, n_top)), 1)[:, ::-1] * m_N[:, None]
    top_NK[:, 0] = m_N
    top_imgs = rng.random((N, n_imgs)).argsort(1)[:, :n_top]
    edges_NB = 0.3 * m_N[:, None] + 0.7 * m_N[:, None] * np.linspace(0, 1, N_BINS + 1)[None, :]
    lo, hi = edges_NB[:, :-1, None], edges_NB[:, 1:, None]
    q_NBE = np.sort(lo + (hi - lo) * rng.random((N, N_BINS, per_bin)), 2)[:, :, ::-1]
    q_imgs = rng.integers(0, n_imgs, (N, N_BINS * per_bin))
    tops = _examples(rng, top_imgs, top_NK, m_N, T, min(n_top, TOP_HEAT))
    qs = _examples(rng, q_imgs, q_NBE.reshape(N, -1), m_N, T, 0)
    n_ex = rng.integers(0, per_bin + 1, (N, N_BINS)).tolist()  # a bin may have no example
    nb_NJ = rng.integers(0, width, (N, N_NEIGHBOURS))
    nb_NJ[nb_NJ == np.arange(start, stop)[:, None]] += 1  # never itself
    nb_NJ %= width
    cos_NJ = np.asarray(r6s(np.sort(rng.uniform(0.1, 0.9, (N, N_NEIGHBOURS)), 1)[:, ::-1])).reshape(N, -1).tolist()
    e_NB = np.asarray(r6s(edges_NB)).reshape(N, -1).tolist()
    nb_l, hist = nb_NJ.tolist(), rng.integers(0, 500, (N, n_hist)).tolist()
    sweep = [(s, rng.integers(0, w, (N, 3)).tolist(), np.asarray(r6s(np.sort(rng.uniform(0.3, 0.99, (N, 3)), 1)[:, ::-1])).reshape(N, 3).tolist())
             for s, w in sweep_ids]  # fmt: skip
    out = []
    for n in range(N):
        if cols["freq"][start + n] == 0:
            out.append({"top": [], "quantiles": [], "hist": [0] * n_hist, "neighbours": [], "sweep_neighbours": []})
            continue
        e, k = e_NB[n], n_ex[n]
        quantiles = [
            {"lo": e[b], "hi": e[b + 1], "examples": qs[n][b * per_bin : b * per_bin + k[b]]} for b in range(N_BINS)
        ]
        out.append({"top": tops[n], "quantiles": quantiles, "hist": hist[n],
                    "neighbours": [{"id": j, "cos": c} for j, c in zip(nb_l[n], cos_NJ[n], strict=True)],
                    "sweep_neighbours": [{"sae_id": s, "id": j, "cos": c} for s, ids, cs in sweep
                                         for j, c in zip(ids[n], cs[n], strict=True)]})  # fmt: skip
    return out


def _image(rng, img: int, label, file: str, width: int, T: int, cls_token: bool):
    """One explorable image: PATCH_TOP latents per token (descending), the image's top 32 by max act."""
    patches, best = [], {}
    for t in range(T):
        n = int(rng.integers(0, PATCH_TOP + 1)) if t or not cls_token else PATCH_TOP
        ids = rng.choice(width, n, replace=False)
        acts = np.sort(rng.uniform(0.01, 10.0, n).astype(np.float32))[::-1]
        patches.append({"ids": [int(j) for j in ids], "acts": [r6(a) for a in acts]})
        for j, a in zip(patches[-1]["ids"], patches[-1]["acts"], strict=True):
            best[j] = max(best.get(j, 0.0), a)
    top = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))[:IMAGE_TOP]
    return {"id": img, "label": label, "file": file, "patches": patches,
            "top": {"ids": [j for j, _ in top], "acts": [a for _, a in top]}}  # fmt: skip


def write_synthetic_explorer(out: str, width: int, *, n_imgs: int = 64, n_explorable: int = 12, grid: int = 4,
                             seed: int = 0, sae_id: str | None = None, sweep: list[dict] | None = None,
                             chunk: int = 1024, detail_chunk: int = 256, n_top: int = N_TOP,
                             per_bin: int = N_PER_BIN) -> dict:  # fmt: skip
    """Write an explorer (app + data) for ``width`` latents into ``out``; returns what was written:
    {"meta", "table" (numpy columns), "images" {id: payload}, "detail" {latent: payload}, "dir"}.
    ``sweep``: the other SAEs' {"sae_id", "title", "href", "width"} (their width bounds the sweep
    neighbours' ids). ``n_top``, ``per_bin``: top examples per latent and at most so many examples
    per quantile bin (fewer: a faster write). Every explorer written here shares its images, labels
    and explorable set."""
    world = np.random.default_rng(1234)  # the images, labels and explorable set: shared by a sweep's SAEs
    rng = np.random.default_rng(seed)
    T = grid * grid + 1
    data = os.path.join(out, "data")
    copy_app(out)
    thumbs = thumbnails(os.path.join(out, "img"), n_imgs, 4 * grid, world)
    labels = world.integers(0, N_CLASSES, n_imgs)
    prevalence = np.bincount(labels, minlength=N_CLASSES) / n_imgs
    explorable = sorted(int(i) for i in world.choice(n_imgs, n_explorable, replace=False))
    hist_edges = np.linspace(0, 20, 21)
    sweep = sweep or []
    meta = {
        "format": 1, "sae_id": sae_id or f"synthetic{width}", "title": f"synthetic SAE, width {width}",
        "width": width, "d_model": 32, "objective": "topk", "k": 16, "n_imgs": n_imgs, "n_tokens": n_imgs * T,
        "tokens_per_img": T, "grid": grid, "patch_of_token": [-1, *range(grid * grid)],
        "chunk": chunk, "detail_chunk": detail_chunk, "hist_edges": [r6(e) for e in hist_edges],
        "classes": {str(c): f"class-{c}" for c in range(N_CLASSES)}, "probe_n": n_imgs // 2,
        "probe_prevalence": {str(c): r6(p) for c, p in enumerate(prevalence)},
        "images": [{"id": i, "label": int(labels[i]), "file": thumbs[str(i)]} for i in explorable],
        "image_thumbs": thumbs, "sweep": [{k: s[k] for k in ("sae_id", "title", "href")} for s in sweep],
        "top_heat": min(n_top, TOP_HEAT), "explore_source": "spread",
        "definitions": {
            "freq": "fraction of tokens where the latent is non-zero in the visuals pass",
            "max_act": "largest activation of the latent over the pass's tokens",
            "mean_act": "mean activation over the tokens where the latent is non-zero",
            "dec_norm": "L2 norm of the latent's decoder row",
            "best_class": "the class whose one-latent probe has the highest test-half AP",
            "best_ap": "average precision of that probe on the test half; chance = the class's prevalence",
            "act": "the latent's activation on that token (the SAE's encode of the stored activation)",
            "cos": "cosine between the two latents' decoder rows",
            "hist": "count of tokens per activation bin (non-zero activations only)",
        },
    }  # fmt: skip
    write_chunk(data, "meta", meta)
    cols, tables = _table(width, chunk, rng, prevalence)
    for c, payload in enumerate(tables):
        write_chunk(data, f"latents/table-{c:04d}", payload)
    detail = {}
    other_ids = [(s["sae_id"], s.get("width", width)) for s in sweep]
    for c, start in enumerate(range(0, width, detail_chunk)):
        stop = min(width, start + detail_chunk)
        lat = _details(rng, start, stop, width, cols, n_imgs, T, len(hist_edges) - 1, other_ids, n_top, per_bin)
        detail.update((start + j, d) for j, d in enumerate(lat))
        write_chunk(data, f"latents/detail-{c:04d}", {"start": start, "latents": lat})
    images = {}
    for i in explorable:
        images[i] = _image(rng, i, int(labels[i]), thumbs[str(i)], width, T, True)
        write_chunk(data, f"images/{i:04d}", images[i])
    return {"meta": meta, "table": cols, "images": images, "detail": detail, "dir": out}
