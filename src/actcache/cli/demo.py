"""`actcache demo-assets [--root DIR] [--family F]`: a tiny random ViT of one family and an image folder."""

from __future__ import annotations

from actcache.demo import make_demo_assets


def cmd_demo_assets(args) -> int:
    for k, v in make_demo_assets(args.root, args.family).items():
        print(f"{k}: {v}")
    return 0
