"""The loaders' C copy kernel alone: gathering random rows out of a huge-page file mapping, with
and without software prefetch.

    python scripts/bench_kernel.py [--rows 768,1536,3072,4096,6144,16384] [--rounds 5] [--no-record]

The shuffled loader spends ~70-80% of its CPU in this gather when the cache is warm, so the
kernel's speed is most of the loader's. The script builds several variants of
``src/actcache/_native.c`` with the C compiler Python was built with, differing only in the
prefetch macros (PREFETCH_SPAN, PREFETCH_LOCALITY, WHOLE_MAX, HEAD_BYTES, MIN_AHEAD), plus a tiny
C entry point each, loads them with ctypes, and times them alternately in one process (the speed
of this VM's memory drifts by +-20% over minutes, so only ratios within a round mean anything):

- ``none``: no prefetch, the reference;
- ``before``: the scheme shipped until 2026-11-25 (prefetchnta; rows up to 2 KiB whole, 8 KiB
  of rows ahead; of a larger row its first 512 bytes, 2 rows ahead);
- ``nta``: the whole-row span (whole rows, 24 KiB of rows ahead) with the non-temporal hint;
- ``whole``: the committed macros, scheme 0 (whole rows into L2, prefetcht1; called ``shipped``
  before 2026-11-26, when it was the only scheme);
- ``heads``: the committed macros, scheme 1 (a row's first 256 bytes, 4 rows ahead, into L3 with
  prefetcht2); the shuffled loader times both on its own copies and keeps the faster
  (kernels.PrefetchChooser);
- ``seq``: the ``whole`` kernel copying the same number of consecutive rows (a sequential read:
  the ceiling of a copy on this machine).

Source: a file of ``--source-gib`` (made once under ``--dir``, read into the page cache) mapped
with 2 MiB pages through the loaders' own ShardMaps, as the shuffled loader maps a warm cache;
``--threads`` threads each copy ``--batch-mib`` batches of rows drawn uniformly at random from
all of it into their own 64-byte-aligned destination with non-temporal stores (the loader's
batch path).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

from actcache.loaders.buffers import huge_empty  # noqa: E402
from actcache.loaders.maps import ShardMaps  # noqa: E402

SOURCE = os.path.join(benchlib.ROOT, "src", "actcache", "_native.c")
ENTRY = r"""
#include "%s"
#ifndef BENCH_SCHEME
#define BENCH_SCHEME 0
#endif
void act_bench_gather(const char *const *bases, const int64_t *srcs, const int64_t *rows, long long n,
                      long long stride, long long piece, char *dst) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.scheme = BENCH_SCHEME;
    j.bases = bases; j.srcs = srcs; j.rows = rows; j.n = n; j.stride = stride; j.piece = piece;
    j.dst = dst; j.scale = 1.0f;
#ifdef ACT_X86
    if (isa < 0) isa = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    run_job(&j, 1);
}
"""
VARIANTS = {
    "none": ["-DPREFETCH_SPAN=0"],
    "before": ["-DWHOLE_MAX=2048", "-DPREFETCH_SPAN=8192", "-DPREFETCH_LOCALITY=0", "-DHEAD_BYTES=512"],
    "nta": ["-DPREFETCH_LOCALITY=0"],
    "whole": [],
    "heads": ["-DBENCH_SCHEME=1"],
}


# Earlier runs on other hosts, kept because which scheme is faster depends on the CPU.
EARLIER = (
    "Earlier run, Zen-4 VM (family 25 model 17), 2026-11-25 03:21 UTC, before `heads` existed (`whole` then "
    "called `shipped`), x none by row bytes 768 / 1,536 / 2,048 / 3,072 / 4,096 / 6,144 / 16,384: whole 1.63, "
    "1.83, 1.73, 1.68, 1.40, 1.37, 1.16; before 1.35, 1.23, 1.11, 1.18, 1.22, 1.17, 1.03; nta 1.39, 1.18, 1.22, "
    "1.11, 1.00, 0.97, 0.90; seq 2.78, 2.71, 2.35, 2.35, 1.92, 1.79, 1.51 (none 8.3-17.0 GB/s). "
    "Earlier still, Zen-5 VM (family 26), 2026-11-24 22:28 UTC, `before` then shipped, whole rows 24 KiB ahead "
    "non-temporally then called `whole` (x none): 768-byte rows before 1.29, nta 1.27; 1,536: 1.27, 1.15; "
    "3,072: 1.09, 1.03; 6,144: 1.19, 0.95; 16,384: 1.05, 0.93; a sequential copy 1.22-1.53 (random rows "
    "without prefetch 17-24 GB/s, sequential 24-29). The prefetch into L2 was not measured on that host."
)


def build(tmp: str) -> dict:
    """Each variant as a ctypes function act_bench_gather."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    inc = sysconfig.get_paths()["include"]
    entry = os.path.join(tmp, "entry.c")
    with open(entry, "w") as fd:
        fd.write(ENTRY % SOURCE)
    fns = {}
    for name, flags in VARIANTS.items():
        out = os.path.join(tmp, f"k_{name}.so")
        cmd = [*cc, "-O2", "-fwrapv", "-DNDEBUG", "-shared", "-fPIC", f"-I{inc}", *flags, entry, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"building variant {name!r} failed: {' '.join(cmd)}\n{r.stderr}")
        fn = ctypes.CDLL(out).act_bench_gather
        P, L = ctypes.c_void_p, ctypes.c_longlong
        fn.argtypes = [P, P, P, L, L, L, P]
        fns[name] = fn
    return fns


