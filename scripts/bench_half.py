"""Benchmark a bfloat16 cache (protocol 2.0) against the float32 cache of the same images, same run.

    python scripts/bench_half.py [--size-gib 1] [--rounds 3] [--cache-dir bench-out/half] [--dtype bfloat16]
                                 [--no-record]

Cache: synthetic float32, d=768, 197 tokens/img (CLS + 196 patches), one layer, ~256 MiB shards, and
its `actcache convert` to 16 bits (same images, same shard sizing in vectors). The loaders read
the patch tokens into float32 batches (the 16-bit cache's values widened in the C copy kernel).
Each measurement runs in a fresh subprocess: one epoch of the shuffled loader (buffer_bytes the
same for both caches) and of the ordered loader, warm (every page cached first) and cold (the
page cache dropped, or the files evicted with posix_fadvise, right before). Figures: medians of
``--rounds`` rounds that alternate the two caches; ratios are 16-bit over float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

D, T = 768, 197
BUFFER_BYTES = 2**28
LOADERS = ("shuffled", "ordered")
MODES = ("cold", "warm")


def build(cache_dir: str, size_gib: float, dtype: str) -> tuple[str, str]:
    """The float32 cache (made once) and its 16-bit conversion."""
    from actcache.convert import convert
    from actcache.writer import synthetic_fill, synthetic_metadata, write_cache

    n_imgs = max(1, int(size_gib * 2**30 // (T * D * 4)))
    md = synthetic_metadata(n_imgs, layers=(10,), n_patches_per_img=T - 1, d_vit=D, max_patches_per_shard=T * 400)
    path = os.path.join(cache_dir, "f32", md.hash)
    if not os.path.exists(os.path.join(path, "shards.json")):
        path = write_cache(os.path.join(cache_dir, "f32"), md, synthetic_fill(md))
    return path, convert(path, dtype, os.path.join(cache_dir, dtype))


def shard_paths(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".bin"))


def worker(path: str, loader: str, mode: str) -> dict:
    """One epoch of one loader over one cache, in this (fresh) process."""
    import warnings

    from actcache.loaders import OrderedLoader, ShuffledLoader

    warnings.simplefilter("ignore")
    files = shard_paths(path)
    how = benchlib.drop_caches(files) if mode == "cold" else benchlib.read_through(files) and "read"
    if loader == "shuffled":
        ld = ShuffledLoader(path, batch_size=16384, patches="image", layer=10, seed=0, buffer_bytes=BUFFER_BYTES)
    else:
        ld = OrderedLoader(path, batch_size=16384, patches="image", layer=10)
    t0 = time.perf_counter()
    n = 0
    for b in ld:
        n += len(b["act"])
    dt = time.perf_counter() - t0
    return {"examples": n, "seconds": dt, "rate": n / dt, "prep": how, "dtype": ld.metadata.dtype}


def measure(path: str, loader: str, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", path, loader, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="float32 cache size (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-dir", default="bench-out/half")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md as it is")
    ap.add_argument("--worker", nargs=3, metavar=("PATH", "LOADER", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    f32, half = build(args.cache_dir, args.size_gib, args.dtype)
    nbytes = {k: sum(os.path.getsize(p) for p in shard_paths(v)) for k, v in (("f32", f32), ("half", half))}
    rates: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.rounds):
        for loader in LOADERS:
            for mode in MODES:
                order = (("f32", f32), ("half", half)) if r % 2 == 0 else (("half", half), ("f32", f32))
                for key, path in order:
                    got = measure(path, loader, mode)
                    rates.setdefault((loader, mode, key), []).append(got["rate"])
                    print(f"round {r}: {loader} {mode} {key}: {got['rate']:,.0f} examples/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [
        {
            "loader": loader,
            "mode": mode,
            "float32 ex/s": f"{med[(loader, mode, 'f32')]:,.0f}",
            f"{args.dtype} ex/s": f"{med[(loader, mode, 'half')]:,.0f}",
            "ratio": benchlib.fmt(med[(loader, mode, "half")] / med[(loader, mode, "f32")]),
        }
        for loader in LOADERS
        for mode in MODES
    ]
    ratio = lambda loader, mode: med[(loader, mode, "half")] / med[(loader, mode, "f32")]  # noqa: E731
    checks = [
        benchlib.check(f"{args.dtype} cache bytes <= 0.50x float32", nbytes["half"] / nbytes["f32"], 0.5, "x", False),
        benchlib.check(f"{args.dtype} shuffled cold >= 1.7x float32 ex/s", ratio("shuffled", "cold"), 1.7, "x"),
        benchlib.check(f"{args.dtype} shuffled warm >= 1.0x float32 ex/s", ratio("shuffled", "warm"), 1.0, "x"),
    ]
    table = benchlib.table(rows)
    print(table)
    for c in checks:
        print(c.bullet())
    if args.no_record:
        return
    setup = [
        f"float32 cache {nbytes['f32'] / 2**30:.2f} GiB (d={D}, {T} tokens/img, 1 layer) and its {args.dtype} "
        f"conversion ({nbytes['half'] / 2**30:.2f} GiB); batches of 16384 float32 patch vectors",
        f"shuffled loader buffer_bytes {BUFFER_BYTES / 2**20:.0f} MiB for both; one epoch per fresh process",
        f"median of {args.rounds} alternating rounds; cold: the shards dropped from the page cache right before "
        "(drop_caches as root, else posix_fadvise DONTNEED)",
    ]
    body = benchlib.section_body(setup, [table], [c.bullet() for c in checks])
    benchlib.record("half", "16-bit caches (protocol 2.0) against float32", body, checks=checks)


if __name__ == "__main__":
    main()
