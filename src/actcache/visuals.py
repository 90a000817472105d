"""What each latent of a trained SAE responds to: the library behind `actcache visuals`.

For each SAE run directory (actcache.rundir), ONE ordered pass over its cache (the layer, patches
and scaling it was trained on, every image; SAEs of the same stream share the pass) gives
per-latent statistics (actcache.topk). :func:`write_visuals` turns them into the run's visuals/
folder (latents.npz, summary.json, an HTML page with its images, training curves, frequency
plot, and the explorer of every latent in visuals/explorer/: actcache.explorer) and the page as
one small self-contained file beside it, for `snakemake --report` (actcache.visuals_report).
:func:`make_visuals` does this for a list of runs; with several runs it also writes the sweep
plots (NMSE against L0, every SAE's curves) into ``opts.out`` (default: their common parent's
visuals/). ``plots_only`` skips the pass and the per-SAE pages.

Invariants: a page is written into a temporary sibling folder and renamed, so a reader never
sees half a visuals/ folder; a cache whose hash differs from the one in run.json is refused.

Modules: this one (errors, the pass, the pages of runs), actcache.topk (streaming statistics),
actcache.visuals_html (page, images, heatmaps), actcache.visuals_plots (matplotlib),
actcache.visuals_report (the one-file page) and actcache.rundir (the run files). The CLI (actcache.cli.visuals) parses the options.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import shutil
import threading
import time

import numpy as np

from actcache.errors import ActCacheError, ConfigError, os_error_text
from actcache.feed import StagedFeed
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import (
    CURVES_PLOT,
    DONE_FILE,
    EXPLORER_DIR,
    FREQ_PLOT,
    PAGE_FILE,
    RUN_FILE,
    SAE_FILES,
    STATS_FILE,
    SUMMARY_FILE,
    VISUALS_DIR,
    VISUALS_PAGE,
    WEIGHTS_FILE,
    Run,
    RunDirError,
    find_runs,
    load_run,
    read_json,
)
from actcache.topk import LatentStats, LatentSummary

log = logging.getLogger(__name__)

TARGET_BATCH_BYTES = 2**28  # latent activations of one batch (B x width float32)


@dataclasses.dataclass(frozen=True)
class VisualsOptions:
    """What :func:`make_visuals` draws, and how (`actcache visuals --help` explains each)."""

    top_k: int = 16
    latents: int = 128
    select: str = "spread"
    latent_ids: tuple[int, ...] | None = None
    cache: str | None = None
    device: str | None = None
    batch_images: int | None = None
    no_images: bool = False
    reuse: bool = False
    plots_only: bool = False
    out: str | None = None
    explorer: bool = True


class VisualsError(ActCacheError):
    """`actcache visuals` cannot run on its input."""


class CacheMissingError(VisualsError):
    """The cache an SAE was trained on is missing or differs."""


class ImagesMissingError(VisualsError):
    """The image dataset that made the cache cannot be opened."""


# ---------------------------------------------------------------------------------------------
# The cache and images of a run


def open_cache(run: Run):
    """The run's cache, checked against the hash recorded in run.json."""
    from actcache.cache import ActivationCache

    if run.cache is None:
        raise CacheMissingError(
            f"{run.dir}: no {RUN_FILE} records which cache this SAE was trained on; pass --cache <dump_to>/<HASH>."
        )
    if not os.path.isdir(run.cache):
        raise CacheMissingError(
            f"{run.dir}: the cache it was trained on, {run.cache}, does not exist. Re-create it (`actcache dump` "
            "+ `actcache gather`, or the workflow), or pass --cache DIR if it moved."
        )
    try:
        cache = ActivationCache.open(run.cache)
    except ActCacheError as err:
        raise CacheMissingError(f"{run.dir}: the cache {run.cache} it was trained on cannot be opened: {err}") from None
    if run.cache_hash and cache.metadata.hash != run.cache_hash:
        raise CacheMissingError(
            f"{run.dir}: {run.cache} holds cache {cache.metadata.hash[:12]}..., but the SAE was trained on "
            f"{run.cache_hash[:12]}... ({RUN_FILE}); pass --cache <dump_to>/{run.cache_hash}."
        )
    md = cache.metadata
    if run.layer is None:
        if len(md.layers) != 1:
            raise RunDirError(f"{run.dir}: {RUN_FILE} does not say which of the layers {list(md.layers)} the SAE saw.")
        run.layer = md.layers[0]
    return cache


