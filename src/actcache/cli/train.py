"""`actcache train --experiment FILE [--dump-to D] [--runs-to R] [--group G] [--device DEV]`, or
`actcache train --cache DIR --train FILE [--runs-to R] [--group G] [--device DEV]` for any existing
cache (v1 or saev 2.1)."""

from __future__ import annotations

import os

from actcache.errors import ConfigError


def cmd_train(args) -> int:
    if args.cache is not None:
        return _train_cache(args)
    if args.experiment is None:
        raise ConfigError("train: give --experiment FILE, or --cache DIR with --train FILE")
    from actcache.config import load_experiment
    from actcache.plan import experiment_metadata
    from actcache.preflight import check_writable_dir, root_setting
    from actcache.sae.config import expand_train_section, groups
    from actcache.sae.train import train_groups

    exp = load_experiment(args.experiment)
    dump_to = args.dump_to or exp.dump_to
    runs_to = args.runs_to or exp.runs_to
    if not dump_to or not runs_to:
        raise ConfigError(f"{args.experiment}: give --dump-to and --runs-to (or dump_to/runs_to in the file).")
    check_writable_dir(root_setting(exp, "runs_to", args.runs_to))
    runs = expand_train_section(exp.train, exp.source, layers=exp.vit.layers)
    if not runs:
        raise ConfigError(f"{exp.source}: no 'train' section, nothing to train.")
    by_group = groups(runs)
    if args.group is not None and args.group not in by_group:
        raise ConfigError(f"{exp.source}: no group {args.group!r}; groups: {', '.join(by_group)}")
    if args.group is not None:
        by_group = {args.group: by_group[args.group]}
    cache_dir = os.path.join(dump_to, experiment_metadata(exp).hash)
    train_groups(cache_dir, by_group, runs_to, device=args.device, wait_for_lock=args.wait_for_lock)
    return 0


def _train_cache(args) -> int:
    from actcache.sae.on_cache import train_on_cache

    if args.experiment is not None:
        raise ConfigError("train: give either --experiment FILE or --cache DIR --train FILE, not both")
    if not args.train:
        raise ConfigError("train --cache: needs --train FILE (an experiment YAML or a file holding only train:)")
    if not os.path.isdir(args.cache):
        raise ConfigError(f"train --cache {args.cache}: not a directory; give a cache directory")
    if args.runs_to:
        from actcache.preflight import COMMAND_LINE, Setting, check_writable_dir

        check_writable_dir(Setting(args.runs_to, COMMAND_LINE, "--runs-to"))
    for d in train_on_cache(args.cache, args.train, runs_to=args.runs_to, group=args.group, device=args.device,
                            wait_for_lock=args.wait_for_lock):
        print(d)
    return 0
