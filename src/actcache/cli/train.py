"""`actcache train --experiment FILE [--dump-to D] [--runs-to R] [--group G] [--device DEV]`."""

from __future__ import annotations

import os

from actcache.config import load_experiment
from actcache.errors import ConfigError
from actcache.plan import experiment_metadata
from actcache.sae.config import expand_train_section, groups
from actcache.sae.train import train_groups


def cmd_train(args) -> int:
    exp = load_experiment(args.experiment)
    dump_to = args.dump_to or exp.dump_to
    runs_to = args.runs_to or exp.runs_to
    if not dump_to or not runs_to:
        raise ConfigError(f"{args.experiment}: give --dump-to and --runs-to (or dump_to/runs_to in the file).")
    runs = expand_train_section(exp.train, exp.source, layers=exp.vit.layers)
    if not runs:
        raise ConfigError(f"{exp.source}: no 'train' section, nothing to train.")
    by_group = groups(runs)
    if args.group is not None and args.group not in by_group:
        raise ConfigError(f"{exp.source}: no group {args.group!r}; groups: {', '.join(by_group)}")
    if args.group is not None:
        by_group = {args.group: by_group[args.group]}
    cache_dir = os.path.join(dump_to, experiment_metadata(exp).hash)
    train_groups(cache_dir, by_group, runs_to, device=args.device)
    return 0
