"""Shuffle quality of the ShuffledLoader's plan alone (no I/O): mean normalised image-index
entropy per batch, per epoch, as scripts/bench_loaders.py measures it on real batches.

    python scripts/plan_entropy.py <dump_to>/<HASH> --buffer-bytes 3200000000 --epochs 4
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_loaders import entropy  # noqa: E402  (the bench's measure, same normalisation)

from actcache.loaders import ShuffledLoader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache")
    ap.add_argument("--buffer-bytes", type=int, default=3_200_000_000)
    ap.add_argument("--batch-size", type=int, default=16384)
    ap.add_argument("--layer", default="10")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--equal", action="store_true", help="equal shares per run (the two-rate plan off)")
    args = ap.parse_args()
    if args.equal:
        from actcache.loaders.plan import EpochPlan

        EpochPlan.LATE_MAX = 0.0
    layer = args.layer if args.layer == "all" else int(args.layer)
    ld = ShuffledLoader(args.cache, args.batch_size, "image", layer, args.buffer_bytes, args.seed)
    n_imgs, per = int(ld.shard_start[-1]), ld.geom.per_img
    print("| epoch | batches | entropy | first decile | last decile | admitted after batch 0 (batches) |")
    print("|---|---|---|---|---|---|")
    for epoch in range(args.epochs):
        H, late = [], []
        for spec in ld.epoch_plan(epoch).batches():
            imgs = np.concatenate([r.img0 + ld.shard_start[r.shard] + x // per for r, x in spec.takes])
            H.append(entropy(imgs, n_imgs))
            if spec.admit and spec.index:
                late.append(spec.index)
        d = np.array_split(np.array(H), 10)
        span = f"{late[0]}-{late[-1]}" if late else "none"
        print(f"| {epoch} | {len(H)} | {np.mean(H):.4f} | {d[0].mean():.3f} | {d[-1].mean():.3f} | {span} |")


if __name__ == "__main__":
    main()
