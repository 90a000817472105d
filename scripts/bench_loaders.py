"""Benchmark the ordered and shuffled loaders against raw reads of the same files, same run.

    python scripts/bench_loaders.py [--size-gib 4] [--layers 1,4] [--rounds 3] [--cache-dir bench-out/loaders]
                                    [--json OUT] [--quick] [--modes warm,cold] [--render]

Cache: synthetic, d=768, 197 tokens/img (CLS + 196 patches), 1 or 4 recorded layers, ~1 GiB shards;
the loaders read one layer's patch tokens. References, same run and same files: ref (one thread,
8 MiB reads), ref2 (two threads, batch-sized buffers), and on a cache of several layers ref layer
(a raw read of just the layer's byte ranges) and ref2 same bytes (ref2 over one epoch's bytes).
naive = torch DataLoader over IndexedDataset, time-boxed and extrapolated.

Every measurement runs in a fresh subprocess. Modes (MODES): warm (every page of the shards
cached, in large folios: ``rewarm`` reads them again where a reclaim daemon or scattered reads
left gaps or small folios), cold (page cache dropped right before), cold-late (dropped, then
COLD_LATE_S idle), cold-primed and warm-primed (the process first touches and frees fresh
memory, so that it reads into memory the host has just backed). Figures are medians of
``--rounds`` alternating rounds (``--warm-rounds`` for the warm modes); ``--modes`` measures a
subset and keeps the stored results of the others. The section of BENCHMARKS.md is rendered by
``render`` from a short template; ``--json`` writes every raw measurement.
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
    only fill holes, or random ones, leave small folios, out of which the loaders copy more
    slowly, so the state would depend on what DAMON took or what read the files last); then
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


# ---- the BENCHMARKS.md section ------------------------------------------------------------------
TITLE = "Loaders: ordered and shuffled vs raw reads"
SETUP = [
    "Synthetic caches: d=768, 197 tokens/img, ~1 GiB shards, 1 or 4 recorded layers; the loaders read "
    "layer {LAYER}'s patch tokens, batch {batch:,}, shuffle buffer {buffer_gb:.1f} GB.",
    "References, same run and files: ref = 1 thread, 8 MiB reads; ref2 = 2 threads, 48 MiB buffers; "
    "ref2 same bytes = ref2 reading only one epoch's bytes of the layer (caches of several layers).",
    "Modes: warm = shards in the page cache; cold = page cache dropped right before; cold-late = dropped, "
    "then {late:g} s idle; *-primed = the process first touches and frees fresh memory.",
    "Each measurement in a fresh process; MB/s (bytes of the layer only) and ratios are medians of "
    "alternating rounds, a ratio taken within each round. Other columns: `--json`.",
]
# (column, mode, summarize's key): the document's table, one row per loader
PIVOT = [
    ("warm MB/s", "warm", "MB/s"),
    ("warm x ref", "warm", "x ref"),
    ("warm x ref2", "warm", "x ref2"),
    ("warm x ref2 same bytes", "warm", "x ref2 same bytes"),
    ("cold x ref", "cold", "x ref"),
    ("cold-late x ref", "cold-late", "x ref"),
    ("cold-primed x ref", "cold-primed", "x ref"),
    ("warm-primed x ref2", "warm-primed", "x ref2"),
    ("warm first batch s", "warm", "first batch s"),
]


def caption(run: dict) -> str:
    """The line above a cache's table: its size and when each mode was measured (see --modes)."""
    whole = {"date": run["date"]}
    days: dict[str, list[str]] = {}
    for mode in run["results"]:
        date = (run.get("measured") or {}).get(mode, whole)["date"]
        days.setdefault(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(date)), []).append(mode)
    if len(days) == 1:
        when = f"measured {next(iter(days))}"
    else:
        when = "; ".join(f"{', '.join(modes)} measured {day}" for day, modes in days.items())
    return f"**{run['n_layers']} recorded layer(s)**: {run['n_imgs']:,} images, {run['size_GB']:.2f} GB; {when}"


def pivot(rows: list[dict]) -> str:
    """One row per loader, one column per (mode, figure) of PIVOT that some row has."""
    by_loader: dict[str, dict] = {}
    for r in rows:
        out = by_loader.setdefault(r["loader"], {"loader": r["loader"]})
        for col, mode, key in PIVOT:
            if r["mode"] == mode and r.get(key) is not None:
                out[col] = r[key]
    cols = ["loader", *(c for c, _, _ in PIVOT if any(c in o for o in by_loader.values()))]
    return benchlib.table(list(by_loader.values()), cols)


