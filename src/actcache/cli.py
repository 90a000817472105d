"""`actcache ...` command line. The Snakemake rules call these, so every step can be run by hand.

Every subcommand's handler lives in the module that does the work and is imported only when that
subcommand runs (so `actcache hash` does not import torch). A user error (ActCacheError) prints
its message and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import warnings

from actcache.errors import ActCacheError

# subcommand -> "module:function"; the function takes the parsed args and returns an exit code.
HANDLERS = {
    "hash": "actcache.cli:cmd_hash",
    "inspect": "actcache.cli:cmd_inspect",
    "verify": "actcache.cli:cmd_verify",
    "gather": "actcache.cli:cmd_gather",
    "plan": "actcache.plan:cli_plan",
    "dump": "actcache.dump:cli_dump",
    "train": "actcache.sae.train:cli_train",
    "visuals": "actcache.visuals:cli_visuals",
    "demo-cache": "actcache.cli:cmd_demo_cache",
    "demo-assets": "actcache.demo:cli_demo_assets",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actcache", description="Cache ViT activations and train SAEs on them.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("hash", help="print the 64-hex content hash of a metadata.json")
    s.add_argument("metadata", help="path to metadata.json (or a cache directory)")

    s = sub.add_parser("inspect", help="metadata, shard table, sizes and validation verdict of a cache")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("verify", help="exit 0 only when the cache is complete and consistent")
    s.add_argument("dir")
    s.add_argument("--deep", action="store_true", help="also read every byte once and count NaN/Inf")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("gather", help="verify every shard of a hash directory and write shards.json")
    s.add_argument("dir")

    s = sub.add_parser("plan", help="per experiment: hash, directory, cache status, training outputs")
    s.add_argument("--config", default="config/config.yaml", help="workflow config (default: %(default)s)")
    s.add_argument("--experiment", action="append", default=[], help="plan only this experiment YAML (repeatable)")
    s.add_argument("--dump-to", help="override dump_to")
    s.add_argument("--runs-to", help="override runs_to")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("dump", help="compute and write shards A..B-1 of an experiment's cache")
    s.add_argument("--experiment", required=True, help="experiment YAML")
    s.add_argument("--shards", default=None, help="shard range A:B (default: all)")
    s.add_argument("--dump-to", help="override the experiment's dump_to root")
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    s.add_argument("--batch-size", type=int, default=None, help="override the dump batch size")
    s.add_argument("--workers", type=int, default=None, help="override the image decoding workers")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")

    s = sub.add_parser("train", help="train the experiment's SAE sweep on its cache")
    s.add_argument("--experiment", required=True)
    s.add_argument("--dump-to")
    s.add_argument("--runs-to")
    s.add_argument("--group", default=None, help="train only this group of SAEs (see `actcache plan`)")
    s.add_argument("--device", default=None)

    s = sub.add_parser("visuals", help="top-activating patches per latent, plots and an HTML page")
    s.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="SAE run directory <runs_to>/<HASH>/<sae-id>/, or a directory holding runs (a sweep)",
    )
    s.add_argument("--top-k", type=int, default=16, help="top images kept per latent (default: %(default)s)")
    s.add_argument("--latents", type=int, default=128, help="latent cards on the page (default: %(default)s)")
    s.add_argument(
        "--select",
        choices=("spread", "frequent", "rare", "strongest"),
        default="spread",
        help="which latents get a card: spread over the frequency range (default), the most "
        "frequent, the rarest, or the largest max activation",
    )
    s.add_argument("--latent-ids", default=None, help="comma-separated latent ids to show (overrides --select)")
    s.add_argument("--cache", default=None, help="cache directory to use instead of the one in run.json")
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    s.add_argument("--batch-images", type=int, default=None, help="images per batch (default: automatic)")
    s.add_argument("--no-images", action="store_true", help="no image dataset: heatmaps without images")
    s.add_argument(
        "--reuse",
        action="store_true",
        help="reuse visuals/latents.npz when it was computed for the same weights and cache",
    )
    s.add_argument(
        "--plots-only",
        action="store_true",
        help="only the training curves and the NMSE-L0 plot (no pass over the cache)",
    )
    s.add_argument("--out", default=None, help="folder for the sweep plots (default: <common parent>/visuals)")

    s = sub.add_parser("demo-assets", help="write the offline demo's tiny random ViT and image folder")
    s.add_argument("--root", default="data/demo")

    s = sub.add_parser("demo-cache", help="write a small cache of synthetic activations (no model)")
    s.add_argument("--dump-to", default="data/demo-synthetic")
    s.add_argument("--n-imgs", type=int, default=200)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    warnings.simplefilter("default")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}\n"
    target = HANDLERS[args.command]
    mod_name, fn_name = target.split(":")
    try:
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except ModuleNotFoundError as err:
            if err.name == mod_name:
                print(f"actcache {args.command}: not implemented in this version.", file=sys.stderr)
                return 3
            raise
        return int(fn(args) or 0)
    except ActCacheError as err:
        print(f"actcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"actcache {args.command}: interrupted", file=sys.stderr)
        return 130


# ---- cache information commands -------------------------------------------------------------


def cmd_hash(args) -> int:
    from actcache.protocol import Metadata

    print(Metadata.load(args.metadata).hash)
    return 0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _report_dict(rep) -> dict:
    md = rep.metadata
    return {
        "path": os.path.abspath(rep.path),
        "ok": rep.ok,
        "hash": md.hash if md else None,
        "metadata": md.to_dict() if md else None,
        "derived": None
        if md is None
        else {
            "n_tokens_per_img": md.n_tokens_per_img,
            "n_imgs_per_shard": md.n_imgs_per_shard,
            "n_shards": md.n_shards,
            "shard_shape": list(md.shard_shape),
            "bytes_per_img": md.bytes_per_img,
            "total_bytes": md.n_imgs * md.bytes_per_img,
        },
        "shards": [
            {"name": s.name, "n_imgs": s.n_imgs, "size": s.size, "padded": s.padded, "n_nonfinite": s.n_nonfinite}
            for s in rep.shards
        ],
        "problems": rep.problems,
        "warnings": rep.warnings,
        "deep": rep.deep,
        "n_nonfinite": rep.n_nonfinite,
    }


def _print_report(rep, show_shards: bool) -> None:
    md = rep.metadata
    print(f"cache     {os.path.abspath(rep.path)}")
    if md is not None:
        print(f"hash      {md.hash}")
        print(f"model     {md.vit_family} {md.vit_ckpt}")
        print(f"layers    {list(md.layers)}")
        print(
            f"tokens    {md.n_tokens_per_img} per image ({'CLS + ' if md.cls_token else ''}"
            f"{md.n_patches_per_img} patches), d_vit {md.d_vit}, {md.dtype}"
        )
        print(
            f"images    {md.n_imgs:,} in {md.n_shards} shard(s) of {md.n_imgs_per_shard:,} (max_patches_per_shard {md.max_patches_per_shard:,})"
        )
        print(
            f"size      {_fmt_bytes(md.n_imgs * md.bytes_per_img)} of activations ({_fmt_bytes(md.bytes_per_img)} per image)"
        )
        print(f"data      {json.dumps(md.data, sort_keys=True)}")
        print(f"protocol  {md.protocol}")
    if show_shards and rep.shards:
        print("shards")
        for s in rep.shards:
            size = "missing" if s.size is None else _fmt_bytes(s.size)
            extra = " (zero-padded to full size)" if s.padded else ""
            bad = f", {s.n_nonfinite} NaN/Inf" if s.n_nonfinite else ""
            print(f"  {s.name}  {s.n_imgs:>8,} images  {size:>10}{extra}{bad}")
    for w in rep.warnings:
        print(f"warning: {w}")
    if rep.deep and rep.ok:
        print(f"deep      read {_fmt_bytes(rep.bytes_read)}, {rep.n_nonfinite} NaN/Inf values")
    if rep.ok:
        print("verdict   OK: complete and consistent")
    else:
        print(f"verdict   INVALID ({len(rep.problems)} problem(s)):")
        for prob in rep.problems:
            print(f"  - {prob}")


def cmd_inspect(args) -> int:
    from actcache.validate import check_dir

    rep = check_dir(args.dir)
    if args.json:
        print(json.dumps(_report_dict(rep), indent=2))
    else:
        _print_report(rep, show_shards=True)
    return 0 if rep.ok else 1


def cmd_verify(args) -> int:
    from actcache.validate import check_dir

    rep = check_dir(args.dir, deep=args.deep)
    if args.json:
        print(json.dumps(_report_dict(rep), indent=2))
    else:
        _print_report(rep, show_shards=False)
    return 0 if rep.ok else 1


def cmd_gather(args) -> int:
    from actcache.writer import gather

    path = gather(args.dir)
    print(f"wrote {path}")
    return 0


def cmd_demo_cache(args) -> int:
    from actcache.writer import synthetic_fill, synthetic_metadata, write_cache

    md = synthetic_metadata(args.n_imgs, layers=(4, 10), max_patches_per_shard=17 * 2 * 64)
    path = write_cache(args.dump_to, md, synthetic_fill(md))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
