"""Benchmark the explorer's cost in `actcache visuals`: time and bytes at widths 4,096 to 65,536.

    python scripts/bench_explorer_pass.py [--widths 4096,16384,65536] [--n-imgs 256] [--d 64] [--device cpu]

A small cache (d=64, 65 tokens: CLS + 64 patches, 1 layer, synthetic activations, a
SyntheticImages dataset so the explorer has real images to write) and per width a random-init
TopK SAE (k=32) with a held-out split in its run.json (the explorable images). Per width, in
alternating order, measured in this process (Python's start and imports not timed):

- ``pass``: one OrderedLoader pass (the batch size visuals uses), every batch touched: the reference;
- ``no explorer``: `actcache visuals RUN --no-explorer` (the page as before the explorer);
- ``visuals``: `actcache visuals RUN` (the pass with the quantile samples and explorable images,
  the page, and the explorer: its share ``explorer s``, and its data bytes and files on disk).

``--device cuda`` records section ``explorer-pass-cuda`` instead of ``explorer-pass``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import benchlib  # noqa: E402
import torch  # noqa: E402

from actcache import cli  # noqa: E402
from actcache.images import SyntheticImages, metadata_data  # noqa: E402
from actcache.loaders import OrderedLoader  # noqa: E402
from actcache.protocol import Metadata  # noqa: E402
from actcache.sae.modeling import SAE, SAEConfig  # noqa: E402
from actcache.sae.split import heldout_images  # noqa: E402
from actcache.visuals import TARGET_BATCH_BYTES  # noqa: E402
from actcache.writer import write_cache  # noqa: E402

T, K = 65, 32


def build_cache(out: str, n_imgs: int, d: int) -> str:
    ckpt = benchlib.clip224_checkpoint(out, d)
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=T - 1, cls_token=True, d_vit=d,
                  n_imgs=n_imgs, max_patches_per_shard=2_400_000,
                  data=metadata_data(SyntheticImages(n_imgs=n_imgs, seed=0, size=64)))  # fmt: skip
    path = os.path.join(out, "cache", md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path

    def fill(start, end):
        return np.random.default_rng(start).standard_normal((end - start, 1, T, d), dtype=np.float32)

    return write_cache(os.path.join(out, "cache"), md, fill)


def make_run(out: str, cache: str, width: int) -> str:
    md = Metadata.load(cache)
    run = os.path.join(out, "runs", md.hash, f"w{width}")
    if not os.path.isfile(os.path.join(run, "sae.safetensors")):
        SAE(SAEConfig(d_vit=md.d_vit, width=width, activation="topk", k=K, seed=0)).save(run)
        held = heldout_images(md.n_imgs, 0.1).tolist()
        doc = {"sae_id": f"w{width}", "cache": os.path.abspath(cache), "cache_hash": md.hash, "layer": -2,
               "d_vit": md.d_vit, "width": width, "run": {"patches": "image", "scale_norm": False},
               "split": {"rule": "bench", "heldout_images": held}}  # fmt: skip
        with open(os.path.join(run, "run.json"), "w") as fh:
            json.dump(doc, fh)
    return run


def ordered_pass(cache: str, width: int) -> float:
    per_img = T - 1
    b = max(1, min(16384 // per_img, TARGET_BATCH_BYTES // (4 * per_img * width)))
    t0 = time.perf_counter()
    with OrderedLoader(cache, batch_size=b * per_img, patches="image", layer=-2) as ld:
        for batch in ld:
            _ = int(batch["act"][0, 0] != 0)  # touch
    return time.perf_counter() - t0


def visuals(run: str, device: str, explorer: bool) -> tuple[float, dict]:
    shutil.rmtree(os.path.join(run, "visuals"), ignore_errors=True)
    t0 = time.perf_counter()
    rc = cli.main(["visuals", run, "--device", device, *([] if explorer else ["--no-explorer"])])
    dt = time.perf_counter() - t0
    assert rc == 0, rc
    with open(os.path.join(run, "visuals", "summary.json")) as fh:
        return dt, json.load(fh)


def du(path: str) -> tuple[int, int]:
    """(bytes, files) under ``path``, each file once (hard links counted once)."""
    seen = {}
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            seen[st.st_ino] = st.st_size
    return sum(seen.values()), len(seen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="4096,16384,65536")
    ap.add_argument("--n-imgs", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds per width (medians)")
    ap.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "explorer"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = benchlib.Device(args.device)
    cache = build_cache(args.out, args.n_imgs, args.d)
    load0 = os.getloadavg()[0]
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        run = make_run(args.out, cache, width)
        got: dict[str, list] = {"pass": [], "off": [], "on": [], "explorer": []}
        for _ in range(args.rounds):
            got["pass"].append(ordered_pass(cache, width))
            got["off"].append(visuals(run, args.device, False)[0])
            t_on, summary = visuals(run, args.device, True)
            got["on"].append(t_on)
            got["explorer"].append(summary["seconds"]["explorer_s"])
        size, files = du(os.path.join(run, "visuals", "explorer"))
        med = {k: float(np.median(v)) for k, v in got.items()}
        r = {"width": width, "pass s": med["pass"], "no explorer s": med["off"], "visuals s": med["on"],
             "explorer s": med["explorer"], "visuals / no explorer": med["on"] / med["off"],
             "visuals / pass": med["on"] / med["pass"], "explorer MB": size / 1e6, "files": files,
             "data MB": summary["explorer"]["data_bytes"] / 1e6}  # fmt: skip
        print(json.dumps(r), flush=True)
        rows.append(r)
    md = Metadata.load(cache)
    setup = [
        f"Cache: {md.n_imgs:,} images x {T} tokens (64 patches + CLS) x d={md.d_vit}, 1 layer, synthetic; random-init "
        f"TopK SAEs (k={K}) on {dev.words}, torch threads {torch.get_num_threads()}; medians of {args.rounds} round(s).",
        "`pass` = one OrderedLoader pass (reference); `no explorer` = `actcache visuals RUN --no-explorer`; "
        "`visuals` = `actcache visuals RUN` with the explorer (its writing: `explorer s`), in-process.",
        "`explorer MB` = every file of visuals/explorer/ (images once), `data MB` = its data/*.js; "
        f"{len(heldout_images(md.n_imgs, 0.1))} explorable images.",
        f"1-minute load average at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ]
    worst = max(rows, key=lambda r: r["visuals / no explorer"])
    notes = [f"info: the explorer costs at most {worst['visuals / no explorer']:.2f} x the visuals without it "
             f"(width {worst['width']:,}); {rows[-1]['explorer MB']:.0f} MB at width {rows[-1]['width']:,}",
             f"the ordered pass reads this small cache in {max(r['pass s'] for r in rows):.2f} s at most, so "
             "`visuals / pass` measures the SAE's encode, the statistics and the page, not the read"]  # fmt: skip
    body = benchlib.section_body(setup, [benchlib.table(rows)], notes)
    if not args.no_record:
        benchlib.record(*dev.section("explorer-pass", "actcache visuals: the explorer's time and bytes"), body)
    print(body)


if __name__ == "__main__":
    main()
