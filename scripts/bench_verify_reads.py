"""Benchmark what ``verify_reads: first`` costs the loaders' first epoch, against ``off`` in the same run.

    python scripts/bench_verify_reads.py [--size-gib 1] [--cache-dir bench-out/verify-reads] [--rounds 3]

One epoch of each loader (ShuffledLoader as train uses it, OrderedLoader) over a sealed cache (its
records list block digests), with verify_reads "off" (the reference) and "first", in alternating
rounds; cold rounds drop the page cache before each epoch, warm rounds read the shards through
first. "First epoch": this process's record of checked blocks is emptied before each epoch, so
every block is checked again, as in a new training process. The cost is 1 - first / off
(examples per second, medians). The default is "first" only if it costs <= 10% cold and <= 25%
warm for both loaders (issue #55); otherwise "off", and train says in one line that reads are
unverified.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

from actcache import shardguard  # noqa: E402
from actcache.loaders import OrderedLoader, ShuffledLoader  # noqa: E402
from actcache.protocol import Metadata, shard_name  # noqa: E402
from actcache.writer import write_cache  # noqa: E402

COLD_LIMIT, WARM_LIMIT = 0.10, 0.25  # the most "first" may cost to be the default


def build(cache_root: str, size_gib: float) -> str:
    d, T = 768, 197
    n_imgs = int(size_gib * 2**30 // (T * d * 4))
    per_shard = -(-n_imgs // max(1, round(size_gib * 4)))  # ~256 MiB shards
    md = Metadata(vit_family="clip", vit_ckpt="bench/synthetic", layers=(-2,), n_patches_per_img=196,
                  cls_token=True, d_vit=d, n_imgs=n_imgs, max_patches_per_shard=per_shard * T,
                  data={"__class__": "BenchVerifyReads", "n": n_imgs})  # fmt: skip
    path = os.path.join(cache_root, md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path
    base = np.random.default_rng(0).standard_normal((256, 1, T, d), dtype=np.float32)

    def fill(start, end):
        out = base[np.arange(start, end) % base.shape[0]]
        out[:, 0, 0, 0] += start
        return out

    return write_cache(cache_root, md, fill)  # (the writer records each shard's block digests)


def epoch(kind: str, path: str, verify_reads: str) -> tuple[float, int]:
    """(seconds, examples) of one epoch, with no block checked yet in this process."""
    shardguard._checked.clear()  # a first epoch: as in a new process
    if kind == "shuffled":
        ld = ShuffledLoader(path, batch_size=4096, layer=-2, n_epochs=1, seed=0, verify_reads=verify_reads)
    else:
        ld = OrderedLoader(path, batch_size=4096, layer=-2, verify_reads=verify_reads)
    t0 = time.perf_counter()
    n = sum(int(b["act"].shape[0]) for b in ld)
    dt = time.perf_counter() - t0
    ld.close()
    return dt, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--cache-dir", default=os.path.join(benchlib.ROOT, "bench-out", "verify-reads"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    path = build(args.cache_dir, args.size_gib)
    files = [os.path.join(path, shard_name(i)) for i in range(Metadata.load(path).n_shards)]
    load0, rows = os.getloadavg()[0], []
    for kind in ("shuffled", "ordered"):
        for mode in ("cold", "warm"):
            rate: dict[str, list[float]] = {"off": [], "first": []}
            for r in range(args.rounds):
                for vr in ("off", "first") if r % 2 == 0 else ("first", "off"):
                    if mode == "cold":
                        benchlib.evict(files)  # (only these files: the machine is shared)
                    else:
                        benchlib.read_through(files)
                    dt, n = epoch(kind, path, vr)
                    rate[vr].append(n / dt)
            off, first = statistics.median(rate["off"]), statistics.median(rate["first"])
            rows.append({"loader": kind, "page cache": mode, "off Mex/s": off / 1e6, "first Mex/s": first / 1e6,
                         "cost": 1 - first / off, "limit": COLD_LIMIT if mode == "cold" else WARM_LIMIT,
                         "rounds": args.rounds})  # fmt: skip
            print(rows[-1], flush=True)
    checks = [benchlib.check(f"verify_reads first costs <= {r['limit']:.0%} ({r['loader']}, {r['page cache']})",
                             r["cost"], r["limit"], "of off", at_least=False) for r in rows]  # fmt: skip
    default = "first" if all(c.met for c in checks) else "off"
    size = sum(os.path.getsize(f) for f in files)
    setup = [
        f"Cache: {size / 2**30:.2f} GiB in {len(files)} shards (d=768, 197 tokens, 1 layer), sealed: each record lists "
        "its 16 MiB blocks' digests.",
        "One first epoch per measurement (no block checked yet in the process), batch 4096, layer -2; "
        f"medians over {args.rounds} alternating rounds of off (reference) and first.",
        "cost = 1 - (first examples/s) / (off examples/s); cold: the shards evicted (fadvise DONTNEED) before each epoch; warm: "
        "shards read through just before.",
        f"1-minute load average at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        "(a negative cost is noise: other jobs slow rounds at random; first does strictly more work).",
    ]
    conclusions = [c.bullet() for c in checks][:4] + [
        f"default it justifies: verify_reads: {default} (first only if every cost is within its limit)"
    ]
    body = benchlib.section_body(setup, [benchlib.table(rows)], conclusions)
    print(body)
    if not args.no_record:
        benchlib.record("verify-reads", "verify_reads: first vs. off, first epoch", body, checks=checks)


if __name__ == "__main__":
    main()