def loader_checks(n_layers: int, rows: list[dict]) -> list[benchlib.Check]:
    """The targets (TARGETS) of the plain loaders, in the modes they are set for."""
    found = {(r["loader"], r["mode"]): r for r in rows}
    checks = []
    for (loader, mode), refs in TARGETS.items():
        row = found.get((loader, mode))
        for ref, minimum in refs if row else []:
            target = f"{mode} {loader} >= {minimum:g} x {ref} ({n_layers} layer{'s' if n_layers > 1 else ''})"
            checks.append(benchlib.check(target, row[f"x {ref}"], minimum, f"x {ref}"))
    return checks


def merged(checks: list[list[benchlib.Check]]) -> list[benchlib.Check]:
    """One summary row per target over the caches: every cache's figure, met where all met it."""
    by_target: dict[str, list[benchlib.Check]] = {}
    for c in (c for cs in checks for c in cs):
        by_target.setdefault(c.target.rsplit(" (", 1)[0], []).append(c)
    return [
        benchlib.Check(
            target,
            ", ".join(f"{c.figure} ({c.target.rsplit(' (', 1)[1]}" for c in cs),
            all(c.met for c in cs),
        )
        for target, cs in by_target.items()
    ]


def side_checks(rows: list[dict]) -> list[str]:
    """The shuffled rows' other checks (entropy, first batch, memory) that some row missed."""
    missed = [
        f"{r['mode']} {r['loader']}: {c.removeprefix('MISSED ')}"
        for r in rows
        if r["loader"].startswith("shuffled")
        for c in r.get("targets", "").split("; ")
        if c.startswith("MISSED") and "xref" not in c
    ]
    return missed


def conclusions(caches: list[dict], checks: list[list[benchlib.Check]]) -> list[str]:
    out = []
    for cache, cs in zip(caches, checks, strict=True):
        missed = [c for c in cs if not c.met]
        head = f"{cache['n_layers']} recorded layer(s): {len(cs) - len(missed)} of {len(cs)} targets met"
        out.append(head + "".join(f"; missed: {c.target}, measured {c.figure}" for c in missed))
    side = [m for cache in caches for m in side_checks(cache["rows"])]
    verdict = "all met" if not side else "missed: " + "; ".join(side)
    out.append(f"entropy, first batch and memory checks of the shuffled rows: {verdict}")
    for cache in caches:
        rows = {(r["loader"], r["mode"]): r for r in cache["rows"]}
        first, second = rows.get(("shuffled", "warm")), rows.get(("shuffled 2nd epoch", "warm"))
        if first and second and len(out) < benchlib.MAX_CONCLUSIONS:
            same = f", {first[f'x {SAME_BYTES}']:.3f} x {SAME_BYTES}" if f"x {SAME_BYTES}" in first else ""
            out.append(
                f"{cache['n_layers']} recorded layer(s), warm shuffled: a first epoch in a fresh process runs at "
                f"{first['x ref2']:.3f} x ref2{same}; a second epoch at {second['x ref2']:.3f} x ref2 (threads, "
                "fresh batch buffers and the first plan are one-time costs)"
            )
    return out[: benchlib.MAX_CONCLUSIONS]


def render(caches: list[dict], buffer_bytes: int, batch_size: int) -> tuple[str, list[benchlib.Check]]:
    """The section's body and its summary checks from each cache's caption and summarize() rows."""
    fill = dict(LAYER=LAYER, batch=batch_size, buffer_gb=buffer_bytes / 1e9, late=COLD_LATE_S)
    checks = [loader_checks(c["n_layers"], c["rows"]) for c in caches]
    tables = [f"{c['caption']}\n\n{pivot(c['rows'])}" for c in caches]
    tables.append("![loader throughput](docs/bench_loaders.png)")
    body = benchlib.section_body([line.format(**fill) for line in SETUP], tables, conclusions(caches, checks))
    return body, merged(checks)


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
        help="rounds of the warm modes (default: --rounds); a warm round takes seconds, and its ratio to "
        "ref2 varies from round to round, so more rounds steady the median",
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
        run.update(machine=benchlib.machine(), machine_short=benchlib.machine_short())
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
    caches = [{"caption": caption(run), "n_layers": run["n_layers"], "rows": summarize(run)} for run in stored]
    first = stored[0] if stored else {}
    body, checks = render(
        caches, first.get("buffer_bytes", args.buffer_bytes), first.get("batch_size", args.batch_size)
    )
    machines = (first["machine"], first["machine_short"]) if args.render and "machine" in first else None
    benchlib.record("loaders", TITLE, body, when=when, checks=checks, machines=machines)


if __name__ == "__main__":
    main()
