#!/usr/bin/env python
"""Benchmark SAE training through the real loader: 1 and 8 SAEs per loader pass, on the CPU (or --device cuda).

    python scripts/bench_train.py [--d 128] [--exp-factor 8] [--k 32] [--batch 2048] [--steps 60]

Writes a synthetic cache (bench-out/train/), then per configuration runs ``train_group`` (the
ShuffledLoader feeding N TopK SAEs that share each batch) and reads its metrics.jsonl: steps/s,
examples/s, SAE-steps/s and the loader's wait time as a share of the wall time (the first
logging window, with the loader's start-up, is left out). The reference, measured in the same
run, is the same N SAEs stepping on batches already in memory (no loader): "vs in-memory" is the
ratio of the two step rates; when compute is the bottleneck the loader should cost <= 5%.
Records section "train" of BENCHMARKS.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

from actcache.rundir import run_dir  # noqa: E402
from actcache.sae import make_objective, make_optimizer  # noqa: E402
from actcache.sae.config import expand_train_section  # noqa: E402
from actcache.sae.modeling import SAE  # noqa: E402
from actcache.sae.optim import train_step  # noqa: E402
from actcache.sae.train import train_group  # noqa: E402
from actcache.writer import synthetic_metadata, write_cache  # noqa: E402


def make_cache(root: str, d: int, n_imgs: int) -> str:
    md = synthetic_metadata(n_imgs, layers=(-2,), n_patches_per_img=196, d_vit=d, seed=0,
                            max_patches_per_shard=1024 * 197)  # fmt: skip

    def fill(a, b):
        rng = np.random.default_rng(a)
        return rng.standard_normal((b - a, 1, md.n_tokens_per_img, d), dtype=np.float32)

    path = os.path.join(root, md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path
    return write_cache(root, md, fill)


def train_section(args, n_saes: int) -> dict:
    return {"batch_size": args.batch, "steps": args.steps, "exp_factor": args.exp_factor, "k": args.k,
            "log_every": args.log_every, "ckpt_every": 10**9, "eval_frac": 0.0, "lr": 1e-3,
            "sweep": {"seed": list(range(n_saes))}}  # fmt: skip


def loader_run(cache: str, args, n_saes: int, out: str) -> dict:
    runs = expand_train_section(train_section(args, n_saes), "bench")
    t0 = time.perf_counter()
    train_group(cache, runs, out, device=args.device)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in open(os.path.join(run_dir(out, os.path.basename(cache), runs[0]), "metrics.jsonl"))]
    steady = lines[1:]  # the first window includes the loader's start-up
    dt = sum(x["step_s"] * args.log_every for x in steady)
    wait = sum(x["wait_s"] for x in steady)
    n = len(steady) * args.log_every
    return {"steps_per_s": n / dt, "wait_share": wait / dt, "wall_s": wall}


def memory_run(cache: str, args, n_saes: int) -> float:
    """Steps/s of the same SAEs on in-memory batches (the reference)."""
    from actcache.cache import ActivationCache

    c = ActivationCache.open(cache)
    imgs = np.arange(min(c.n_imgs, args.batch // 196 + 2))
    x = torch.from_numpy(c[imgs, -2][:, 1:])  # patch tokens, as patches="image"
    x = x.reshape(-1, x.shape[-1])[: args.batch].contiguous().to(args.device)
    runs = expand_train_section(train_section(args, n_saes), "bench")
    saes = [SAE(r.sae_config(x.shape[1])).to(args.device) for r in runs]
    objs = [make_objective(s, dead_tokens_threshold=r.dead_tokens) for s, r in zip(saes, runs, strict=True)]
    opts = [make_optimizer(s, lr=1e-3) for s in saes]
    for s in saes:
        s.init_b_dec(x)

    def step():
        for s, o, opt in zip(saes, objs, opts, strict=True):
            train_step(s, o, opt, x, max_grad_norm=1.0)

    sync = benchlib.Device(args.device).sync
    for _ in range(3):
        step()
    n = max(5, args.steps - args.log_every)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return n / (time.perf_counter() - t0)


def render(setup: list[str], rows: list[dict]) -> tuple[str, list[benchlib.Check]]:
    """The section's body and its check: the loader costs at most 5% of the in-memory step rate."""
    worst = min(rows, key=lambda r: r["vs in-memory"])
    check = benchlib.check(
        "training through the loader >= 0.95 x in-memory steps/s (every SAE count)",
        worst["vs in-memory"],
        0.95,
        f"x in-memory at {worst['SAEs per pass']} SAE(s)",
    )
    wait = max(r["loader wait share"] for r in rows)
    notes = [check.bullet(), f"the trainer waits for the loader at most {wait:.1%} of the wall time"]
    return benchlib.section_body(setup, [benchlib.table(rows)], notes), [check]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (section train-cuda; its defaults: "
                   "--d 768 --exp-factor 16 --batch 16384 --steps 100 --n-imgs 4096)")  # fmt: skip
    p.add_argument("--d", type=int, default=None, help="default 128")
    p.add_argument("--exp-factor", type=float, default=None, help="default 8")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=None, help="default 2048")
    p.add_argument("--steps", type=int, default=None, help="default 60")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--n-imgs", type=int, default=None, help="default 2048")
    p.add_argument("--saes", default="1,8")
    p.add_argument("--repeats", type=int, default=3, help="measurements per configuration (best kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "train"))
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    dev = benchlib.Device(args.device)
    defaults = dict(d=768, exp_factor=16, batch=16384, steps=100, n_imgs=4096) if dev.cuda else \
        dict(d=128, exp_factor=8, batch=2048, steps=60, n_imgs=2048)  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    cache = make_cache(args.out, args.d, args.n_imgs)
    rows, load0 = [], os.getloadavg()[0]
    for n in [int(s) for s in args.saes.split(",")]:
        tries, refs = [], []
        for _ in range(args.repeats):  # alternate the two; keep the best of each (other jobs add noise)
            runs_to = tempfile.mkdtemp(prefix="runs-", dir=args.out)
            try:
                tries.append(loader_run(cache, args, n, runs_to))
            finally:
                shutil.rmtree(runs_to, ignore_errors=True)
            refs.append(memory_run(cache, args, n))
        got, ref = max(tries, key=lambda t: t["steps_per_s"]), max(refs)
        rows.append({
            "SAEs per pass": n, "steps/s": got["steps_per_s"], "examples/s": got["steps_per_s"] * args.batch,
            "SAE-steps/s": got["steps_per_s"] * n, "loader wait share": got["wait_share"],
            "in-memory steps/s": ref, "vs in-memory": got["steps_per_s"] / ref,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    width = int(args.d * args.exp_factor)
    setup = [
        f"TopK SAEs (d={args.d}, width {width}, k={args.k}) on {dev.words} (torch threads: "
        f"{torch.get_num_threads()}), batch {args.batch}, {args.steps} steps, best of {args.repeats}.",
        f"Fed by the ShuffledLoader from a {args.n_imgs}-image synthetic cache (warm); all SAEs of a pass share "
        "each batch. 'vs in-memory': the same SAEs stepping on a batch already in memory.",
        f"Load average (1 min) at start / end: {load0:.1f} / {os.getloadavg()[0]:.1f}.",
    ]
    body, checks = render(setup, rows)
    print(body)
    if not args.no_record:
        benchlib.record(*dev.section("train", "SAE training (scripts/bench_train.py)"), body, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
