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
      shards_per_job: auto     # shards per Slurm dump job (auto: at most cache.gib_per_job GiB each)
    train: {...}               # SAE sweep (actcache.sae.config); optional

Keys that change the cache (vit.*, data.*, cache.max_patches_per_shard, cache.dtype, cache.forward) go into
metadata.json and so into the hash; the others (batch size, workers, shards_per_job, train.*) never touch it.

Each key is declared once, as a field below (:func:`actcache.keys.key`: type, default, help,
checks, ``hashed``); validation, workflow/schemas/ and config/README.md's tables come from them.
The ``data:`` keys are the fields of the data configs in :mod:`actcache.images`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from actcache.errors import ConfigError
from actcache.keys import check_fields, key, read_section
from actcache.protocol import DEFAULT_FORWARD, DEFAULT_MAX_PATCHES_PER_SHARD, DTYPES, FAMILIES, FORWARDS

DTYPE_NAMES = tuple(DTYPES)

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


def _vit(help: str, **kw):
    return key(help=help, scope="vit", required=True, **kw)


AUTO = "auto"  # cache.shards_per_job: dump job ranges sized by cache.gib_per_job (actcache.plan.shard_ranges)
MAX_WORKERS = 256  # the stated cap of cache.n_workers (dump also cuts it to the node's CPUs)


def _cache(default, help: str, **kw):
    return key(default, help, scope="cache", hashed=False, **kw)


@dataclasses.dataclass(frozen=True)
class VitConfig:
    family: str = _vit(
        "model family: transformers `CLIPVisionModel`, `SiglipVisionModel` (no CLS token), `Dinov2Model` "
        "or with registers (registers not stored)",
        choices=FAMILIES,
    )
    ckpt: str = _vit(
        "Hugging Face hub id, or a local directory written by `save_pretrained` (relative to the project "
        "root; the cache hash holds a digest of its config and weight files, not its path); its "
        "`config.json` and `preprocessor_config.json` give the shapes without loading weights",
        min_len=1,
        example="openai/clip-vit-base-patch16",
    )
    layers: tuple[int, ...] = _vit(
        "residual-block outputs to record, as written: `-2` is the second-to-last block; loaders select "
        "by the same values. Non-empty, no repeats, within the model's depth",
        min_len=1,
        unique=True,
        example=(-2,),
    )

    def __post_init__(self) -> None:
        check_fields(self, "vit config", "vit.")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    max_patches_per_shard: int = key(
        DEFAULT_MAX_PATCHES_PER_SHARD,
        "vectors per shard; images per shard = this // (tokens x layers); the default gives ~10 GiB shards at d=1024",
        scope="cache",
        ge=1,
    )
    dtype: str = key(
        "float32",
        "stored value type: `float32` writes protocol v1; `float16` / `bfloat16` write protocol 2.0 (half the "
        "bytes, same shard sizing in vectors; v1 readers cannot open it)",
        scope="cache",
        late=True,
        choices=DTYPE_NAMES,
    )
    forward: str = key(
        DEFAULT_FORWARD,
        "precision of the dump's forward pass: `fp32` (exact float32; TF32 switched off on CUDA), `tf32` (CUDA "
        "matrix products in TF32; the same as fp32 on the CPU), `bf16` (autocast to bfloat16); the activations "
        "are stored as `cache.dtype` either way. A value other than fp32 is recorded in metadata.json",
        scope="cache",
        late=True,
        choices=FORWARDS,
    )
    batch_size: int = _cache(256, "images per forward pass in `actcache dump`", ge=1)
    n_workers: int = _cache(4, "image decoding processes (the workflow passes the job's threads instead); more than the node's CPUs are cut to them",
                            ge=0, le=MAX_WORKERS)  # fmt: skip
    shards_per_job: int | str = _cache(
        AUTO,
        "shards per dump job (one Slurm job per range of this many shards): `auto` sizes each range to at "
        "most `cache.gib_per_job` (at least one shard); an integer is exact",
        ge=1,
        pattern=r"^(auto|[0-9]+)$",
        example=AUTO,
    )
    gib_per_job: float = _cache(
        128.0,
        "with `shards_per_job: auto`, the most GiB of shards one dump job writes (at least one shard): 128 GiB "
        "take about 2 min at 1 GB/s, 15 min at 150 MB/s; keep a job well inside the dump runtime limit",
        gt=0,
        late=True,
    )
    device: str = _cache("auto", "`auto` (CUDA when present), `cpu`, `cuda`, `cuda:1`")

    def __post_init__(self) -> None:
        check_fields(self, "cache config", "cache.")


