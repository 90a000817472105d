"""`actcache ...` command line: the top of the house. The Snakemake rules call these commands, so
every step can be run by hand (`python -m actcache.cli` works too; torchrun uses it).

This package parses the arguments; each subcommand's handler lives in a module of its own here
(cache, plan, dump, train, visuals, eval, demo), imported only when that subcommand runs, so `actcache
hash` does not import torch. A handler turns the parsed arguments into typed calls of the
library; no library module imports this package. A user error (ActCacheError) prints its message
and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

from actcache.errors import EXIT_RETRY, EXIT_USER, TRANSIENT_ERRNOS, ActCacheError, os_error_text

# subcommand -> "module:function"; the function takes the parsed args and returns an exit code.
HANDLERS = {
    "hash": "actcache.cli.cache:cmd_hash",
    "inspect": "actcache.cli.cache:cmd_inspect",
    "verify": "actcache.cli.cache:cmd_verify",
    "gather": "actcache.cli.cache:cmd_gather",
    "convert": "actcache.cli.cache:cmd_convert",
    "seal": "actcache.cli.cache:cmd_seal",
    "plan": "actcache.cli.plan:cmd_plan",
    "dump": "actcache.cli.dump:cmd_dump",
    "train": "actcache.cli.train:cmd_train",
    "visuals": "actcache.cli.visuals:cmd_visuals",
    "serve": "actcache.cli.serve:cmd_serve",
    "eval": "actcache.cli.eval:cmd_eval",
    "demo-cache": "actcache.cli.cache:cmd_demo_cache",
    "demo-assets": "actcache.cli.demo:cmd_demo_assets",
    "export": "actcache.cli.export:cmd_export",
    "import": "actcache.cli.export:cmd_import",
}


def build_parser() -> argparse.ArgumentParser:
    from actcache import __version__
    from actcache.protocol import DTYPES, FAMILIES

    p = argparse.ArgumentParser(prog="actcache", description="Cache ViT activations and train SAEs on them.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.add_argument("--version", action="version", version=f"actcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("hash", help="print the 64-hex content hash of a metadata.json")
    s.add_argument("metadata", help="path to metadata.json (or a cache directory)")

    s = sub.add_parser("inspect", help="metadata, shard table, sizes and validation verdict of a cache")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("verify", help="exit 0 only when the cache is complete and consistent")
    s.add_argument("dir")
    s.add_argument(
        "--deep", action="store_true", help="also read every byte once: NaN/Inf, zeroed and copied shards, checksums"
    )
    s.add_argument("--checksums", default=None, help="the checksum records' directory (default: DIR/.checksums)")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("seal", help="verify every byte of a cache, then add checksums to shards that have none")
    s.add_argument("dir")
    s.add_argument("--to", default=None, help="write the records here (required for a saev cache)")

    s = sub.add_parser("gather", help="verify every shard of a hash directory and write shards.json")
    s.add_argument("dir")

    s = sub.add_parser("convert", help="write a cache as another dtype or format: a new hash directory, verified")
    s.add_argument("dir", help="the cache to convert (actcache's, or a saev 2.1 cache)")
    s.add_argument("--dtype", default=None, choices=DTYPES,
                   help="float32 (protocol 1) or float16 / bfloat16 (2.0); a saev cache's default: float32")  # fmt: skip
    s.add_argument("--to-format", default="v1", choices=("v1", "saev"),
                   help="v1: actcache's protocol (default); saev: saev 2.1, written to ROOT/saev/shards/<h>/")  # fmt: skip
    s.add_argument("--to", required=True, metavar="ROOT", help="root the new <HASH>/ directory is written under")
    s.add_argument("--allow-rounded", action="store_true",
                   help="convert a 16-bit cache (its rounded values get the hash of a cache of exact ones)")  # fmt: skip

    s = sub.add_parser("plan", help="per experiment: hash, directory, cache status, training outputs")
    s.add_argument("--config", default="config/config.yaml", help="workflow config (default: %(default)s)")
    s.add_argument("--experiment", action="append", default=[], help="plan only this experiment YAML (repeatable)")
    s.add_argument("--dump-to", help="override dump_to")
    s.add_argument("--runs-to", help="override runs_to")
    s.add_argument("--json", action="store_true")
    s.add_argument("--relist", action="store_true", help="list image folders again, ignoring stored listings")
    s.add_argument(
        "--failures", action="store_true", help="the failed jobs of the last workflow run here, with their logs' tails"
    )

    s = sub.add_parser("dump", help="compute and write shards A..B-1 of an experiment's cache")
    s.add_argument("--experiment", required=True, help="experiment YAML")
    s.add_argument("--shards", default=None, help="shard range A:B (default: all)")
    s.add_argument("--dump-to", help="override the experiment's dump_to root")
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    s.add_argument("--batch-size", type=int, default=None, help="override the dump batch size")
    s.add_argument("--workers", type=int, default=None, help="override the image decoding workers")
    s.add_argument("--no-progress", action="store_true", help="no progress bar: a log line every 10 s instead")
    s.add_argument("--no-space-check", action="store_true",
                   help="start even where the free space looks too small (a compressing filesystem)")  # fmt: skip

    s = sub.add_parser("train", help="train the experiment's SAE sweep on its cache, or a train: file on any cache")
    s.add_argument("--experiment", help="experiment YAML (its cache is found from dump_to)")
    s.add_argument("--cache", help="instead: train on this existing cache directory (v1 or saev 2.1)")
    s.add_argument("--train", help="with --cache: an experiment YAML or a file holding only train:")
    s.add_argument("--dump-to")
    s.add_argument("--runs-to")
    s.add_argument("--group", default=None, help="train only this group of SAEs (see `actcache plan`)")
    s.add_argument("--device", default=None)
    s.add_argument("--wait-for-lock", action="store_true",
                   help="when another train owns a run of the group, wait for it to end (default: exit 2 naming it)")  # fmt: skip

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
    s.add_argument("--no-explorer", action="store_true",
                   help="no visuals/explorer/ (every latent's data) and none of its statistics: a faster pass; "
                   "only the page's cards are then reachable")  # fmt: skip

    s = sub.add_parser("serve", help="serve the explorers and pages under a folder over local HTTP (read-only)")
    s.add_argument("runs_dir", metavar="RUNS_DIR", help="the folder holding SAE runs (runs_to)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s; 0 picks a free one)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")

    s = sub.add_parser("eval", help="spliced-in downstream metrics of trained SAEs, into their eval.json")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="SAE run directory, or a directory holding runs")
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    s.add_argument("--batch-images", type=int, default=32, help="images per forward pass (default: %(default)s)")
    s.add_argument("--max-images", type=int, default=None, help="at most this many held-out images (a seeded subset)")
    s.add_argument("--no-images", action="store_true",
                   help="no image dataset (gone, or a saev cache): only the held-out statistics, no spliced metrics")  # fmt: skip
    s.add_argument("--missing", action="store_true", help="only SAEs whose eval.json has no spliced metrics yet")

    s = sub.add_parser("demo-assets", help="write the offline demo's tiny random ViT and image folder")
    s.add_argument("--root", default="data/demo")
    s.add_argument("--family", default="clip", choices=FAMILIES, help="ViT family (default: %(default)s)")

    s = sub.add_parser("export", help="write SAELens folders (weights, cfg.json, model card) of trained SAEs")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished SAE run directories, or directories holding them")
    s.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "OUT"), help="saelens OUT: one folder per SAE")
    s.add_argument("--push", metavar="REPO_ID",
                   help="also upload every exported SAE to this Hugging Face Hub repo, one folder per SAE id")  # fmt: skip
    s.add_argument("--n-blocks", type=int, default=None,
                   help="the model's number of blocks, for a layer counted from the end whose model config is not readable")  # fmt: skip
    s.add_argument("--dataset", default=None, metavar="HUB_ID", help="Hub dataset id of the images, for the model card")

    s = sub.add_parser("import", help="an SAE trained elsewhere (saev sae.pt, SAELens folder) as a run on a cache")
    s.add_argument("source", metavar="FILE_OR_DIR", help="saev's sae.pt, or a SAELens folder (cfg.json + weights)")
    s.add_argument("--cache", required=True, help="the cache to evaluate it on (its d, layer and tokens must match)")
    s.add_argument("--runs-to", required=True, help="root of the run directories (<runs-to>/<HASH>/<sae-id>/)")
    s.add_argument("--layer", type=int, default=None, help="the recorded cache layer it reads (default: its hook)")
    s.add_argument("--patches", choices=("cls", "image", "all"), default=None, help="its token set (default: image)")
    s.add_argument("--eval-frac", type=float, default=None, help="held-out fraction, as the runs it is ranked with")
    s.add_argument("--device", default="cpu")

    s = sub.add_parser("demo-cache", help="write a small cache of synthetic activations (no model)")
    s.add_argument("--dump-to", default="data/demo-synthetic")
    s.add_argument("--n-imgs", type=int, default=200)
    return p


def one_line(text: str) -> str:
    """A message on one line: its lines joined by spaces; other control characters (from a
    damaged file's keys or names) escaped."""
    joined = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in joined)


def os_error_line(err: OSError) -> str:
    """One line for an OSError: the file(s), the cause and what to check."""
    names = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None) or "a file"
    return f"{names}: {os_error_text(err)}; check that path, its permissions and the filesystem."


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
        print(f"actcache {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return err.exit_status
    except OSError as err:  # the filesystem refused something the library did not expect to fail
        print(f"actcache {args.command}: error: {one_line(os_error_line(err))}", file=sys.stderr)
        return EXIT_RETRY if err.errno in TRANSIENT_ERRNOS else EXIT_USER
    except KeyboardInterrupt:
        print(f"actcache {args.command}: interrupted", file=sys.stderr)
        return 130
