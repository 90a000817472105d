"""Experiment configs -> Metadata, hash, shard ranges and on-disk status, without loading weights.

The model's dimensions come from its config.json (actcache.models.describe_checkpoint); the image
count from the dataset listing (actcache.images.count_images, cached under <dump_to>/.listings).
The Snakemake workflow (workflow/rules/common.smk) and `actcache plan` both use :func:`plan`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import yaml

from actcache.config import Experiment, load_experiment
from actcache.errors import ConfigError
from actcache.protocol import METADATA_FILE, SHARDS_FILE, Metadata, shard_name

DUMP_MARKS = ".actcache-dump"  # <HASH>/.actcache-dump/A-B.done: range A..B-1 was written and verified


def experiment_metadata(exp: Experiment, listing_cache: str | None = None) -> Metadata:
    from actcache.images import count_images, metadata_data
    from actcache.models import describe_checkpoint, resolve_layers

    dims = describe_checkpoint(exp.vit.family, exp.vit.ckpt)
    try:
        resolve_layers(exp.vit.layers, dims.n_layers)  # a layer beyond the model's depth fails here
    except ConfigError as err:
        raise ConfigError(f"{exp.source}: key 'vit.layers': {err}") from None
    return Metadata(
        vit_family=exp.vit.family,
        vit_ckpt=exp.vit.ckpt,
        layers=tuple(exp.vit.layers),
        n_patches_per_img=dims.n_patches_per_img,
        cls_token=dims.cls_token,
        d_vit=dims.d_vit,
        n_imgs=count_images(exp.data, listing_cache=listing_cache),
        max_patches_per_shard=exp.cache.max_patches_per_shard,
        data=metadata_data(exp.data),
    )


def shard_ranges(md: Metadata, shards_per_job: int) -> list[tuple[int, int]]:
    """[(A, B), ...] covering every shard, ``shards_per_job`` shards per dump job."""
    return [(a, min(a + shards_per_job, md.n_shards)) for a in range(0, md.n_shards, shards_per_job)]


def range_tag(a: int, b: int) -> str:
    return f"{a:06d}-{b:06d}"


def dump_mark(cache_dir: str, a: int, b: int) -> str:
    return os.path.join(cache_dir, DUMP_MARKS, f"{range_tag(a, b)}.done")


@dataclasses.dataclass(frozen=True)
class Planned:
    exp: Experiment
    metadata: Metadata
    dump_to: str
    runs_to: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def hash(self) -> str:
        return self.metadata.hash

    @property
    def cache_dir(self) -> str:
        return os.path.join(self.dump_to, self.hash)

    def shard_complete(self, i: int) -> bool:
        md = self.metadata
        try:
            size = os.stat(os.path.join(self.cache_dir, shard_name(i))).st_size
        except FileNotFoundError:
            return False
        return size in (md.shard_n_imgs(i) * md.bytes_per_img, md.shard_nbytes)

    def range_complete(self, a: int, b: int) -> bool:
        return all(self.shard_complete(i) for i in range(a, b))

    def status(self) -> dict:
        md = self.metadata
        done = sum(self.shard_complete(i) for i in range(md.n_shards))
        gathered = os.path.exists(os.path.join(self.cache_dir, SHARDS_FILE))
        if done == md.n_shards and gathered:
            state = "complete"
        elif done == 0 and not os.path.exists(os.path.join(self.cache_dir, METADATA_FILE)):
            state = "missing"
        elif done == md.n_shards:
            state = "not gathered"
        else:
            state = f"{done} of {md.n_shards} shards"
        return {"state": state, "shards_done": done, "n_shards": md.n_shards, "gathered": gathered}

    def train_runs(self) -> list:
        """The SAE runs of the experiment's train section ([] without one)."""
        if not self.exp.train:
            return []
        from actcache.sae.config import expand_train_section

        return expand_train_section(
            self.exp.train, where=f"{self.exp.source}: train", layers=self.metadata.layers, d_vit=self.metadata.d_vit
        )


def train_groups(p: Planned) -> list[tuple[str, str]]:
    """[(tag, group key)] of an experiment's training groups.

    The group key names a set of SAEs that share one stream of batches (`actcache train --group`);
    the tag is a short hash of the key and the group's SAE ids, so any change to a member's
    hyperparameters gives a new tag (a new Snakemake job) while the cache stays untouched.
    """
    runs = p.train_runs()
    if not runs:
        return []
    from actcache.sae.config import groups

    out = []
    for key, members in sorted(groups(runs).items()):
        ids = sorted(r.sae_id for r in members)
        tag = hashlib.sha256(json.dumps([key, ids]).encode()).hexdigest()[:16]
        out.append((tag, key))
    return out


