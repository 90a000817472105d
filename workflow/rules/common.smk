# Helpers: experiments -> hashes -> shard ranges -> targets. The logic lives in actcache.plan
# (no weights are loaded: dims come from each checkpoint's config.json, the image count from a
# cached dataset listing), so `actcache plan` and this workflow always agree.
import os
import sys

import yaml

from actcache.errors import ActCacheError
from actcache.plan import dump_mark, plan, train_groups


# The actcache CLI of the Python that runs this workflow (on Slurm, jobs re-run the same Python).
ACTCACHE = f"{sys.executable} -m actcache.cli"
DUMP_TO = config["dump_to"]
RUNS_TO = config["runs_to"]


def _fail(msg):
    # A config error is the user's to fix: one message naming the file and the key, no traceback.
    print(f"actcache: config error: {msg}", file=sys.stderr)
    sys.exit(1)


def _validate_experiment_schemas(files):
    for f in files:
        try:
            with open(f) as fd:
                doc = yaml.safe_load(fd)
        except (OSError, yaml.YAMLError):
            continue  # actcache.plan reports these with the file and line
        try:
            validate(doc, "../schemas/experiment.schema.yaml")
        except Exception as err:  # snakemake's WorkflowError from jsonschema
            _fail(f"{f}: {err}")


try:
    PLAN = plan(config["experiments"], DUMP_TO, RUNS_TO, base_dir=workflow.basedir)
except ActCacheError as err:
    _fail(str(err))
_validate_experiment_schemas([os.path.join(workflow.basedir, f) for f in config["experiments"]])

# One entry per cache hash: experiments with identical cache settings share one directory and one
# set of dump jobs.
CACHES = {}
for _p in PLAN:
    CACHES.setdefault(_p.hash, _p)

# A range's .done mark claims "every shard of A..B-1 is complete". If a shard was deleted or
# truncated since, that claim is false: remove the mark so the range's dump job runs again.
for _h, _p in CACHES.items():
    for _a, _b in _p.ranges:
        _mark = dump_mark(os.path.join(DUMP_TO, _h), _a, _b)
        if os.path.exists(_mark) and not _p.range_complete(_a, _b):
            print(f"actcache: {_h[:12]} shards {_a}..{_b - 1} incomplete on disk; their dump job will run again.",
                  file=sys.stderr)
            os.remove(_mark)


def experiment_file(hash):
    return CACHES[hash].exp.source


def range_marks(hash):
    p = CACHES[hash]
    return [dump_mark(os.path.join(DUMP_TO, hash), a, b) for a, b in p.ranges]


# (hash, group tag) -> (experiment file, group key). The tag also covers the group's SAE ids, so
# a changed SAE hyperparameter makes a new training job (and never a dump job).
TRAIN_JOBS = {}
try:
    for _p in PLAN:
        for _tag, _key in train_groups(_p):
            TRAIN_JOBS.setdefault((_p.hash, _tag), (_p.exp.source, _key))
except ActCacheError as err:
    _fail(str(err))


def train_job(hash, tag):
    return TRAIN_JOBS[(hash, tag)]


def all_targets():
    out = [os.path.join(DUMP_TO, h, "shards.json") for h in CACHES]
    out += [m for h in CACHES for m in range_marks(h)]  # a lost shard re-runs its range's job
    out += [os.path.join(RUNS_TO, h, "groups", f"{tag}.done") for h, tag in TRAIN_JOBS]
    return out


# ---- visuals (workflow/rules/report.smk) --------------------------------------------------
wildcard_constraints:
    sae=r"[0-9a-f]{12}",


# (hash, sae id) -> the tag of the training group that writes it (see common.smk: TRAIN_JOBS).
VISUALS_JOBS = {}
try:
    for _p in PLAN:
        _tag_of = {_key: _tag for _tag, _key in train_groups(_p)}
        for _r in _p.train_runs():
            VISUALS_JOBS.setdefault((_p.hash, _r.sae_id), _tag_of[_r.group_id])
except ActCacheError as err:
    _fail(str(err))


def visuals_group_mark(hash, sae):
    return os.path.join(RUNS_TO, hash, "groups", f"{VISUALS_JOBS[(hash, sae)]}.done")


def sweep_group_marks(hash):
    tags = sorted({tag for (h, _), tag in VISUALS_JOBS.items() if h == hash})
    return [os.path.join(RUNS_TO, hash, "groups", f"{tag}.done") for tag in tags]


def sweep_run_dirs(hash):
    return [os.path.join(RUNS_TO, hash, sae) for (h, sae) in sorted(VISUALS_JOBS) if h == hash]


def report_targets():
    """Every per-SAE visuals folder and every per-cache sweep plot (add to `rule all` to build them)."""
    out = [os.path.join(RUNS_TO, h, s, "visuals.html") for h, s in VISUALS_JOBS]
    hashes = sorted({h for h, _ in VISUALS_JOBS})
    out += [os.path.join(RUNS_TO, h, "visuals", f) for h in hashes for f in ("nmse_l0.png", "curves.png")]
    return out
