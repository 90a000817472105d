"""Benchmark `actcache dump` (actcache.dump.dump_shards) against references measured in the same run.

    python scripts/bench_dump.py [--dir bench-out/dump] [--rounds 3] [--vit-rounds 5] [--io-imgs 20000]
                                 [--vit-imgs 48] [--device cpu] [--workers N] [--only io|compute|both]
                                 [--quick] [--no-record]

Two scenarios, each with random-weight CLIP vision checkpoints written with save_pretrained
(no downloads) and synthetic images (``data.kind: synthetic``), on ``--device`` (default cpu;
``cuda`` records section ``dump-cuda`` of BENCHMARKS.md instead of ``dump``, runs only the
I/O-bound scenario unless ``--only both``, and defaults to 100,000 images, batch 1024 and cores - 2
workers):

I/O-bound: a tiny model (d=32, MLP 32, 4 blocks, all 4 recorded, 32x32 images in 4x4 patches:
65 tokens, 33 KB of activations per image). References: ``seq write`` = the same bytes in the same number
of shard-sized files, written with 8 MiB writes from one reused buffer, fsync per file, in the same
directory; ``write path`` = the dump's own writer thread (ShardSink) fed from memory (no model);
``forward only`` = the model forward over the same preprocessed images, same batches, no writes.
Target: dump MB/s >= 0.70 x seq write MB/s (seq write and write path run three times per round).

Compute-bound: a ViT-B/16-sized model (d=768, 12 blocks, 12 heads, 3072 MLP, 224x224, patch 16),
layer -2 (the forward stops after block 10). Reference: ``forward only`` = the same model forward
over the same preprocessed images up to the same block, same batches. The dump's wall time counts
everything it does (listing, metadata, model load, decoding, forward, writing, fsync).
Target: dump wall time <= 1.10 x forward-only time.

Checksums (``--only checksums``, section ``dump-checksums``): the dump's writer thread (ShardSink,
fed from memory, I/O-bound sizes) with its per-shard checksums (xxh3 of every byte as it is written,
plus one record file per shard) against the same writer with hashing and records switched off in
this process (the writer as it was before checksums). Target: with >= 0.95 x without.

Rounds alternate the order of the measurements. On a shared machine other jobs take the CPU at
random moments, so each figure is the best (minimum) time over the rounds, as timeit does:
interference only ever slows a run down. The per-round ratios are printed too.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from actcache.config import experiment_from_dict  # noqa: E402
from actcache.dump import ShardSink, dump_shards, plan_batches  # noqa: E402
from actcache.plan import experiment_metadata  # noqa: E402

MiB = 2**20


def make_ckpt(root: str, name: str, **vision) -> str:
    import transformers

    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        cfg = transformers.CLIPVisionConfig(**vision)
        transformers.CLIPVisionModel(cfg).save_pretrained(path)
        size = vision["image_size"]
        transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}
                                        ).save_pretrained(path)  # fmt: skip
    return path


DEV = benchlib.Device("cpu")  # --device (set in main)


def where() -> str:
    """The device in words, for the tables' text."""
    if DEV.cuda:
        return f"{DEV.words}; CPU: {torch.get_num_threads()} torch threads"
    return f"CPU ({torch.get_num_threads()} threads)"


def make_exp(ckpt: str, n_imgs: int, size: int, layers: list[int], max_patches: int, batch: int, workers: int):
    doc = {
        "name": "bench",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": layers},
        "data": {"kind": "synthetic", "n_imgs": n_imgs, "size": size, "seed": 0},
        "cache": {"max_patches_per_shard": max_patches, "batch_size": batch, "n_workers": workers, "device": DEV.name},
    }
    return experiment_from_dict(doc, source="<bench>")


