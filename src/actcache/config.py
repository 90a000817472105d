"""Experiment YAML files -> frozen, validated config objects.

One YAML file per experiment (config/experiments/NAME.yaml); config/README.md documents every key.

    name: demo                 # optional, default: the file name without .yaml
    vit:
      family: clip             # clip | siglip | dinov2
      ckpt: openai/clip-vit-base-patch16   # hub id or local directory
      layers: [-2]             # residual-block indices as written (negative counts from the end)
    data:
      kind: image_folder       # image_folder | hf_disk | synthetic (see actcache.images)
      root: /fs/scratch/imagenet/train
    cache:
      max_patches_per_shard: 2400000
      batch_size: 256          # images per forward pass
      n_workers: 8             # image decoding processes
      shards_per_job: 4        # shards per Slurm dump job
    train: {...}               # SAE sweep (actcache.sae.config); optional

Keys that change the cache (vit.*, data.*, cache.max_patches_per_shard) go into metadata.json and
so into the hash; the others (batch size, workers, shards_per_job, train.*) never touch it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from actcache.errors import ConfigError

FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "siglip2")


def _where(src: str, key: str) -> str:
    return f"{src}: key '{key}'"


def _take(d: dict, allowed: dict[str, tuple], src: str, prefix: str) -> dict:
    """Check keys/types of mapping ``d`` against ``allowed`` = {key: (types, required, default)}."""
    if not isinstance(d, dict):
        raise ConfigError(f"{src}: '{prefix.rstrip('.')}' must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ConfigError(
            f"{src}: unknown key '{prefix}{unknown[0]}'. Allowed under "
            f"'{prefix.rstrip('.') or 'top level'}': {', '.join(sorted(allowed))}. Check the spelling (config/README.md)."
        )
    out = {}
    for key, (types, required, default) in allowed.items():
        if key not in d:
            if required:
                raise ConfigError(f"{src}: missing required key '{prefix}{key}' (see config/README.md).")
            out[key] = default
            continue
        v = d[key]
        if types is not None and not _is_type(v, types):
            names = " or ".join(t.__name__ if isinstance(t, type) else str(t) for t in types)
            raise ConfigError(f"{_where(src, prefix + key)} must be {names}, got {v!r} ({type(v).__name__}).")
        out[key] = v
    return out


def _is_type(v: Any, types: tuple) -> bool:
    for t in types:
        if t is int and isinstance(v, int) and not isinstance(v, bool):
            return True
        if t is float and isinstance(v, (int, float)) and not isinstance(v, bool):
            return True
        if t not in (int, float) and isinstance(t, type) and isinstance(v, t):
            return True
        if t is None and v is None:
            return True
    return False


@dataclasses.dataclass(frozen=True)
class VitConfig:
    family: str
    ckpt: str
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"vit.family={self.family!r} is not supported; use one of {', '.join(FAMILIES)}.")
        if not self.layers:
            raise ConfigError("vit.layers is empty; list at least one residual-block index, e.g. [-2].")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"vit.layers={list(self.layers)} repeats a layer.")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    max_patches_per_shard: int = 2_400_000
    batch_size: int = 256
    n_workers: int = 4
    shards_per_job: int = 1
    device: str = "auto"

    def __post_init__(self) -> None:
        for k in ("max_patches_per_shard", "batch_size", "shards_per_job"):
            if getattr(self, k) < 1:
                raise ConfigError(f"cache.{k} must be >= 1, got {getattr(self, k)}.")
        if self.n_workers < 0:
            raise ConfigError(f"cache.n_workers must be >= 0, got {self.n_workers}.")


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    source: str  # the YAML file it came from ("<dict>" otherwise)
    vit: VitConfig
    data: Any  # an actcache.images data config (frozen dataclass)
    cache: CacheConfig
    train: dict | None = None
    dump_to: str | None = None
    runs_to: str | None = None

    @property
    def data_dict(self) -> dict:
        from actcache.images import metadata_data

        return metadata_data(self.data)


_TOP = {
    "name": ((str,), False, None),
    "vit": ((dict,), True, None),
    "data": ((dict,), True, None),
    "cache": ((dict,), False, {}),
    "train": ((dict, None), False, None),
    "dump_to": ((str,), False, None),
    "runs_to": ((str,), False, None),
}
_VIT = {"family": ((str,), True, None), "ckpt": ((str,), True, None), "layers": ((list, int), True, None)}
_CACHE = {
    "max_patches_per_shard": ((int,), False, 2_400_000),
    "batch_size": ((int,), False, 256),
    "n_workers": ((int,), False, 4),
    "shards_per_job": ((int,), False, 1),
    "device": ((str,), False, "auto"),
}


def _norm_ckpt(ckpt: str, base: str) -> str:
    """A local checkpoint directory becomes an absolute path (relative to the YAML's project);
    anything else is a hub id and stays as written."""
    if os.path.isabs(ckpt):
        return os.path.normpath(ckpt)
    cand = os.path.join(base, ckpt)
    if ckpt.startswith((".", "/")) or os.path.isdir(cand):
        return os.path.normpath(os.path.abspath(cand))
    return ckpt


def experiment_from_dict(doc: object, source: str = "<dict>", base_dir: str | None = None) -> Experiment:
    """Validate an experiment mapping; every error names ``source`` and the key."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: an experiment file must be a YAML mapping, got {type(doc).__name__}.")
    top = _take(doc, _TOP, source, "")
    vit = _take(top["vit"], _VIT, source, "vit.")
    layers = vit["layers"]
    if isinstance(layers, int):
        layers = [layers]
    if not all(_is_type(x, (int,)) for x in layers):
        raise ConfigError(f"{_where(source, 'vit.layers')} must be a list of integers, got {layers!r}.")
    if not layers:
        raise ConfigError(f"{_where(source, 'vit.layers')} is empty; list at least one layer, e.g. [-2].")
    if vit["family"] not in FAMILIES:
        raise ConfigError(f"{_where(source, 'vit.family')} is {vit['family']!r}; allowed: {', '.join(FAMILIES)}.")
    base = base_dir or os.getcwd()
    try:
        vitc = VitConfig(vit["family"], _norm_ckpt(vit["ckpt"], base), tuple(layers))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    cache = _take(top["cache"] or {}, _CACHE, source, "cache.")
    try:
        cachec = CacheConfig(**cache)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    from actcache.images import data_config_from_dict

    data = data_config_from_dict(dict(top["data"]), where=f"{source}: data")
    name = top["name"]
    if name is None:
        name = os.path.splitext(os.path.basename(source))[0] if source != "<dict>" else "experiment"
    if not name or any(c in name for c in "/\\ \t\n"):
        raise ConfigError(f"{_where(source, 'name')} is {name!r}; use letters, digits, '-', '_' or '.'.")
    return Experiment(
        name=name,
        source=source,
        vit=vitc,
        data=data,
        cache=cachec,
        train=top["train"],
        dump_to=top["dump_to"],
        runs_to=top["runs_to"],
    )


def load_experiment(path: str | os.PathLike, base_dir: str | None = None) -> Experiment:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fd:
            doc = yaml.safe_load(fd)
    except FileNotFoundError:
        raise ConfigError(f"{path}: experiment file not found.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(err, 'problem', err)}") from None
    return experiment_from_dict(doc, source=path, base_dir=base_dir)
