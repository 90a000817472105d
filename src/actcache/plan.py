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
import functools
import os

from actcache.config import AUTO, Experiment, load_experiment
from actcache.errors import ConfigError
from actcache.preflight import COMMAND_LINE, Setting, check_inputs, check_listed_once, check_writable_dir
from actcache.protocol import METADATA_FILE, SHARDS_FILE, Metadata, shard_name
from actcache.rundir import group_mark, is_done, run_dir

DUMP_MARKS = ".actcache-dump"  # <HASH>/.actcache-dump/A-B.<slot>: range A..B-1 was written and verified
MARK_SLOTS = ("done", "redo")


def experiment_metadata(exp: Experiment, listing_cache: str | None = None, relist: bool = False) -> Metadata:
    """The cache metadata of ``exp``; every ConfigError names the experiment file and its keys as written.
    ``relist``: list an image folder again, ignoring its stored listing."""
    from actcache.ckptid import checkpoint_identity
    from actcache.images import count_images, metadata_data
    from actcache.models import describe_checkpoint, resolve_layers

    check_inputs(exp)
    try:
        dims = describe_checkpoint(exp.vit.family, exp.vit.ckpt)
    except ConfigError as err:
        raise ConfigError(f"{exp.source}: {_as_written(str(err))}") from None
    try:
        resolve_layers(exp.vit.layers, dims.n_layers)  # a layer beyond the model's depth fails here
    except ConfigError as err:
        raise ConfigError(f"{exp.source}: key 'vit.layers': {err}") from None
    try:
        n_imgs = count_images(exp.data, listing_cache=listing_cache, relist=relist)
    except ConfigError as err:
        raise ConfigError(f"{exp.source}: {err}") from None
    try:
        vit_ckpt = checkpoint_identity(exp.vit.ckpt, memo_dir=listing_cache)
    except ConfigError as err:
        raise ConfigError(f"{exp.source}: key 'vit.ckpt': {err}") from None
    return Metadata(
        vit_family=exp.vit.family,
        vit_ckpt=vit_ckpt,
        layers=tuple(exp.vit.layers),
        n_patches_per_img=dims.n_patches_per_img,
        cls_token=dims.cls_token,
        d_vit=dims.d_vit,
        n_imgs=n_imgs,
        max_patches_per_shard=exp.cache.max_patches_per_shard,
        data=metadata_data(exp.data),
        dtype=exp.cache.dtype,
        forward=exp.cache.forward,
    )


def _n_layers(md: Metadata, exp: Experiment) -> int:
    from actcache.models import describe_checkpoint

    return describe_checkpoint(exp.vit.family, exp.vit.ckpt).n_layers


def _as_written(msg: str) -> str:
    """actcache.models names the checkpoint keys as metadata.json does; an experiment file spells them
    ``vit.ckpt`` and ``vit.family``. A hub error quoted in the message may span lines: joined."""
    import re

    return " ".join(re.sub(r"\bvit_(ckpt|family)\b", r"vit.\1", msg).split())  # one line, as every error


