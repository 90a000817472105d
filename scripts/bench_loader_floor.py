"""A lower bound for the shuffled loader's first epoch in a fresh process, against ref2.

The loader issue asks a warm shuffled epoch for >= 0.9 x ref2 (two threads reading the shards
into 48 MiB buffers), also on a cache that records 4 layers when one of them is read. This script
measures, in alternating fresh processes (warm page cache, as bench_loaders.py's warm mode):

- ``ref2``: as in bench_loaders.py, every byte of the shards;
- ``ref2 same bytes``: ref2 reading only as many bytes as one epoch of the layer delivers (the
  first part of every shard; on one layer of four a quarter of ref2's bytes);
- ``floor``: the least work any loader that hands out shuffled batches of the layer does in a
  fresh process, and nothing else: two threads, each with one fresh batch buffer (4 KiB pages,
  populated with MADV_POPULATE_WRITE, as buffers.py does), one uniform random order
  of all the layer's patch-token rows (C Fisher-Yates), and each thread gathering every other batch
  straight out of the memory-mapped shards with the loader's C copy kernel. No shuffle-window
  bound, planner, reader threads, residency checks, partitions, hand-off to a consumer (which
  needs a second buffer set while the consumer holds the last batch) or consumer;
- ``shuffled``: the ShuffledLoader itself, one epoch (bench_loaders.py's worker).

If ``floor`` stays below 0.9 x ref2, no loader built from these parts can meet that target on the
machine measured.

    python scripts/bench_loader_floor.py --layers 4 --rounds 8 [--cache-dir bench-out/loaders]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_loaders as bl  # noqa: E402
import benchlib  # noqa: E402

KINDS = ("ref2", bl.SAME_BYTES, "floor", "shuffled")


def floor_epoch(path: str, batch_size: int, seed: int = 12345, checksum: bool = False) -> dict:
    """One shuffled epoch of layer LAYER's patch tokens at the least cost (module doc). With
    ``checksum``: also the float64 sum of every value copied (tests compare it with the cache)."""
    from actcache.cache import ActivationCache
    from actcache.loaders import kernels
    from actcache.loaders.buffers import huge_empty, populate_small

    c = ActivationCache.open(path)
    md = c.metadata
    n_layers, tokens, d = len(md.layers), md.n_patches_per_img + 1, md.d_vit
    li = list(md.layers).index(bl.LAYER)
    per_img = tokens - 1
    t0 = time.perf_counter()
    srcs, fds = [], []
    for s in c.shards:
        fd = os.open(os.path.join(path, s.name), os.O_RDONLY)
        fds.append(fd)
        mm = mmap.mmap(fd, s.n_imgs * md.bytes_per_img, prot=mmap.PROT_READ)
        mm.madvise(mmap.MADV_RANDOM)
        srcs.append(np.frombuffer(mm, np.float32).reshape(-1, d))
    addresses = np.array([kernels.address(s) for s in srcs], np.int64)
    counts = np.array([s.shape[0] for s in srcs], np.int64)
    first = np.r_[0, np.cumsum([s.n_imgs for s in c.shards])].astype(np.int64)
    n = int(first[-1]) * per_img
    order = kernels.permutation(n, seed)
    n_batches = -(-n // batch_size)
    sums = [0.0, 0.0]

    def work(k: int) -> None:
        buf = huge_empty((batch_size, d), np.float32, False)
        populate_small(buf)
        for b in range(k, n_batches, 2):
            ids = order[b * batch_size : (b + 1) * batch_size]
            img, patch = np.divmod(ids, per_img)
            shard = np.searchsorted(first, img, side="right") - 1
            rows = (img - first[shard]) * (n_layers * tokens) + li * tokens + 1 + patch
            out = buf[: len(ids)]
            kernels.take_multi(srcs, shard, rows, out, stream=True, addresses=addresses, counts=counts, prefetch=1)
            if checksum:
                sums[k] += float(out.sum(dtype=np.float64))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    srcs.clear()
    for fd in fds:
        os.close(fd)
    out = {"MBps": n * d * 4 / 1e6 / dt, "seconds": dt, "examples": n}
    if checksum:
        out["sum"] = sums[0] + sums[1]
    return out


def worker(spec: dict) -> dict:
    """The floor, in this fresh process (the files made resident first, as bench_loaders' warm mode)."""
    warm = bl.rewarm([f for f, _ in bl.shard_files(spec["path"])])
    return {**floor_epoch(spec["path"], spec["batch_size"]), **warm}


def measure(spec: dict, files: list[str]) -> dict:
    """One measurement in a fresh process: the floor here, the others by bench_loaders.py's warm worker."""
    if spec["kind"] != "floor":
        return bl.measure({**spec, "options": {}}, "warm", files)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"floor failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(setup: list[str], rows: list[dict], n_layers: int) -> tuple[str, list[benchlib.Check]]:
    """The section's body and its summary line (the floor has no target of its own: info)."""
    by = {r["kind"]: r for r in rows}
    floor, loader = by["floor"]["x ref2"], by["shuffled"]["x ref2"]
    info = benchlib.Check(f"lower bound of a shuffled first epoch ({n_layers} layer(s); no target)",
                          f"{floor:.3f} x ref2", None)  # fmt: skip
    target = dict(bl.TARGETS[("shuffled", "warm")])["ref2"]
    can = "can" if floor >= target else "cannot"
    notes = [
        f"the floor runs at {floor:.3f} x ref2: a loader built from these parts {can} reach {target:g} x ref2 here",
        f"the ShuffledLoader runs at {loader:.3f} x ref2, {loader / floor:.2f} of the floor",
    ]
    return benchlib.section_body(setup, [benchlib.table(rows)], notes), [info]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=4, help="recorded layers of the cache (the loader reads one)")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16384)
    ap.add_argument("--buffer-bytes", type=int, default=3_200_000_000)
    ap.add_argument("--cache-dir", default=os.path.join(benchlib.ROOT, "bench-out", "loaders"))
    ap.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    path = bl.build(args.cache_dir, args.size_gib, args.layers, args.shard_gib)
    files = [f for f, _ in bl.shard_files(path)]
    base = {"path": path, "batch_size": args.batch_size, "buffer_bytes": args.buffer_bytes}
    got: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for k in KINDS if r % 2 == 0 else KINDS[::-1]:
            got[k].append(measure({**base, "kind": k, "seed": 17 + r}, files))
        print(r, {k: round(v[-1]["MBps"]) for k, v in got.items()}, flush=True)

    def ratio(k: str, ref: str) -> float:
        return statistics.median(a["MBps"] / b["MBps"] for a, b in zip(got[k], got[ref], strict=True))

    rows = [
        {
            "kind": k,
            "MB/s": statistics.median(m["MBps"] for m in got[k]),
            "x ref2": ratio(k, "ref2"),
            "x ref2 same bytes": ratio(k, bl.SAME_BYTES),
            "ms": statistics.median(m["seconds"] for m in got[k]) * 1e3,
            "MB/s by round": ", ".join(f"{m['MBps']:,.0f}" for m in got[k]),
        }
        for k in KINDS
    ]
    layer_gb = bl.layer_bytes(path) / 1e9
    cache_gb = sum(size for _, size in bl.shard_files(path)) / 1e9
    setup = [
        f"Warm page cache; a cache of {args.layers} recorded layer(s) ({cache_gb:.2f} GB) of which one layer's patch "
        f"tokens are read ({layer_gb:.2f} GB), batch {args.batch_size}; {args.rounds} alternating rounds, each "
        "measurement in a fresh process.",
        "ref2 and ref2 same bytes as in the loaders' section; floor = two threads, one fresh batch buffer each, "
        "one random order, the loader's C kernel and nothing else (the script's docstring);",
        f"shuffled = the ShuffledLoader's first epoch (buffer {args.buffer_bytes / 1e9:.1f} GB). x: median over "
        "rounds of the ratio within the round.",
    ]
    body, checks = render(setup, rows, args.layers)
    print(body)
    if not args.no_record:
        title = f"Shuffled first epoch against a lower bound and ref2 ({args.layers} recorded layer(s))"
        benchlib.record(f"loader-floor-L{args.layers}", title, body, checks=checks)


if __name__ == "__main__":
    main()
