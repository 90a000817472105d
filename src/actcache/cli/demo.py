"""`actcache demo-assets`: the offline demo's tiny random ViT and image folder."""

from __future__ import annotations

from actcache.demo import make_demo_assets


def cmd_demo_assets(args) -> int:
    for k, v in make_demo_assets(args.root).items():
        print(f"{k}: {v}")
    return 0