# ---- measurements --------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the dump's image workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def seq_write(directory: str, n_files: int, file_bytes: int) -> float:
    """Seconds to write n_files x file_bytes with 8 MiB writes from one reused buffer, fsync per file."""
    buf = np.random.default_rng(0).standard_normal(8 * MiB // 4, dtype=np.float32).tobytes()
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n_files):
        with open(os.path.join(directory, f"seq{i:06d}.bin"), "wb", buffering=0) as fd:
            left = file_bytes
            while left > 0:
                left -= fd.write(memoryview(buf)[: min(left, len(buf))])
            os.fsync(fd.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(directory)
    return dt


def write_path(directory: str, md, acts_NLTD: np.ndarray, batch: int) -> float:
    """Seconds for the dump's writer thread (ShardSink) to write the whole cache from memory."""
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    sink = ShardSink(directory, md).start()
    for shard, lo, hi in plan_batches(md, range(md.n_shards), batch):
        sink.put(shard, acts_NLTD[lo % len(acts_NLTD) : lo % len(acts_NLTD) + hi - lo])
    sink.finish()
    dt = time.perf_counter() - t0
    shutil.rmtree(directory)
    return dt


class _NoHash:
    """The writer's hasher switched off: the reference of the checksums scenario."""

    def __init__(self, *args, **kw):
        self.nbytes = 0

    def update(self, data) -> None:
        self.nbytes += memoryview(data).nbytes

    def digest(self) -> str:
        return "0" * 16


def unhashed(run, *args):
    """``run(*args)`` with the writer's checksums switched off (the writer as it was before them)."""
    from actcache import checksums

    saved = checksums.StreamHasher, checksums.write_record
    checksums.StreamHasher, checksums.write_record = _NoHash, lambda directory, rec: None
    try:
        return run(*args)
    finally:
        checksums.StreamHasher, checksums.write_record = saved


def hash_alone(md, acts_NLTD: np.ndarray, batch: int) -> float:
    """Seconds for one thread to hash the cache's bytes as the writer does, without writing them."""
    from actcache.checksums import StreamHasher

    t0 = time.perf_counter()
    h = StreamHasher()
    for _, lo, hi in plan_batches(md, range(md.n_shards), batch):
        h.update(acts_NLTD[lo % len(acts_NLTD) : lo % len(acts_NLTD) + hi - lo])
    h.digest()
    return time.perf_counter() - t0


def tiny_setup(root: str, n_imgs: int, workers: int, batch: int) -> tuple:
    """The I/O-bound scenarios' tiny ViT (4 layers recorded, d=32), its experiment, metadata, byte
    count and 2048 images' worth of random activations: (ckpt, exp, md, total bytes, acts)."""
    ckpt = make_ckpt(root, "tiny", hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=1,
                     image_size=32, patch_size=4)  # fmt: skip
    exp = make_exp(ckpt, n_imgs, 32, [0, 1, 2, 3], max_patches=4096 * 65 * 4, batch=batch, workers=workers)
    md = experiment_metadata(exp)
    acts = np.random.default_rng(0).standard_normal((2048, *md.shard_shape[1:]), dtype=np.float32)
    return ckpt, exp, md, md.n_imgs * md.bytes_per_img, acts


def checksum_cost(root: str, n_imgs: int, rounds: int, workers: int, batch: int) -> tuple[list[dict], tuple]:
    ckpt, exp, md, total, acts = tiny_setup(root, n_imgs, workers, batch)
    write_path(os.path.join(root, "warm"), md, acts, batch)
    dump(make_exp(ckpt, 512, 32, [0, 1, 2, 3], 4096 * 65 * 4, batch, workers), os.path.join(root, "warm-dump"))
    res: dict[str, list[float]] = {"off": [], "on": [], "dump off": [], "dump on": []}
    for r in range(rounds):
        for which in ("off", "on") if r % 2 == 0 else ("on", "off"):
            sink = (os.path.join(root, "sink"), md, acts, batch)
            res[which].append(write_path(*sink) if which == "on" else unhashed(write_path, *sink))
            full = (exp, os.path.join(root, "dump"))
            res["dump " + which].append((dump(*full) if which == "on" else unhashed(dump, *full))[0])
            for key in (which, "dump " + which):
                dt = res[key][-1]
                print(f"  checksums round {r}: {key:8s} {dt:7.3f} s  {total / dt / 1e6:8.1f} MB/s", flush=True)
    best = {k: min(v) for k, v in res.items()}
    ratios = [a / b for a, b in zip(res["dump off"], res["dump on"], strict=True)]
    best["hash"] = min(hash_alone(md, acts, batch) for _ in range(3))
    rows = [
        {"checksums": label, "seconds": best[k], "MB/s": total / best[k] / 1e6, "vs without": best[ref] / best[k]}
        for label, k, ref in [
            ("dump (end to end) without checksums", "dump off", "dump off"),
            ("dump (end to end) with checksums", "dump on", "dump off"),
            ("write path (ShardSink, no model) without checksums", "off", "off"),
            ("write path with checksums (xxh3 while writing, one record per shard)", "on", "off"),
            ("for scale: xxh3 of the same bytes alone, one thread, no writes", "hash", "off"),
        ]
    ]
    ratio = best["dump off"] / best["dump on"]
    check = benchlib.check("dump throughput with checksums >= 0.95 x without", ratio, 0.95, "x without")
    setup = (
        f"Checksums, on {where()}: the I/O-bound scenario's model and images, {md.n_imgs:,} images of "
        f"{md.bytes_per_img / 1e3:.1f} KB, {total / 1e9:.2f} GB in {md.n_shards} shards, batch {batch}, {workers} "
        f"worker(s); best of {rounds} rounds (per-round dump ratios {', '.join(f'{x:.3f}' for x in ratios)})."
    )
    note = f"the writer alone (no model) keeps {best['off'] / best['on']:.3f} x its speed with checksums"
    return rows, (setup, check, [note])


def preprocessed(exp, n: int) -> torch.Tensor:
    from actcache.images import open_dataset
    from actcache.models import load_transform

    ds = open_dataset(exp.data)
    tf = load_transform(exp.vit.family, exp.vit.ckpt)
    return torch.from_numpy(np.stack([tf(ds[i][0]) for i in range(n)]))


def forward_only(exp, md, pixels: torch.Tensor) -> tuple[float, float, float]:
    """(seconds of the forward loop, its CPU seconds, seconds to load the model): same batches as the dump."""
    from actcache.models import load_vit

    t0 = time.perf_counter()
    vit = load_vit(exp.vit.family, exp.vit.ckpt, DEV.name)
    DEV.sync()
    t_load = time.perf_counter() - t0
    layers = list(exp.vit.layers)
    n = len(pixels)
    if DEV.cuda:
        pixels = pixels.pin_memory()  # as the dump's DataLoader delivers them
    c0, t0 = cpu_seconds(), time.perf_counter()
    for _, lo, hi in plan_batches(md, range(md.n_shards), exp.cache.batch_size):
        k = lo % n
        vit.forward(pixels[k : k + hi - lo].to(DEV.name, non_blocking=True), layers)
    DEV.sync()
    return time.perf_counter() - t0, cpu_seconds() - c0, t_load


def dump(exp, directory: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds incl. the image workers) of one dump_shards call."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    path = dump_shards(exp, None, directory, progress=False)
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    assert len([n for n in os.listdir(path) if n.endswith(".bin")]) == experiment_metadata(exp).n_shards
    shutil.rmtree(directory)
    return dt, cpu


# ---- scenarios -----------------------------------------------------------------------------------


def io_bound(root: str, n_imgs: int, rounds: int, workers: int, batch: int) -> tuple[list[dict], tuple]:
    ckpt, exp, md, total, acts = tiny_setup(root, n_imgs, workers, batch)
    pixels = preprocessed(exp, min(n_imgs, 2048))
    dump(make_exp(ckpt, 512, 32, [0, 1, 2, 3], 4096 * 65 * 4, batch, workers), os.path.join(root, "warm"))
    seq_write(os.path.join(root, "seq"), md.n_shards, md.shard_nbytes)  # page cache pages backed by the host
    res: dict[str, list[float]] = {"seq": [], "sink": [], "fwd": [], "dump": []}
    # The disk's speed swings more than the CPU's: three cheap seq/sink runs per slow dump/forward pair.
    order = ["seq", "sink", "seq", "dump", "sink", "fwd", "seq", "sink"]
    round_seq = []
    cpus: dict[str, list[float]] = {"fwd": [], "dump": []}
    for r in range(rounds):
        n_seq = len(res["seq"])
        for which in order if r % 2 == 0 else order[::-1]:
            if which == "seq":
                dt = seq_write(os.path.join(root, "seq"), md.n_shards, md.shard_nbytes)
            elif which == "sink":
                dt = write_path(os.path.join(root, "sink"), md, acts, batch)
            elif which == "fwd":
                dt, cpu, _ = forward_only(exp, md, pixels)
                cpus["fwd"].append(cpu)
            else:
                dt, cpu = dump(exp, os.path.join(root, "dump"))
                cpus["dump"].append(cpu)
            res[which].append(dt)
            print(f"  io round {r}: {which:5s} {dt:7.2f} s  {total / dt / 1e6:8.1f} MB/s", flush=True)
        round_seq.append(min(res["seq"][n_seq:]))
    med = {k: min(v) for k, v in res.items()}
    ratios = [s / d for s, d in zip(round_seq, res["dump"], strict=True)]
    ratio = med["seq"] / med["dump"]
    rows = []
    for key, label in [("seq", "seq write (8 MiB writes, fsync per file)"), ("sink", "write path (ShardSink, no model)"),
                       ("fwd", "forward only (no decoding, no writes)"), ("dump", "dump (end to end)")]:  # fmt: skip
        rows.append({
            "I/O-bound": label,
            "seconds": med[key],
            "MB/s": total / med[key] / 1e6,
            "images/s": md.n_imgs / med[key],
            "vs seq write": med["seq"] / med[key],
            "CPU s": min(cpus[key]) if key in cpus else "",
        })  # fmt: skip
    check = benchlib.check("dump MB/s >= 0.70 x seq write MB/s (I/O-bound)", ratio, 0.70, "x seq write")
    setup = (
        f"I/O-bound, on {where()}: {md.n_imgs:,} synthetic 32x32 images, d=32, 4 blocks recorded "
        f"({md.bytes_per_img / 1e3:.1f} KB/image), {total / 1e9:.2f} GB in {md.n_shards} shards, batch {batch}, "
        f"{workers} worker(s); best of {rounds} rounds (per-round ratios {', '.join(f'{x:.3f}' for x in ratios)})."
    )
    bound = "compute" if med["fwd"] > med["seq"] else "I/O"
    notes = [
        f"I/O-bound scenario: the dump is {bound}-bound here (forward only {med['fwd']:.2f} s, seq write "
        f"{med['seq']:.2f} s); the write path runs at {med['seq'] / med['sink']:.2f} x seq write"
    ]
    text = (setup, check, notes)
    return rows, text


def compute_bound(root: str, n_imgs: int, rounds: int, workers: int, batch: int) -> tuple[list[dict], tuple]:
    ckpt = make_ckpt(root, "vitb16", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, image_size=224, patch_size=16)  # fmt: skip
    exp = make_exp(ckpt, n_imgs, 224, [-2], max_patches=32 * 197, batch=batch, workers=workers)
    md = experiment_metadata(exp)
    pixels = preprocessed(exp, n_imgs)
    dump(make_exp(ckpt, 4, 224, [-2], 32 * 197, batch, workers), os.path.join(root, "warm"))  # imports, page cache
    res: dict[str, list[float]] = {"fwd": [], "load": [], "dump": [], "fwd_cpu": [], "dump_cpu": []}
    for r in range(rounds):
        for which in ("fwd", "dump") if r % 2 == 0 else ("dump", "fwd"):
            if which == "fwd":
                dt, cpu, t_load = forward_only(exp, md, pixels)
                res["load"].append(t_load)
            else:
                dt, cpu = dump(exp, os.path.join(root, "dump"))
            res[which].append(dt)
            res[which + "_cpu"].append(cpu)
            print(f"  compute round {r}: {which:5s} {dt:7.2f} s  {n_imgs / dt:6.2f} images/s", flush=True)
    ratios = [d / f for d, f in zip(res["dump"], res["fwd"], strict=True)]
    fwd, dmp = min(res["fwd"]), min(res["dump"])
    fwd_cpu, dmp_cpu = min(res["fwd_cpu"]), min(res["dump_cpu"])
    rows = [
        {"compute-bound": "forward only (up to block 10)", "seconds": fwd, "images/s": n_imgs / fwd, "x forward": 1.0,
         "CPU s": fwd_cpu, "x forward (CPU)": 1.0},
        {"compute-bound": "dump (end to end, incl. model load)", "seconds": dmp, "images/s": n_imgs / dmp,
         "x forward": dmp / fwd, "CPU s": dmp_cpu, "x forward (CPU)": dmp_cpu / fwd_cpu},
    ]  # fmt: skip
    check = benchlib.check("dump wall time <= 1.10 x forward only (compute-bound)", dmp / fwd, 1.10,
                           "x forward", at_least=False)  # fmt: skip
    setup = (
        f"Compute-bound: ViT-B/16-sized random CLIP, layer -2, {n_imgs} synthetic 224x224 images, batch {batch}, "
        f"{workers} worker(s), {where()}, {md.n_shards} shards; best of {rounds} rounds (per-round ratios "
        f"{', '.join(f'{x:.3f}' for x in ratios)})."
    )
    notes = [
        f"Compute-bound scenario: CPU seconds, which other jobs disturb less than wall time, give dump / forward "
        f"{dmp_cpu / fwd_cpu:.3f}; the model load takes {min(res['load']):.2f} s of the dump's time"
    ]
    text = (setup, check, notes)
    return rows, text


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(benchlib.ROOT, "bench-out", "dump"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vit-rounds", type=int, default=5)
    ap.add_argument("--io-imgs", type=int, default=None, help="default 20,000 (cpu), 100,000 (cuda)")
    ap.add_argument("--io-batch", type=int, default=None, help="I/O-bound batch size (default 256 cpu, 1024 cuda)")
    ap.add_argument("--vit-imgs", type=int, default=48)
    ap.add_argument("--vit-batch", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--workers", type=int, default=None, help="image workers (default 1 on cpu, cores - 2 on cuda)")
    ap.add_argument("--only", choices=["io", "compute", "both", "checksums"], default=None,
                    help="scenarios to run (default both on cpu, io on cuda; checksums: its own section)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 round, no record (a smoke test)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    DEV = benchlib.Device(args.device)
    cuda = DEV.cuda
    if args.workers is None:
        args.workers = max(1, (os.cpu_count() or 2) - 2) if cuda else 1
    if args.io_batch is None:
        args.io_batch = 1024 if cuda else 256
    if args.io_imgs is None:
        args.io_imgs = 100_000 if cuda else 20_000
    only = args.only or ("io" if cuda else "both")
    if args.quick:
        args.rounds, args.vit_rounds, args.io_imgs, args.vit_imgs, args.no_record = 1, 1, 4000, 16, True
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    load0 = os.getloadavg()[0]
    setup, tables, checks, notes = [], [], [], []
    try:
        for name, run, n_rounds, n_imgs, batch in [("io", io_bound, args.rounds, args.io_imgs, args.io_batch),
                                                   ("compute", compute_bound, args.vit_rounds, args.vit_imgs,
                                                    args.vit_batch),
                                                   ("checksums", checksum_cost, 2 * args.rounds + 1, args.io_imgs,
                                                    args.io_batch)]:  # fmt: skip
            if only != name and (only != "both" or name == "checksums"):
                continue
            print(name, flush=True)
            rows, (line, check, note) = run(root, n_imgs, n_rounds, args.workers, batch)
            setup.append(line)
            tables.append(benchlib.table(rows))
            checks.append(check)
            notes += note
    finally:
        shutil.rmtree(root, ignore_errors=True)
    setup.append(
        f"Rounds alternate the order; each figure is the best time. 1-minute load average at the start / end: "
        f"{load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    )
    body = benchlib.section_body(setup, tables, [c.bullet() for c in checks] + notes)
    print(body)
    if not args.no_record:
        if only == "checksums":
            title = "dump: the writer with per-shard checksums vs. without"
            benchlib.record(*DEV.section("dump-checksums", title), body, checks=checks)
        else:
            title = "dump: activations written vs. disk speed and forward-pass time"
            benchlib.record(*DEV.section("dump", title), body, checks=checks)


if __name__ == "__main__":
    main()
