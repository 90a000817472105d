"""Benchmark the ordered and shuffled loaders against raw reads of the same files, same run.

    python scripts/bench_loaders.py [--size-gib 4] [--layers 1,4] [--rounds 3] [--cache-dir bench-out/loaders]
                                    [--json OUT] [--quick]

Cache: synthetic, d=768, 197 tokens/img (CLS + 196 patches), 1 or 4 recorded layers, ~1 GiB shards;
the loaders read one layer (10), patch tokens, batch 16384; the shuffled loader with a 3.2 GB buffer.
References (same run, same files): ref = one thread reading the shards with 8 MiB reads into one
reused buffer; ref2 = two threads reading them into batch-sized (48 MiB) buffers; on a cache of
several layers also ref layer = the raw read of just the bytes the loaders read (layer 10's
patch-token ranges, ~600 KB each, one thread, one reused batch-sized buffer; cold, a second thread
asks the kernel for them four batches ahead). Loaders count only the bytes of the layer they
read. naive = torch DataLoader over IndexedDataset with a RandomSampler and 2 workers,
time-boxed and extrapolated. Every measurement runs in a fresh
subprocess (clean peak-RSS figure, no mapping kept open across a cold measurement). Warm: the
measuring process first makes sure every page of the shards is in the page cache, read in by plain
sequential reads (rewarm: on the project VM a DAMON scheme pages out file pages read once and left
for a while, even with memory free, so a cache read a minute earlier is partly gone; the table's
"cached before, min" is the least share found cached before; where much was gone, or where the page
cache holds the shards in small folios, which the loaders copy out of ~1.4x slower, the shards are
dropped and read through again whole; "2 MiB folios, min" is the least share held in 2 MiB folios
when measured); cold: page cache dropped right before each measurement; cold-late: the
same, then COLD_LATE_S idle before it starts (see the machine note: on this VM memory freed a
second or more earlier has been handed back to the host, as it has before any real cold read);
cold-primed: dropped, then the measuring process touches and frees as much memory as the cache
plus 1 GiB before it starts, so every measurement reads into memory the host has just backed (the
closest this VM comes to a machine without free page reporting, and the steadiest cold figure);
warm-primed: warm, then the measuring process touches and frees buffer_bytes plus 1 GiB right
before it starts, so that the batch buffers (and ref2's) are memory the host has just backed: on
this VM fresh memory faults in at 0.3-4 GB/s and a first epoch's batch buffers can cost as much
as the copy itself, which a machine without free page reporting does not pay; all median of
``--rounds`` alternating rounds (``--warm-rounds``, if given, for the warm modes). ``--modes cold-primed`` (any subset) measures only
those modes and keeps the stored results of the others.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

D, T, LAYER = 768, 197, 10
VARIANTS = {  # extra loader configurations measured beside the default ones
    "ordered io=read": {"io": "read"},
    "ordered io=mmap": {"io": "mmap"},
    "ordered 2nd epoch": {},  # two passes in one process, the second timed with the pause before it (warm only)
    "shuffled 2nd epoch": {"n_epochs": 2},  # the second epoch timed, with the pause before it (warm only)
    # a cache of several layers: as many epochs as make the bytes ref2 reads (warm only; see WHOLE_VOLUME)
    "shuffled ref2's volume": {},
    "shuffled strips=3": {"n_strips": 3},
    "shuffled io=read": {"io": "read"},
    "shuffled cold_read=fault": {"cold_read": "fault"},  # runs not cached read through the mapping
}
MODES = ("warm", "cold", "cold-late", "cold-primed", "warm-primed")
# "shuffled ref2's volume": on a cache of several layers ref2 reads every layer (4.3 GB) and the
# loader one (1.07 GB per epoch), so a one-epoch measurement weighs a fresh process's one-time
# costs (threads, fresh batch buffers, the first plan) 4x more for the loader than for ref2. This
# row times as many epochs in one process as make the bytes ref2 reads, all of them: equal volumes.
WHOLE_VOLUME = "shuffled ref2's volume"
# The other way to compare equal volumes on a cache of several layers: ref2 itself reading only as
# many bytes as one epoch of the layer (the first 1/L of every shard), in its own fresh process, so
# that its one-time costs (threads, two fresh 48 MiB buffers) weigh on the loader's volume too.
SAME_BYTES = "ref2 same bytes"
WARM_ONLY = ("2nd epoch", WHOLE_VOLUME)  # kinds measured in the warm mode only


def warm_only(kind: str) -> bool:
    return any(w in kind for w in WARM_ONLY)


COLD_LATE_S = 4.0  # idle after drop_caches in mode cold-late
PRIME_EXTRA = 2**30  # cold-primed: memory touched and freed = the cache's size + this
REWARM_WHOLE = 0.95  # warm: with less than this share still cached, read the files again whole
REWARM_HUGE = 0.9  # ... or with less than this share in 2 MiB page-cache folios
TARGETS = {  # (loader, mode) -> [(reference, minimum ratio)]; cold-late and cold-primed have cold's
    ("shuffled", "warm"): [("ref", 0.30), ("ref2", 0.90)],
    ("shuffled", "cold"): [("ref", 0.80)],
    ("ordered", "warm"): [("ref", 0.60)],
    ("ordered", "cold"): [("ref", 0.90)],
}


# ---- the cache ----------------------------------------------------------------------------------
def build(root: str, size_gib: float, n_layers: int, shard_gib: float) -> str:
    from actcache.validate import check_dir
    from actcache.writer import ensure_metadata, gather, open_shard_writer, synthetic_metadata

    layers = tuple(range(LAYER - n_layers + 2, LAYER + 2))[-n_layers:] if n_layers > 1 else (LAYER,)
    img_bytes = n_layers * T * D * 4
    n_imgs = max(1, int(size_gib * 2**30) // img_bytes)
    n_shards = max(1, round(size_gib / shard_gib))
    per_shard = -(-n_imgs // n_shards)  # shards of equal size (no nearly empty last one)
    md = synthetic_metadata(
        n_imgs,
        layers=layers,
        n_patches_per_img=T - 1,
        cls_token=True,
        d_vit=D,
        max_patches_per_shard=per_shard * T * n_layers,
        seed=n_layers,
    )
    path = ensure_metadata(root, md)
    if os.path.exists(os.path.join(path, "shards.json")) and check_dir(path).ok:
        return path
    base = np.random.default_rng(n_layers).standard_normal((64, n_layers, T, D), dtype=np.float32)
    for s in range(md.n_shards):
        a, b = md.shard_img_range(s)
        with open_shard_writer(path, md, s) as w:
            for i in range(a, b, 64):
                n = min(64, b - i)
                w.write(base[:n] * np.float32(0.5 + (i // 64) % 7 / 4))
    gather(path)
    return path


def shard_files(path: str) -> list[tuple[str, int]]:
    from actcache.cache import ActivationCache

    c = ActivationCache.open(path)
    return [(os.path.join(path, s.name), s.n_imgs * c.metadata.bytes_per_img) for s in c.shards]


# ---- measurements (run in a subprocess) ---------------------------------------------------------
def ref_read(files, threads: int, chunk: int) -> dict:
    jobs = [(f, off, min(chunk, size - off)) for f, size in files for off in range(0, size, chunk)]

    def work(k):
        buf = np.empty(chunk, np.uint8)
        buf[:] = 0
        fds = {}
        for f, off, n in jobs[k::threads]:
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            os.preadv(fd, [memoryview(buf)[:n]], off)
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    dt = time.perf_counter() - t0
    total = sum(size for _, size in files)
    return {"MBps": total / 1e6 / dt, "seconds": dt}


def layer_bytes(path: str) -> int:
    """The bytes one epoch of the loaders delivers: layer LAYER's patch tokens of every image."""
    with open(os.path.join(path, "metadata.json")) as fh:
        return json.load(fh)["n_imgs"] * (T - 1) * D * 4