def image_source(md, no_images: bool, cache_dir: str | None = None):
    """The ImageSource of the cache metadata; an unopenable dataset is an ImagesMissingError."""
    from actcache.images import data_config_from_metadata, open_dataset
    from actcache.visuals_html import ImageSource

    if no_images:
        return ImageSource(None, None, "Images are off (--no-images).")
    fix = "restore it there (the cache hash depends on the path), or pass --no-images for a page without images."
    try:
        cfg = data_config_from_metadata(md.data)
    except ConfigError as err:
        raise ImagesMissingError(
            f"the cache's data config {json.dumps(md.data, sort_keys=True)} is not an image dataset actcache can "
            f"open ({err}); pass --no-images for a page without images."
        ) from None
    try:
        ds = open_dataset(cfg)
    except ActCacheError as err:
        raise ImagesMissingError(f"cannot open the image dataset that made the cache: {err}. {fix}") from None
    if len(ds) < md.n_imgs:
        raise ImagesMissingError(
            f"the image dataset {json.dumps(md.data, sort_keys=True)} now has {len(ds)} images but the cache "
            f"has {md.n_imgs}: it changed since the dump. {fix}"
        )
    return ImageSource(ds, *display_transform(md, cache_dir))


def display_transform(md, cache_dir: str | None = None):
    """(transform, note): the checkpoint's resize + center crop without normalisation."""
    from actcache.ckptid import checkpoint_source
    from actcache.images import ImageTransform
    from actcache.models import BICUBIC, load_transform

    try:
        t = load_transform(md.vit_family, checkpoint_source(md.vit_ckpt, cache_dir))
        return dataclasses.replace(t, rescale_factor=None, mean=None, std=None), ""
    except ActCacheError as err:
        log.warning("no preprocessing for %s (%s); images shown with a plain center crop", md.vit_ckpt, err)
        return ImageTransform(("shortest_edge", 224), BICUBIC, (224, 224), None, None, None), (
            f"The checkpoint's preprocessing is not available ({err}); images are shown with a plain "
            "224x224 center crop, which may not match the patch grid exactly."
        )


# ---------------------------------------------------------------------------------------------
# The pass


def dead_line(ev: dict) -> str:
    """The dead and almost-dead counts with their one definition (eval.json's), as every view shows them."""
    return f"{ev['n_dead']:,} dead, {ev.get('n_almost_dead', 0):,} almost dead ({ev.get('dead_definition', '')})"


def sae_title(run, width: int) -> str:
    """What the SAE is, from its run.json and its weights' width (e.g. ``jumprelu l0_coeff=0.01
    width=1024 layer -2``)."""
    import dataclasses

    from actcache.errors import ConfigError
    from actcache.sae.config import RunConfig

    try:
        return dataclasses.replace(RunConfig.from_dict(run.info.get("run", {})), width=width, layer=run.layer).title()
    except (ConfigError, TypeError):  # a run.json from another version: its label as before
        return run.label()


