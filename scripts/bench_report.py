"""Size of the Snakemake report of an SAE sweep, and of each SAE's page in it.

    python scripts/bench_report.py [--saes 20] [--width 16384] [--images noise|shapes] [--out bench-out/report]

Per SAE, ``actcache.visuals.write_visuals`` (the code behind `actcache visuals`) writes its
visuals/ folder and its one-file page (visuals.html: what the report embeds) from synthetic
statistics: a LatentSummary of ``--width`` latents (a third dead, scattered; log-uniform
frequencies; 16 distinct top images per latent with sparse per-patch activations), 128 latent
cards of 16 images each, as `actcache visuals` draws by default. The SAE's forward pass adds
nothing to a page's size, so no SAE runs. Images: ``noise`` (SyntheticImages: random pixels,
the worst case for JPEG) or ``shapes`` (the demo's image folder). A two-rule workflow copies
the pages and sweep plots in, with workflow/rules/report.smk's categories and captions, and
Snakemake builds report.html and report.zip from it.

Reference: the same pages with every image inlined at full size (what the report embedded
before pages had a byte budget). Targets: report.html <= 50 MB; every embedded page's data:
URL under Chromium's 2 MiB URL limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import benchlib  # noqa: E402

from actcache import visuals_html as vh  # noqa: E402
from actcache.demo import make_image_folder  # noqa: E402
from actcache.images import ImageFolder, SyntheticImages, metadata_data  # noqa: E402
from actcache.protocol import Metadata  # noqa: E402
from actcache.rundir import PAGE_FILE, SUMMARY_FILE, VISUALS_DIR, VISUALS_PAGE, load_run  # noqa: E402
from actcache.sae.modeling import SAE, SAEConfig  # noqa: E402
from actcache.topk import HIST_EDGES, N_BINS, LatentSummary  # noqa: E402
from actcache.visuals import VisualsOptions, image_source, write_visuals  # noqa: E402
from actcache.visuals_plots import write_sweep  # noqa: E402
from actcache.visuals_report import InlineAssets  # noqa: E402

D, T, K = 768, 197, 16
CHROMIUM_URL_LIMIT = 2 * 1024 * 1024
SNAKEFILE = """
import json, os
PAGES = json.load(open("pages.json"))
REPORT = {report!r}

rule all:
    input:
        expand("pages/{{hash}}/{{sae}}/visuals.html", hash=PAGES["hash"], sae=PAGES["saes"]),
        expand("pages/{{hash}}/sweep/{{plot}}", hash=PAGES["hash"], plot=["nmse_l0.png", "curves.png"]),

rule page:
    output:
        report("pages/{{hash}}/{{sae}}/visuals.html", caption=os.path.join(REPORT, "visuals.rst"),
               category="SAE latents", subcategory="{{hash}}", labels={{"SAE": "{{sae}}", "cache": "{{hash}}"}}),
    params:
        src=lambda w: PAGES["pages"][w.sae],
    shell:
        "cp {{params.src}} {{output}}"

rule sweep:
    output:
        nmse_l0=report("pages/{{hash}}/sweep/nmse_l0.png", caption=os.path.join(REPORT, "sweep.rst"),
                       category="SAE sweeps", labels={{"cache": "{{hash}}", "plot": "NMSE against L0"}}),
        curves=report("pages/{{hash}}/sweep/curves.png", caption=os.path.join(REPORT, "curves.rst"),
                      category="SAE sweeps", labels={{"cache": "{{hash}}", "plot": "training curves"}}),
    params:
        src=PAGES["sweep"],
    shell:
        "cp {{params.src}}/nmse_l0.png {{output.nmse_l0}} && cp {{params.src}}/curves.png {{output.curves}}"
