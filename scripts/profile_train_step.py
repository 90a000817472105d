#!/usr/bin/env python
"""Profile SAE training steps per variant (decode-precision): steps/s and the top operators.

    python scripts/profile_train_step.py [--device cuda] [--variants sparse-bf16,hybrid-bf16] [--steps 10]

One TopK SAE (d=768, width 12,288, k=32 by default; batch 16,384 on CUDA, 1,024 on the CPU) steps
with optim.train_step on one random batch: a few untimed warm-up steps, then ``--steps`` steps
timed and recorded by torch.profiler. Prints, per variant, steps/s (the timing includes the
profiler's overhead) and a table of the ``--rows`` operators with the most device time (self
CPU time on the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from actcache.sae.config import expand_train_section  # noqa: E402
from actcache.sae.modeling import SAE  # noqa: E402
from actcache.sae.objectives import make_objective  # noqa: E402
from actcache.sae.optim import make_optimizer, train_step  # noqa: E402

DEFAULT_VARIANTS = "sparse-bf16,hybrid-bf16,auto-bf16,dense-bf16,hybrid-tf32"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile_variant(x_BD: torch.Tensor, args, variant: str) -> None:
    decode, precision = variant.split("-")
    section = {"batch_size": x_BD.shape[0], "steps": 1, "exp_factor": args.exp_factor, "k": args.k, "lr": 1e-3,
               "decode": decode, "precision": precision, "eval_frac": 0.0}  # fmt: skip
    run = expand_train_section(section, "profile")[0]
    sae = SAE(run.sae_config(x_BD.shape[1])).to(x_BD.device).set_compute(run.decode, run.precision)
    obj, opt = make_objective(sae, dead_tokens_threshold=run.dead_tokens), make_optimizer(sae, lr=1e-3)
    sae.init_b_dec(x_BD[:4096])
    for _ in range(args.warmup):
        train_step(sae, obj, opt, x_BD, max_grad_norm=1.0)
    sync(args.device)
    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            train_step(sae, obj, opt, x_BD, max_grad_norm=1.0)
        sync(args.device)
        dt = (time.perf_counter() - t0) / args.steps
    print(f"=== {variant} (decode resolved to {sae.decode_mode}): {1 / dt:.1f} steps/s, {dt * 1e3:.2f} ms/step",
          flush=True)  # fmt: skip
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=48), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated decode-precision pairs")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--exp-factor", type=float, default=16)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=None, help="default: 16384 on CUDA, 1024 on the CPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rows", type=int, default=12)
    args = p.parse_args()
    batch = args.batch or (16384 if args.device.startswith("cuda") else 1024)
    x_BD = torch.randn(batch, args.d, generator=torch.Generator().manual_seed(0)).to(args.device)
    for variant in [v for v in args.variants.split(",") if v]:
        try:  # one failing variant leaves the others profiled
            profile_variant(x_BD, args, variant)
        except Exception as err:  # noqa: BLE001
            print(f"=== {variant}: FAILED {type(err).__name__}: {err}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
