"""The loaders' C copy kernel alone: gathering random rows out of a huge-page file mapping, with
and without software prefetch.

    python scripts/bench_kernel.py [--rows 768,1536,3072,4096,6144,16384] [--rounds 5] [--no-record]

The shuffled loader spends most of its CPU in this gather when the cache is warm, so the
kernel's speed is most of the loader's. The script builds several variants of
``src/actcache/_native.c`` with the C compiler Python was built with, differing only in the
prefetch macros (PREFETCH_SPAN, PREFETCH_LOCALITY, WHOLE_MAX, HEAD_BYTES, MIN_AHEAD), plus a tiny
C entry point each, loads them with ctypes, and times them alternately in one process (the speed
of a VM's memory can drift over minutes, so only ratios within a round mean anything):

- ``none``: no prefetch, the reference;
- ``before``: an earlier scheme (prefetchnta; rows up to 2 KiB whole, 8 KiB of rows ahead; of a
  larger row its first 512 bytes, 2 rows ahead);
- ``nta``: the whole-row span (whole rows, 24 KiB of rows ahead) with the non-temporal hint;
- ``whole``: the committed macros, scheme 0 (whole rows into L2, prefetcht1);
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
import json
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


def render(setup: list[str], rows: list[dict]) -> tuple[str, list[benchlib.Check]]:
    """The section's body (ratios only) and its summary line: the committed schemes at d=768 rows."""
    cols = ["row bytes", "none GB/s", *(k for k in rows[0] if k.endswith(" x none"))]
    row = next((r for r in rows if r["row bytes"] == 3072), rows[0])
    best = max(("whole", "heads"), key=lambda k: row.get(f"{k} x none", 0.0))
    info = benchlib.Check(
        f"committed prefetch vs none ({row['row bytes']:,}-byte rows; no target)",
        f"{row[f'{best} x none']:.3f} x none ({best})",
        None,
    )
    gains = [max(r["whole x none"], r["heads x none"]) for r in rows]
    notes = [
        f"the faster committed scheme runs at {min(gains):.2f}-{max(gains):.2f} x none over the row sizes; which "
        "scheme wins depends on the CPU, so the loader times both on its own copies (kernels.PrefetchChooser)",
    ]
    return benchlib.section_body(setup, [benchlib.table(rows, cols)], notes), [info]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="768,1536,2048,3072,4096,6144,16384", help="row sizes in bytes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-mib", type=int, default=48)
    ap.add_argument("--batches", type=int, default=30, help="batches per thread per measurement")
    ap.add_argument("--source-gib", type=float, default=4.0)
    ap.add_argument("--dir", default=os.path.join(benchlib.ROOT, "bench-out", "kernel"))
    ap.add_argument("--json", help="write every variant's GB/s and ratios here")
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
    if args.json:
        with open(args.json, "w") as fd:
            json.dump(rows_out, fd, indent=1)
    setup = [
        f"{args.threads} threads, each copying {args.batch_mib} MiB batches of random rows out of a "
        f"{size / 2**30:.1f} GiB page-cache file mapped with 2 MiB pages ({pmd:.0%} PMD-mapped) with non-temporal "
        "stores: the shuffled loader's warm gather.",
        "Variants of src/actcache/_native.c, alternated in one process: `none` (no prefetch, the reference), "
        "`before` (an earlier scheme), `nta` (whole rows, non-temporal), `whole` and `heads` (the committed "
        "schemes 0 and 1), `seq` (consecutive rows).",
        f"x none: median over {args.rounds} rounds of the ratio within a round; GB/s of every variant: `--json`.",
    ]
    body, checks = render(setup, rows_out)
    if not args.no_record:
        benchlib.record("kernel", "Copy kernel: random-row gather with and without prefetch", body, checks=checks)
    print(body)


if __name__ == "__main__":
    main()