"""


def summary(width: int, n_imgs: int, seed: int, opts: VisualsOptions) -> LatentSummary:
    """Statistics shaped like a trained SAE's: a third of the latents dead, frequencies
    log-uniform over 1e-5 .. 0.2; the shown latents' top images distinct, their per-patch
    activations sparse."""
    rng = np.random.default_rng(seed)
    n_tokens = n_imgs * (T - 1)
    alive = rng.random(width) > 1 / 3
    fire = np.where(alive, np.maximum(1, n_tokens * 10 ** rng.uniform(-5, np.log10(0.2), width)), 0).astype(np.int64)
    mean = 10 ** rng.normal(0, 0.4, width)
    hist = np.zeros((width, N_BINS), np.int64)
    centre = np.clip(np.searchsorted(HIST_EDGES, mean) - 1, 2, N_BINS - 3)
    for off, share in ((-2, 0.05), (-1, 0.25), (0, 0.4), (1, 0.25), (2, 0.05)):
        hist[np.arange(width), centre + off] = np.round(fire * share)
    top_img = rng.integers(0, n_imgs, (width, K))
    top_img = np.where(alive[:, None], top_img, -1)
    top_score = np.where(alive[:, None], np.sort(mean[:, None] * rng.uniform(2, 6, (width, K)))[:, ::-1], 0)
    res = LatentSummary(n_tokens=n_tokens, n_imgs=n_imgs, fire_count=fire, act_sum=fire * mean, hist=hist,
                        top_img=top_img.astype(np.int64), top_score=top_score.astype(np.float32),
                        top_acts=np.zeros((width, K, T - 1), np.float32))  # fmt: skip
    shown = vh.select_latents(res, opts.latents, opts.select)  # by frequency only: the top images can change
    res.top_img[shown] = [rng.choice(n_imgs, K, replace=False) for _ in shown]
    patches = rng.exponential(1.0, (len(shown), K, T - 1)) * (rng.random((len(shown), K, T - 1)) < 0.15)
    res.top_acts[shown] = patches * (top_score[shown, :, None] / np.maximum(patches.max(2, keepdims=True), 1e-9))
    return res


def make_run(out: str, md: Metadata, i: int, width: int) -> str:
    """An SAE run directory (a small SAE file for the page's weights stamp, run.json, metrics, eval)."""
    run = os.path.join(out, "runs", md.hash, f"sae{i:02d}")
    os.makedirs(run, exist_ok=True)
    SAE(SAEConfig(d_vit=8, width=width, activation="topk", k=32, seed=i)).save(run)
    doc = {"sae_id": f"sae{i:02d}", "cache_hash": md.hash, "layer": -2, "d_vit": D, "width": width,
           "run": {"patches": "image", "scale_norm": False, "activation": "topk", "k": 32}}  # fmt: skip
    with open(os.path.join(run, "run.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(run, "metrics.jsonl"), "w") as fh:
        for s in range(100, 1100, 100):
            fh.write(json.dumps({"step": s, "nmse": 0.5 / s**0.3 + 0.002 * i, "l0": 32 + i, "n_dead": 900 // s}) + "\n")
    with open(os.path.join(run, "eval.json"), "w") as fh:
        json.dump({"nmse": 0.2 - 0.004 * i, "l0": 16.0 + 4 * i}, fh)
    return run


def pages(args, out: str) -> tuple[Metadata, list[str], list[dict]]:
    """Every SAE's visuals.html (the visuals/ folders are removed once measured); per SAE a row."""
    if args.images == "shapes":
        n_per_class = -(-args.n_images // 3)
        cfg = ImageFolder(make_image_folder(os.path.join(out, "shapes"), n_per_class=n_per_class))
        n_imgs = 3 * n_per_class
    else:
        cfg, n_imgs = SyntheticImages(n_imgs=args.n_images, seed=0, size=64), args.n_images
    md = Metadata(vit_family="clip", vit_ckpt=benchlib.clip224_checkpoint(out, D), layers=(-2,), n_patches_per_img=T - 1, cls_token=True,
                  d_vit=D, n_imgs=n_imgs, max_patches_per_shard=2_400_000, data=metadata_data(cfg))  # fmt: skip
    src, opts = image_source(md, False), VisualsOptions()
    runs, rows = [], []
    for i in range(args.saes):
        run = load_run(make_run(out, md, i, args.width))
        write_visuals(run, types.SimpleNamespace(metadata=md), summary(args.width, n_imgs, i, opts), src, opts, {})
        vis = os.path.join(run.dir, VISUALS_DIR)
        with open(os.path.join(vis, PAGE_FILE), encoding="utf-8") as fh:
            full = len(InlineAssets(vis, thumb_side=None).inline(fh.read()).encode())
        with open(os.path.join(vis, SUMMARY_FILE)) as fh:
            doc = json.load(fh)
        size = os.path.getsize(os.path.join(run.dir, VISUALS_PAGE))
        rows.append({"cards": len(doc["one_file_latents"]), "of": len(doc["latents_shown"]), "page": size,
                     "full page": full})  # fmt: skip
        print(json.dumps({"sae": run.name, **rows[-1]}), flush=True)
        shutil.rmtree(vis)  # the report takes visuals.html only
        runs.append(run)
    write_sweep(runs, os.path.join(out, "sweep"))
    return md, [r.dir for r in runs], rows


def build_report(out: str, md: Metadata, run_dirs: list[str]) -> dict[str, int]:
    """report.html and report.zip of the two-rule workflow; their sizes in bytes."""
    wf = os.path.join(out, "wf")
    shutil.rmtree(wf, ignore_errors=True)
    os.makedirs(wf)
    doc = {"hash": md.hash, "saes": [os.path.basename(d) for d in run_dirs], "sweep": os.path.join(out, "sweep"),
           "pages": {os.path.basename(d): os.path.join(d, VISUALS_PAGE) for d in run_dirs}}  # fmt: skip
    with open(os.path.join(wf, "pages.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(wf, "Snakefile"), "w") as fh:
        fh.write(SNAKEFILE.format(report=os.path.join(benchlib.ROOT, "workflow", "report")))
    exe = os.path.join(os.path.dirname(sys.executable), "snakemake")
    sizes = {}
    for args in (["--cores", "1"], ["--report", "report.html"], ["--report", "report.zip"]):
        proc = subprocess.run([exe, "-s", "Snakefile", "-d", wf, "--quiet", "all", *args], cwd=wf,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            sys.exit(f"snakemake {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        if args[0] == "--report":
            sizes[args[1]] = os.path.getsize(os.path.join(wf, args[1]))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--saes", type=int, default=20)
    ap.add_argument("--width", type=int, default=16384)
    ap.add_argument("--images", choices=("noise", "shapes"), default="noise")
    ap.add_argument("--n-images", type=int, default=4096, help="images the top images are drawn from")
    ap.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "report"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(os.path.join(args.out, "runs"), ignore_errors=True)
    md, run_dirs, rows = pages(args, args.out)
    sizes = build_report(args.out, md, run_dirs)
    mb = 1e6
    url = max(len("data:text/html;base64,") + 4 * -(-r["page"] // 3) for r in rows)
    full = sum(4 * -(-r["full page"] // 3) for r in rows)
    table = [{
        "SAEs x width": f"{args.saes} x {args.width:,}", "images": args.images,
        "report.html MB": sizes["report.html"] / mb, "report.zip MB": sizes["report.zip"] / mb,
        "full pages inlined MB": full / mb, "largest page URL MiB": url / 2**20,
        "cards per page (min / median)": f"{min(r['cards'] for r in rows)} / {statistics.median(r['cards'] for r in rows):g}"
                                         f" of {rows[0]['of']}",
    }]  # fmt: skip
    checks = [
        benchlib.check(f"report.html of {args.saes} SAEs x {args.width:,} <= 50 MB", sizes["report.html"] / mb, 50,
                       f"MB ({sizes['report.html'] / full:.3f} x the full pages inlined)", at_least=False),
        benchlib.check("every report page's data: URL < 2 MiB (Chromium)", url / 2**20, CHROMIUM_URL_LIMIT / 2**20,
                       "MiB (largest)", at_least=False),
    ]  # fmt: skip
    setup = [
        f"{args.saes} SAEs of width {args.width:,}; per SAE the page `actcache visuals` writes (128 cards x 16 top "
        f"images, {args.images} images at 224 px) from synthetic statistics (no SAE runs), by write_visuals.",
        "Snakemake builds report.html and report.zip from a two-rule workflow that copies each SAE's one-file page "
        "(visuals.html) and the sweep plots in, with workflow/rules/report.smk's categories and captions.",
        "Reference: the same pages with every image inlined at full size, as one data: URL each (base64).",
    ]
    notes = [c.bullet() for c in checks]
    body = benchlib.section_body(setup, [benchlib.table(table)], notes)
    if not args.no_record:
        benchlib.record("report", "Snakemake report size of an SAE sweep", body, checks=checks)
    print(body)


if __name__ == "__main__":
    main()