def layer_ranges(path: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(file, starts, ends): the byte ranges of layer LAYER's patch tokens in every image of every
    shard, the bytes the loaders read and count."""
    from actcache.cache import ActivationCache

    c = ActivationCache.open(path)
    md = c.metadata
    li = list(md.layers).index(LAYER)
    out = []
    for s in c.shards:
        first = np.arange(s.n_imgs, dtype=np.int64) * md.bytes_per_img + (li * T + 1) * D * 4  # skip CLS
        out.append((os.path.join(path, s.name), first, first + (T - 1) * D * 4))
    return out


def ref_layer(path: str, batch_bytes: int, ask_ahead: bool) -> dict:
    """The raw read of what the loaders read from a multi-layer cache: one thread reads LAYER's
    byte ranges in file order with preadv into one reused batch-sized buffer; with ``ask_ahead``
    (cold) a second thread first asks the kernel for them (posix_fadvise WILLNEED) up to four
    batches ahead, so that many reads are in flight, as the ordered loader's readers do."""
    ranges = [(f, int(a), int(b)) for f, starts, ends in layer_ranges(path) for a, b in zip(starts, ends, strict=True)]
    fds = {f: os.open(f, os.O_RDONLY) for f, _, _ in ranges}
    cond, state = threading.Condition(), {"read": 0}
    ahead = 4 * batch_bytes

    def ask():
        asked = 0
        for f, a, b in ranges:
            with cond:
                cond.wait_for(lambda asked=asked: asked - state["read"] < ahead)
            os.posix_fadvise(fds[f], a, b - a, os.POSIX_FADV_WILLNEED)
            asked += b - a

    t0 = time.perf_counter()
    buf = np.empty(batch_bytes, np.uint8)
    buf[:] = 0
    mv = memoryview(buf)
    th = threading.Thread(target=ask, daemon=True) if ask_ahead else None
    if th is not None:
        th.start()
    pos = total = 0
    for f, a, b in ranges:
        n = b - a
        if pos + n > batch_bytes:
            pos = 0
        total += os.preadv(fds[f], [mv[pos : pos + n]], a)
        pos += n
        with cond:
            state["read"] = total
            cond.notify_all()
    dt = time.perf_counter() - t0
    if th is not None:
        th.join()
    for fd in fds.values():
        os.close(fd)
    return {"MBps": total / 1e6 / dt, "seconds": dt}


def entropy(x: np.ndarray, k: int) -> float:
    c = np.bincount(x)
    p = c[c > 0] / len(x)
    return float(-(p * np.log(p)).sum() / np.log(min(len(x), k))) if min(len(x), k) > 1 else 1.0


def entropy_balanced(m: int, n_imgs: int, batch: int) -> float:
    """Entropy of a batch taking the same count (+-1) from each of ``m`` images."""
    k = min(m, batch)
    c = np.full(k, batch // k, np.int64)
    c[: batch % k] += 1
    p = c / batch
    return float(-(p * np.log(p)).sum() / np.log(min(batch, n_imgs)))


def entropy_bound(n_imgs: int, buffer_bytes: int | None, batch: int) -> tuple[int, float]:
    """(images that fit in the buffer, mean entropy of uniform batches drawn from them)."""
    m = n_imgs if buffer_bytes is None else max(1, min(n_imgs, buffer_bytes // ((T - 1) * D * 4)))
    rng = np.random.default_rng(0)
    return m, float(np.mean([entropy(rng.integers(0, m, batch), n_imgs) for _ in range(5)]))


def cpu_s() -> float:
    """CPU seconds (user + system) used by this process so far."""
    t = os.times()
    return t.user + t.system


class MemSampler:
    """Peak growth of this process's anonymous and mapped-file memory (sampled every 20 ms)."""

    def __init__(self):
        self.base_anon, self.base_file = self.sample()  # the interpreter's own code is file-mapped
        self.anon_peak, self.file_peak = self.base_anon, self.base_file
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def sample() -> tuple[int, int]:
        vals = {}
        for line in open("/proc/self/status"):
            if line.startswith(("RssAnon", "RssFile")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) * 1024
        return vals["RssAnon"], vals["RssFile"]

    def _run(self):
        while not self._stop.wait(0.02):
            a, f = self.sample()
            self.anon_peak, self.file_peak = max(self.anon_peak, a), max(self.file_peak, f)

    def stop(self):
        self._stop.set()
        self._t.join()

    @property
    def anon_growth(self) -> int:
        return self.anon_peak - self.base_anon


def rewarm(paths: list[str], tries: int = 3) -> dict:
    """Warm measurements: bring the files back to the warm state the run started from, all of
    their pages in the page cache, read in by plain sequential reads, right before the measurement.
    The files are dropped and read through once if less than REWARM_WHOLE of them is still
    cached, or if less than REWARM_HUGE is held in 2 MiB folios (benchlib.huge_share: reads that
    only fill holes, or random ones, leave small folios, out of which the loaders copy ~1.4x
    slower, so the state would depend on what DAMON took or what read the files last); then
    holes are filled (at most ``tries`` reads through) until every page is cached. -> the
    resident share found first ("resident_before") and at the end ("resident"), whether the files
    were read again whole ("reread"), and the share in 2 MiB folios at the end ("huge_share")."""
    before = frac = benchlib.resident_fraction(paths)
    huge = benchlib.huge_share(paths) if frac == 1.0 else None  # (maps only: nothing left to read)
    reread = frac is not None and (frac < REWARM_WHOLE or (huge is not None and huge < REWARM_HUGE))
    if reread:
        benchlib.evict(paths)
        benchlib.read_through(paths)
        frac = benchlib.resident_fraction(paths)
    read = reread
    for _ in range(tries):
        if frac is not None and frac >= 1.0:
            break
        benchlib.read_through(paths)
        frac = benchlib.resident_fraction(paths)
        read = True
    if read or huge is None:  # (the share found first still holds when nothing was read)
        huge = benchlib.huge_share(paths)
    return {"resident_before": before, "resident": frac, "reread": reread, "huge_share": huge}


def run_loader(spec: dict) -> dict:
    import torch

    from actcache.loaders import IndexedDataset, OrderedLoader, ShuffledLoader

    path, kind, B = spec["path"], spec["kind"], spec["batch_size"]
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    files = shard_files(path)
    # warm this process's own code first (torch's libraries are paged in lazily); a cold
    # measurement then drops the page cache from here: pages mapped by this process (its code)
    # stay, the shards (not mapped yet) go
    torch.from_numpy(np.ones((4, 4), np.float32)).sum().item()
    if spec.get("cold"):
        benchlib.drop_caches([f for f, _ in files])
        time.sleep(spec.get("cold_delay_s", 0.0))
    warm = {}
    if not spec.get("cold"):  # warm: the files resident right now (module doc: DAMON pages them out)
        warm = rewarm([f for f, _ in files])
    if spec.get("prime_bytes"):  # memory the host backs again now, freed right before the measurement
        prime = np.empty(spec["prime_bytes"], np.uint8)
        prime[:: os.sysconf("SC_PAGE_SIZE")] = 1
        del prime
    if kind in ("ref", "ref2", SAME_BYTES):
        if kind == SAME_BYTES:  # the first part of every shard, as many bytes in all as the layer's
            share = layer_bytes(path) / sum(size for _, size in files)
            files = [(f, max(1, int(size * share) // 4096 * 4096)) for f, size in files]
        c0 = cpu_s()
        out = ref_read(files, 1, 8 * 2**20) if kind == "ref" else ref_read(files, 2, 48 * 2**20)
        cpu = cpu_s() - c0  # (0 for a tiny --quick cache: below the clock's 10 ms tick)
        out["GB_per_cpu_s"] = sum(size for _, size in files) / 1e9 / cpu if cpu > 0 else None
        return {**out, **warm}
    if kind == "ref layer":
        c0 = cpu_s()
        out = ref_layer(path, B * D * 4, bool(spec.get("cold")))
        cpu = cpu_s() - c0
        out["GB_per_cpu_s"] = out["MBps"] * out["seconds"] / 1e3 / cpu if cpu > 0 else None
        return {**out, **warm}
    if kind.startswith("ordered"):
        loader = OrderedLoader(path, batch_size=B, patches="image", layer=LAYER, **spec.get("options", {}))
    elif kind.startswith("shuffled"):
        opts = dict(spec.get("options", {}))
        if kind == WHOLE_VOLUME:  # whole epochs making ref2's bytes (at least one)
            opts["n_epochs"] = max(1, round(sum(size for _, size in files) / layer_bytes(path)))
        loader = ShuffledLoader(
            path,
            batch_size=B,
            patches="image",
            layer=LAYER,
            buffer_bytes=spec["buffer_bytes"],
            seed=spec.get("seed", 17),
            **opts,
        )
    else:
        ds = IndexedDataset(path, "image", LAYER)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=B,
            num_workers=2,
            sampler=torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
        )
    with open("/proc/self/clear_refs", "w") as fd:  # reset the peak-RSS counter
        fd.write("5")
    base = rss()
    mem = MemSampler()
    n, first, imgs, patches = 0, None, [], []
    deadline = spec.get("time_box_s")
    skip = len(loader) if "2nd epoch" in kind else 0  # time epoch 2 only (from the end of epoch 1)
    # the shuffled loader runs both epochs in one iteration (n_epochs=2); the ordered one, one pass
    # per `for` loop: the second pass starts when the first ends, on the same loader
    batches = itertools.chain(loader, loader) if skip and kind.startswith("ordered") else loader
    c0 = cpu_s()
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        if first is None:
            first = time.perf_counter() - t0
        n += len(b["act"])
        if kind.startswith("shuffled"):
            imgs.append(b["image_i"].numpy().copy())
            patches.append(b["patch_i"].numpy().copy())
        if skip and i == skip - 1:  # the first epoch's last batch: time the second from here, with
            # the pause between the two (its 'first batch')
            c0, t0, imgs, patches, n, first = cpu_s(), time.perf_counter(), [], [], 0, None
        if deadline and time.perf_counter() - t0 > deadline:
            break
    dt = time.perf_counter() - t0
    cpu = cpu_s() - c0
    mem.stop()
    hwm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
    out = {
        "examples": n,
        "seconds": dt,
        "examples_per_s": n / dt,
        "MBps": n * D * 4 / 1e6 / dt,
        "first_batch_s": first,
        "peak_rss_GB": hwm / 1e9,
        "rss_growth_GB": (hwm - base) / 1e9,
        "anon_growth_GB": mem.anon_growth / 1e9,
        "file_mapped_GB": (mem.file_peak - mem.base_file) / 1e9,
        "GB_per_cpu_s": n * D * 4 / 1e9 / cpu if kind != "naive" and cpu > 0 else None,
    }
    if hasattr(loader, "stats"):
        out["held_GB"] = loader.stats.peak_held_bytes / 1e9
    if kind == "naive":
        out["extrapolated_epoch_s"] = len(loader.dataset) / (n / dt)
    if kind.startswith("shuffled"):
        out["wait_s"] = loader.stats.wait_s
        out["prefetch"] = loader.stats.prefetch  # the copy kernel's scheme the loader chose
        out["prefetch_GBps"] = loader.stats.prefetch_GBps
        n_imgs = loader.metadata.n_imgs
        out["entropy_image"] = float(np.mean([entropy(x, n_imgs) for x in imgs]))
        out["entropy_patch"] = float(np.mean([entropy(x, T - 1) for x in patches]))
        nb = len(loader)  # batches per epoch: every example exactly once in each epoch timed
        ok = True
        for e in range(0, len(imgs), nb):
            key = np.concatenate(imgs[e : e + nb]) * (T - 1) + np.concatenate(patches[e : e + nb])
            ok = ok and bool((np.bincount(key, minlength=n_imgs * (T - 1)) == 1).all())
        out["exactly_once"] = ok and len(imgs) % nb == 0
        out["epochs"] = len(imgs) // nb
    return {**out, **warm}


def measure(spec: dict, mode: str | bool, files: list[str]) -> dict:
    """One measurement in a fresh process; mode: one of MODES (True: cold, False: warm)."""
    mode = "cold" if mode is True else "warm" if mode is False else mode
    extra = {"cold": not mode.startswith("warm"), "cold_delay_s": COLD_LATE_S if mode == "cold-late" else 0.0}
    if mode == "cold-primed":  # the page cache the read fills, and the loader's own memory
        extra["prime_bytes"] = sum(os.path.getsize(f) for f in files) + PRIME_EXTRA
    elif mode == "warm-primed":  # the loader's own memory (io="read": an arena of buffer_bytes)
        extra["prime_bytes"] = spec["buffer_bytes"] + PRIME_EXTRA
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps({**spec, **extra})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{spec['kind']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- driver -------------------------------------------------------------------------------------
def bench_cache(args, n_layers: int) -> dict:
    path = build(args.cache_dir, args.size_gib, n_layers, args.shard_gib)
    files = [f for f, _ in shard_files(path)]
    base = {"path": path, "batch_size": args.batch_size, "buffer_bytes": args.buffer_bytes}
    refs = ["ref", "ref2", SAME_BYTES, "ref layer"] if n_layers > 1 else ["ref", "ref2"]
    kinds = [*refs, "ordered", "shuffled", *(v for v in args.variants if n_layers > 1 or v != WHOLE_VOLUME)]
    res = {mode: {k: [] for k in kinds if mode == "warm" or not warm_only(k)} for mode in args.modes}
    if any(m.startswith("warm") for m in args.modes):  # a defined warm state: one plain sequential read
        measure({**base, "kind": "ref"}, True, files)
    for mode in args.modes:
        rounds = args.warm_rounds if mode.startswith("warm") and args.warm_rounds else args.rounds
        for r in range(rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for k in order:
                if mode != "warm" and warm_only(k):
                    continue
                m = measure({**base, "kind": k, "seed": 17 + r, "options": VARIANTS.get(k, {})}, mode, files)
                res[mode][k].append(m)
                print(f"  L={n_layers} {mode} round {r} {k:9s} {m['MBps']:8.0f} MB/s", flush=True)
    if args.naive_s > 0 and "warm" in args.modes:
        measure({**base, "kind": "ref"}, True, files)
        res["warm"]["naive"] = [measure({**base, "kind": "naive", "time_box_s": args.naive_s}, False, files)]
    with open(os.path.join(path, "metadata.json")) as fh:
        md = json.load(fh)
    return {
        "n_layers": n_layers,
        "path": path,
        "n_imgs": md["n_imgs"],
        "size_GB": sum(size for _, size in shard_files(path)) / 1e9,
        "results": res,
        "date": time.time(),
    }


def merge_stored(args, run: dict) -> dict:
    """Results of the modes measured now over the stored ones of the same cache (other modes kept),
    so that one mode can be measured again without the others (see --modes)."""
    p = os.path.join(args.cache_dir, f"results-L{run['n_layers']}.json")
    if args.quick or set(args.modes) == set(MODES) or not os.path.exists(p):
        return run
    with open(p) as fh:
        old = json.load(fh)
    if any(old.get(k) != run[k] for k in ("path", "batch_size", "buffer_bytes")):
        return run  # another cache or configuration: nothing to keep
    before = old.get("measured") or {m: {"date": old["date"], "argv": old.get("argv")} for m in old["results"]}
    results = {m: old["results"][m] for m in MODES if m in old["results"] and m not in run["results"]}
    results.update(run["results"])
    run["results"] = {m: results[m] for m in MODES if m in results}
    run["measured"] = {**before, **run["measured"]}
    for k in ("argv", "date", "load"):  # the header names the run that measured the most
        run[k] = old.get(k, run[k])
    return run


def _median(ms: list[dict], key: str):
    return statistics.median(m[key] for m in ms) if ms and ms[0].get(key) is not None else None


def _ratios(ms: list[dict], refs: list[dict]) -> list[float]:
    """The ratio within each round (same page-cache and host-cache state), in round order."""
    return [m["MBps"] / r["MBps"] for m, r in zip(ms, refs, strict=False)]


def _ratio(ms: list[dict], refs: list[dict]) -> float:
    """Median over rounds of the ratio within a round."""
    return statistics.median(_ratios(ms, refs))


def summarize(run: dict) -> list[dict]:
    rows = []
    for mode, kinds in run["results"].items():
        for kind, ms in kinds.items():
            med = functools.partial(_median, ms)
            mbps = med("MBps")
            row = {
                "layers": run["n_layers"],
                "mode": mode,
                "loader": kind,
                "MB/s": mbps,
                "x ref": _ratio(ms, kinds["ref"]),
                "x ref2": _ratio(ms, kinds["ref2"]),
                "x ref layer": _ratio(ms, kinds["ref layer"]) if "ref layer" in kinds else None,
                "x ref2 same bytes": _ratio(ms, kinds[SAME_BYTES]) if SAME_BYTES in kinds else None,
            }
            if mode.startswith("warm") and med("GB_per_cpu_s") is not None:
                ref2_eff = statistics.median(m["GB_per_cpu_s"] for m in kinds["ref2"])
                row["GB/cpu-s"] = med("GB_per_cpu_s")
                row["cpu x ref2"] = row["GB/cpu-s"] / ref2_eff
            row["MB/s by round"] = ", ".join(f"{m['MBps']:,.0f}" for m in ms)  # cold figures swing (host cache)
            if not mode.startswith("warm") and kind != "ref":  # forward rounds (even) against reversed ones
                ratios = _ratios(ms, kinds["ref"])
                if len(ratios) > 1:
                    fwd, rev = statistics.median(ratios[0::2]), statistics.median(ratios[1::2])
                    row["x ref fwd / rev"] = f"{fwd:.3f} / {rev:.3f}"
            before = [m["resident_before"] for m in ms if m.get("resident_before") is not None]
            if mode.startswith("warm") and before:  # what DAMON had paged out since the last read (rewarm)
                row["cached before, min"] = min(before)
            huge = [m["huge_share"] for m in ms if m.get("huge_share") is not None]
            if mode.startswith("warm") and huge:  # the page cache's folios when measured (rewarm)
                row["2 MiB folios, min"] = min(huge)
            if not kind.startswith("ref"):
                row.update(
                    {
                        "examples/s": med("examples_per_s"),
                        "first batch s": med("first_batch_s"),
                        "RSS GB": med("rss_growth_GB"),
                        "anon GB": med("anon_growth_GB"),
                        "held GB": med("held_GB"),
                        "mapped GB": med("file_mapped_GB"),
                    }
                )
            if kind.startswith("shuffled"):
                row.update(
                    {
                        "entropy img": med("entropy_image"),
                        "entropy patch": med("entropy_patch"),
                        "exactly once": all(m["exactly_once"] for m in ms),
                    }
                )
            target_kind = next((k for k in ("shuffled", "ordered") if kind.startswith(k)), kind)
            row = {k: v for k, v in row.items() if v is not None}
            checks = [
                f"{'ok' if row[f'x {r}'] >= t else 'MISSED'} x{r}>={t}"
                for r, t in TARGETS.get((target_kind, mode.split("-")[0]), [])
            ]
            if target_kind == "shuffled" and mode.startswith("warm") and run["n_layers"] == 1:
                checks.append(f"{'ok' if row['entropy img'] >= 0.95 else 'MISSED'} entropy>=0.95")
                checks.append(f"{'ok' if row['first batch s'] <= 1 else 'MISSED'} first<=1s")
            if target_kind == "shuffled":  # memory: the buffer plus a few batches
                batch_gb, buf_gb = run["batch_size"] * D * 4 / 1e9, run["buffer_bytes"] / 1e9
                if "io=read" in kind:  # the window is a private arena: it is in anon
                    ok = row["anon GB"] <= buf_gb + 8 * batch_gb
                else:  # the window is mapped page cache (held); anon is batch buffers
                    ok = row["held GB"] <= buf_gb + 2 * batch_gb and row["anon GB"] <= 6 * batch_gb
                checks.append(f"{'ok' if ok else 'MISSED'} mem<=buffer+few batches")
            row["targets"] = "; ".join(checks)
            rows.append(row)
    return rows


def columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k != "targets"]
    return cols + ["targets"]


def plot(runs: list[dict], out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [summarize(run)[::-1] for run in runs]
    # one bar per row, ~0.17 inch each, so that the labels of five modes x ~12 rows do not overlap
    n_rows = max((len(rows) for rows in tables), default=1)
    fig, axes = plt.subplots(1, len(runs), figsize=(8 * len(runs), 1.5 + 0.17 * n_rows), squeeze=False)
    for ax, run, rows in zip(axes[0], runs, tables, strict=True):
        hue = {"warm": "C0", "cold": "C1", "cold-late": "C3", "cold-primed": "C2", "warm-primed": "C4"}
        colors = ["0.6" if r["loader"].startswith("ref") else hue.get(r["mode"], "C1") for r in rows]
        ax.barh(range(len(rows)), [r["MB/s"] for r in rows], color=colors)
        ax.set_yticks(range(len(rows)), [f"{r['loader']} ({r['mode']})" for r in rows], fontsize=8)
        ax.set_xlabel("MB/s (bytes of the layer read; grey: raw-read references)")
        ax.set_title(
            f"{run['n_layers']} recorded layer(s), {run['size_GB']:.1f} GB\nblue warm, orange cold, "
            "red cold-late, green cold-primed, purple warm-primed",
            fontsize=10,
        )
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png), exist_ok=True)
    fig.savefig(out_png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write every raw measurement here")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--shard-gib", type=float, default=1.0)
    ap.add_argument("--layers", default="1,4", help="recorded layers of the cache(s): 1, 4 or 1,4")
    ap.add_argument("--cache-dir", default=os.path.join(benchlib.ROOT, "bench-out", "loaders"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warm-rounds",
        type=int,
        default=0,
        help="rounds of the warm modes (default: --rounds); a warm round takes seconds, and the ratio to "
        "ref2 within a round spread 0.79-1.19 over 6 rounds on the project VM (2026-11-26)",
    )
    ap.add_argument("--batch-size", type=int, default=16384)
    ap.add_argument("--buffer-bytes", type=int, default=3_200_000_000)
    ap.add_argument("--naive-s", type=float, default=20.0, help="time box of the naive baseline (0: skip)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="extra shuffled configurations (comma list)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; does not touch BENCHMARKS.md")
    ap.add_argument("--render", action="store_true", help="only re-render the section and plot from stored results")
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    args.modes = [m for m in args.modes.split(",") if m in MODES]
    if args.worker:
        print(json.dumps(run_loader(json.loads(args.worker))))
        return
    if args.quick:
        args.size_gib, args.shard_gib, args.rounds, args.naive_s = 0.06, 0.02, 1, 2.0
        args.batch_size, args.buffer_bytes = 4096, 20_000_000
        args.cache_dir = os.path.join(args.cache_dir, "quick")
    os.makedirs(args.cache_dir, exist_ok=True)
    runs = []
    for n_layers in [] if args.render else [int(x) for x in args.layers.split(",")]:
        run = bench_cache(args, n_layers)
        run.update(batch_size=args.batch_size, buffer_bytes=args.buffer_bytes, load=os.getloadavg(), argv=sys.argv)
        run["measured"] = {m: {"date": run["date"], "argv": sys.argv} for m in args.modes}
        run = merge_stored(args, run)
        runs.append(run)
        if not args.quick:
            with open(os.path.join(args.cache_dir, f"results-L{n_layers}.json"), "w") as fd:
                json.dump(run, fd, indent=1)
    if args.json:
        with open(args.json, "w") as fd:
            json.dump(runs, fd, indent=1)
    rows = [r for run in runs for r in summarize(run)]
    if rows:
        print(benchlib.table(rows, columns(rows)))
    if args.quick:
        plot(runs, os.path.join(args.cache_dir, "bench_loaders.png"))
        return
    # the section shows the latest results of every cache layout benchmarked so far
    stored = []
    for n in (1, 4):
        p = os.path.join(args.cache_dir, f"results-L{n}.json")
        if os.path.exists(p):
            with open(p) as fh:
                stored.append(json.load(fh))
    when = None
    if args.render and stored:  # the section names the latest command that measured results, as a measuring run does
        latest = [m for run in stored for m in (run.get("measured") or {}).values()]
        latest = (
            max(latest, key=lambda m: m["date"])
            if latest
            else {"date": stored[0]["date"], "argv": stored[0].get("argv", sys.argv)}
        )
        sys.argv, when = [a for a in latest["argv"] if a != "--render"], latest["date"]
    png = os.path.join(benchlib.ROOT, "docs", "bench_loaders.png")
    plot(stored, png)
    body = [
        "Synthetic caches: d=768, 197 tokens/img, ~1 GiB shards; loaders read layer 10, patch tokens, batch "
        f"{args.batch_size}; shuffled buffer {args.buffer_bytes / 1e9:.1f} GB. MB/s count only the bytes of "
        "the layer read. ref = 1 thread, 8 MiB reads, one reused buffer; ref2 = 2 threads, 48 MiB buffers; "
        "ref layer (4-layer cache) = a raw read of only the bytes the loaders read: layer 10's patch-token "
        "ranges (~600 KB each, 2.4 MB apart) in file order, preadv into one reused 48 MiB buffer, and when cold "
        "a second thread asking the kernel for them (posix_fadvise WILLNEED) four batches ahead. ref and ref2 "
        "read 4x as many bytes as they count there, in large sequential reads; ref layer shows what reading "
        "only the layer's ranges costs the disk. "
        "MB/s: median of alternating rounds; x ref, x ref2: median over rounds of the ratio within the round; "
        "x ref fwd / rev (cold modes): the same median over the forward rounds (the 1st, 3rd, ...: ref measured "
        "first) and over the reversed ones (ref measured last, right after ref2), because cold ref's speed "
        "depends on its place in the round (paragraph of 2026-11-25 ~08:30); "
        "each measurement in a fresh process; cold = page cache dropped right before; cold-late = dropped, "
        f"then {COLD_LATE_S:g} s idle before the measurement starts; cold-primed = dropped, then the measuring "
        "process touches and frees as much memory as the cache plus 1 GiB right before it starts (see below); "
        "warm-primed = warm, then the measuring process touches and frees the shuffle buffer's size plus 1 GiB "
        "right before it starts (see below). "
        "naive = torch DataLoader over IndexedDataset, RandomSampler, 2 workers (time-boxed, warm). "
        "'2nd epoch' rows (warm only): two epochs in one process (ordered: two passes of the same loader), "
        "only the second timed, from the moment the first epoch's last batch arrives (so 'first batch s' is "
        "the pause between the epochs): the steady state of a long run, without the first epoch's one-time "
        "costs (threads, fresh batch buffers, the first plan). "
        "'shuffled ref2's volume' (a cache of several layers, warm only): as many epochs in one process as "
        "make the bytes ref2 reads (4 on one layer of four), all of them timed, so that a fresh process's "
        "one-time costs weigh on the same volume as in ref2 (the plain row's one epoch is a quarter of it). "
        "'ref2 same bytes' (a cache of several layers): the other way round, ref2 reading only as many bytes "
        "as one epoch of the layer (the first 1/L of every shard) in its own fresh process, so that its "
        "one-time costs (threads, two fresh 48 MiB buffers) weigh on the loader's volume too; 'x ref2 same "
        "bytes' compares with it. The targets stay against ref2, as the issue sets them. "
        "Memory: RSS = peak resident-set growth while iterating; anon = peak growth of the process's anonymous memory while iterating (batch buffers, "
        "arenas); held = most shard bytes the loader kept resident on purpose (its shuffle window plus "
        "read-ahead); mapped = peak growth of the page-cache memory mapped in the process (the kernel maps whole "
        "large page-cache folios, so this can exceed what was asked for). GB/cpu-s = bytes copied per "
        "CPU-second of the whole process (user + system); 'cpu x ref2' compares that efficiency with "
        "ref2's: warm, both are CPU-bound, so it predicts the wall-clock ratio on an idle machine and "
        "does not depend on what else runs (other jobs shared these 2 cores: see the load average).",
        "",
        "Run of 2026-11-27 06:04-06:47 UTC (the tables; another host: CPU model 167 under KVM, where the "
        "tables of 2026-11-26 ran on model 207; no loader code changed since then; new: the 'ref2 same bytes' "
        "reference). The 1-layer cache meets every target (warm shuffled 0.965 x ref2). One layer of four misses "
        "warm shuffled >= 0.9 x ref2: 0.683 for one epoch in a fresh process, 0.81 against ref2 over the same "
        "bytes, 0.81 over ref2's volume (four epochs), 0.947 for a second epoch alone. Why one epoch cannot reach "
        "0.9 on this host (one layer of four, warm, fresh processes; thread CPU per phase from a harness that "
        "wraps the loader's functions, /tmp/s41/phase.py, not in the repository; 6 runs): the gather threads' "
        "copies take 135-140 ms of CPU in a first epoch and 133-135 in a second (~7.9 GB per CPU-second; the "
        "bare copy kernel on two threads at once reaches 8.3-8.8 here: one 1 GiB shard, 48 MiB batches of random "
        "rows, /tmp/s41/sortcopy.py); a first epoch adds 27-52 ms faulting in the two batch buffer sets made "
        "before its first batch (100 MB), 12-14 ms for the third, 9-11 ms indexing (7 in a second epoch), and "
        "~15 ms each of planner and readers: 216-245 ms of process CPU (123-153 ms wall) against 158 (82-89 ms) "
        "for a second epoch. A system-wide perf profile of a first epoch: both cores busy 96% of the time. At "
        "this run's ref2 (12.2 GB/s, median), 0.9 x ref2 means the epoch's 1.07 GB in 97 ms, ~187 ms of CPU on "
        "two cores at that occupancy: the copies take ~137 of it, and the fresh memory of the fewest batch "
        "buffers a loader can hand out without waiting for its consumer to drop the last batch (two 50 MB sets, "
        "~28 ms at this VM's best fault-in rate: 3.1-3.8 GB per CPU-second on 4 KiB pages) leaves ~20 ms for "
        "starting the threads, planning and mapping the first fill (the whole layer here: it fits the buffer), "
        "indexing 22 batches and the consumer, which measure ~50-60. ref2 itself, reading only one epoch's bytes "
        "in its own fresh process, ran at 0.81 of ref2 in the table (0.858 in 8 alternating rounds by "
        "/tmp/s41/refvol.py): its own one-time costs weigh 4x on a quarter of the volume. Also measured on this "
        "host, not in the tables: a 4-layer cache of 16 GiB (7,096 images, so that one layer is 4.29 GB, as large "
        "as the 1-layer cache): one epoch of the layer 0.754 x ref2 (5 alternating rounds; 410-427 ms; ref2 over "
        "its 17.2 GB at 13.1-15.0 GB/s), so equal epochs of equal size do not close the gap here either. Tried, "
        "no change: the one-of-four shards mapped with MADV_HUGEPAGE instead of MADV_RANDOM (first-epoch copy CPU "
        "136-140 ms either way, 3 alternating rounds); regular stores instead of non-temporal ones into the batch "
        "buffers: first epoch 146-174 ms against 120-138 (4 alternating rounds). The sections 'Shuffled first epoch "
        "against a lower bound and ref2' (scripts/bench_loader_floor.py, measured 06:59-07:00 UTC) time the least "
        "any shuffled loader does in a fresh process (two threads, one fresh batch buffer each, one random order, "
        "the C kernel, nothing else) in the same rounds as ref2: 0.842 x ref2 on one layer of four, where the "
        "loader measured 0.656 there; 1.041 on the 1-layer cache, where the loader measured 0.815 there.",
        "",
        "Changes of 2026-11-26 ~23:30 to 11-27 ~00:20 UTC (Intel host; the tables were not measured again: "
        "neither change touches a first epoch in a fresh process). (1) io='read': a pass hands its free arena "
        "slots to the loader's next pass, as batch buffer sets already were (a loop per epoch, README), so only "
        "the first pass faults the arena in. 1-layer cache, warm, one process, three loops of one epoch each, 3 "
        "alternating rounds against the code before (/tmp/s39/twofor.py, not in the repository): loops 2 and 3 "
        "took 1.65-1.78 s before and 0.79-0.97 s after, their first batch 0.45-0.54 s and 0.17-0.26 s. (2) "
        "buffers.py split into maps.py (the shard mappings) and buffers.py (batch buffers and fresh memory), code"
        " unchanged. Observed, not changed: on a cache that records 4 layers of the same 7,096 images (17.2 GB, "
        "--size-gib 16 --layers 4), so that the layer read is as large as the 1-layer cache, the default shuffled"
        " loader's steady epochs of that layer (4.28 GB) took 389-488 ms against 348-393 ms on the 1-layer cache "
        "in the same minutes (3 epochs per process, measured alone: x1.10-1.25), and with buffer_bytes 0.8 GB the"
        " gap stayed (466-476 against 397-417 ms), so the span of the shuffle window in address space is not what"
        " costs. A guess: each run there spans 4x the 2 MiB blocks per byte delivered, mapped by the copies' "
        "first touch and unmapped when the run is released; this VM exposes no hardware counters to perf, so it "
        "stays a guess. Its warm bench run (5 of its 7 warm rounds ran while single tests ran beside it, so no "
        "table is kept) gave, in its 2 clean rounds, shuffled 0.69 and 0.83 x ref2 for one epoch and 0.83 and "
        "0.81 for a second.",
        "",
        "Change of 2026-11-26 ~22:00-22:40 UTC (Intel host; the tables' warm and cold rows were measured after it, "
        "22:41-23:01 with --modes warm,cold; their cold-late, cold-primed and warm-primed rows come from the full run "
        "of 20:27-21:31, before it, so their io='read' rows show the code before). io='read' only (the default "
        "plans are byte-identical before and after, 8 configurations hashed): (1) its runs are all run_imgs images "
        "long (plan.cut_runs equal=True; a shard's last run is shorter) and each arena slot is exactly that size. "
        "Runs of random length (0.5x-1.5x) in slots that fit the longest held ~2/3 of the slots' bytes, so the "
        "arena mixed ~2/3 of buffer_bytes of images: 1-layer cache, image-index entropy 0.913 -> 0.952 in the "
        "table (the plan alone: 0.9523, 41 -> 63 slots; one layer of four 0.972 -> 0.974). (2) When the data does "
        "not fit in the buffer, batch 0 draws from the first half of the first fill only (plan FILL_RAMP), "
        "since io='read' reads the whole first fill into fresh memory before batch 0 otherwise: plan entropy "
        "0.9516 against 0.9523 without the ramp; the ramp of a part that fits (1/8, 3/8, 5/8) gave 0.9482 here, "
        "(1/4, 1/2, 3/4) 0.9499. 1-layer cache, warm, 6 alternating fresh rounds against the code before: first "
        "batch 0.70 -> 0.52 s, first epoch x1.076 (a larger arena to fault in: the buffer is now used), second "
        "epoch x0.958. In the table: 2,624 -> 2,493 MB/s (0.265 -> 0.281 x ref2, another ref2), first batch "
        "0.69 -> 0.50 s. Where the default loader's first epoch on one layer of four goes, again (warm, fresh "
        "processes, 8 alternating rounds): three batch buffer sets handed to it already faulted in (a harness) "
        "made it x0.79 (median 184 -> 142 ms; first batch 58 -> 25 ms; process CPU 325 -> 255 ms), while a "
        "second epoch takes ~102-108 ms, so ~40 ms of a first epoch is fresh memory and ~37 ms the rest of the "
        "start: with the sets faulted in, the first two batches' index took ~7 ms each (against ~1 ms steady, "
        "beside the readers mapping the first fill) and their copies up to 2x a steady one, and batch 0 came at "
        "~30 ms. ref2 at ~10 GB/s reads a layer's 1.07 GB in ~107 ms; 0.9 x ref2 allows ~119 ms, i.e. ~15 ms "
        "more than a steady epoch, against ~80 ms of one-time costs measured. The 4-layer one-epoch row keeps "
        "missing (0.730 here, rounds 0.55-0.86), while over ref2's volume it measured 0.937 and a second epoch "
        "1.166; the 1-layer cache met every target in this run (warm shuffled 1.006 x ref2).",
        "Changes of 2026-11-26 ~19:55-21:35 UTC (Intel host). The tables' cold, cold-late, cold-primed and "
        "warm-primed rows come from the full run of 20:27-21:31, with change (1) but not (2); their warm rows from "
        "the run of 21:34-21:46 (--modes warm), after both. Neither change touches the default io='mmap' path. "
        "(1) io='read': arena slots go on the page size fresh memory faults in fastest, as batch buffer sets do "
        "(buffers.FreshPages, one per iteration, shared by both): 2 MiB pages until a piece faults in slower "
        "than 2 GB/s, 4 KiB pages from then on, which fault in ~2x faster on this VM (1 GB alone, fresh processes "
        "3 s apart: 0.77-0.98 GB/s on 2 MiB pages, 1.81-1.90 on 4 KiB); a slot on 4 KiB pages is replaced by one "
        "on 2 MiB pages after SMALL_SET_USES reads into it, as a set is. Each new slot is faulted in by the "
        "reader that first needs it. (2) Only the bytes of the run read into a new slot are faulted in: a slot "
        "fits the largest run, ~1.5x the mean, and faulting slots in whole made the arena's memory grow to all of "
        "buffer_bytes (1-layer anon 3.48 GB in the full run, against 2.76 now and 2.79 before (1)). 1-layer "
        "cache, io='read', warm, 6 alternating rounds of fresh processes against slots on 2 MiB pages faulted in "
        "by the reads: first epoch x0.60 with (1), x0.52 with both (median 2.86 -> 1.56 s), first batch 1.75 -> "
        "0.69 s, second epoch x0.93. In the tables, 'shuffled io=read' warm: 1-layer 0.187 -> 0.265 x ref2 "
        "(1,608 -> 2,624 MB/s; first batch 1.49 -> 0.69 s), one layer of four 0.122 -> 0.234 (978 -> 2,214 MB/s). "
        "Where a first epoch of one layer of four goes (warm, fresh processes, per-thread timestamps and a "
        "system-wide scheduler trace): the gather threads prefill the first two 50 MB sets until 38-43 ms, while "
        "the first batch's plan is out at ~10 ms and its runs are resident by ~21 ms, so the first batch comes at "
        "~48 ms; batch 2, copied into the third set as it is populated, takes parts of 7.4-8.6 ms against ~2 "
        "(~25 ms of CPU for 50 MB); from then on a batch every ~4.3 ms. During the prefill 0.3-1.2 of the two "
        "cores sit idle by 4 ms window while the prefilling threads wait for the GIL between their madvise "
        "calls (45-63 times, 13-23 ms per thread and first epoch). Tried and not taken (first epoch, alternating "
        "fresh rounds): (a) two sets, the consumer's release of a batch noticed at once (weak references to the "
        "views it is handed, whose callback wakes the gather threads): x1.30, its second epoch x1.39 (8 rounds): "
        "with two sets each batch waits for the consumer to take the one before, and publish -> consumer wakes "
        "-> release -> gather wakes took ~3 ms per batch with seven threads sharing the GIL on 2 cores, which "
        "the third set hides; the same notice with three sets: no gain (x1.13, 8 rounds); (b) 4 KiB-page sets "
        "populated in 4 MiB madvise calls instead of 1 MiB (a quarter of the GIL round trips): x1.02 (10); (c) "
        "sets straight on 4 KiB pages, populated in one call without the GIL (madvise, or a byte per page "
        "written in C): x0.98 and x0.96 (10 rounds, within the noise). Warm shuffled against ref2 moved with the "
        "machine between the two runs, with no change to that code path: 1-layer 0.936 in the full run (ref2 "
        "6.1-9.3 GB/s) and 0.884 in the warm run (ref2 8.1-11.2; the loader 8.3-11.0 GB/s); one layer of four "
        "0.732 and 0.716 for one epoch, 0.843 and 0.906 over ref2's volume, 1.10 and 1.086 for a second epoch "
        "alone.",
        "",
        "Change of 2026-11-26 ~18:20-18:50 UTC (Intel host; the warm rows were measured after it with --modes "
        "warm, the 1-layer cache's at 18:37-18:52, one layer of four's at 18:52-18:58 and again at 19:18-19:25 "
        "(next paragraph), on a slower machine than at 16:29: ref2 7.0-9.0 GB/s on the 4-layer cache against "
        "7.6-10.9; the other modes' rows are from the run of 16:29-17:25, before it). Loader threads start held "
        "until the last one has started (Runtime.spawn_all): Thread.start() returns only once the new thread "
        "runs, and one that went straight to Python work (the planner) kept the GIL from the spawning thread for "
        "up to a switch interval, so on one layer of four the second gather thread started 10-14 ms into an "
        "iteration; now all seven threads run by ~2.7 ms. First epoch x0.98 (20 alternating fresh rounds: noise "
        "level). Where the rest of that first epoch goes (hooks, fresh processes): every run of the first batch "
        "is resident by 32-40 ms; the gather threads finish prefilling the first two 50 MB batch buffer sets at "
        "28-50 ms (4 KiB pages, ~2.9 GB/s of CPU beside the other threads); the third set is populated by the "
        "copies of batch 2, which took ~19 ms against ~4.7 for a steady batch. Fresh memory is the gap: a test "
        "harness that handed the loader three sets faulted in before its timer started measured 118 against 143 "
        "ms per first epoch (x0.84, 10 alternating rounds; gather CPU 187 against 229 ms), ~1.0 x ref2. Tried "
        "and not taken: (a) keeping a set on 2 MiB pages through a single slow piece (4 KiB pages only after two "
        "slow pieces in a row, or once the pool's pieces average below 2 GB/s): in back-to-back processes pieces "
        "faulted in at 5-8 GB/s with single ones at 0.7-1.1 among them and slow ones dense once the memory freed "
        "moments before ran out; first epoch x1.006 (16 rounds); (b) two sets instead of three: x1.006 (12 "
        "rounds; the third set's faults saved, ~0.5 ms lost per batch until the consumer drops its last batch); "
        "(c) no residency probe in the readers, a bound for a cheaper probe (reader CPU 14 -> 6 ms): x0.98 (12); "
        "(d) the gather threads spawned first: x0.99 (14). At 18:37-18:58 one layer of four measured 0.791 x "
        "ref2 warm (rounds 0.63-0.83; first epochs 159-204 ms) and its 2nd epoch 1.206; the 1-layer cache 1.013 "
        "(rounds 0.88-1.30).",
        "",
        "Row 'shuffled ref2's volume' (2026-11-26 19:18-19:25, one layer of four, warm; ref2 7.0-8.8 GB/s). On "
        "this cache ref2 reads 4.29 GB in its fresh process and the plain shuffled row's one epoch delivers 1.07 "
        "GB in its own, so the loader's one-time costs (threads, the first plan and mappings, ~25 ms of fresh "
        "batch buffer memory: paragraph above) weigh on a quarter of ref2's volume; on the 1-layer cache the two "
        "volumes are the same. This row times four epochs in one fresh process (4.27 GB, every example exactly "
        "once per epoch): 0.966 x ref2 (rounds 0.81-1.06; 513-636 ms), where one epoch measured 0.754 (rounds "
        "0.59-0.92; 153-206 ms) and a second one alone 1.168, in the same rounds. The target rows stay the plain "
        "one-epoch ones.",
        "",
        "Changes of 2026-11-26 ~15:40-16:30 UTC (Intel host; the tables were measured after them, 16:29-17:25, "
        "with 9 warm rounds instead of 5, --warm-rounds: in 6 alternating rounds before, the 1-layer warm shuffled "
        "ratio to ref2 ranged 0.79-1.19 by round). What a first epoch spends besides the copies: a plan computed "
        "before the loader starts (a test harness only) made a 1-layer first epoch x0.81-0.94 faster and a second "
        "x0.91-0.97 (8-10 alternating fresh processes), more than the planner's CPU alone; its Python holds the GIL "
        "and ran ~2.5-5x slower beside the copies than alone (~50 ms of planner CPU per first epoch against ~20 "
        "planned alone). So (1) the planner passes each run to the readers as soon as the plan admits it, before "
        "it draws the run's order (the first batch admits ~63 runs); (2) the plan keeps per-run numpy arrays "
        "(examples left, weights, cursors, the orders' addresses, first images, shards) instead of per-run "
        "Python, and gives each batch's example ids as one array (C kernels.concat_ranges), so the gather "
        "threads' index needs no per-run Python either; (3) a batch's reads are known done from a count per "
        "batch, not a scan of its runs; (4) a run's block ranges merge without np.r_ (63 warm runs read alone: "
        "28 -> 19 ms of CPU). The plans are byte-identical before and after (10 configurations, with and "
        "without the C kernel); planned alone, a steady 1-layer epoch takes 9 ms (24 before). In the loader, "
        "alternating fresh processes against the code before: an epoch harness, first epoch x0.95-1.02 and "
        "second x0.95-1.00 (12-16 rounds; epochs of 407-660 ms by round); this script's worker (memory sampler, "
        "the bench's consumer), warm shuffled first epoch 1.019 against 0.912 x ref2 on the 1-layer cache "
        "(8 rounds, faster in 7), 0.780 against 0.738 on one layer of four (10 rounds, right after the tables' "
        "run). In the tables' run the 1-layer cache meets every target (warm shuffled 1.038 x ref2, 9.1 GB/s, "
        "ref2 7.6-12.9), and one layer of four misses one: warm shuffled 0.767 x ref2 (rounds 0.65-1.15; its "
        "2nd epoch 1.123), where the run of 15:05 measured 0.909 with the code before. Its first epoch (1.07 GB, "
        "~150 ms) waits ~30 ms for the first two 50 MB batch buffer sets to fault in (timeline: first gather at "
        "33-35 ms, right after the prefill ends; CPU before the first batch 56 ms, util 0.85) and then runs at "
        "~6 ms per batch against ~4.6 for a steady one (the third set faulted in by the copies, pages mapped on "
        "first touch).",
        "",
        "Machine on 2026-11-26 (the run of 11:28-12:09 UTC, with the code of the 2026-11-25 tables; its rows, "
        "quoted here, have been replaced by runs after the changes of the next paragraph): the "
        "project VM came back on an Intel Xeon host (cpu family 6 model 207), with the same guest setup (2 vCPUs, "
        "free page reporting at order 11; no DAMON scheme was running). Warm, ref ran at 6.2-7.8 GB/s and ref2 "
        "at 7.8-9.5; cold, ref at 0.8-1.5 GB/s. Every target of the loader issue is met on both caches but one: "
        "warm shuffled on one layer of four, 0.787 x ref2 (rounds 0.73, 0.79, 0.72, 0.90, 1.04: first epochs of "
        "0.161, 0.173, 0.191, 0.152, 0.128 s; its 2nd epoch 1.256 x ref2). The 1-layer cold shuffled row, which "
        "missed on the Zen-4 host (0.674), measured 0.912 x ref here: the loader read at 1.10-1.19 GB/s in every "
        "round (epoch 3.6-3.9 s, first batch 2.1-2.5 s, after the first 3.2 GB fill), ref at 1.1-1.5. "
        "Where the warm first epoch on one layer of four goes (fresh process, 2 epochs, perf record at 5 kHz "
        "split at the epoch boundary; /tmp/s33/trace.py and split.py, not in the repository): 351 ms of CPU "
        "against 173 ms for the second epoch. The copy kernel took 165 ms against 133. Faulting in the three "
        "fresh 50 MB batch buffer sets took ~85 ms: 53 ms prefilling, ~32 ms of faults inside the copy into the "
        "set made on demand. The readers and the planner took ~40 ms against ~2 (they also prepare epoch 2 "
        "during epoch 1); the rest was ~50 ms of Python and indexing against ~35. In those runs the sets went "
        "on 4 KiB pages (buffers.HUGE_FAULT_MIN_BPS), as they should: measured alone in fresh processes, a 50 MB "
        "set on 2 MiB pages faulted in at 4-6 GB/s when the host still backed the memory and at 0.7-0.9 GB/s "
        "once it had been reported, and on 4 KiB pages at ~1.8 GB/s. The first batch came at 27-47 ms, "
        "behind the prefill of two sets, and batches 1-3 took ~18 ms each against ~4 ms from batch 4 on. So, "
        "as on the Zen-4 host, fresh memory is the largest one-time cost of a 1 GB first epoch on this VM. "
        "Tried here and not taken (alternating fresh processes, medians): two buffer sets instead of three, "
        "first epoch x0.96 and second x0.80 (8 rounds: the third set's faults saved are lost again to the "
        "pipeline bubble); only one set prefilled before the first batch instead of one per gather thread, "
        "first epoch x0.96 (12 rounds; first batch 44 against 40 ms); a 0.5 ms GIL switch interval instead of "
        "5 ms, no change (x0.98-1.02, 10 rounds). "
        "cachestat(2) in place of the per-range probes would save ~3 ms of CPU per 1 GB epoch (1,774 ranges "
        "at 1.7-2.1 us against ~16 us per run of 70 ranges, one thread), ~1%: not done.",
        "",
        "Changes of 2026-11-26 ~13:00-14:58 UTC (Intel host; paired A/B in fresh processes, warm, alternating). The "
        "tables of 15:05 (since replaced) had their warm rows measured after all of them (15:00-15:05, --modes "
        "warm), their cold, cold-late, cold-primed and warm-primed rows in the full run of 14:06-14:52, before "
        "change (4). (1) Batch buffer sets on"
        " 4 KiB pages are populated with MADV_POPULATE_WRITE in 1 MiB calls (buffers.populate_small) instead of a "
        "write into each page: 2.5-3.5 against ~2.2 GB/s alone, no page-fault exception per page; a set made on "
        "demand is populated by each gather thread for its own share of the batch before it copies. One layer of "
        "four, 14 rounds: first epoch x0.96, the gather threads' CPU 289 -> 256 ms. (2) The copy kernel has a second "
        "prefetch scheme, a row's first 256 bytes 4 rows ahead into L3 ('heads'), and the shuffled loader times both "
        "on its first copies and keeps the faster (kernels.PrefetchChooser: medians of per-copy rates, 8 copies each,"
        " the other looked at again every 16th copy; section 'Copy kernel': on this host heads x1.02-1.30 of no "
        "prefetch where whole rows give x0.89-1.22, while on the Zen-4 host whole rows won at 3 KiB, x1.68 against "
        "x1.18 for a 512-byte head). One layer of four, 8 rounds, heads against whole: steady epochs x0.89, first "
        "x0.985. It chose heads in 48 of the 50 shuffled runs of the tables' warm rows, in all of the default and "
        "2nd-epoch ones. (3) Each batch's row order comes from a C Fisher-Yates (kernels.permutation) instead of "
        "numpy's Generator.permutation: the batch index took 0.56 against 0.81 ms per 16384 rows (1-layer cache, ~21 "
        "ms of CPU per epoch). (4) The chooser first re-evaluated its medians with np.median after every copy, in the"
        " gather threads with the GIL held; in the bench's worker on the 1-layer cache that made prefetch='auto' "
        "slower than either fixed scheme (8 rounds: 0.745 x ref2 against 0.916 for heads and 0.837 for the code of "
        "11:28). It now decides only when its trial ends and after each look at the other scheme, with a plain-Python"
        " median: 0.867 against 0.861 for heads and 0.735 for the code of 11:28 (8 rounds). Tried and not taken: no "
        "prefill before the first batch (every set populated by the copies, 10 rounds x1.02); two buffer sets again, "
        "now that the sets populate faster (8 rounds: first epoch x0.95, second x1.10). How far the warm shuffled "
        "rows moved: one layer of four 0.787 x ref2 at 11:28 (6.6 GB/s, ref2 7.8-9.5), 0.728 in the full run of 14:06"
        " (7.5 GB/s, ref2 8.0-11.7), 0.909 in the tables' run (7.9 GB/s, ref2 7.5-9.7); 1-layer 1.085 at 11:28 (9.0 "
        "GB/s, ref2 ~8.1), 0.721 at 14:06 (6.9 GB/s, ref2 8.8-11.0: change (4) missing), 0.837 in the tables' run "
        "(9.9 GB/s, ref2 9.9-13.0). Warm runs between 13:27 and 13:52 (before (4)) put one layer of four at "
        "0.685-0.754 and the 1-layer cache at 0.711-0.884. So the loaders' speed held or rose while ref2, a "
        "sequential copy into fresh 48 MiB buffers, ran at 7.5-14.4 GB/s by run against 7.8-9.5 in the morning; the "
        "ratio now depends on the run more than on the code, and the fixed costs of a 1 GB first epoch (three 50 MB "
        "sets of fresh memory, 50-60 ms of CPU populating them; the first plan and mappings) still make a first epoch"
        " on one layer of four ~1.35x a steady one (~136 against ~99 ms in A/B runs).",
        "",
        "Machine on 2026-11-25 from ~03:00 UTC (the tables of that day, since replaced): the project VM came back on "
        "another host, a Zen-4 EPYC (cpu family 25 model 17; the paragraphs dated before that, and the "
        "2026-11-24 machine note below, were measured on a Zen-5, family 26). Its memory behaves differently: one "
        "thread copies out of the page cache at 5-16 GB/s by round (ref; Zen-5 22-30), two threads into fresh "
        "48 MiB buffers at 7-10 GB/s (ref2; Zen-5 14-23), and a gather of random 3 KiB rows without software "
        "prefetch runs at 0.45 of a sequential copy (section 'Copy kernel'; Zen-5 0.66). So ratios here cannot be "
        "compared with the figures of earlier days quoted below: a slower ref makes the 'x ref' targets easier "
        "on this host, and the loaders' random gathers weigh more against ref2.",
        "",
        "Changes of 2026-11-25 on the Zen-4 host (paired A/B, fresh processes in this script's warm state, "
        "alternating; the tables of 2026-11-25 were measured after both): (1) the copy kernel prefetches whole rows "
        "(up to 16 KiB) 24 KiB of rows ahead into L2 (prefetcht1) instead of a row's first 512 bytes non-temporally: "
        "the gather alone x1.68 against no prefetch where the old scheme ran x1.18 (3 KiB rows, section 'Copy "
        "kernel'); shuffled loader, 1-layer cache, 6 rounds: first epoch x1.22, second x1.22; one layer of four: first "
        "epoch x1.03, later ones x1.15-1.25. (2) One layer of several (ShardMaps mode 'random'): ranges the readers "
        "find cached are no longer populated (MADV_POPULATE_READ cost ~12 us per 600 KB range) but mapped by the "
        "copies' first touch, and releasing a run unmaps each stretch of touching 2 MiB blocks with one madvise "
        "instead of one per image (1,774 calls per epoch, each flushing the other core's TLB by IPI: ~6% of the "
        "loader's CPU samples; now 24). One layer of four: shuffled first epoch x1.22 (first batch 53 -> 37 ms), "
        "steady epochs x1.14-1.22; ordered (io=auto) first pass x1.18, later passes x1.17-1.29. After both (run of "
        "03:52-04:39, since replaced) all targets were met but two. Warm shuffled on one layer of four reached 0.768 x "
        "ref2 (its 2nd epoch 1.201): the first epoch of 1.07 GB took 0.118-0.205 s against 0.081-0.106 s for a steady "
        "one, the difference being one-time costs (threads, the first fill of the buffer, fresh batch buffers). Cold "
        "shuffled on the 1-layer cache reached 0.762 x ref: ref ran at either 0.8-0.9 or 1.6-1.8 GB/s by round and the "
        "loader at 1.15-1.30 GB/s in every round (cold-late 1.293 x ref, cold-primed 0.854; on the 4-layer cache 1.013 "
        "x ref, 0.824 x ref layer).",
        "",
        "Cold-read path (2026-11-25 ~11:00, Zen-4 host; nothing changed): the 'shuffled cold_read=fault' "
        "rows beat the default cold (1-layer 1.050 against 0.674 x ref) because of their place in the round, "
        "not because the fault path reads faster. What decides a cold epoch on this VM is whether the "
        "page-cache memory a read lands in is still backed by the host. Memory freed within the last ~2 s is; "
        "memory free for longer has been reported, and the first touch of each of its 4 KiB pages costs "
        "~6.4 us of CPU (~0.65 GB/s) in whichever thread makes it: one byte per page of a 2 MiB block just "
        "populated took 90-200 us in backed memory and 3.2-3.4 ms in reported memory, and a read of the whole "
        "4.3 GB cache reached reported memory after 2.5-3.5 GB. The fault path takes 2 MiB folios, which come "
        "from the large free blocks that get reported, and its first touch falls in the gather threads after "
        "the fill; preadv takes small folios from smaller free blocks, which are not reported, and touches "
        "them in reader threads that wait on the disk anyway. Fresh processes one after another, 1-layer "
        "cache: 'fault' after a 'fault' run (whose 4.3 GB of 2 MiB folios the drop had just freed) 1.8-2.0 s, "
        "the gathers' copy 0.66 CPU-s; after a 'read' run 4.0-4.5 s, the copy 3.56 CPU-s; 'read' 2.2-2.9 s "
        "either way. In this script the fault variant follows 'shuffled io=read' (freeing its 3.2 GB arena) "
        "or itself. Tried and not taken: a per-run choice, the fault path while a one-byte sample of 32 pages "
        "of each run read that way costs under 2 us a page (0.2-0.8 us in backed memory, 3-33 us in reported "
        "memory) and preadv for the next 16 runs after a slower one: 8 alternating fresh rounds against "
        "'read', first epoch x0.937, second x1.097 (from the 2 MiB folios).",
        "",
        "Change of 2026-11-25 ~08:30 (Zen-4 host; measured after it 08:38-09:15, tables since replaced): batch "
        "buffer sets go on 4 KiB pages while 2 MiB pages fault in slowly (buffers.HUGE_FAULT_MIN_BPS). The pool "
        "times each 4 MiB piece of a set it prefills in thread CPU time (host faults count as the guest's CPU); "
        "once one runs below 2 GB/s (a 2 MiB page the host must back again: 0.45-0.9 GB/s, against ~1.9 for "
        "4 KiB pages, which the kernel takes from smaller free blocks that it does not report), the rest of the "
        "set and the next sets go on 4 KiB pages, and a small set is replaced by a 2 MiB one after 128 uses. "
        "The fallback tried at ~06:30 (x1.01) timed only a set's first piece, which often comes from memory "
        "freed just before while the rest comes from reported memory: traced, sets with 88-103 ms of fault CPU "
        "went unnoticed. Warm, fresh processes started 4 s apart (the host has taken the freed memory back), "
        "alternating against the pool without this: 4-layer shuffled first epoch x1.37 (10 rounds; second "
        "x0.92), ordered first pass x1.46 (6; second x0.99), 1-layer shuffled x1.24 (6; second x1.02); started "
        "back to back, x0.99 (10). The bench starts its measurements back to back, so its warm rows hardly "
        "move: one layer of four, warm shuffled 0.858 x ref2 (0.859 before; first epochs 0.102-0.123 s, a "
        "steady one 0.075-0.089). Traced in that state, 2 MiB pages faulted in at ~2 GB/s, so no set switched, "
        "and fresh memory still took ~70 ms of a first epoch's ~240 ms of CPU (a steady epoch: ~138). Cold, the "
        "1-layer shuffled loader ran at 1.31-1.64 GB/s (1.13-1.37 before) but measured 0.674 x ref. In the 3 "
        "forward rounds ref, measured first, ran at 1.9-2.4 GB/s. In the 2 reversed rounds, measured right "
        "after ref2, it ran at 0.94-1.0 GB/s, and the loader there ran faster (1.59, 1.64 GB/s). With 5 "
        "rounds the median falls on a forward round. One layer of four, cold shuffled: 1.098 x ref (0.784 "
        "before). Cold-primed, one layer of four: reading just the layer's ~600 KB ranges (ref layer) ran at "
        "0.815 x ref, so ordered (0.771) and shuffled (0.625) cannot reach cold's targets there. Where the "
        "1-layer cold shuffled epoch goes (trace, 3.3 s): the first fill (3.2 GB) is read by 1.9 s. No run "
        "ends before batch 36 of 85 (the two-rate plan), so the readers wait ~0.5 s. The last 1.25 GB are "
        "admitted over batches 37-49, and those reads fill page-cache memory that the host had taken back "
        "(50-124 ms of CPU per 48 MiB run, against 10-15 ms during the first fill). Tried and not taken: "
        "evict=True there (x1.05, 6 rounds; it drops data that a second epoch would read again); a longer "
        "ramp for a part that fits the buffer (modelled gain <= 2% on one layer of four cold, for -0.01 of "
        "entropy); two buffer sets with a 0.1 ms poll (steady epochs x0.89).",
        "",
        "Change of 2026-11-25 ~06:30 (Zen-4 host; measured 06:46-07:30, tables since replaced): the readers' "
        "page-cache probes run in C (kernels.probe: preadv2 RWF_NOWAIT on each range's first and last byte, "
        "posix_fadvise WILLNEED on the misses, one call per run without the GIL) instead of two Python preadv "
        "calls per range. On one layer of four a run has ~35 ranges of ~600 KB; probed from Python in 4 reader "
        "threads beside the gathers they cost ~25 ms of reader CPU per 1 GB epoch (~14 us a range, against ~3 us "
        "in one thread alone), now ~13 ms with the rest of the readers' work. 4-layer cache, warm, alternating "
        "fresh runs against the Python probes: shuffled first epoch x1.23 (10 runs), ordered io=auto x1.20 every "
        "pass (8); 1-layer ordered x1.10 / x1.04 (10); cold, no change (4 runs each). Where the targets stood "
        "then: the 1-layer cache met all of them (cold shuffled 0.809 x ref, the loader steady at 1.13-1.37 "
        "GB/s while ref ran at 0.9 or 1.6-2.1 GB/s by round). One layer of four missed two: warm shuffled "
        "0.859 x ref2 (first epoch 0.102-0.150 s where it was 0.118-0.205, a steady one 0.079-0.090; its "
        "2nd epoch 1.203 x ref2) and cold shuffled 0.784 x ref (the loader at 1.06-1.23 GB/s every round, "
        "ref at 0.8-0.9 or 1.5-2.1 GB/s; 0.825 x ref layer; the previous run, same code but the probes, "
        "measured 1.013 x ref). What is left of the warm first epoch's one-time cost is mostly fresh memory "
        "for the three batch buffer sets (150 MB): on this VM a fresh 50 MB set faulted in with 2 MiB pages "
        "in 4 ms when the host still backed the memory and in 105-134 ms when it had been reported free; the "
        "loader's CPU for the first epoch ranged 187-436 ms over such runs, 128-134 ms for a steady one. "
        "Tried and not taken: 4 KiB pages for the batch buffers (fault in at a steady ~28 ms per set, but "
        "steady epochs x0.94-0.96 on the 1-layer cache, 8 rounds), falling back to them only when a 2 MiB "
        "fault is slow (first epoch x1.01, 10 rounds), two buffer sets instead of three (first epoch x1.12, "
        "steady x0.93-0.95); cold, 2 or 8 readers instead of 4 (1-layer: x0.87 / x1.07; one layer of four: "
        "x1.03 / x1.00) and 8 MiB reads (x0.91).",
        "",
        "Machine, 2026-11-24 to 2026-11-25 ~02:30: the project VM was a Zen-5 EPYC (2 vCPUs). Its page cache -> "
        "buffer copies ran ~5-8x faster than the VM the loaders were first tuned on (ref2 17-29 GB/s warm "
        "against ~3.3), so a first epoch of 4.3 GB (one layer of four: 1.07 GB) lasted 0.2-0.35 s and every "
        "fixed cost (threads, "
        "the first plan, mapping the first 3.2 GB, faulting in fresh batch buffers) weighs 5-8x more against "
        "the references. Fresh memory is the largest of these: the guest runs with free page reporting "
        "(page_reporting_order=11 on the kernel command line), so memory freed a second or more before has "
        "been given back to the host and faults in again at ~0.5-1.6 GB/s, against ~23 GB/s for memory freed "
        "just before (measured: 4 x 48 MiB after 0 / 1 / 3 / 6 s idle: 9 / 138 / 161 / 127 ms). Each round "
        "is a fresh process, so a loader's 3-4 batch buffer sets (150-200 MB) can cost 100-300 ms in a round "
        "of 0.1-0.3 s, while ref reuses one 8 MiB buffer. How much a row's neighbours in the round move it "
        "shows in the 4-layer warm rows: 'ordered' (io=auto) and 'ordered io=read' run the same code there "
        "(auto reads one layer of several), measured in different places of each round. The speed of the "
        "host's memory also "
        "drifts by +-20% over an hour, hence ratios measured within one round. Cold figures swing between two "
        "modes (see MB/s by round): the virtual disk is cached by the host, and how fast a cold read runs "
        "depends on what read the disk just before (measured: a cold shuffled epoch took 3.7-4.8 s right after a "
        "cold ordered pass with io=read, 2.5-3.0 s after one with io=mmap; ref is slow right after ref2). "
        "Free page reporting is a cause: the page cache that drop_caches frees is given back to the host, and "
        "the next cold pass needs that memory backed again. ref right after drop_caches ran at 983-3,329 MB/s "
        "(mostly ~3,300), 6 s after it at 710-781 MB/s (7 runs each, alternating). So 'cold' measures a read "
        "into memory the host still backs, which is rare outside a benchmark: a cache read for real has not "
        "been read for a while, and the memory its pages land in has usually been free (and handed back) "
        "for longer. 'cold-late' measures that case: ref, the loaders and every variant all wait "
        f"{COLD_LATE_S:g} s after the drop. There one thread reading (ref) is much slower than two (ref2: "
        "~2.4 against ~0.9 GB/s), so x ref2 is the fairer ratio in cold-late rows. The shuffled loader's "
        "cold_read default was chosen on these conditions (1-layer cache, one epoch in a fresh process, 6 "
        "alternating rounds each, /tmp/mb/sab.py): page cache dropped right before, 'read' took 1.6-1.8 s, "
        "'fault' 1.4 s when it ran right after ref but 4.5-4.9 s right after 'read' (how fast the fault "
        "path's 2 MiB folios come depends on what freed memory last); dropped 4 s before, 'read' 2.0-3.0 s, "
        "'fault' 4.0-5.6 s (ref 0.92-1.07 GB/s). In this script's order the 'shuffled cold_read=fault' row "
        "runs right after 'shuffled io=read', whose 3.2 GB arena has just been freed: its cold figure is "
        "that best case. 'cold-primed' rows remove that dependence: each measurement first touches and frees "
        "more memory than the read will need, so the page cache fills memory the host has just backed, as on a "
        "machine without free page reporting (bare-metal cluster nodes). They are the steadiest cold figures "
        "here (see MB/s by round), and there the fault path is the faster cold read: for the shuffled "
        "loader (cold_read=fault) and for the ordered one (io=mmap), 1-layer cache. The defaults stay cold_read='read', chosen for cold-late, the state a real cold "
        "read meets on this VM (ordered io='auto' reads uncached batches with preadv); on a machine without "
        "free page reporting, cold_read='fault' (also a key of the SAE train config) and io='mmap' are worth "
        "measuring.",
        "",
        "One layer of four (the 4-layer cache): a loader reads ~600 KB ranges 2.4 MB apart, and the virtual "
        "disk serves such ranges more slowly than one sequential stream: cold, the raw read of just those "
        "ranges ('ref layer') ran at 0.72 x ref, 0.67 x ref cold-primed (2026-11-24 16:51 run), so the 0.9 "
        "x ref cold target is out of reach of any reader there; compare the loaders with ref layer (x ref "
        "layer). The ordered loader requests the first batch's ranges before any other's (its FIRST_ALONE): "
        "cold, its first batch came in 0.06 s instead of 0.14 s and the pass rose from 0.70 to 0.81 x ref "
        "(~1.0 x ref layer).",
        "",
        "Between epochs (shuffled loader, 1-layer cache, where the buffer holds 3/4 of the data): the old "
        "epoch's last runs all end with its last batch, and the next epoch's first batch needs its whole "
        "first fill. The runs next in line now hold the 2 MiB blocks they share with older runs before those "
        "let go of them (its PIN_SHARED), instead of having them unmapped and mapped again. In this script's "
        "'shuffled 2nd epoch' measurement, 6 alternating rounds against the code before (page cache left by "
        "earlier runs): pause 42-66 -> 17-28 ms, 11.2 -> 12.3 GB/s. Since 2026-11-24 19:10 the '2nd epoch' "
        "rows count the pause between the epochs (before, their clock started after the second epoch's first "
        "batch), so they read lower than earlier runs of this section for the same code.",
        "",
        "Fresh batch buffers in a first pass (2026-11-24 21:00): the ordered loader's copy threads now fill "
        "each batch the readers found cached together, a part each, in 3 batch buffer sets instead of one "
        "batch each in 4 (one set less to fault in at ~0.5-1.5 GB/s; a batch still to be read from disk "
        "stays with one thread: split, it read cold-primed at 0.754 against 0.807 x ref), and a set still being faulted in when a loader finishes is "
        "given up (before, the end of a short pass could wait ~20-45 ms for a copy thread faulting in a set "
        "that no batch needed). One layer of the 4-layer cache, this script's worker, 7 alternating rounds "
        "against the code before: 'ordered' 8.0 -> 10.3 GB/s, the pause before an 'ordered 2nd epoch' "
        "8.6 -> 6.6 ms. The shuffled loader's plan of the first batch also got cheaper (each run's span "
        "worked out once, vectorised; no np.unique, whose first call imports numpy.ma): first batch 63 -> "
        "57 ms in 12 alternating rounds.",
        "",
        "Copy kernel prefetch (2026-11-24 22:20): the C kernel's software prefetch of the next random rows "
        "had been compiled out (gcc judged the helper const and dropped its calls; the module held no prefetch "
        "instruction). It is now inlined, and rows over 2 KiB have only their first 512 bytes prefetched, 2 "
        "rows ahead. The gather alone, 3 KiB rows: x1.09-1.15 against no prefetch (section 'Copy kernel' "
        "below, `scripts/bench_kernel.py`). In the shuffled loader, 1-layer cache, epochs 2-4 of one process, "
        "3 alternating runs against the code before: the kernel's own time 9.4-10.0 -> 11.0-11.5 GB per "
        "CPU-second. Warm rows of the run of 22:24 against those of 21:00 (5 rounds each): 1-layer shuffled 0.624 -> "
        "0.692 x ref2 (6.47 -> 7.63 GB/cpu-s), its 2nd epoch 0.754 -> 0.793; 4-layer shuffled 0.478 -> 0.546 "
        "x ref2, its 2nd epoch 0.680 -> 0.673 (within the noise). The ordered loader copies whole images "
        "(600 KB blocks), which the hardware prefetcher follows anyway. Cold, the loaders wait on the disk: "
        "the cold rows, measured again after the change, agree with the previous run (16:36 / 16:51) within "
        "the disk's swings (one layer of four, x ref layer: ordered 1.008 -> 0.987 cold, 0.98 -> 1.021 "
        "cold-primed; shuffled 0.822 -> 0.817, 0.81 -> 0.809).",
        "",
        "Ordered io='auto' chooses per cached batch (2026-11-24 23:30): a batch whose bytes the readers find in "
        "the page cache is now mapped or read with preadv, whichever has cost less CPU per byte lately (the "
        "other way every 16th batch), where it was always mapped (whole images) or always read (one layer of "
        "several). Which wins depends on the page cache's folios: warm after a plain sequential read (this "
        "table's warm state, ~90% in 2 MiB folios) mapping does; warm after the loader's own cold pass (its "
        "WILLNEED reads make small folios) reading does, by far (1-layer cache, 3 passes per process: always "
        "mapping 13.3-14.4 GB/s from the second pass on, read 17.1-20.1, the choice 16.2-18.3; see the "
        "ordered loader's module doc). That second state is not in this table. Warm rows of 23:44 against "
        "those of 22:24: 1-layer ordered 0.735 -> 0.749 x ref; one layer of four: ordered 0.460 -> 0.501, its "
        "2nd epoch 0.534 -> 0.608 (one layer of several is now mapped when that is cheaper). Warm rows "
        "were measured after these changes; cold rows (23:01 / 23:13) before the last one, which changes "
        "only batches found cached.",
        "",
        "Warm means cached now (2026-11-25 00:30): this VM runs a DAMON scheme (kdamond, action pageout, file "
        "pages only) that evicts page-cache memory its sampling saw used at most once per 5 s for 60 s, "
        "whatever memory is free. The 4-layer cache, read with `cat` and left alone ~4 minutes, was 0.9% "
        "resident; read through 4 times in a row, it was 98.9% resident 10 s later, 94.7% after 40 s and 79% "
        "after 60 s. So each warm measurement now first reads the shards through until mincore finds every "
        "page cached (rewarm; 'cached before, min' = the least share found before that read). Within a run, "
        "measurements follow each other closely and 99.0-100% was still cached; the first measurement after "
        "a pause was not (the 4-layer ref of round 0 at 23:47 ran at 4.9 GB/s against 21.6-26.8 in the other "
        "rounds). The warm rows of 00:30 are the first with rewarm. Against those of 23:44, with no loader "
        "change in between: ref2 19.0 -> 21.7 GB/s (1 layer), the loaders' rounds within the spread of "
        "before, so ratios to ref2 fell (1-layer shuffled 0.73 -> 0.61, its 2nd epoch 0.75 -> 0.74).",
        "",
        "Warm also means large folios (2026-11-25 01:29 / 01:31): the loaders copy out of a warm page cache faster "
        "when it holds the shards in 2 MiB folios, which a mapping then maps 2 MiB at a time. A plain "
        "sequential read of files not cached at all leaves ~95% of them that way (benchlib.huge_share: the "
        "growth of FilePmdMapped while the shards are mapped with MADV_HUGEPAGE and MADV_POPULATE_READ); "
        "reads that only refill what DAMON took, or reads at scattered offsets, leave small folios. Measured "
        "on the 1-layer cache: steady shuffled epochs (one process) took 0.375 s with 44% of it in 2 MiB "
        "folios, 0.267 s with 97%; bench workers (5 alternating rounds) with 44%: shuffled 0.453 x ref2, its "
        "2nd epoch 0.551, ordered 0.771 x ref2; right after the shards were read again whole (94.6%): 0.661, "
        "0.815 and 1.019. No preadv pattern the shuffled loader could use for cold runs leaves 2 MiB folios "
        "reliably (one shard read in 48 MiB runs at random offsets by 4 threads, share in 2 MiB folios: one "
        "shared descriptor 0.60-0.69, a descriptor per run 0.25, one per thread 0.40-0.44, with "
        "POSIX_FADV_SEQUENTIAL 0.06-0.09, 8 or 48 MiB reads 0.10-0.60), and MADV_COLLAPSE is refused (EINVAL) "
        "on these file mappings, so a cache read cold with preadv keeps its small folios until it is read "
        "again from disk. So rewarm now drops the shards and reads them through again whole when less than "
        "95% is still cached or less than 90% is in 2 MiB folios (column '2 MiB folios, min': the least "
        "share over the rounds, when measured). The warm rows of 01:29 / 01:31 are the first measured this way. "
        "Against those of 00:30, which were in the same state (cached 0.99-1.0, read in whole at the start "
        "of the run), with no loader change in between: 1-layer shuffled 0.614 -> 0.605 x ref2, its 2nd "
        "epoch 0.741 -> 0.733, ordered 0.698 -> 0.651 x ref; one layer of four: shuffled 0.516 -> 0.499 x "
        "ref2, ordered 0.494 -> 0.401 x ref with two slow rounds (7.9 and 8.7 GB/s against 11.2-12.9; "
        "ordered io=mmap 0.518 -> 0.516).",
        "",
        "Warm-primed (2026-11-25 01:45 / 01:47): warm, then the measuring process touches and frees "
        "buffer_bytes plus 1 GiB right before it starts, so that the memory it allocates fresh is memory the "
        "host has just backed, as on a machine without free page reporting (the warm counterpart of "
        "cold-primed; the plain warm rows stay the ones the targets are judged on). It separates what this "
        "VM's fresh memory costs from what the loaders cost. The shuffled loader with io='read', whose 3.2 GB "
        "arena is fresh memory, went from 0.064 to 0.338 x ref2 (1 layer); the ordered loader, which faults "
        "its batch buffer sets in before its first batch, from 0.401 to 0.535 x ref on one layer of four "
        "(io=mmap 0.516 -> 0.594; 1 layer: 0.651 -> 0.596, within its rounds' spread). The default shuffled "
        "loader did not move (1 layer 0.605 -> 0.595 x ref2, one layer of four 0.499 -> 0.512): fresh memory "
        "does not hold its first epoch up on average. What does: in steady epochs (perf record -F 4000 -g, 1-layer "
        "cache, 12 epochs in one process) the copy kernel took 71.5% of the process's CPU samples, thread "
        "switches and wake-ups ~6%, the Python around it ~3%, numpy's per-batch row permutation ~2.3%, "
        "index_rows 1.4%, the readers' mapping work ~6% and the process used ~1.8 of the 2 cores; the bare "
        "kernel alone (bench_kernel.py, same day) copied 3 KiB rows at 28.9 GB/s with both cores, so ~0.9 x "
        "ref2 needs the loader's whole overhead below ~25% of its CPU where it is ~30% plus ~10% idle. A "
        "new loader's first epoch in a process that already ran one took 0.27-0.36 s, the same as in a "
        "fresh process (0.27-0.34 s), against ~0.26 s for a steady epoch of one loader.",
        "",
        "Ordered io='auto' learns with one read (2026-11-25 02:08): until both ways' costs are known, cached "
        "batches are mapped but for the second, which is read; before, every batch chosen until the first "
        "read's cost came in was read (~4 with the readers' look-ahead). Paired A/B in fresh processes "
        "(this script's worker, warm): one layer of four 1.078 and 1.061 x the old rule (medians of the "
        "in-round ratio over 8 and 14 alternating rounds), 1-layer cache 1.009 (10 rounds). The warm and "
        "warm-primed rows of 02:13 / 02:17 were measured after the change, on a noisier machine than the "
        "runs before (one layer of four, warm-primed: ref layer 6.1-16.1 GB/s by round, ordered io=mmap "
        "6.6-13.8), so the 4-layer ordered rows moved within their spread (warm 0.401 -> 0.455 x ref, "
        "warm-primed 0.535 -> 0.427) and show neither the A/B's gain nor a loss; 1-layer warm: ordered "
        "0.651 -> 0.712 x ref, shuffled 0.605 -> 0.673 x ref2 (no shuffled change), 2nd epoch 0.733 -> 0.739.",
        "",
    ]
    for run in stored:
        groups: dict = {}  # modes grouped by the run that measured them (see --modes)
        whole = {"date": run["date"], "argv": run.get("argv", [__file__])}
        for mode in run["results"]:
            m = (run.get("measured") or {}).get(mode, whole)
            groups.setdefault((m["date"], tuple(m["argv"])), []).append(mode)
        parts = []
        for (date, argv), modes in groups.items():
            day = time.strftime("%Y-%m-%d %H:%M", time.gmtime(date))
            names = " and ".join([", ".join(modes[:-1]), modes[-1]] if len(modes) > 1 else modes)
            parts.append(f"{names} rows measured {day} UTC by `{benchlib.command_line(list(argv))}`")
        body.append(
            f"**{run['n_layers']} recorded layer(s)**: {run['n_imgs']:,} images, {run['size_GB']:.2f} GB; "
            + "; ".join(parts)
            + f" (load average at the end of the last full run {run['load'][0]:.1f})"
        )
        body.append("")
        rows = [{k: v for k, v in r.items() if k != "layers"} for r in summarize(run)]
        body.append(benchlib.table(rows, columns(rows)))
        m, bound = entropy_bound(
            run["n_imgs"], run.get("buffer_bytes", args.buffer_bytes), run.get("batch_size", args.batch_size)
        )
        bal = entropy_balanced(m, run["n_imgs"], run.get("batch_size", args.batch_size))
        body.append(f"Image entropy when whole images are held: the buffer fits {m:,} of the "
                    f"{run['n_imgs']:,} images' selected bytes. A batch drawn uniformly at random from {m:,} images "
                    f"scores {bound:.3f} (from all {run['n_imgs']:,}: {entropy_bound(run['n_imgs'], None, run.get('batch_size', args.batch_size))[1]:.3f}); "
                    f"one taking the same count (+-1) from each of them scores {bal:.3f}, the most that holding whole "
                    "images allows. The shuffled loader's balanced draws land between the two: as the buffer drains "
                    "at the end of an epoch, the images still held have unequal amounts left. Partial-image "
                    "residency (`n_strips` > 1) holds parts of more images and goes beyond.")  # fmt: skip
        body.append("")
    body.append("![loader throughput](docs/bench_loaders.png)")
    benchlib.record("loaders", "Loaders: ordered and shuffled vs raw reads", "\n".join(body), when=when)


if __name__ == "__main__":
    main()