def load_workflow_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fd:
            doc = yaml.safe_load(fd) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: workflow config not found (default config/config.yaml).") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: must be a YAML mapping with dump_to, runs_to and experiments.")
    allowed = {"dump_to", "runs_to", "experiments"}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ConfigError(f"{path}: unknown key '{unknown[0]}'; allowed: {', '.join(sorted(allowed))}.")
    for k in ("dump_to", "runs_to"):
        if k not in doc or not isinstance(doc[k], str):
            raise ConfigError(f"{path}: key '{k}' must be a directory path (string).")
    exps = doc.get("experiments")
    if not isinstance(exps, list) or not exps or not all(isinstance(e, str) for e in exps):
        raise ConfigError(f"{path}: key 'experiments' must be a non-empty list of experiment YAML paths.")
    return doc


def plan(
    experiment_files: list[str],
    dump_to: str,
    runs_to: str,
    base_dir: str | None = None,
) -> list[Planned]:
    """Load, validate and plan every experiment. Errors name the file and key.

    Two experiments with one name are an error; two with identical cache settings share one hash
    (and so one directory and one set of dump jobs).
    """
    base_dir = base_dir or os.getcwd()
    out: list[Planned] = []
    names: dict[str, str] = {}
    listing_cache = os.path.join(dump_to, ".listings")
    for f in experiment_files:
        path = f if os.path.isabs(f) else os.path.join(base_dir, f)
        exp = load_experiment(path, base_dir=base_dir)
        if exp.name in names:
            raise ConfigError(
                f"{f}: key 'name': experiment name {exp.name!r} is already used by {names[exp.name]}; "
                "give each experiment a unique name."
            )
        names[exp.name] = f
        d_to = exp.dump_to or dump_to
        r_to = exp.runs_to or runs_to
        md = experiment_metadata(exp, listing_cache=listing_cache)
        out.append(Planned(exp, md, d_to, r_to, tuple(shard_ranges(md, exp.cache.shards_per_job))))
    return out


def plan_from_config(
    config_path: str, dump_to: str | None = None, runs_to: str | None = None, experiments: list[str] | None = None
) -> list[Planned]:
    cfg = load_workflow_config(config_path)
    base = (
        os.path.dirname(os.path.dirname(os.path.abspath(config_path)))
        if os.path.basename(os.path.dirname(os.path.abspath(config_path))) == "config"
        else os.getcwd()
    )
    return plan(experiments or cfg["experiments"], dump_to or cfg["dump_to"], runs_to or cfg["runs_to"], base_dir=base)


def cli_plan(args) -> int:
    dump_to, runs_to = args.dump_to, args.runs_to
    if args.experiment and not os.path.exists(args.config):
        if not (dump_to and runs_to):
            raise ConfigError("--experiment without a workflow config needs --dump-to and --runs-to.")
        planned = plan(args.experiment, dump_to, runs_to)
    else:
        planned = plan_from_config(args.config, dump_to, runs_to, args.experiment or None)
    rows = []
    for p in planned:
        st = p.status()
        runs = []
        for r in p.train_runs():
            run_dir = os.path.join(p.runs_to, p.hash, r.sae_id)
            runs.append(
                {
                    "sae_id": r.sae_id,
                    "group": r.group_id,
                    "dir": run_dir,
                    "done": os.path.exists(os.path.join(run_dir, "done.json")),
                }
            )
        rows.append(
            {
                "experiment": p.exp.name,
                "file": p.exp.source,
                "hash": p.hash,
                "dir": p.cache_dir,
                "cache": st,
                "dump_jobs": len(p.ranges),
                "training": runs,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        st = r["cache"]
        print(f"{r['experiment']}  ({r['file']})")
        print(f"  hash      {r['hash']}")
        print(f"  dir       {r['dir']}")
        print(f"  cache     {st['state']} ({st['shards_done']}/{st['n_shards']} shards, {r['dump_jobs']} dump job(s))")
        if r["training"]:
            done = sum(t["done"] for t in r["training"])
            print(f"  training  {done} of {len(r['training'])} SAE(s) done")
            for t in r["training"]:
                print(f"    {'done   ' if t['done'] else 'pending'}  {t['sae_id']}  group {t['group']}")
    return 0