def job_shards(md: Metadata, shards_per_job: int | str, gib_per_job: float) -> int:
    """Shards per dump job: an integer as given; ``auto``: as many full shards as fit in
    ``gib_per_job`` GiB (at least one), so the job count falls as shards shrink or caches grow."""
    if shards_per_job != AUTO:
        return int(shards_per_job)
    return max(1, min(md.n_shards, int(gib_per_job * 2**30 // md.shard_nbytes)))


def shard_ranges(md: Metadata, shards_per_job: int | str, gib_per_job: float) -> list[tuple[int, int]]:
    """[(A, B), ...] covering every shard, :func:`job_shards` shards per dump job."""
    n = job_shards(md, shards_per_job, gib_per_job)
    return [(a, min(a + n, md.n_shards)) for a in range(0, md.n_shards, n)]


def around(ranges: tuple[tuple[int, int], ...], fixed: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` with the ranges ``fixed`` kept as they are (the ranges of dump jobs still in flight,
    submitted under another job layout) and every other range cut to the shards outside them."""
    out = set(fixed)
    for a, b in ranges:
        cuts = sorted((max(a, fa), min(b, fb)) for fa, fb in fixed if fa < b and a < fb)
        start = a
        for ca, cb in cuts:
            if start < ca:
                out.add((start, ca))
            start = max(start, cb)
        if start < b:
            out.add((start, b))
    return tuple(sorted(out))


def parse_range_tag(tag: str) -> tuple[int, int]:
    a, b = tag.split("-")
    return int(a), int(b)


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

    @functools.cached_property
    def hash(self) -> str:  # asked per shard range while the workflow is parsed: computed once
        return self.metadata.hash

    @property
    def cache_dir(self) -> str:
        return os.path.join(self.dump_to, self.hash)

    @property
    def source(self) -> str:
        return self.exp.source

    @property
    def train_args(self) -> tuple[str, ...]:
        """How `actcache train` finds this experiment's cache (with the workflow's --dump-to)."""
        return ("--experiment", self.exp.source)

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

    def notes(self) -> list[str]:
        """What a user should know before dumping: a cache of the same resolved layers under another
        spelling, or a cache dumped when the checkpoint was named by its path (adopted by the dump)."""
        from actcache.adopt import adoptable
        from actcache.models import resolve_layers

        out = []
        md = self.metadata
        if not os.path.exists(self.cache_dir):
            old, why = adoptable(self.dump_to, md, self.exp.vit.ckpt)
            if old is not None:
                out.append(f"{old} holds this cache, dumped when the checkpoint was named by its path; "
                           "the dump adopts it (renamed to this hash, nothing recomputed)")  # fmt: skip
            elif why:
                out.append(why)
        n_layers = _n_layers(md, self.exp)
        resolved = resolve_layers(md.layers, n_layers)
        for spelling in dict.fromkeys([tuple(resolved), tuple(r - n_layers for r in resolved)]):
            other = dataclasses.replace(md, layers=spelling)
            if spelling != md.layers and os.path.isfile(os.path.join(self.dump_to, other.hash, METADATA_FILE)):
                out.append(f"a cache of the same layers spelled {list(spelling)} exists at "
                           f"{os.path.join(self.dump_to, other.hash)}; write vit.layers: {list(spelling)} to use it")  # fmt: skip
        return out

    def cost(self) -> dict:
        """What the cache takes on disk: ``bytes`` of activations in all ``n_shards`` shards (labels and
        JSON files, a few KiB, not counted), ``bytes_to_write`` for the shards not complete yet, and
        ``free_bytes`` on the filesystem of ``dump_to`` now (see fsutil.free_bytes)."""
        from actcache.fsutil import free_bytes

        md = self.metadata
        missing = [i for i in range(md.n_shards) if not self.shard_complete(i)]
        return {
            "bytes": md.n_imgs * md.bytes_per_img,
            "n_shards": md.n_shards,
            "bytes_to_write": sum(md.shard_n_imgs(i) for i in missing) * md.bytes_per_img,
            "free_bytes": free_bytes(self.dump_to),
        }

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
    experiments: tuple[str, ...]  # experiment (or train) files whose SAEs of this group it trains
    sae_ids: tuple[str, ...]
    mark: str  # the group mark the workflow asks for (see current_mark)
    train_args: tuple[tuple[str, ...], ...] = ()  # per file: how `actcache train` names its cache


def check_eval_caches(planned: list) -> None:
    """Every not-yet-done SAE's ``train.eval_cache`` is a gathered cache, or one that this plan dumps:
    else one ConfigError naming the file, the key and the fix, before any job trains for hours and
    fails at its evaluation. A relative path is read from the current directory, as the job does."""
    dumped = {os.path.realpath(p.cache_dir) for p in planned if isinstance(p, Planned)}
    seen = set()
    for p in planned:
        for r in p.train_runs():
            if r.eval_cache is None or (p.source, r.eval_cache) in seen or is_done(run_dir(p.runs_to, p.hash, r)):
                continue
            seen.add((p.source, r.eval_cache))
            path = os.path.abspath(os.path.expanduser(r.eval_cache))
            if os.path.isfile(os.path.join(path, SHARDS_FILE)) or os.path.realpath(path) in dumped:
                continue
            where = "" if path == r.eval_cache else f" (relative to {os.getcwd()}, where the jobs run)"
            raise ConfigError(
                f"{p.source}: key 'train.eval_cache' is {r.eval_cache!r}{where}, which holds no {SHARDS_FILE}; "
                "give a gathered cache directory (actcache verify DIR checks one), or delete the key to hold out "
                "eval_frac of this cache."
            )


def train_jobs(planned: list, runs_to: str) -> list[TrainJob]:
    """One training job per (cache hash, group id), with its mark under ``runs_to``.

    Experiments that share a cache and a group's keys share its id, so they share its job; an
    experiment joins the job only for SAEs no earlier one has. A group is complete when every
    member SAE has its done file. A changed hyperparameter gives a new SAE id, so its group is
    incomplete and trains again (only the new SAE: the trainer skips finished ones), while the
    cache hash and every other id stay the same.
    """
    from actcache.sae.config import groups

    check_eval_caches(planned)
    by_job: dict[tuple[str, str], dict[str, list[str]]] = {}  # -> experiment file -> new SAE ids
    args: dict[str, tuple[str, ...]] = {}
    for p in planned:
        for gid, members in sorted(groups(p.train_runs()).items()):
            files = by_job.setdefault((p.hash, gid), {})
            known = {i for ids in files.values() for i in ids}
            new = [r.sae_id for r in members if r.sae_id not in known]
            if new:
                files.setdefault(p.source, []).extend(new)
                args[p.source] = p.train_args
    out = []
    for (h, gid), files in by_job.items():
        ids = tuple(i for sae_ids in files.values() for i in sae_ids)
        complete = all(is_done(run_dir(runs_to, h, i)) for i in ids)
        mark = current_mark(group_mark(runs_to, h, gid), complete)
        out.append(TrainJob(h, gid, tuple(files), ids, mark, tuple(args[f] for f in files)))
    return out


@dataclasses.dataclass(frozen=True)
class ExternalCache:
    """An existing cache named in config/config.yaml's ``caches:``: never dumped nor written to,
    its SAEs trained, evaluated and reported like an experiment's."""

    cache_dir: str
    source: str  # the train file (an experiment YAML or a file holding only train:)
    metadata: object  # Metadata (v1) or SaevMetadata (saev 2.1)
    runs_to: str

    @property
    def hash(self) -> str:
        return self.metadata.hash

    @property
    def train_args(self) -> tuple[str, ...]:
        return ("--cache", self.cache_dir, "--train", self.source)

    @property
    def has_images(self) -> bool:
        """Whether its metadata names an image dataset actcache can open (a saev cache's is opaque)."""
        from actcache.images import data_config_from_metadata

        try:
            data_config_from_metadata(self.metadata.data)
        except (ConfigError, TypeError, AttributeError):
            return False
        return True

    def train_runs(self) -> list:
        from actcache.sae.config import expand_train_section
        from actcache.sae.on_cache import read_train_section

        train, _ = read_train_section(self.source)
        return expand_train_section(train, f"{self.source}: train", layers=self.metadata.layers, d_vit=self.metadata.d_vit)


def external_caches(entries, runs_to: str, base_dir: str, where: str) -> list[ExternalCache]:
    """config.yaml's ``caches:`` items (CacheEntry) -> ExternalCache; a cache that is missing or not
    gathered, or a train file that is missing, is one error naming ``where`` and the key."""
    from actcache.formats import load_metadata

    out = []
    for i, e in enumerate(entries):
        cache_dir, train = (p if os.path.isabs(p) else os.path.join(base_dir, p) for p in (e.dir, e.train))
        if not os.path.isfile(os.path.join(cache_dir, SHARDS_FILE)):
            raise ConfigError(
                f"{where}: key 'caches[{i}].dir' is {e.dir!r}, which holds no {SHARDS_FILE}; give a gathered cache "
                "directory (actcache verify DIR checks one)."
            )
        if not os.path.isfile(train):
            raise ConfigError(f"{where}: key 'caches[{i}].train' is {e.train!r}, which does not exist; give a YAML file.")
        out.append(ExternalCache(cache_dir, train, load_metadata(cache_dir), runs_to))
    return out


def dump_marks(p: Planned, cache_dir: str, in_flight: list[str] = ()) -> list[str]:
    """The mark of each shard range of ``p`` under ``cache_dir`` that the workflow asks for.
    ``in_flight``: the range tags of live dump jobs of an earlier run; one of another job layout is
    kept as it is (its job is awaited) and the ranges of ``p`` are cut around it (:func:`around`).

    The job layout (``cache.shards_per_job``) is not part of the cache: a complete, gathered cache
    asks for the marks its own jobs left, whatever the layout now, so it never schedules work; in
    an incomplete one, a range of the current layout whose shards are all there and that has no
    mark asks for none, so a lost shard brings back the one range that holds it.
    """
    if in_flight:
        p = dataclasses.replace(p, ranges=around(p.ranges, [parse_range_tag(t) for t in in_flight]))
    complete = {(a, b): p.range_complete(a, b) for a, b in p.ranges}
    if all(complete.values()) and os.path.exists(os.path.join(cache_dir, SHARDS_FILE)):
        return marks_on_disk(cache_dir)
    marks = []
    for a, b in p.ranges:
        base = _dump_mark_base(cache_dir, a, b)
        if complete[a, b] and not any(os.path.exists(f"{base}.{slot}") for slot in MARK_SLOTS):
            continue  # its shards are on disk, dumped under another job layout: no job to run
        marks.append(current_mark(base, complete[a, b]))
    return marks


def marks_on_disk(cache_dir: str) -> list[str]:
    """The newest mark of every range that has one in ``cache_dir`` (any job layout)."""
    try:
        names = os.listdir(os.path.join(cache_dir, DUMP_MARKS))
    except FileNotFoundError:
        return []
    bases = {n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1] in MARK_SLOTS}
    return [current_mark(os.path.join(cache_dir, DUMP_MARKS, b), True) for b in sorted(bases)]


def load_workflow_config(path: str):
    """config/config.yaml, checked (a WorkflowConfig)."""
    from actcache.docfiles import load_yaml_file

    doc = load_yaml_file(path, ConfigError, "workflow config (default config/config.yaml)") or {}
    return checked_workflow_config(doc, path)


def checked_workflow_config(doc: object, source: str):
    """config.yaml's mapping, checked (a WorkflowConfig): unknown keys, types, an experiment listed
    twice; each a one-line ConfigError naming ``source`` (the workflow's parse calls this before
    its schema check)."""
    from actcache.config import workflow_config_from_dict

    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: must be a YAML mapping with dump_to, runs_to and experiments.")
    cfg = workflow_config_from_dict(doc, source)
    check_listed_once(list(cfg.experiments), config_base_dir(source), Setting("", source, "experiments"))
    return cfg


def _setting(s: str | Setting, key: str) -> Setting:
    return s if isinstance(s, Setting) else Setting(s, COMMAND_LINE, "--" + key.replace("_", "-"))


def plan(
    experiment_files: list[str],
    dump_to: str | Setting,
    runs_to: str | Setting,
    base_dir: str | None = None,
    listed_in: Setting | None = None,
    relist: bool = False,
) -> list[Planned]:
    """Load, validate and plan every experiment. Errors name the file and key as written.

    ``dump_to``/``runs_to`` say where they were written (a plain string: the command line), and
    ``listed_in`` where the experiment list was. Every precondition (inputs exist, roots writable) is
    checked before anything is written (the image listing cache under ``<dump_to>/.listings``).
    Two experiments with one name are an error; two with identical cache settings share one hash
    (and so one directory and one set of dump jobs). ``relist`` lists image folders again.
    """
    base_dir = base_dir or os.getcwd()
    dump_to, runs_to = _setting(dump_to, "dump_to"), _setting(runs_to, "runs_to")
    check_listed_once(experiment_files, base_dir, listed_in or Setting("", COMMAND_LINE, "--experiment"))
    exps: list[tuple[Experiment, Setting, Setting]] = []
    names: dict[str, str] = {}
    for f in experiment_files:
        path = f if os.path.isabs(f) else os.path.join(base_dir, f)
        exp = load_experiment(path, base_dir=base_dir)
        if exp.name in names:
            raise ConfigError(
                f"{f}: key 'name': experiment name {exp.name!r} is already used by {names[exp.name]}; "
                "give each experiment a unique name."
            )
        names[exp.name] = f
        d_to = Setting(exp.dump_to, exp.source, "dump_to") if exp.dump_to else dump_to
        r_to = Setting(exp.runs_to, exp.source, "runs_to") if exp.runs_to else runs_to
        exps.append((exp, d_to, r_to))
    for exp, _, _ in exps:
        check_inputs(exp)
    for root in dict.fromkeys(s for _, d_to, r_to in exps for s in (d_to, r_to)):
        check_writable_dir(root)
    out: list[Planned] = []
    listing_cache = os.path.join(dump_to.value, ".listings")
    for exp, d_to, r_to in exps:
        md = experiment_metadata(exp, listing_cache=listing_cache, relist=relist)
        ranges = shard_ranges(md, exp.cache.shards_per_job, exp.cache.gib_per_job)
        out.append(Planned(exp, md, d_to.value, r_to.value, tuple(ranges)))
    return out


def config_base_dir(config_path: str) -> str:
    """The project root of a config file: the parent of its ``config/`` folder, else the cwd."""
    parent = os.path.dirname(os.path.abspath(config_path))
    return os.path.dirname(parent) if os.path.basename(parent) == "config" else os.getcwd()


def plan_from_config(
    config_path: str,
    dump_to: str | None = None,
    runs_to: str | None = None,
    experiments: list[str] | None = None,
    relist: bool = False,
) -> list[Planned]:
    """Plan config.yaml's experiments (or ``experiments``); ``dump_to``/``runs_to`` override its roots."""
    cfg = load_workflow_config(config_path)
    d_to = _setting(dump_to, "dump_to") if dump_to else Setting(cfg.dump_to, config_path, "dump_to")
    r_to = _setting(runs_to, "runs_to") if runs_to else Setting(cfg.runs_to, config_path, "runs_to")
    listed_in = Setting("", COMMAND_LINE, "--experiment") if experiments else Setting("", config_path, "experiments")
    files = experiments or list(cfg.experiments)
    return plan(files, d_to, r_to, base_dir=config_base_dir(config_path), listed_in=listed_in, relist=relist)


def caches_from_config(config_path: str, runs_to: str | None = None) -> list[ExternalCache]:
    """The existing caches named in config.yaml's ``caches:``."""
    cfg = load_workflow_config(config_path)
    return external_caches(cfg.caches, runs_to or cfg.runs_to, config_base_dir(config_path), config_path)


def _training_row(r, directory: str, d_vit: int | None) -> dict:
    """One SAE of a plan: its ids, what it is (objective, k or coefficient, width, layer), status."""
    return {"sae_id": r.sae_id, "group": r.group_id, "title": r.title(d_vit), **r.describe(d_vit),
            "dir": directory, "done": is_done(directory)}  # fmt: skip


def cache_summary(c: ExternalCache) -> dict:
    """What `actcache plan --json` prints for one of config.yaml's ``caches:``."""
    d_vit = getattr(c.metadata, "d_vit", None)
    runs = [_training_row(r, run_dir(c.runs_to, c.hash, r), d_vit) for r in c.train_runs()]
    return {"cache": c.cache_dir, "file": c.source, "hash": c.hash, "training": runs}


def plan_summary(p: Planned) -> dict:
    """What `actcache plan --json` prints for one experiment: its cache and its SAEs, with status."""
    runs = [_training_row(r, run_dir(p.runs_to, p.hash, r), p.metadata.d_vit) for r in p.train_runs()]
    return {
        "experiment": p.exp.name,
        "file": p.exp.source,
        "hash": p.hash,
        "dir": p.cache_dir,
        "cache": p.status(),
        "size": p.cost(),
        "notes": p.notes(),
        "dump_jobs": len(p.ranges),
        "dump_jobs_to_run": sum(not p.range_complete(a, b) for a, b in p.ranges),  # as `snakemake -n` lists
        "training": runs,
    }
