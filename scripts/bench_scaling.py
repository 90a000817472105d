"""How the cache-side costs grow with the number of shards: 1x, 10x and 100x ImageNet-1k's.

    python scripts/bench_scaling.py [--dir bench-out/scaling] [--scales 1,10,100] [--imgs-per-shard 4] [--no-record]

1x is the shard count of ImageNet-1k (1,281,167 images) dumped from ViT-B/16 (d=768, 197 tokens,
1 layer) at the default shard size (2,400,000 vectors: 12,182 images, 7.5 GB per shard): 106
shards; 10x and 100x have ten and a hundred times as many. Each shard here holds
``--imgs-per-shard`` images (2.4 MB at 4), so that ``verify --deep``, which reads every byte, stays
short; the shards are sparse files (4 KiB of random values at the start, the rest a hole), so no
disk is used. The experiment is a real one (a ViT-B/16 config, synthetic data), its cache
directory written as the dump would (metadata.json, shard files, gather's shards.json).

Each command runs in a fresh process, as a user runs it, timed from start to exit (imports
included), with its peak resident memory (its own ru_maxrss, from GNU time):
``actcache plan``, the workflow's dry run (``snakemake -n``: the DAG of every dump job, one shard
per job), ``actcache verify``, ``actcache verify --deep``, and a shuffled loader's start (construct
it and take its first batch of 4,096 patch vectors; buffer 256 MiB). Section ``scaling``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT
IMAGENET = 1_281_167
SNAKEMAKE = os.path.join(os.path.dirname(sys.executable), "snakemake")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "src"))
LOADER = """
import sys, time
from actcache.loaders import ShuffledLoader
t0 = time.perf_counter()
loader = ShuffledLoader(sys.argv[1], batch_size=4096, buffer_bytes=2**28)
batch = next(iter(loader))
acts = batch["act"] if isinstance(batch, dict) else batch
assert len(acts) == 4096, (type(batch), len(acts))
print(time.perf_counter() - t0, flush=True)
loader.close()
"""


def imagenet_shards() -> int:
    """Shards of ImageNet-1k from ViT-B/16, 1 layer, at the default shard size."""
    from actcache.protocol import DEFAULT_MAX_PATCHES_PER_SHARD

    per_shard = DEFAULT_MAX_PATCHES_PER_SHARD // 197
    return -(-IMAGENET // per_shard)


def vitb16_config(root: str) -> str:
    """A ViT-B/16 CLIP checkpoint's config files (no weights: planning reads only these)."""
    import transformers

    path = os.path.join(root, "vitb16-config")
    cfg = transformers.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=12, image_size=224, patch_size=16)  # fmt: skip
    cfg.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).save_pretrained(path)
    return path


def build(root: str, ckpt: str, n_shards: int, per_shard: int) -> tuple[str, str, str]:
    """(experiment YAML, workflow config, cache directory) of a sparse cache of n_shards shards."""
    import yaml

    from actcache.config import load_experiment
    from actcache.plan import experiment_metadata
    from actcache.protocol import shard_name
    from actcache.writer import ensure_metadata, gather

    doc = {
        "name": f"scale{n_shards}",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
        "data": {"kind": "synthetic", "n_imgs": n_shards * per_shard, "size": 224, "seed": 0},
        "cache": {"max_patches_per_shard": per_shard * 197, "shards_per_job": 1},
    }
    exp_path = os.path.join(root, f"{doc['name']}.yaml")
    with open(exp_path, "w") as fd:
        yaml.safe_dump(doc, fd)
    dump_to = os.path.join(root, "cache")
    md = experiment_metadata(load_experiment(exp_path))
    path = ensure_metadata(dump_to, md)
    rng = np.random.default_rng(n_shards)
    for i in range(n_shards):
        with open(os.path.join(path, shard_name(i)), "wb") as fd:
            fd.write(rng.standard_normal(1024, dtype=np.float32).tobytes())
            fd.truncate(md.shard_nbytes)
    gather(path)
    cfg = os.path.join(root, "config.yaml")
    with open(cfg, "w") as fd:
        yaml.safe_dump({"dump_to": dump_to, "runs_to": os.path.join(root, "runs"), "experiments": [exp_path]}, fd)
    return exp_path, cfg, path


