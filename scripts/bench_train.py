#!/usr/bin/env python
"""Benchmark SAE training: 1 and 8 TopK SAEs per pass, dense/sparse decoding x fp32/tf32/bf16.

    python scripts/bench_train.py [--device cuda] [--quick] [--saes 1,8] [--json out.json] [--no-record]

Two measurements per (SAEs per pass, variant), all variants alternating within each round so
that other jobs on the machine shift them alike (the best round is kept):
- in memory: the SAEs step on one batch already on the device (optim.train_step), so the rate
  is the SAE compute alone;
- through the loader (``--loader-variants``): ``train_group`` fed by the ShuffledLoader from a
  synthetic cache (written once under --out), read back from metrics.jsonl without its first
  window (start-up): steps/s and the loader wait share (time the trainer waited for data / wall).
Variant suffixes: ``+stack`` (passes of 2+ SAEs: stepped as one batched module, batch_saes: on;
column "x one by one"), ``+compile`` (1 SAE: its forward under torch.compile; the warm-up compiles).
SAE-steps/s = steps/s x SAEs per pass; tokens/s = steps/s x batch. ``--quick`` is the issue's
configuration (d=768, width 12,288, k=32; batch 16,384 on a GPU, 4,096 on the CPU) sized for a
few minutes. Records section "train" (or "train-cuda") of BENCHMARKS.md unless --no-record.
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
from actcache.sae.batched import BatchedSAEs  # noqa: E402
from actcache.sae.config import expand_train_section  # noqa: E402
from actcache.sae.modeling import SAE  # noqa: E402
from actcache.sae.optim import train_step  # noqa: E402
from actcache.sae.train import train_group  # noqa: E402
from actcache.writer import synthetic_metadata, write_cache  # noqa: E402

ALL_VARIANTS = "dense-fp32,sparse-fp32,sparse-tf32,sparse-bf16,hybrid-tf32,hybrid-bf16,dense-bf16"
# Variants of sparse decoding: "hybrid" forms the weight gradients by dense matmuls (see choose_decode).
SPARSE_FAMILY = ("sparse", "hybrid")
STACKED = "+stack"  # variant suffix: the SAEs of a pass step as one batched module (batch_saes: on)
COMPILED = "+compile"  # variant suffix: each SAE's forward under torch.compile (the warm-up steps compile)
SIZES = {  # (cuda?, quick?) -> defaults
    (True, True): dict(d=768, exp_factor=16, batch=16384, steps=20, loader_steps=60, n_imgs=1024, repeats=1,
                       saes="1,8", variants=ALL_VARIANTS + ",hybrid-bf16+compile,dense-fp32+compile",
                       loader_variants="hybrid-bf16,dense-fp32", warmup=3, stacked_variants="hybrid-bf16,dense-fp32"),
    (True, False): dict(d=768, exp_factor=16, batch=16384, steps=50, loader_steps=200, n_imgs=2048, repeats=3,
                        saes="1,8", variants=ALL_VARIANTS, loader_variants=ALL_VARIANTS, warmup=3,
                        stacked_variants="hybrid-bf16,sparse-bf16,dense-fp32"),
    (False, True): dict(d=768, exp_factor=16, batch=4096, steps=2, loader_steps=0, n_imgs=64, repeats=2,
                        saes="1", variants="dense-fp32,sparse-fp32,sparse-bf16", loader_variants="", warmup=1,
                        stacked_variants=""),
    (False, False): dict(d=128, exp_factor=8, batch=2048, steps=30, loader_steps=60, n_imgs=2048, repeats=3,
                         saes="1,8", variants=ALL_VARIANTS, loader_variants="dense-fp32,sparse-fp32", warmup=2,
                         stacked_variants="dense-fp32,sparse-fp32"),
}  # fmt: skip


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


def train_section(args, n_saes: int, variant: str, steps: int) -> dict:
    decode, precision = variant.split("-")
    return {"batch_size": args.batch, "steps": steps, "exp_factor": args.exp_factor, "k": args.k,
            "log_every": args.log_every, "ckpt_every": 10**9, "eval_frac": 0.0, "lr": 1e-3, "decode": decode,
            "precision": precision, "sweep": {"seed": list(range(n_saes))}}  # fmt: skip


def loader_run(cache: str, args, n_saes: int, variant: str) -> dict:
    runs = expand_train_section(train_section(args, n_saes, variant, args.loader_steps), "bench")
    out = tempfile.mkdtemp(prefix="runs-", dir=args.out)
    try:
        train_group(cache, runs, out, device=args.device)
        path = os.path.join(run_dir(out, os.path.basename(cache), runs[0]), "metrics.jsonl")
        steady = [json.loads(x) for x in open(path)][1:]  # the first window includes the start-up
    finally:
        shutil.rmtree(out, ignore_errors=True)
    dt = sum(x["step_s"] * args.log_every for x in steady)
    return {"steps_per_s": len(steady) * args.log_every / dt, "wait_share": sum(x["wait_s"] for x in steady) / dt}


def memory_rate(x_BD: torch.Tensor, args, n_saes: int, variant: str, dev) -> float:
    """Steps/s of ``n_saes`` SAEs stepping on ``x_BD`` (already on the device); a variant ending
    in STACKED steps them as one batched module (actcache.sae.batched), otherwise one by one."""
    compiled = variant.endswith(COMPILED)
    variant = variant.removesuffix(COMPILED)
    stacked = variant.endswith(STACKED)
    variant = variant.removesuffix(STACKED)
    runs = expand_train_section(train_section(args, n_saes, variant, 1), "bench")
    saes = [SAE(r.sae_config(x_BD.shape[1])).to(x_BD.device).set_compute(r.decode, r.precision) for r in runs]
    objs = [make_objective(s, dead_tokens_threshold=r.dead_tokens) for s, r in zip(saes, runs, strict=True)]
    opts = [make_optimizer(s, lr=1e-3) for s in saes]
    for s in saes:
        s.init_b_dec(x_BD[:4096])
        if compiled:
            s.compile()  # torch.compile of the SAE's forward (the objective's bookkeeping stays eager)

    stack = BatchedSAEs(saes, opts) if stacked else None

    def step():
        if stack is not None:
            return stack.step(objs, x_BD, lr=1e-3, sparsity_scales=[1.0] * n_saes, max_grad_norm=1.0)
        for s, o, opt in zip(saes, objs, opts, strict=True):
            train_step(s, o, opt, x_BD, max_grad_norm=1.0)

    for _ in range(args.warmup):
        step()
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dev.sync()
    return args.steps / (time.perf_counter() - t0)


def batch_from(cache: str, args) -> torch.Tensor:
    from actcache.cache import ActivationCache

    c = ActivationCache.open(cache)
    imgs = np.arange(min(c.n_imgs, args.batch // 196 + 2))
    x = torch.from_numpy(np.ascontiguousarray(c[imgs, -2][:, 1:]))  # patch tokens, as patches="image"
    x = x.reshape(-1, x.shape[-1])
    x = x.repeat(-(-args.batch // x.shape[0]), 1)[: args.batch]
    return x.contiguous().to(args.device)


def measure(cache: str, args, dev) -> list[dict]:
    x_BD = batch_from(cache, args)
    variants = [v for v in args.variants.split(",") if v]
    loader_variants = [v for v in args.loader_variants.split(",") if v and args.loader_steps > 0]
    rows = []
    for n in [int(s) for s in args.saes.split(",")]:
        stacked = [v + STACKED for v in args.stacked_variants.split(",") if v and n > 1]
        own = [v for v in variants if n == 1 or not v.endswith(COMPILED)]  # compile: 1 SAE per pass only
        mem = {v: [] for v in own + stacked}
        for _ in range(args.repeats):  # every variant once per round
            for v in own + stacked:
                try:  # one failing variant (say, an op missing on this build) leaves the others measured
                    mem[v].append(memory_rate(x_BD, args, n, v, dev))
                except Exception as err:  # noqa: BLE001
                    print(f"  {n} SAE(s) {v}: FAILED {type(err).__name__}: {err}", flush=True)
                    mem[v].append(float("nan"))
                print(f"  {n} SAE(s) {v}: in memory {mem[v][-1]:.3g} steps/s", flush=True)
        fed = {v: [loader_run(cache, args, n, v) for _ in range(args.repeats)] for v in loader_variants}
        base = max(mem[variants[0]]) if variants else None
        for v in dict.fromkeys(own + stacked + loader_variants):
            row = {"SAEs per pass": n, "variant": v}
            if v in mem:
                r = max(mem[v])
                row.update({"SAE-steps/s": r * n, "tokens/s": r * args.batch, f"x {variants[0]}": r / base})
            if v.endswith(STACKED) and v.removesuffix(STACKED) in mem:
                row["x one by one"] = max(mem[v]) / max(mem[v.removesuffix(STACKED)])
            if v in fed:
                best = max(fed[v], key=lambda t: t["steps_per_s"])
                row.update({"loader SAE-steps/s": best["steps_per_s"] * n,
                            "loader tokens/s": best["steps_per_s"] * args.batch,
                            "loader wait share": best["wait_share"]})  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def checks(rows: list[dict], args, dev) -> list[benchlib.Check]:
    """Issue targets: on the CPU sparse >= 1.7 x dense (fp32); on CUDA, sparse decoding (sparse or
    hybrid, the faster) in bf16 at >= 100 steps/s for one SAE, >= 90 SAE-steps/s for 8, and a loader
    wait share of at most 2%."""

    def row_rate(n, v, col):
        return next((r.get(col) for r in rows if r["SAEs per pass"] == n and r["variant"] == v), None)

    def rate(n, v, col="SAE-steps/s"):
        if v == "sparse-bf16":  # the "bf16 with sparse decoding": the best of the family
            found = [row_rate(n, f"{d}-bf16", col) for d in SPARSE_FAMILY]
            return max((r for r in found if r and r == r), default=None)
        return row_rate(n, v, col)

    out = []
    one = min(r["SAEs per pass"] for r in rows)
    if not dev.cuda and rate(one, "sparse-fp32") and rate(one, "dense-fp32"):
        ratio = rate(one, "sparse-fp32") / rate(one, "dense-fp32")
        out.append(benchlib.check(f"sparse decoding >= 1.7 x dense (fp32, batch {args.batch})", ratio, 1.7,
                                  f"x dense at {one} SAE"))  # fmt: skip
    if dev.cuda and rate(1, "sparse-bf16"):
        out.append(benchlib.check("1 SAE, sparse/hybrid bf16, batch 16,384: >= 100 steps/s", rate(1, "sparse-bf16"), 100,
                                  "steps/s"))  # fmt: skip
    if dev.cuda and rate(8, "sparse-bf16"):
        out.append(benchlib.check("8 SAEs per pass, sparse/hybrid bf16: >= 90 SAE-steps/s", rate(8, "sparse-bf16"), 90,
                                  "SAE-steps/s"))  # fmt: skip
    family = [r for r in rows if r["variant"].split("-")[0] in SPARSE_FAMILY]
    waits = [r["loader wait share"] for r in family if "loader wait share" in r]
    if dev.cuda and waits:
        out.append(benchlib.check("loader wait share <= 2% (sparse)", max(waits), 0.02, "", at_least=False))
    return out


def render(rows: list[dict], args, dev, load: tuple[float, float]) -> tuple[str, list[benchlib.Check]]:
    width = int(args.d * args.exp_factor)
    ref = args.variants.split(",")[0]
    cols = ["SAEs per pass", "variant", "SAE-steps/s", "tokens/s", f"x {ref}", "x one by one",
            "loader SAE-steps/s", "loader wait share"]  # fmt: skip
    setup = [
        f"TopK SAEs (d={args.d}, width {width}, k={args.k}, AuxK) on {dev.words}, torch threads "
        f"{torch.get_num_threads()}, batch {args.batch}; variant = decode-precision.",
        f"In memory: {args.steps} timed steps on one batch on the device, best of {args.repeats}, variants alternating.",
        f"Loader columns: train_group fed by the ShuffledLoader ({args.loader_steps} steps, warm {args.n_imgs}-image "
        "synthetic cache)." if any("loader wait share" in r for r in rows) else "No loader runs.",
        f"Load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}.",
    ]
    cks = checks(rows, args, dev)
    stacked = [f"{r['variant'].removesuffix(STACKED)} {benchlib.fmt(r['x one by one'])} x"
               for r in rows if "x one by one" in r]  # fmt: skip
    notes = []
    if stacked:
        notes.append(f"{STACKED} (batch_saes: on) against the same SAEs stepped one by one: " + ", ".join(stacked))
    rate = {(r["SAEs per pass"], r["variant"]): r.get("SAE-steps/s") for r in rows}
    compiled = [
        f"{v.removesuffix(COMPILED)} {benchlib.fmt(r / rate[n, v.removesuffix(COMPILED)])} x"
        for (n, v), r in rate.items()
        if v.endswith(COMPILED) and r and rate.get((n, v.removesuffix(COMPILED)))
    ]
    if compiled:
        notes.append(f"{COMPILED} (torch.compile of each SAE's forward) against eager, same SAEs: " + ", ".join(compiled))
    return benchlib.section_body(setup, [benchlib.table(rows, cols)], [c.bullet() for c in cks] + notes), cks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (section train-cuda)")
    p.add_argument("--quick", action="store_true", help="the issue's configuration, a few minutes")
    for name in ("d", "exp_factor", "batch", "steps", "loader_steps", "n_imgs", "repeats"):
        p.add_argument("--" + name.replace("_", "-"), type=float if name == "exp_factor" else int, default=None)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before the in-memory timing")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--saes", default=None, help="SAEs per pass, e.g. 1,8")
    p.add_argument("--variants", default=None, help=f"in-memory variants (first: the reference), e.g. {ALL_VARIANTS}")
    p.add_argument("--loader-variants", default=None, help="variants also run through the loader ('' for none)")
    p.add_argument("--stacked-variants", default=None,
                   help=f"in-memory variants also run with the SAEs of a pass stacked ({STACKED}; passes of 2+ SAEs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "train"))
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--section", default="train", help="BENCHMARKS.md section to record (CUDA: NAME-cuda)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    dev = benchlib.Device(args.device)
    for key, value in SIZES[(dev.cuda, args.quick)].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    load0 = os.getloadavg()[0]
    cache = make_cache(args.out, args.d, args.n_imgs)
    rows = measure(cache, args, dev)
    body, cks = render(rows, args, dev, (load0, os.getloadavg()[0]))
    print(body)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"device": dev.words, "args": vars(args), "rows": rows}, fh, indent=1)
    if not args.no_record:
        title = "SAE training (scripts/bench_train.py)" + ("" if args.section == "train" else f", {args.section}")
        benchlib.record(*dev.section(args.section, title), body, checks=cks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
