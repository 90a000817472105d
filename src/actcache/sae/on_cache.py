"""Train the ``train:`` section of a YAML file on any finished cache (protocol v1 or saev 2.1).

    train_on_cache("<dir>/saev/shards/1a2b3c4d", "sweep.yaml", runs_to="runs")

The file is either an experiment YAML (its ``train:`` section is used; its ``vit``/``data`` are not
needed, since the cache already exists) or a file holding only ``train:``. ``runs_to`` defaults to
the file's own ``runs_to`` key. SAEs land in ``<runs_to>/<cache hash>/<sae-id>/`` as for an
experiment (a saev cache's hash is its 8-hex directory id), resume the same way, and are evaluated
on the held-out images. Nothing is written into the cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from actcache.errors import ConfigError


def read_train_section(path: str | os.PathLike) -> tuple[dict, str | None]:
    """(the ``train:`` mapping, the file's ``runs_to`` or None) of a YAML file."""
    path = os.fspath(path)
    from actcache.docfiles import load_yaml_file

    doc = load_yaml_file(path, ConfigError, "train file")
    if not isinstance(doc, dict) or not isinstance(doc.get("train"), dict):
        raise ConfigError(f"{path}: needs a 'train:' mapping (an experiment YAML or a file holding only train:).")
    runs_to = doc.get("runs_to")
    if runs_to is not None and not isinstance(runs_to, str):
        raise ConfigError(f"{path}: runs_to is {runs_to!r}; give a directory path.")
    return doc["train"], runs_to


def train_on_cache(cache_dir: str | os.PathLike, train_file: str | os.PathLike, runs_to: str | None = None,
                   group: str | None = None, device: str | None = None,
                   stop: Callable[[], bool] | None = None, wait_for_lock: bool = False) -> list[str]:  # fmt: skip
    """Train every SAE (or one ``group``) of ``train_file`` on ``cache_dir``; returns the run dirs.
    SIGTERM/SIGUSR2 checkpoint and stop, as for an experiment (see sae.train.train_groups)."""
    from actcache.cache import ActivationCache
    from actcache.sae.config import expand_train_section, groups
    from actcache.sae.train import train_groups

    cache_dir, train_file = os.fspath(cache_dir), os.fspath(train_file)
    train, file_runs_to = read_train_section(train_file)
    runs_to = runs_to or file_runs_to
    if not runs_to:
        raise ConfigError(f"{train_file}: give runs_to (in the file or as --runs-to DIR).")
    md = ActivationCache.open(cache_dir).metadata
    runs = expand_train_section(train, train_file, layers=md.layers, d_vit=md.d_vit)
    by_group = groups(runs)
    if group is not None and group not in by_group:
        raise ConfigError(f"{train_file}: no group {group!r}; groups: {', '.join(by_group)}")
    if group is not None:
        by_group = {group: by_group[group]}
    return train_groups(cache_dir, by_group, runs_to, device=device, stop=stop, wait_for_lock=wait_for_lock)