def run(cmd: list[str], cwd: str) -> tuple[float, float, str]:
    """(seconds, peak resident MiB, last line of its output) of one command in a fresh process; a failure stops the run.
    The memory is GNU time's %M: the process's own ru_maxrss (a child forked straight from this
    process would report this process's size, inherited through fork and exec)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".time") as tf, tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        rc = subprocess.call(["/usr/bin/time", "-o", tf.name, "-f", "%M", *cmd], cwd=cwd, env=ENV, stdout=out,
                             stderr=subprocess.STDOUT)  # fmt: skip
        dt = time.perf_counter() - t0
        if rc != 0:
            out.seek(0)
            raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{out.read()[-3000:]}")
        out.seek(0)
        lines = out.read().strip().splitlines()
        return dt, int(tf.read().split()[-1]) / 1024, lines[-1] if lines else ""


def measure(root: str, n_shards: int, per_shard: int, ckpt: str) -> dict:
    t0 = time.perf_counter()
    exp, cfg, path = build(root, ckpt, n_shards, per_shard)
    t_build = time.perf_counter() - t0
    py = sys.executable
    cmds = {
        "plan": [py, "-m", "actcache.cli", "plan", "--config", cfg, "--experiment", exp],
        "dry run": [SNAKEMAKE, "-s", os.path.join(ROOT, "Snakefile"), "--configfile", cfg, "-d", root, "--cores", "1",
                    "-n", "--quiet", "rules"],
        "verify": [py, "-m", "actcache.cli", "verify", path],
        "verify --deep": [py, "-m", "actcache.cli", "verify", "--deep", path],
        "loader start": [py, "-c", LOADER, path],
    }  # fmt: skip
    row = {"shards": n_shards}
    for name, cmd in cmds.items():
        dt, rss, last = run(cmd, root)
        if name == "loader start":  # its own figure, after the imports (torch's, cold, take seconds here)
            row["loader process s"], dt = dt, float(last)
        row[f"{name} s"] = dt
        row[f"{name} MiB"] = rss
        print(f"  {n_shards:7,} shards: {name:14s} {dt:7.2f} s  {rss:7.0f} MiB", flush=True)
    from actcache.protocol import Metadata

    md = Metadata.load(path)
    row["apparent GB"] = md.n_imgs * md.bytes_per_img / 1e9
    row["build s"] = t_build
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench-out", "scaling"))
    ap.add_argument("--scales", default="1,10,100")
    ap.add_argument("--imgs-per-shard", type=int, default=4)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    load0 = os.getloadavg()[0]
    base = imagenet_shards()
    rows = []
    top = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    try:
        ckpt = vitb16_config(top)
        for scale in (int(s) for s in args.scales.split(",")):
            root = os.path.join(top, f"x{scale}")
            os.makedirs(root)
            rows.append({"scale": f"{scale}x", **measure(root, base * scale, args.imgs_per_shard, ckpt)})
            shutil.rmtree(root)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    first = rows[0]
    for r in rows:
        r["x 1x (slowest)"] = max(r[f"{k} s"] / first[f"{k} s"] for k in ("plan", "dry run", "verify", "loader start"))
    times = [{k: r[k] for k in ("scale", "shards", "plan s", "dry run s", "verify s", "verify --deep s", "loader start s",
                               "apparent GB", "x 1x (slowest)")} for r in rows]  # fmt: skip
    mem = [{"scale": r["scale"], "shards": r["shards"], **{f"{k} MiB": r[f"{k} MiB"] for k in
            ("plan", "dry run", "verify", "verify --deep", "loader start")}} for r in rows]  # fmt: skip
    setup = [
        f"1x = {base} shards: ImageNet-1k from ViT-B/16 (1 layer, 197 tokens, d=768) at the default shard size; "
        f"here {args.imgs_per_shard} images (2.4 MB) per shard, sparse files (4 KiB of values each, the rest a hole).",
        "Each command in a fresh process, wall seconds from start to exit (imports included) and its own peak "
        "resident memory (GNU time's %M). dry run = snakemake -n over one dump job per shard; loader start = "
        "a ShuffledLoader (buffer 256 MiB) built and its first batch of 4,096 vectors taken, timed in the process "
        "after its imports (the whole process: below).",
        f"One run per scale. 1-minute load average at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores.",
    ]
    last = rows[-1]
    notes = [
        f"from {first['shards']:,} to {last['shards']:,} shards ({last['shards'] // first['shards']}x): plan "
        f"{last['plan s'] / first['plan s']:.2f}x, dry run {last['dry run s'] / first['dry run s']:.2f}x, verify "
        f"{last['verify s'] / first['verify s']:.2f}x, loader start {last['loader start s'] / first['loader start s']:.2f}x "
        "the time",
        f"a loader's whole process (imports, start, first batch, exit) takes {first['loader process s']:.1f} s at "
        f"{first['scale']} and {last['loader process s']:.1f} s at {last['scale']}",
        f"verify --deep reads every byte: {last['verify --deep s'] / first['verify --deep s']:.1f}x the time for "
        f"{last['apparent GB'] / first['apparent GB']:.0f}x the bytes",
    ]
    body = benchlib.section_body(setup, [benchlib.table(times), benchlib.table(mem)], notes)
    print(body)
    if not args.no_record:
        benchlib.record("scaling", "Scaling: plan, dry run, verify, loader start at 1x, 10x, 100x shards", body)


if __name__ == "__main__":
    main()
