"""Command-line handlers for external caches and exports, ready to be wired into `actcache`:

    actcache export RUN_DIR [RUN_DIR ...] --to saelens OUT [--push REPO_ID]
    actcache train --cache DIR --train FILE [--runs-to DIR] [--group G] [--device DEV]
    actcache demo-assets [--root DIR] [--family F]

``add_export_parser(sub)`` declares the export subcommand; ``add_train_cache_arguments(parser)``
adds --cache/--train to the train subcommand, whose handler calls ``cmd_train_cache`` when
--cache is given. Handlers return an exit code; user errors are ActCacheError (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from actcache.errors import ConfigError

EXPORT_FORMATS = ("saelens",)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


def add_export_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("export", help="write SAELens folders (weights, cfg.json, model card) of trained SAEs")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished SAE run directories")
    s.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "OUT"), help="saelens OUT: one folder per SAE")
    s.add_argument("--push", metavar="REPO_ID", help="also upload OUT to this Hugging Face Hub repo")
    return s


def add_train_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", help="train on this existing cache directory (v1 or saev 2.1)")
    parser.add_argument("--train", help="with --cache: an experiment YAML or a file holding only train:")


def cmd_export(args) -> int:
    from actcache.export import export_many, push

    fmt, out = args.to
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--to {fmt!r}: unknown export format; use one of {', '.join(EXPORT_FORMATS)}")
    for folder in export_many(args.run_dirs, out):
        print(folder)
    if args.push:
        print(push(out, args.push))
    return 0


def cmd_train_cache(args) -> int:
    """SIGTERM/SIGUSR2 (Slurm's preemption notice) checkpoint at the end of the step, as for --experiment."""
    from actcache.sae.on_cache import train_on_cache

    if not args.train:
        raise ConfigError("--cache needs --train FILE (an experiment YAML or a file holding only train:)")
    if not os.path.isdir(args.cache):
        raise ConfigError(f"--cache {args.cache}: not a directory; give a cache directory")
    stopping = {"flag": False}
    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, lambda *_: stopping.update(flag=True)) for sig in STOP_SIGNALS} if main else {}
    try:
        dirs = train_on_cache(args.cache, args.train, runs_to=args.runs_to, group=args.group, device=args.device,
                              stop=lambda: stopping["flag"])  # fmt: skip
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for d in dirs:
        print(d)
    return 0
