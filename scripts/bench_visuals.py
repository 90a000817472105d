"""Benchmark `actcache visuals` against one ordered pass over the same 4 GiB cache.

    python scripts/bench_visuals.py [--widths 64,768,6144] [--size-gib 4] [--out bench-out/visuals] [--device cpu]

The cache: d=768, 197 tokens (CLS + 196 patches), 1 layer, synthetic activations (distinct per
image), written once under ``--out``; its data config is a SyntheticImages dataset, so the page
has real images to load and crop (through a local CLIP-224 checkpoint config). Per SAE width
(a random-init TopK SAE, k=min(32, width/8), saved as `actcache train` would), measured in this process:

- ``pass``: one OrderedLoader pass (the batch size visuals uses), every batch touched;
- ``visuals``: `actcache visuals RUN_DIR` (the pass, encode, streaming statistics, the page
  with 128 latent cards x 16 images, plots), via ``actcache.cli.main``, with its parts (loader
  wait, ``sae.encode``, statistics, page) as visuals records them in summary.json. On a
  small CPU the SAE's forward pass dominates; ``(visuals - encode) / pass`` is the ratio without it.

``--device cuda`` runs the SAEs and the statistics on the GPU and records section
``visuals-cuda`` of BENCHMARKS.md instead of ``visuals``.

Cold = the cache's pages dropped first (posix_fadvise DONTNEED on its files; the virtual disk
may still be cached by the host); warm = read once just before. Target: visuals <= 1.5x pass.
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
from actcache.protocol import Metadata, shard_name  # noqa: E402
from actcache.sae.modeling import SAE, SAEConfig  # noqa: E402
from actcache.visuals import TARGET_BATCH_BYTES  # noqa: E402
from actcache.writer import write_cache  # noqa: E402

D, T, K = 768, 197, 32


def build_cache(out: str, size_gib: float) -> str:
    ckpt = benchlib.clip224_checkpoint(out, D)
    n_imgs = int(size_gib * 2**30 // (T * D * 4))
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=T - 1,
                  cls_token=True, d_vit=D, n_imgs=n_imgs, max_patches_per_shard=2_400_000,
                  data=metadata_data(SyntheticImages(n_imgs=n_imgs, seed=0, size=64)))  # fmt: skip
    path = os.path.join(out, "cache", md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path
    print(f"writing a {size_gib} GiB cache ({n_imgs} images) to {path} ...", flush=True)

    def fill(start, end):
        rng = np.random.default_rng(start)
        return rng.standard_normal((end - start, 1, T, D), dtype=np.float32)

    return write_cache(os.path.join(out, "cache"), md, fill)


def make_run(out: str, cache: str, width: int) -> str:
    md = Metadata.load(cache)
    run = os.path.join(out, "runs", md.hash, f"w{width}")
    if not os.path.isfile(os.path.join(run, "sae.safetensors")):
        SAE(SAEConfig(d_vit=D, width=width, activation="topk", k=min(K, width // 8), seed=0)).save(run)
        doc = {"sae_id": f"w{width}", "cache": os.path.abspath(cache), "cache_hash": md.hash, "layer": -2,
               "d_vit": D, "width": width, "run": {"patches": "image", "scale_norm": False}}  # fmt: skip
        with open(os.path.join(run, "run.json"), "w") as fh:
            json.dump(doc, fh)
    return run


def evict(cache: str) -> None:
    os.sync()
    md = Metadata.load(cache)
    for i in range(md.n_shards):
        fd = os.open(os.path.join(cache, shard_name(i)), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def batch_images(width: int) -> int:
    per_img = T - 1  # patches="image"
    return max(1, min(16384 // per_img, TARGET_BATCH_BYTES // (4 * per_img * width)))


def ordered_pass(cache: str, width: int) -> float:
    t0 = time.perf_counter()
    n = 0
    with OrderedLoader(cache, batch_size=batch_images(width) * (T - 1), patches="image", layer=-2) as ld:
        for b in ld:
            n += int(b["act"][0, 0] != 0)  # touch
    return time.perf_counter() - t0


def visuals(run: str, device: str) -> tuple[float, dict]:
    shutil.rmtree(os.path.join(run, "visuals"), ignore_errors=True)  # time making it, not deleting the last one
    t0 = time.perf_counter()
    rc = cli.main(["visuals", run, "--device", device])
    dt = time.perf_counter() - t0
    assert rc == 0, rc
    with open(os.path.join(run, "visuals", "summary.json")) as fh:
        return dt, json.load(fh)["seconds"]


def render(setup: list[str], rows: list[dict]) -> tuple[str, list[benchlib.Check]]:
    """The section's body and its check: the worst cold ``visuals / pass`` over the widths."""
    cold = [r for r in rows if r["page cache"] == "cold"] or rows
    worst = max(cold, key=lambda r: r["visuals / pass"])
    check = benchlib.check(
        "cold visuals <= 1.5 x one ordered pass (every width)",
        worst["visuals / pass"],
        1.5,
        f"x pass at width {worst['width']:,}",
        at_least=False,
    )
    encode = worst["SAE encode s"] / worst["visuals s"]
    notes = [
        check.bullet(),
        f"at width {worst['width']:,} the SAE's encode takes {encode:.0%} of visuals' time; without it, "
        f"visuals take {worst['(visuals - encode) / pass']:.2f} x pass",
    ]
    return benchlib.section_body(setup, [benchlib.table(rows)], notes), [check]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="64,768,6144")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "visuals"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--warm-max-width", type=int, default=1024, help="measure warm visuals only up to this width")
    ap.add_argument("--device", default="cpu", help="where the SAEs run: cpu (default), cuda or cuda:N")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = benchlib.Device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = build_cache(args.out, args.size_gib)
    if dev.cuda:  # the CUDA context, cuBLAS and the pass's kernels load once per process (~1 s), like Python and
        # torch's import: not timed (an SAE's encode and one statistics update on random numbers)
        from actcache.topk import LatentStats

        sae = SAE(SAEConfig(d_vit=D, width=64, activation="topk", k=8, seed=0)).to(args.device)
        with torch.inference_mode():
            x = torch.randn((2 * (T - 1), D), device=args.device)
            LatentStats(64, T - 1, 16, args.device).update(sae.encode(x), torch.arange(2).repeat_interleave(T - 1))
        torch.cuda.synchronize()
    md = Metadata.load(cache)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        run = make_run(args.out, cache, width)
        for mode in ("cold", "warm") if width <= args.warm_max_width else ("cold",):
            if mode == "cold":
                evict(cache)
            else:
                ordered_pass(cache, width)
            t_pass = ordered_pass(cache, width)
            if mode == "cold":
                evict(cache)
            t_vis, parts = visuals(run, args.device)
            r = {"width": width, "page cache": mode, "pass s": t_pass, "visuals s": t_vis,
                 "loader wait s": parts["wait_s"], "SAE encode s": parts["encode_s"], "top-k/stats s": parts["stats_s"],
                 "page s": parts["page_s"], "visuals / pass": t_vis / t_pass,
                 "(visuals - encode) / pass": (t_vis - parts["encode_s"]) / t_pass}  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
    gib = md.n_imgs * md.bytes_per_img / 2**30
    setup = [
        f"Cache: {gib:.2f} GiB ({md.n_imgs:,} images x {T} tokens x d={D}, 1 layer); random-init TopK SAEs "
        f"(k=min(32, width/8)) on {dev.words}, torch threads: {torch.get_num_threads()}.",
        "`pass` = one OrderedLoader pass; `visuals` = `actcache visuals RUN_DIR` end to end, in-process "
        "(Python's start and imports not timed), with its parts: loader wait, encode, statistics, page.",
        "`(visuals - encode) / pass` leaves out the SAE's own forward pass, which no visualisation can skip.",
    ]
    body, checks = render(setup, rows)
    if not args.no_record:
        benchlib.record(*dev.section("visuals", "actcache visuals vs one ordered pass"), body, checks=checks)
    print(body)


if __name__ == "__main__":
    main()