def make_source(d: str, gib: float) -> str:
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "source.bin")
    size = int(gib * 2**30) // (2 * 2**20) * (2 * 2**20)
    if not (os.path.exists(path) and os.path.getsize(path) == size):
        chunk = np.random.default_rng(0).standard_normal(8 * 2**20 // 4, dtype=np.float32)
        with open(path + ".part", "wb") as fd:
            for _ in range(size // chunk.nbytes):
                fd.write(chunk)
        os.replace(path + ".part", path)
    buf = bytearray(64 * 2**20)
    with open(path, "rb", buffering=0) as fd:  # into the page cache
        while fd.readinto(buf):
            pass
    return path


def measure(fn, jobs: list, bases: np.ndarray, dsts: list, piece: int, batches: int) -> float:
    """GB/s of len(dsts) threads, each copying ``batches`` batches (jobs in turn) with ``fn``."""
    n = len(jobs[0][1])

    def work(k: int) -> None:
        for i in range(batches):
            s, r = jobs[(i * len(dsts) + k) % len(jobs)]
            fn(bases.ctypes.data, s.ctypes.data, r.ctypes.data, n, piece, piece, dsts[k].ctypes.data)

    ths = [threading.Thread(target=work, args=(k,)) for k in range(len(dsts))]
    t = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return len(dsts) * batches * n * piece / (time.perf_counter() - t) / 1e9


def pmd_mapped_kib() -> int:
    with open("/proc/self/smaps_rollup") as fd:
        for line in fd:
            if line.startswith("FilePmdMapped:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="768,1536,2048,3072,4096,6144,16384", help="row sizes in bytes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-mib", type=int, default=48)
    ap.add_argument("--batches", type=int, default=30, help="batches per thread per measurement")
    ap.add_argument("--source-gib", type=float, default=4.0)
    ap.add_argument("--dir", default=os.path.join(benchlib.ROOT, "bench-out", "kernel"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    path = make_source(args.dir, args.source_gib)
    size = os.path.getsize(path)
    maps = ShardMaps(os.path.dirname(path), [os.path.basename(path)], [size], mode="huge")
    src = maps.array(0)
    maps.make_resident(0, np.array([0]), np.array([size]))
    pmd = pmd_mapped_kib() * 1024 / size
    nbytes = args.batch_mib * 2**20
    dsts = [huge_empty((nbytes,), np.uint8) for _ in range(args.threads)]  # as the loaders' batch buffers
    for d in dsts:
        d[:] = 1  # fault the destinations in before any timing
    bases = np.array([src.ctypes.data], np.int64)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        fns = build(tmp)
        rows_out = []
        for piece in (int(x) for x in args.rows.split(",")):
            n = nbytes // piece
            jobs = [(np.zeros(n, np.int64), rng.integers(0, size // piece, n)) for _ in range(8)]
            seq = [(np.zeros(n, np.int64), (np.arange(n, dtype=np.int64) + k * n) % (size // piece)) for k in range(8)]

            cases = {**{k: (f, jobs) for k, f in fns.items()}, "seq": (fns["whole"], seq)}
            measure(*cases["none"], bases, dsts, piece, 4)  # warm-up
            got = {k: [] for k in cases}
            for rnd in range(args.rounds):
                order = list(cases) if rnd % 2 == 0 else list(reversed(cases))
                for k in order:
                    got[k].append(measure(*cases[k], bases, dsts, piece, args.batches))
            ref = np.array(got["none"])
            row = {"row bytes": piece}
            for k, v in got.items():
                row[f"{k} GB/s"] = float(np.median(v))
                if k != "none":
                    row[f"{k} x none"] = float(np.median(np.array(v) / ref))
            print(row, flush=True)
            rows_out.append(row)
    body = (
        f"{args.threads} threads, each copying {args.batch_mib} MiB batches of rows drawn uniformly at random from a "
        f"{size / 2**30:.1f} GiB page-cache file mapped with 2 MiB pages ({pmd:.0%} of it PMD-mapped in this run) into "
        f"its own destination with non-temporal stores: the shuffled loader's warm gather. Variants of "
        f"src/actcache/_native.c, built by this script and alternated in one process: `none` = no prefetch "
        f"(the reference), `before` = the prefetch shipped until 2026-11-25 (prefetchnta: whole rows up to 2 KiB, "
        f"8 KiB of rows ahead; the first 512 bytes of a larger row, 2 rows ahead), `nta` = whole rows 24 KiB "
        f"ahead, non-temporal, `whole` = the committed scheme 0 (whole rows up to 16 KiB into L2 with "
        f"prefetcht1, 24 KiB of rows ahead, 2-16 rows; `shipped` in earlier runs), `heads` = the committed "
        f"scheme 1 (a row's first 256 bytes, 4 rows ahead, into L3 with prefetcht2; the shuffled loader times "
        f"both and keeps the faster); `seq` = the `whole` kernel copying consecutive rows (a "
        f"sequential copy). GB/s: medians of {args.rounds} rounds; x none: median "
        f"over rounds of the ratio within the round.\n\n" + benchlib.table(rows_out) + "\n" + EARLIER
    )
    if not args.no_record:
        benchlib.record("kernel", "Copy kernel: random-row gather with and without prefetch", body)
    print(body)


if __name__ == "__main__":
    main()