def _data_schema() -> dict:
    from actcache.images import DATA_KINDS  # the data configs own their keys

    return {"type": "object", "properties": {"kind": {"enum": list(DATA_KINDS)}}, "required": ["kind"]}


def _top(default, help: str, **kw):
    return key(default, help, scope="experiment", hashed=False, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str = _top(
        None, "unique experiment name (letters, digits, `-`, `_`, `.`); default: the file name without .yaml",
        pattern=NAME_PATTERN, example="demo",
    )  # fmt: skip
    source: str = "<dict>"  # the YAML file it came from
    vit: VitConfig = key(help="the model and the layers recorded", scope="experiment", required=True)
    data: Any = key(
        help="the image dataset: `kind` and that kind's keys (table below)",
        scope="experiment",
        required=True,
        schema=_data_schema,
    )  # an actcache.images data config (frozen dataclass)
    cache: CacheConfig = _top(CacheConfig(), "how the cache is cut and written")
    train: dict | None = _top(None, "the SAE sweep (section `train:` below)")
    dump_to: str | None = _top(
        None, "used by `actcache dump/train` run by hand without `--dump-to`; the workflow uses config.yaml's"
    )
    runs_to: str | None = _top(
        None, "used by `actcache train` run by hand without `--runs-to`; the workflow uses config.yaml's"
    )

    @property
    def data_dict(self) -> dict:
        from actcache.images import metadata_data

        return metadata_data(self.data)


def _workflow(help: str, **kw):
    # a required key of config/config.yaml (its paths and roots have no default)
    return key(help=help, scope="workflow", required=True, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheEntry:
    """One item of config/config.yaml's ``caches:``: an existing cache and the SAEs to train on it."""

    dir: str = _workflow(
        "an existing, gathered cache directory (protocol v1 or saev 2.1), relative to the project root; "
        "never written to"
    )
    train: str = _workflow("an experiment YAML or a file holding only `train:`, relative to the project root")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkflowConfig:
    """config/config.yaml: the workflow's roots, experiments and existing caches."""

    dump_to: str = _workflow(
        "root of the activation caches: each lives in `<dump_to>/<HASH>/` (protocol v1); on a "
        "cluster, a shared scratch filesystem"
    )
    runs_to: str = _workflow("root of SAE training runs: `<runs_to>/<HASH>/<sae-id>/`")
    experiments: tuple[str, ...] = key(
        (),
        help="experiment files, relative to the project root; two experiments may not share a `name`",
        scope="workflow",
        example=("config/experiments/demo.yaml",),
    )
    caches: tuple[CacheEntry, ...] = key(
        (),
        help="existing caches whose SAEs are trained, evaluated and reported like an experiment's: a list of "
        "`{dir, train}` (keys below)",
        scope="workflow",
    )


def workflow_config_from_dict(doc: object, source: str) -> WorkflowConfig:
    """The checked config, ``caches`` items as CacheEntry. It needs an experiment or a cache."""
    fields = read_section(doc, WorkflowConfig, source)
    fields["caches"] = tuple(
        CacheEntry(**read_section(item, CacheEntry, source, prefix=f"caches[{i}]."))
        for i, item in enumerate(fields["caches"])
    )
    if not fields["experiments"] and not fields["caches"]:
        raise ConfigError(f"{source}: nothing to run; list experiment files under 'experiments' or caches under 'caches'.")
    return WorkflowConfig(**fields)


def project_root(experiment_path: str) -> str:
    """The project root of an experiment file: the nearest folder above it that holds
    ``config/config.yaml``; the current directory for a file outside any project."""
    d = os.path.dirname(os.path.abspath(experiment_path))
    while True:
        if os.path.isfile(os.path.join(d, "config", "config.yaml")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return os.getcwd()
        d = parent


def resolve_path(value: str, base: str, source: str, key_: str) -> str:
    """A path from an experiment file, made absolute: a relative one is relative to the project root
    ``base``. One read relative to the current directory instead (it exists there, not under
    ``base``) is an error, never silently used."""
    value_x = os.path.expanduser(value)
    if os.path.isabs(value_x):
        return os.path.normpath(value_x)
    cand = os.path.normpath(os.path.join(base, value_x))
    cwd = os.getcwd()
    if not os.path.exists(cand) and os.path.normpath(base) != cwd and os.path.exists(os.path.join(cwd, value_x)):
        raise ConfigError(
            f"{source}: key '{key_}' is {value!r}: relative paths in an experiment are read from the project root "
            f"{base} (where config/config.yaml lives), which has no {value!r}; the current directory has one. "
            "Write the path relative to the project root, or absolute."
        )
    return os.path.abspath(cand)


def _norm_ckpt(ckpt: str, base: str, source: str) -> str:
    """A local checkpoint directory becomes an absolute path (relative to the project root);
    anything else is a hub id and stays as written."""
    if os.path.isabs(ckpt):
        return os.path.normpath(ckpt)
    cand = os.path.join(base, ckpt)
    if ckpt.startswith((".", "/")) or os.path.isdir(cand) or os.path.isdir(ckpt):
        return resolve_path(ckpt, base, source, "vit.ckpt")
    return ckpt


_DATA_PATHS = {"image_folder": "root", "hf_disk": "path"}  # data keys that name a path


def experiment_from_dict(doc: object, source: str = "<dict>", base_dir: str | None = None) -> Experiment:
    """Validate an experiment mapping; every error names ``source`` and the key. Relative paths
    (vit.ckpt, data.root, data.path, dump_to, runs_to) are read from ``base_dir``, by default the
    file's project root (:func:`project_root`)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: an experiment file must be a YAML mapping, got {type(doc).__name__}.")
    base = base_dir or (project_root(source) if source != "<dict>" else os.getcwd())
    top = read_section(doc, Experiment, source)
    vit = read_section(top["vit"], VitConfig, source, "vit.")
    vit["ckpt"] = _norm_ckpt(vit["ckpt"], base, source)
    cache = top["cache"]
    if not isinstance(cache, CacheConfig):
        cache = CacheConfig(**read_section(cache, CacheConfig, source, "cache."))
    from actcache.images import data_config_from_dict

    if not isinstance(top["data"], dict):
        raise ConfigError(
            f"{source}: key 'data' is {type(top['data']).__name__} {str(top['data'])[:60]!r}; give a mapping, "
            "e.g. data: {kind: image_folder, root: DIR}."
        )
    data_doc = dict(top["data"])
    kind = data_doc.get("kind")
    field = _DATA_PATHS.get(kind) if isinstance(kind, str) else None
    if field is not None and isinstance(data_doc.get(field), str) and data_doc[field]:
        data_doc[field] = resolve_path(data_doc[field], base, source, f"data.{field}")
    data = data_config_from_dict(data_doc, where=f"{source}: data")
    for root in ("dump_to", "runs_to"):
        if isinstance(top[root], str) and top[root]:
            top[root] = resolve_path(top[root], base, source, root)
    name = top["name"]
    if name is None:
        name = os.path.splitext(os.path.basename(source))[0] if source != "<dict>" else "experiment"
    if not name or any(c in name for c in "/\\ \t\n"):
        raise ConfigError(f"{source}: key 'name' is {name!r}; use letters, digits, '-', '_' or '.'.")
    return Experiment(**{**top, "name": name, "source": source, "vit": VitConfig(**vit), "data": data, "cache": cache})


def load_experiment(path: str | os.PathLike, base_dir: str | None = None) -> Experiment:
    from actcache.docfiles import load_yaml_file

    path = os.fspath(path)
    doc = load_yaml_file(path, ConfigError, "experiment file")
    return experiment_from_dict(doc, source=path, base_dir=base_dir)
