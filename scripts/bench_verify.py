"""Benchmark `actcache verify --deep` against the raw sequential read speed of the same files.

    python scripts/bench_verify.py [--size-gib 4] [--cache-dir bench-out/verify] [--rounds 3] [--warm-only] [--best]

Reference (same run, same files): one thread reading every shard with 8 MiB reads into one reused
buffer. Cold rounds drop the page cache before each measurement and alternate reference/verify
(the virtual disk here is cached by the host, so cold figures swing between runs; the ratio
within a round is what counts). Every shard has its checksum record, so verify --deep reads each byte
once and checks NaN/Inf, all-zero and copied shards and the checksums. Target: verify --deep >= 0.80
of the reference. ``--warm-only`` skips the cold rounds (they drop the whole page cache, as root);
``--best`` checks the ratio of the best rounds instead of the medians (a busy machine).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

from actcache.protocol import Metadata, shard_name  # noqa: E402
from actcache.validate import check_dir  # noqa: E402
from actcache.writer import write_cache  # noqa: E402


def build(cache_root: str, size_gib: float) -> str:
    d, T = 768, 197
    per_img = T * d * 4
    n_imgs = int(size_gib * 2**30 // per_img)
    n_shards = max(1, round(size_gib))  # ~1 GiB shards of equal size: no large padded tail
    per_shard = -(-n_imgs // n_shards)
    md = Metadata(
        vit_family="clip",
        vit_ckpt="bench/synthetic",
        layers=(-2,),
        n_patches_per_img=196,
        cls_token=True,
        d_vit=d,
        n_imgs=n_imgs,
        max_patches_per_shard=per_shard * T,
        data={"__class__": "BenchVerify", "n": n_imgs},
    )
    path = os.path.join(cache_root, md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path
    base = np.random.default_rng(0).standard_normal((256, 1, T, d), dtype=np.float32)

    def fill(start, end):
        idx = np.arange(start, end) % base.shape[0]
        out = base[idx]
        out[:, 0, 0, 0] += start  # no two shards hold the same bytes (verify --deep would say so)
        return out

    return write_cache(cache_root, md, fill)


def files_of(path: str) -> list[str]:
    md = Metadata.load(path)
    return [os.path.join(path, shard_name(i)) for i in range(md.n_shards)]


def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def deep_verify(path: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    rep = check_dir(path, deep=True)
    dt = time.perf_counter() - t0
    assert rep.ok, rep.problems
    assert rep.checksums.startswith("checksums of all"), rep.checksums
    return dt, rep.bytes_read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--cache-dir", default=os.path.join(benchlib.ROOT, "bench-out", "verify"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--warm-only", action="store_true", help="no cold rounds (they drop the page cache)")
    ap.add_argument("--best", action="store_true", help="check the ratio of the best rounds (a busy machine)")
    args = ap.parse_args()
    path = build(args.cache_dir, args.size_gib)
    files = files_of(path)
    rows = []
    load0 = os.getloadavg()[0]
    for mode in ("warm",) if args.warm_only else ("warm", "cold"):
        refs, vers = [], []
        cpu: dict[str, list[float]] = {"ref": [], "verify": []}  # CPU seconds per GB, all threads
        for r in range(args.rounds):
            for which in ("ref", "verify") if r % 2 == 0 else ("verify", "ref"):
                if mode == "cold":
                    benchlib.drop_caches(files)
                else:
                    benchlib.read_through(files)  # make it warm
                c0 = cpu_seconds()
                dt, n = benchlib.read_through(files) if which == "ref" else deep_verify(path)
                cpu[which].append((cpu_seconds() - c0) / (n / 1e9))
                (refs if which == "ref" else vers).append(n / dt / 1e9)
        ref, ver = statistics.median(refs), statistics.median(vers)
        rows.append(
            {
                "page cache": mode,
                "ref GB/s (8 MiB reads)": ref,
                "verify --deep GB/s": ver,
                "ratio": ver / ref,
                "best ref GB/s": max(refs),
                "best verify GB/s": max(vers),
                "ratio of bests": max(vers) / max(refs),
                "ref CPU s/GB": min(cpu["ref"]),
                "verify CPU s/GB": min(cpu["verify"]),
                "rounds": args.rounds,
            }
        )
        print(rows[-1], flush=True)
    size = sum(os.path.getsize(f) for f in files)
    key = "ratio of bests" if args.best else "ratio"
    checks = [
        benchlib.check(f"{r['page cache']} verify --deep >= 0.80 x sequential read", r[key], 0.80, "x read")
        for r in rows
    ]
    setup = [
        f"Cache: {size / 2**30:.2f} GiB in {len(files)} shards (d=768, 197 tokens, 1 layer); medians over "
        f"{args.rounds} alternating rounds.",
        "Reference, same run: a sequential read of the shards with 8 MiB reads.",
        "verify --deep checks every shard's checksum record (xxh3 over 16 MiB blocks), NaN/Inf, all-zero and "
        "copied shards in the same read. CPU s/GB: CPU time of all the process's threads per GB (least over "
        "the rounds); verify --deep spreads it over up to 4 threads.",
        f"Checked: the {'ratio of the best rounds (other jobs only ever slow a round down)' if args.best else 'ratio of the medians'}; "
        f"1-minute load average at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ]
    body = benchlib.section_body(setup, [benchlib.table(rows)], [c.bullet() for c in checks])
    print(body)
    if not args.no_record:
        benchlib.record("verify", "verify --deep vs. sequential read", body, checks=checks)


if __name__ == "__main__":
    main()
