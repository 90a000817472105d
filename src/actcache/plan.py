"""Experiment configs -> Metadata, hash, shard ranges and on-disk status, without loading weights.

The model's dimensions come from its config.json (actcache.models.describe_checkpoint); the image
count from the dataset listing (actcache.images.count_images, cached under <dump_to>/.listings).
The Snakemake workflow (workflow/rules/common.smk) and `actcache plan` both use :func:`plan`.

Workflow marks: a dump job marks its shard range in ``<HASH>/.actcache-dump/``, a training job
its group in ``<runs_to>/<HASH>/groups/`` (named by ``RunConfig.group_id``, the one id of a group
in plan output, jobs, logs and ``actcache train --group``). A mark lives in one of two slots
(``.done``, ``.redo``); :func:`current_mark` only reads the disk to pick the slot the workflow
asks for, so parsing the workflow writes nothing. See :func:`current_mark` for why.
"""

from __future__ import annotations

import dataclasses
import os

from actcache.config import Experiment, load_experiment
from actcache.errors import ConfigError
from actcache.protocol import METADATA_FILE, SHARDS_FILE, Metadata, shard_name
from actcache.rundir import group_mark, is_done, run_dir

DUMP_MARKS = ".actcache-dump"  # <HASH>/.actcache-dump/A-B.<slot>: range A..B-1 was written and verified
MARK_SLOTS = ("done", "redo")


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


def dump_mark(cache_dir: str, a: int, b: int, slot: str = MARK_SLOTS[0]) -> str:
    return f"{_dump_mark_base(cache_dir, a, b)}.{slot}"


def _dump_mark_base(cache_dir: str, a: int, b: int) -> str:
    return os.path.join(cache_dir, DUMP_MARKS, range_tag(a, b))


def current_mark(base: str, complete: bool) -> str:
    """The mark (``base`` + ``.done`` or ``.redo``) the workflow asks for; reads, never writes.

    A mark says "this job's outputs are complete". When they are no longer (a shard deleted, an
    SAE added to a group), the mark on disk is stale. Snakemake would trust it, and parsing the
    workflow must not delete it; so the workflow asks for the other, empty slot instead: that job
    runs again, and its first step deletes the stale mark. While the outputs stay complete, the
    newest existing mark is asked for, so the inputs of later jobs stay the same between runs
    (Snakemake reruns a job whose set of input files changed).
    """
    paths = [f"{base}.{slot}" for slot in MARK_SLOTS]
    existing = [p for p in paths if os.path.exists(p)]
    if not existing:
        return paths[0]
    newest = max(existing, key=os.path.getmtime)
    if complete:
        return newest
    return paths[1 - paths.index(newest)]


def other_mark(mark: str) -> str:
    """The mark in the other slot, which the job of ``mark`` deletes before it runs."""
    base, slot = mark.rsplit(".", 1)
    return f"{base}.{MARK_SLOTS[1 - MARK_SLOTS.index(slot)]}"


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


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """One training job of the workflow: a group of SAEs on one cache (one loader pass per file)."""

    cache_hash: str
    group_id: str
    experiments: tuple[str, ...]  # experiment files whose SAEs of this group it trains
    sae_ids: tuple[str, ...]
    mark: str  # the group mark the workflow asks for (see current_mark)


def train_jobs(planned: list[Planned], runs_to: str) -> list[TrainJob]:
    """One training job per (cache hash, group id), with its mark under ``runs_to``.

    Experiments that share a cache and a group's keys share its id, so they share its job; an
    experiment joins the job only for SAEs no earlier one has. A group is complete when every
    member SAE has its done file. A changed hyperparameter gives a new SAE id, so its group is
    incomplete and trains again (only the new SAE: the trainer skips finished ones), while the
    cache hash and every other id stay the same.
    """
    from actcache.sae.config import groups

    by_job: dict[tuple[str, str], dict[str, list[str]]] = {}  # -> experiment file -> new SAE ids
    for p in planned:
        for gid, members in sorted(groups(p.train_runs()).items()):
            files = by_job.setdefault((p.hash, gid), {})
            known = {i for ids in files.values() for i in ids}
            new = [r.sae_id for r in members if r.sae_id not in known]
            if new:
                files.setdefault(p.exp.source, []).extend(new)
    out = []
    for (h, gid), files in by_job.items():
        ids = tuple(i for sae_ids in files.values() for i in sae_ids)
        complete = all(is_done(run_dir(runs_to, h, i)) for i in ids)
        out.append(TrainJob(h, gid, tuple(files), ids, current_mark(group_mark(runs_to, h, gid), complete)))
    return out


def dump_marks(p: Planned, cache_dir: str) -> list[str]:
    """The mark of each shard range of ``p`` under ``cache_dir`` that the workflow asks for.

    The job layout (``cache.shards_per_job``) is not part of the cache: a complete, gathered cache
    asks for the marks its own jobs left, whatever the layout now, so it never schedules work.
    """
    complete = {(a, b): p.range_complete(a, b) for a, b in p.ranges}
    if all(complete.values()) and os.path.exists(os.path.join(cache_dir, SHARDS_FILE)):
        return marks_on_disk(cache_dir)
    return [current_mark(_dump_mark_base(cache_dir, a, b), complete[a, b]) for a, b in p.ranges]


def marks_on_disk(cache_dir: str) -> list[str]:
    """The newest mark of every range that has one in ``cache_dir`` (any job layout)."""
    try:
        names = os.listdir(os.path.join(cache_dir, DUMP_MARKS))
    except FileNotFoundError:
        return []
    bases = {n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1] in MARK_SLOTS}
    return [current_mark(os.path.join(cache_dir, DUMP_MARKS, b), True) for b in sorted(bases)]


def load_workflow_config(path: str) -> dict:
    from actcache.docfiles import load_yaml_file

    doc = load_yaml_file(path, ConfigError, "workflow config (default config/config.yaml)") or {}
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


def plan_summary(p: Planned) -> dict:
    """What `actcache plan --json` prints for one experiment: its cache and its SAEs, with status."""
    runs = []
    for r in p.train_runs():
        directory = run_dir(p.runs_to, p.hash, r)
        runs.append({"sae_id": r.sae_id, "group": r.group_id, "dir": directory, "done": is_done(directory)})
    return {
        "experiment": p.exp.name,
        "file": p.exp.source,
        "hash": p.hash,
        "dir": p.cache_dir,
        "cache": p.status(),
        "dump_jobs": len(p.ranges),
        "training": runs,
    }