def heldout_rows(ev: dict) -> dict[str, str]:
    """The page's rows of held-out statistics: eval.json's values with their definitions (the
    one place they are computed is actcache.sae.evaluate)."""
    if not isinstance(ev.get("nmse"), (int, float)):
        return {"held-out eval": "none (eval.json has no held-out statistics)"}
    defs = ev.get("definitions", {})
    rows = {}
    for name, key, fmt in (("FVU (= NMSE)", "nmse", "{:.4f}"), ("L0", "l0", "{:.2f}"), ("dense latents", "n_dense", "{:,}"),
                           ("cos(x, x_hat)", "cos_x_xhat", "{:.4f}")):  # fmt: skip
        if isinstance(ev.get(key), (int, float)):
            why = defs.get("fvu" if key == "nmse" else key)
            rows[name] = fmt.format(ev[key]) + (f" ({why})" if why else "")
    if isinstance(ev.get("n_dead"), int):
        rows["dead / almost-dead latents"] = dead_line(ev)
    for kind, st in (ev.get("by_token_kind") or {}).items():
        rows[f"{kind} tokens"] = (f"FVU {st['fvu']:.4f}, MSE per token {st['mse_per_token']:.4g}, mean ||x|| "
                                  f"{st['mean_norm_x']:.4g}, mean ||x_hat|| {st['mean_norm_x_hat']:.4g} "
                                  f"on {st['n_tokens']:,} tokens")  # fmt: skip
    prefixes = sorted((k for k in ev if k.startswith("nmse_prefix_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in prefixes:  # matryoshka: each nested prefix's FVU
        why = defs.get("nmse_prefix")
        rows[f"FVU, first {int(key.rsplit('_', 1)[1]):,} latents"] = f"{ev[key]:.4f}" + (f" ({why})" if why else "")
    sp = ev.get("spliced") or {}
    if sp:
        rows["spliced in"] = spliced_row(sp)
    return rows


def spliced_row(sp: dict) -> str:
    """The page's "spliced in" row: the headline (eval.json's "headline" field) with its noise
    control and chance level, then the embedding distance; a null value shows its note."""

    def f(v):
        return f"{v:.4f}" if isinstance(v, (int, float)) and v == v else "n/a"

    key = sp.get("headline", "fraction_recovered_zero")
    row = (f"{key} {f(sp.get(key))} (1 = as clean, 0 = as mean-ablation: chance; unbounded below), noise control "
           f"at the SAE's FVU {f(sp.get(key + '_noise'))}; embedding fraction recovered vs mean "
           f"{f(sp.get('fraction_recovered_mean'))}, cos {f(sp.get('cos_spliced_clean'))}; "
           f"{sp.get('n_images', 0):,} images, test half {sp.get('task_n_test', 0):,}")  # fmt: skip
    notes = [sp[k] for k in ("head_note", "task_note") if sp.get(k)]
    return row + "".join(f". Note: {n}" for n in notes)


def compute_stats(cache, saes: list, patches: str, layer: int, scale_norm: bool, k: int = 16,
                  batch_images: int | None = None, device: str = "cpu",
                  timings: dict | None = None, explore=(), quantiles: bool = True) -> list[LatentSummary]:  # fmt: skip
    """One ordered pass over ``cache``; per SAE, its :class:`LatentSummary` (``explore``: the
    explorable images, whose per-token latents it keeps; ``quantiles``: the quantile samples).

    ``timings`` (a dict) receives the seconds spent waiting for batches (``wait_s``), in the
    SAEs' ``encode`` (``encode_s``) and in the statistics (``stats_s``).
    """
    import torch

    from actcache.loaders import OrderedLoader
    from actcache.loaders.common import Selection
    from actcache.progress import Progress

    per_img = Selection(cache.metadata, patches, layer).per_img
    width = max(s.cfg.width for s in saes)
    if batch_images is None:
        batch_images = max(1, min(16384 // per_img, TARGET_BATCH_BYTES // (4 * per_img * width)))
    stats = [LatentStats(s.cfg.width, per_img, k, device, explore=explore, quantiles=quantiles) for s in saes]
    for s in saes:
        s.to(device).eval()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    loader = OrderedLoader(cache, batch_size=batch_images * per_img, patches=patches, layer=layer,
                           scale_norm=scale_norm, batch_timeout_s=None)  # fmt: skip
    n, spent = len(loader), {"wait_s": 0.0, "encode_s": 0.0, "stats_s": 0.0}
    with loader, torch.inference_mode(), Progress(n, desc="visuals: pass over the cache", unit="batch") as bar:
        if torch.device(device).type == "cuda":
            batches = cuda_feed(loader, torch.device(device))
        else:
            batches = ((b["act"], b["image_i"]) for b in loader)
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                x_BD, img = next(batches)
                x_BD, img = x_BD.to(device), img.to(device)  # no-ops on the GPU feed
                spent["wait_s"] += time.perf_counter() - t0
                for sae, st in zip(saes, stats, strict=True):
                    t1 = time.perf_counter()
                    f_BS = sae.encode(x_BD)
                    sync()
                    t2 = time.perf_counter()
                    st.update(f_BS, img)
                    sync()
                    spent["encode_s"] += t2 - t1
                    spent["stats_s"] += time.perf_counter() - t2
                bar.update(1)
        finally:
            if isinstance(batches, StagedFeed):
                batches.close()
    if timings is not None:
        timings.update(spent)
    return [st.result() for st in stats]


def cuda_feed(loader, device) -> StagedFeed:
    """The pass's batches on a GPU as ``(act (B, D), image_i (B,))``: the thread copies each batch
    into a page-locked host buffer, then to the GPU on a CUDA stream of its own, while the main
    thread runs the SAEs and the statistics on the batch before. A copy straight from the loader's
    (pageable) buffers is much slower and holds the host thread until it is done."""
    import torch

    @contextlib.contextmanager
    def stage():
        stream = torch.cuda.Stream(device)
        pinned: dict[str, torch.Tensor] = {}

        def to_device(batch) -> tuple:
            out = []
            for key in ("act", "image_i"):
                src = batch[key]
                buf = pinned.get(key)
                if buf is None or buf.numel() < src.numel():
                    buf = pinned[key] = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
                host = buf[: src.numel()].view(src.shape)
                host.copy_(src)
                out.append(host.to(device, non_blocking=True))
            stream.synchronize()  # the tensors are complete and the page-locked buffers free again
            return tuple(out)

        with torch.cuda.stream(stream), torch.inference_mode():
            yield to_device

    def on_take(item) -> None:
        current = torch.cuda.current_stream(device)
        for t in item:  # made on the feed's stream, used (and freed) on this one
            t.record_stream(current)

    return StagedFeed(loader, stage, on_take=on_take, name="actcache-visuals-h2d")


# ---------------------------------------------------------------------------------------------
# Writing one run's visuals/


def _patch_of_token(md, patches: str, layer: int) -> np.ndarray:
    from actcache.loaders.common import Selection

    sel = Selection(md, patches, layer)
    return np.asarray(sel.decode(np.arange(sel.per_img))[3], np.int64)


@contextlib.contextmanager
def _writing(what: str, kept: str):
    """An OSError while writing output (a full disk, a quota, a read-only folder) -> a VisualsError
    naming it and the fix, not a traceback."""
    try:
        yield
    except OSError as err:
        raise VisualsError(
            f"could not write {what}: {os_error_text(err)}; {kept}. Free space there (or fix its "
            "permissions) and re-run the same command."
        ) from err


def write_visuals(run: Run, cache, res: LatentSummary, src, opts, timings: dict, sweep: list[Run] = ()) -> str:
    """Write RUN_DIR/visuals/ (into a temporary sibling, then renamed; the explorer in it) and
    RUN_DIR/visuals.html (the page in one small self-contained file); returns visuals/index.html.
    ``sweep``: the other runs shown beside this one (the explorer's links and neighbours)."""
    from actcache import visuals_html as vh
    from actcache.explorer import ExplorerPlan
    from actcache.visuals_plots import plot_curves, plot_freq
    from actcache.visuals_report import one_file_page

    md = cache.metadata
    final = os.path.join(run.dir, VISUALS_DIR)
    tmp = os.path.join(run.dir, f".{VISUALS_DIR}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        t0 = time.perf_counter()
        notes = [src.note] if src.note else []
        ids = list(opts.latent_ids) if opts.latent_ids else None
        if ids is not None and any(not 0 <= i < res.width for i in ids):
            shown = ",".join(str(i) for i in ids)
            raise ConfigError(f"--latent-ids: ids must be in [0, {res.width}), got {shown}")
        latents = vh.select_latents(res, opts.latents, opts.select, ids)
        plan = ExplorerPlan.of(res) if opts.explorer else ExplorerPlan([], [])
        href = "explorer/index.html" if opts.explorer else None
        pot = _patch_of_token(md, run.patches, run.layer)
        grid = math.isqrt(md.n_patches_per_img)
        heat = (pot >= 0).any() and grid * grid == md.n_patches_per_img
        # The statistics file (zlib) and the heatmap sprites are written by a pool of threads, the
        # images (decode, resize, crop, encode) by forked processes (threads for a small page: see
        # visuals_html.image_writer), while this thread draws the plots.
        with concurrent.futures.ThreadPoolExecutor(vh.page_workers(), thread_name_prefix="actcache-page") as pool:
            jobs = [pool.submit(res.save, os.path.join(tmp, STATS_FILE))]
            if heat:
                jobs += vh.write_sprites(res, latents, pot, grid, os.path.join(tmp, "img", "heat"), pool=pool)
            image_labels, stop_images = (lambda: {}), (lambda: None)
            if src.dataset is not None:
                top = res.top_img[latents]
                ids = sorted({int(i) for i in top[top >= 0]} | set(plan.image_ids))
                image_labels, stop_images = vh.image_writer(src, ids, os.path.join(tmp, "img"), pool)
            try:
                plots = []
                if plot_curves([run], os.path.join(tmp, CURVES_PLOT)):
                    plots.append(CURVES_PLOT)
                plot_freq(res, os.path.join(tmp, FREQ_PLOT))
                plots.append(FREQ_PLOT)
                labels = image_labels()
                for job in jobs:
                    job.result()
            except BaseException:  # a failed write (e.g. a full disk): stop the rest
                for job in jobs:
                    job.cancel()
                stop_images()
                raise
        timings["page_s"] = time.perf_counter() - t0
        ev, cfg = run.eval(), run.sae_config()
        t0 = time.perf_counter()
        device = opts.device or ("cuda" if _cuda() else "cpu")
        explorer_bytes = _write_explorer(run, cache, res, plan, src, ev, tmp, sweep, device) if opts.explorer else 0
        timings["explorer_s"] = time.perf_counter() - t0
        info = {
            "SAE": run.name, "what": sae_title(run, res.width),
            "cache": f"{md.hash[:16]}... ({run.cache})", "model": f"{md.vit_family} {md.vit_ckpt}",
            "layer / patches": f"{run.layer} / {run.patches}" + (" (scale_norm)" if run.scale_norm else ""),
            "images / tokens (this page)": f"{res.n_imgs:,} / {res.n_tokens:,}",
            **heldout_rows(ev),
        }  # fmt: skip
        dense_frac = float(ev.get("dense_frac", cfg.get("dense_frac", 0.1)))
        page = vh.render_page(res, latents, info, labels, pot, heat, src.dataset is not None, plots, notes,
                              dense_frac=dense_frac, explorer=href)  # fmt: skip
        from actcache.visuals_probes import annotate_page

        page = annotate_page(page, ev.get("probes"), href)
        vh.write_page(os.path.join(tmp, PAGE_FILE), page)
        standalone, one_file = one_file_page(res, latents, info, labels, pot, heat, src.dataset is not None, plots,
                                             notes, tmp, os.path.abspath(os.path.join(final, PAGE_FILE)),
                                             probes=ev.get("probes"), dense_frac=dense_frac,
                                             explorer=opts.explorer)  # fmt: skip
        summary = {
            "version": 1, "sae_id": run.name, "run_dir": os.path.abspath(run.dir), "cache": run.cache,
            "cache_hash": md.hash, "layer": run.layer, "patches": run.patches, "scale_norm": run.scale_norm,
            "k": int(res.top_img.shape[1]), "width": res.width, "n_imgs": res.n_imgs, "n_tokens": res.n_tokens,
            "n_dead": ev.get("n_dead"), "n_almost_dead": ev.get("n_almost_dead"),
            "dead_definition": ev.get("dead_definition"),
            "latents_shown": [int(s) for s in latents], "one_file_latents": [int(s) for s in one_file],
            "sae_weights": _weights_stamp(run.dir), "reused": timings.pop("reused", False), "seconds": timings,
            "explorer": {"dir": EXPLORER_DIR, "data_bytes": explorer_bytes, "images": res.ex_img.tolist()}
            if opts.explorer else None,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }  # fmt: skip
        atomic_write_bytes(os.path.join(tmp, SUMMARY_FILE), (json.dumps(summary, indent=2) + "\n").encode())
        old = None
        if os.path.isdir(final):
            old = os.path.join(run.dir, f".{VISUALS_DIR}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        # the page in one small file (images inlined), beside the folder: for `snakemake --report`
        atomic_write_bytes(os.path.join(run.dir, VISUALS_PAGE), standalone.encode("utf-8"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(final, PAGE_FILE)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _decoder(run: Run) -> np.ndarray:
    from actcache.sae.modeling import SAE

    return SAE.load(run.dir).W_dec.detach().float().cpu().numpy()


def _write_explorer(run: Run, cache, res: LatentSummary, plan, src, ev: dict, tmp: str, sweep, device: str) -> int:
    """The explorer into ``tmp``/explorer (actcache.explorer); returns its data bytes."""
    from actcache.explorer import ExplorerInfo, write_explorer
    from actcache.labels import read_labels

    md = cache.metadata
    pot = _patch_of_token(md, run.patches, run.layer)
    grid = math.isqrt(md.n_patches_per_img)
    lab = read_labels(cache.path, md.n_imgs)
    cfg = run.sae_config()
    here = os.path.join(run.dir, VISUALS_DIR, EXPLORER_DIR)
    others = [{"sae_id": o.name, "title": sae_title(o, o.sae_config().get("width") or 0),
               "href": os.path.relpath(os.path.join(o.dir, VISUALS_DIR, EXPLORER_DIR, PAGE_FILE), here),
               "dec_W": _decoder(o)} for o in sweep if o.dir != run.dir and o.has_weights]  # fmt: skip
    info = ExplorerInfo(
        sae_id=run.name, title=sae_title(run, res.width), d_model=int(md.d_vit),
        objective=str(cfg.get("activation", "")), k=cfg.get("k"), patch_of_token=pot,
        grid=grid if grid * grid == md.n_patches_per_img and (pot >= 0).any() else None, dec_W=_decoder(run),
        probes=ev.get("probes"), labels=None if lab is None else lab[0],
        class_names=(ev.get("probes") or {}).get("class_names") or ([] if lab is None else lab[1]),
        images_dir=os.path.join(tmp, "img") if src.dataset is not None else None,
        explore_source=_explore_source(run), sweep=others, device=device,
    )  # fmt: skip
    return write_explorer(os.path.join(tmp, EXPLORER_DIR), res, plan, info)


def _explore_source(run: Run) -> str:
    return "held-out" if (run.info.get("split") or {}).get("heldout_images") else "spread"


def explore_ids(runs: list[Run], n_imgs: int) -> np.ndarray:
    """The explorable images of a stream's runs: from the first run whose run.json records the
    held-out split (every run of a cache with one eval_frac has the same), else spread."""
    from actcache.explorer import explore_images

    split = next((r.info.get("split") for r in runs if (r.info.get("split") or {}).get("heldout_images")), None)
    return explore_images(split, n_imgs)[0]


def _preload_plotting() -> None:
    """Import matplotlib while the pass runs; a failure is reported later, where it is used."""
    try:
        from actcache.visuals_plots import _plt

        _plt()
    except Exception:  # noqa: BLE001 - the plot step reports a missing matplotlib itself
        pass


def _weights_stamp(run_dir: str) -> dict:
    st = os.stat(os.path.join(run_dir, WEIGHTS_FILE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _reusable(run: Run, md, opts, explore: np.ndarray) -> LatentSummary | None:
    d = os.path.join(run.dir, VISUALS_DIR)
    doc = read_json(os.path.join(d, SUMMARY_FILE)) if os.path.isdir(d) else None
    if not doc or not os.path.isfile(os.path.join(d, STATS_FILE)):
        return None
    same = (doc.get("sae_weights") == _weights_stamp(run.dir) and doc.get("cache_hash") == md.hash
            and doc.get("layer") == run.layer and doc.get("patches") == run.patches and doc.get("k") == opts.top_k)  # fmt: skip
    got = _load_summary(os.path.join(d, STATS_FILE), run.sae_config().get("width"), opts.top_k) if same else None
    if got is not None and opts.explorer and not (got.has_explorer_stats and np.array_equal(got.ex_img, explore)):
        log.info("%s lacks the explorer's statistics (or for other images); computing it again", d)
        return None
    return got


def _load_summary(path: str, width, k: int) -> LatentSummary | None:
    """The saved summary, or None (recompute it) when it is damaged or not of this SAE's shape."""
    try:
        got = LatentSummary.load(path)
        ok = got.fire_count.shape[0] == width and got.top_img.shape == (width, k)
    except Exception as err:  # noqa: BLE001 - BadZipFile, EOFError, KeyError, ValueError...: recompute
        log.warning("%s is damaged (%s: %s); computing it again", path, type(err).__name__, err)
        return None
    if not ok:
        log.warning("%s does not match the SAE's width %s and --top-k %d; computing it again", path, width, k)
    return got if ok else None


# ---------------------------------------------------------------------------------------------
# Runs -> pages


def _siblings(run: Run) -> list[Run]:
    """The runs beside ``run`` in its cache's folder (``<runs_to>/<HASH>/``) whose explorer exists,
    for the explorer of one SAE made alone (as the workflow does): its sweep links and neighbours."""
    try:
        dirs = find_runs([os.path.dirname(os.path.abspath(run.dir))])
        others = [load_run(d) for d in dirs if os.path.realpath(d) != os.path.realpath(run.dir)]
    except ActCacheError:
        return []
    made = [o for o in others if os.path.isfile(os.path.join(o.dir, VISUALS_DIR, EXPLORER_DIR, PAGE_FILE))]
    return [o for o in made if o.has_weights and o.info.get("d_vit") == run.info.get("d_vit")]


def _group_streams(runs: list[Run]) -> tuple[dict[tuple, list[Run]], dict]:
    """Runs by the stream of activations they read: (cache, layer, patches, scale_norm)."""
    streams: dict[tuple, list[Run]] = {}
    caches = {}
    for r in runs:
        cache = open_cache(r)
        key = (os.path.realpath(cache.path), r.layer, r.patches, r.scale_norm)
        caches[key] = cache
        streams.setdefault(key, []).append(r)
    return streams, caches


def _stream_pages(key: tuple, cache, members: list[Run], opts: VisualsOptions, report, sweep: list[Run]) -> None:
    """One pass over a stream for the members that need it, then each member's pages."""
    import torch

    from actcache.sae.modeling import SAE

    src = image_source(cache.metadata, opts.no_images, cache.path)  # fails before the pass, not after it
    todo, results = [], {}
    explore = explore_ids(members, cache.metadata.n_imgs) if opts.explorer else np.zeros(0, np.int64)
    for r in members:
        got = _reusable(r, cache.metadata, opts, explore) if opts.reuse else None
        if got is not None:
            results[r.dir] = got
        else:
            todo.append(r)
    t0, timings = time.perf_counter(), {}
    if todo:
        log.info("visuals: one pass over %s (layer %s, patches %s) for %d SAE(s)", cache.path, key[1], key[2],
                 len(todo))  # fmt: skip
        saes = [SAE.load(r.dir) for r in todo]
        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        for r, res in zip(todo, compute_stats(cache, saes, key[2], key[1], key[3], opts.top_k,
                                              opts.batch_images, device, timings, explore, opts.explorer),
                                strict=True):  # fmt: skip
            results[r.dir] = res
    pass_s = time.perf_counter() - t0
    for r in members:
        with _writing(f"the visuals of {r.dir}", "a page already there is kept"):
            path = write_visuals(r, cache, results[r.dir], src, opts,
                                 {"pass_s": pass_s, **timings, "reused": r not in todo}, sweep)  # fmt: skip
        report(path)


def make_visuals(run_dirs: list[str], opts: VisualsOptions, report=print) -> None:
    """The pages of every run under ``run_dirs`` (see the module docstring); ``report`` gets the
    path of each page and plot as soon as it is written."""
    runs = [load_run(p, opts.cache) for p in find_runs(run_dirs)]
    if not opts.plots_only:
        missing = [r.dir for r in runs if not r.has_weights]
        if missing:
            raise RunDirError(
                f"{missing[0]}: no final SAE weights ({' + '.join(SAE_FILES)}); training has not finished (wait "
                f"for its {DONE_FILE}), or use --plots-only for the training curves."
            )
        threading.Thread(target=_preload_plotting, name="actcache-import-matplotlib", daemon=True).start()
        streams, caches = _group_streams(runs)
        for key, members in streams.items():
            _stream_pages(key, caches[key], members, opts, report, runs if len(runs) > 1 else _siblings(runs[0]))
    if len(runs) > 1 or opts.out or opts.plots_only:
        out = opts.out or os.path.join(os.path.commonpath([os.path.abspath(os.path.dirname(r.dir)) for r in runs]),
                                       VISUALS_DIR)  # fmt: skip
        from actcache.visuals_plots import write_sweep

        with _writing(f"the sweep plots in {out}", "a plot cut short there is rewritten by the re-run"):
            made = write_sweep(runs, out)
        for name in made:
            report(os.path.join(out, name))
        report(os.path.join(out, PAGE_FILE))
