# Helpers: experiments -> hashes -> shard ranges -> targets. The logic lives in actcache.plan
# (no weights are loaded: dims come from each checkpoint's config.json, the image count from a
# cached dataset listing), so `actcache plan` and this workflow always agree.
# Parsing only reads the disk: which mark each job should leave is decided by
# actcache.plan.current_mark, and the job that needs it deletes a stale mark (see cache.smk).
# Everything below is computed once, when the workflow is parsed.
import dataclasses
import os
import re
import shlex
import sys

import yaml

from actcache.errors import ActCacheError
from actcache.plan import DUMP_MARKS as DUMP_MARKS_DIR
from actcache.plan import MARK_SLOTS, dump_mark, dump_marks, external_caches, other_mark, plan, train_jobs
from actcache.slurmjobs import (
    Claim,
    InFlight,
    claim_path,
    claimed_ranges,
    in_flight,
    live_jobs,
    plugin_comment,
    site_warnings,
    slot_of,
    status_init_in_force,
)
from actcache.slurmsite import SKIP_VAR, check_site, jobs_from_resources, submits_to_slurm
from actcache.protocol import SHARDS_FILE
from actcache.rundir import (
    DONE_FILE,
    EVAL_FILE,
    CURVES_PLOT,
    GROUPS_DIR,
    NMSE_L0_PLOT,
    PARETO_FVU_PLOT,
    PARETO_PROBE_PLOT,
    PARETO_SPLICED_PLOT,
    SPLICED_MARK,
    SWEEP_PLOTS,
    VISUALS_DIR,
    VISUALS_PAGE,
    run_dir,
    sweep_dir,
)


# The actcache CLI of the Python that runs this workflow (on Slurm, jobs re-run the same Python).
ACTCACHE = f"{sys.executable} -m actcache.cli"
DUMP_TO = config["dump_to"]
RUNS_TO = config["runs_to"]


def _validate_experiment_schemas(files):
    """Each experiment file against its schema, read once (Snakemake's validate() reads it per call)."""
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where built
    with open(os.path.join(workflow.basedir, "workflow", "schemas", "experiment.schema.yaml")) as fd:
        schema = jsonschema.Draft202012Validator(yaml.load(fd, Loader=loader))
    for f in files:
        try:
            with open(f) as fd:
                doc = yaml.load(fd, Loader=loader)
        except (OSError, yaml.YAMLError):
            continue  # actcache.plan reports these with the file and line
        err = jsonschema.exceptions.best_match(schema.iter_errors(doc))
        if err is not None:
            _fail(f"{f}: key '{'.'.join(map(str, err.absolute_path)) or 'top level'}': {err.message} (config/README.md)")


try:
    PLAN = plan(
        list(WORKFLOW_CONFIG.experiments),
        config_setting("dump_to"),
        config_setting("runs_to"),
        base_dir=workflow.basedir,
        listed_in=Setting("", config_source("experiments"), "experiments"),
    )
    # config.yaml's `caches:`: existing caches (v1 or saev 2.1) trained like an experiment's, never dumped
    EXTERNAL = external_caches(WORKFLOW_CONFIG.caches, RUNS_TO, workflow.basedir, config_source("caches"))
except ActCacheError as err:
    _fail(str(err))
_validate_experiment_schemas([os.path.join(workflow.basedir, f) for f in WORKFLOW_CONFIG.experiments])

# One entry per cache hash: experiments with identical cache settings share one directory and one
# set of dump jobs.
CACHES = {}
for _p in PLAN:
    CACHES.setdefault(_p.hash, _p)

# Shell prefixes of the job rules. Under Slurm, `scancel` sends SIGTERM only to a job step's task
# (the job's inner snakemake), never to the processes it starts; so actcache runs as the task of
# its own step (`srun --overlap` shares the job's CPUs and GPUs) and receives the signal itself:
# dump stops (a partial shard is never renamed into place), train writes its checkpoint.
AS_TASK_RAW = "${SLURM_JOB_ID:+srun --overlap --quiet --ntasks=1}"
AS_TASK = AS_TASK_RAW.replace("{", "{{").replace("}", "}}")  # for a rule's shell template
# Every attempt keeps its log: {log} is a hard link to <log without .log>.attempt<N>.<UTC time>.log,
# which starts with the attempt number and the Slurm job id (whose Slurm log is
# .snakemake/slurm_logs/rule_<rule>/<wildcards>/<job id>.log). Snakemake deletes {log} before a
# retry; that unlinks only the name, so the earlier attempt's file stays.
ATTEMPT_LOG = (
    'attempt_log={log:q}; attempt_log="${{attempt_log%.log}}.attempt{resources.attempt}.$(date -u +%Y%m%dT%H%M%S).log"; '
    ': > "$attempt_log" && ln -f "$attempt_log" {log:q} && '
    'echo "attempt {resources.attempt}, Slurm job ${{SLURM_JOB_ID:-none}}, host $(hostname)" >> {log:q} && '
)

# Fail fast on user errors: actcache exits 2 on an error every retry would meet again (a corrupt
# image, a bad config). That attempt leaves <log without .log>.user-error; a retry (`retries:` of
# the profile) finds it and stops at once, running nothing. Attempt 1 (a new snakemake run, after
# the fix) deletes it. Other exit statuses (node failure, preemption, timeout, kill) are retried.
USER_ERROR = (
    'user_error={log:q}; user_error="${{user_error%.log}}.user-error"; '
    'if [ {resources.attempt} -gt 1 ] && [ -e "$user_error" ]; then '
    'msg="actcache: not retried: an earlier attempt failed with a user error (exit status 2, its log is beside '
    '{log}); fix what it names and run snakemake again"; echo "$msg" >> {log:q}; echo "$msg" >&2; exit 2; fi; '
    'rm -f "$user_error" && '
)


def fail_fast(command):
    """`command` (a shell template, after USER_ERROR) such that its exit status 2 is recorded for the retry."""
    return f'{{{{ {command}; }}}} || {{{{ rc=$?; [ "$rc" -ne 2 ] || touch "$user_error"; exit "$rc"; }}}}'


# The `attempt` resource of each job (1, then 2 on the first retry, ...) names its log.
def attempt(wildcards, attempt):
    return attempt


# ---- Slurm site checks (actcache.slurmsite) ---------------------------------------------------
# Before anything is submitted, the snakemake a user started asks the cluster (sacctmgr, scontrol)
# whether the account, partitions, GPU model and QOS of the profile in force exist and admit this
# user: one line per problem naming the variable to set, then the run (or dry run) stops, exit
# status 2. Quiet where Slurm is not installed; ACTCACHE_SLURM_SKIP_CHECKS=1 skips it.
_SITE_JOBS = (
    jobs_from_resources(workflow.resource_settings.default_resources, workflow.resource_settings.overwrite_resources)
    if workflow.is_main_process
    else []
)
if submits_to_slurm(sys.argv, _SITE_JOBS):
    _SITE_PROBLEMS = check_site(_SITE_JOBS)
    for _line in _SITE_PROBLEMS:
        print(f"actcache: Slurm site: {_line}", file=sys.stderr)
    if _SITE_PROBLEMS:
        print(
            f"actcache: nothing was submitted. (Asked of the cluster with sacctmgr and scontrol; where a check "
            f"is wrong for your site, {SKIP_VAR}=1 skips them.)",
            file=sys.stderr,
        )
        sys.exit(2)
# ---- end of the Slurm site checks -------------------------------------------------------------

# Warnings about the Slurm site settings (account unset or unknown, MinJobAge too short for the
# squeue status check), once, on the login node: never inside a job.
_DEFAULT_RESOURCES = workflow.resource_settings.default_resources
if workflow.is_main_process and _DEFAULT_RESOURCES is not None and "slurm_account" in _DEFAULT_RESOURCES.keys():
    # against the status-check delay in force: the command line's, else the profile's
    for _w in site_warnings(status_init_s=status_init_in_force(sys.argv)):
        print(f"actcache: warning: {_w}", file=sys.stderr)

# A lock left by a snakemake that was killed (lost login session, SIGKILL): Snakemake refuses to
# run until `--unlock`. Say what is safe to do, since its jobs may still be queued or running.
_LOCKS = os.path.join(".snakemake", "locks")
if workflow.is_main_process and os.path.isdir(_LOCKS) and os.listdir(_LOCKS):
    print(
        "actcache: this directory holds a Snakemake lock. If no other snakemake runs here (one that was "
        "killed left it), run the same command with --unlock, then again without it: the jobs the killed run "
        "submitted that are still queued or running (dump, gather, train, spliced_eval, report, sweep_report) "
        "are awaited (rules await_*), never submitted twice.",
        file=sys.stderr,
    )

# hash -> the mark of each shard range (a range found incomplete on disk gets the other slot, so
# its dump job runs again; the gather after it verifies the cache again).
DUMP_MARKS = {_h: dump_marks(_p, os.path.join(DUMP_TO, _h)) for _h, _p in CACHES.items()}

# (hash, group id) -> its training job. The group id is RunConfig.group_id, the same id that
# `actcache plan` prints and `actcache train --group` takes. A group with an SAE that has no done
# file yet (e.g. a changed hyperparameter made a new SAE id) gets a new mark slot: a new training
# job, and never a dump job.
try:
    TRAIN_JOBS = {(_job.cache_hash, _job.group_id): _job for _job in train_jobs(PLAN + EXTERNAL, RUNS_TO)}
except ActCacheError as err:
    _fail(str(err))

# (hash, sae id) -> the id of the training group that writes it.
SAE_GROUP = {(h, sae): gid for (h, gid), job in TRAIN_JOBS.items() for sae in job.sae_ids}

# (hash, sae id) -> what the SAE is (objective, k or coefficient, width, layer), for report menus.
SAE_TITLES = {
    (_p.hash, _r.sae_id): _r.title(getattr(_p.metadata, "d_vit", None)) for _p in PLAN + EXTERNAL for _r in _p.train_runs()
}


def sae_title(hash, sae):
    return SAE_TITLES.get((hash, sae), "")


def experiment_file(hash):
    return CACHES[hash].exp.source


def range_marks(hash):
    return DUMP_MARKS[hash]


def train_job(hash, group):
    return TRAIN_JOBS[(hash, group)]


# The finished cache a training job reads: an experiment's under DUMP_TO, or one of `caches:`.
EXTERNAL_DIRS = {_c.hash: _c.cache_dir for _c in EXTERNAL if _c.hash not in CACHES}


def has_images(hash):
    """Whether the visuals can show a cache's images: an experiment's always; one of `caches:` when
    its metadata names a dataset actcache opens (a saev cache's is opaque)."""
    return all(_c.has_images for _c in EXTERNAL if _c.hash == hash and hash not in CACHES)


def cache_shards(hash):
    return os.path.join(EXTERNAL_DIRS.get(hash) or os.path.join(DUMP_TO, hash), SHARDS_FILE)


def train_commands(hash, group, runs_to):
    """The `actcache train` calls of one training job, one per file that has SAEs in it (an
    experiment reads its cache under DUMP_TO; a `caches:` entry names its directory)."""
    calls = []
    for args in train_job(hash, group).train_args:
        args = (*args, "--dump-to", DUMP_TO) if args[0] == "--experiment" else args
        calls.append(f"{AS_TASK_RAW} {ACTCACHE} train {shlex.join(args)} --group {group} --runs-to {shlex.quote(runs_to)}")
    return " && ".join(calls)


def all_targets():
    out = [os.path.join(DUMP_TO, h, SHARDS_FILE) for h in CACHES]
    out += [m for h in CACHES for m in range_marks(h)]  # a lost shard re-runs its range's job
    out += [job.mark for job in TRAIN_JOBS.values()]
    return out


# ---- visuals (workflow/rules/report.smk) --------------------------------------------------
wildcard_constraints:
    sae=r"[0-9a-f]{12}",


def visuals_group_mark(hash, sae):
    return train_job(hash, SAE_GROUP[(hash, sae)]).mark


def sae_done(hash, sae):
    """An SAE's done file, checked by the trained rule: its page depends on it, not on its group's
    mark, so a group that trains a new member re-renders only that member's page."""
    return os.path.join(run_dir(RUNS_TO, hash, sae), DONE_FILE)


def sae_eval(hash, sae):
    """An SAE's eval.json (training writes it, `actcache eval` rewrites it): its page is stale when it changes."""
    return os.path.join(run_dir(RUNS_TO, hash, sae), EVAL_FILE)


def sweep_group_marks(hash):
    return sorted(job.mark for (h, _), job in TRAIN_JOBS.items() if h == hash)


def spliced_mark(hash):
    """The spliced evaluation's mark, or none for a cache whose images and model actcache cannot
    open (one of `caches:` written by saev): its Pareto view of spliced metrics stays empty."""
    return os.path.join(RUNS_TO, hash, GROUPS_DIR, SPLICED_MARK) if has_images(hash) else []


def sweep_run_dirs(hash):
    return [run_dir(RUNS_TO, hash, sae) for (h, sae) in sorted(SAE_GROUP) if h == hash]


def report_targets():
    """Every per-SAE visuals page and every per-cache sweep plot (add to `rule all` to build them)."""
    out = [os.path.join(run_dir(RUNS_TO, h, s), VISUALS_PAGE) for h, s in SAE_GROUP]
    hashes = sorted({h for h, _ in SAE_GROUP})
    out += [os.path.join(sweep_dir(RUNS_TO, h), f) for h in hashes for f in SWEEP_PLOTS]
    return out


# ---- jobs in flight after a killed snakemake (rules await_*) ---------------------------------
# Under Slurm the job of every rule that is no localrule first writes its Slurm job id to a claim
# file beside its mark (CLAIM). A snakemake started after a killed one asks squeue, once, which of
# the jobs it would submit a live Slurm job of this user is already doing (claimed, or queued with
# the plugin's comment for that rule and wildcards), and plans an await_<rule> job on the login
# node for each instead of a second Slurm job. Asked only by the snakemake a user started (a
# job's own snakemake would find itself).
CLAIM = (
    'if [ -n "${{SLURM_JOB_ID:-}}" ]; then mkdir -p "$(dirname {params.claim})" && '
    'echo "$SLURM_JOB_ID" > {params.claim}.$SLURM_JOB_ID && mv -f {params.claim}.$SLURM_JOB_ID {params.claim}; fi && '
)


def groups_dir(hash):
    return os.path.join(RUNS_TO, hash, GROUPS_DIR)


def mark_claim(mark):
    """The claim file of the job that writes a slotted mark (<base>.<slot> -> <base>.job)."""
    return claim_path(os.path.dirname(mark), os.path.basename(mark).rsplit(".", 1)[0])


def gather_claim(hash):
    return claim_path(os.path.join(DUMP_TO, hash, DUMP_MARKS_DIR), "gather")


def report_claim(hash, sae):
    return claim_path(groups_dir(hash), f"report-{sae}")


def spliced_claim(hash):
    return claim_path(groups_dir(hash), "spliced")


def sweep_claim(hash):
    return claim_path(groups_dir(hash), "sweep")


def _range_of(mark):
    return os.path.basename(mark).rsplit(".", 1)[0]


def _unmarked_ranges(hash):
    """The ranges of a cache without a mark in the slot asked for, and, before its gather, those of
    its layout that ask for none (shards all on disk, no mark: maybe a job that has not yet touched
    its mark; see actcache.plan.dump_marks)."""
    asked = {_range_of(m): m for m in DUMP_MARKS[hash]}
    out = [r for r, m in asked.items() if not os.path.exists(m)]
    if not os.path.exists(os.path.join(DUMP_TO, hash, SHARDS_FILE)):
        layout = [_range_of(dump_mark(os.path.join(DUMP_TO, hash), a, b)) for a, b in CACHES[hash].ranges]
        out += [r for r in layout if r not in asked]
    return out


def _claims():
    """(rule, hash, name) -> Claim of every job but the dumps this run would submit: name is the
    group or SAE ("" for one job per cache)."""
    out = {}
    for h in CACHES:
        if not os.path.exists(os.path.join(DUMP_TO, h, SHARDS_FILE)):
            out["gather", h, ""] = Claim(gather_claim(h), plugin_comment("gather", h))
    for (h, g), job in TRAIN_JOBS.items():
        if not os.path.exists(job.mark):
            out["train", h, g] = Claim(mark_claim(job.mark), plugin_comment("train", h, g))
    for h, sae in SAE_GROUP:
        if not os.path.exists(os.path.join(run_dir(RUNS_TO, h, sae), VISUALS_PAGE)):
            out["report", h, sae] = Claim(report_claim(h, sae), plugin_comment("report", h, sae))
    for h in sorted({h for h, _ in SAE_GROUP}):
        if spliced_mark(h) and not os.path.exists(spliced_mark(h)):
            out["spliced_eval", h, ""] = Claim(spliced_claim(h), plugin_comment("spliced_eval", h))
        if not all(os.path.exists(os.path.join(sweep_dir(RUNS_TO, h), f)) for f in SWEEP_PLOTS):
            out["sweep_report", h, ""] = Claim(sweep_claim(h), plugin_comment("sweep_report", h))
    return out


def _dumps_in_flight():
    """(dump, hash, range) -> InFlight: the live dump jobs of unmarked ranges, also of ranges of
    another job layout (cache.shards_per_job) that overlap them; those keep their range, and the
    current layout's ranges are cut around them (actcache.plan.around)."""
    out = {}
    for h in CACHES:
        found = claimed_ranges(_LIVE, h, _unmarked_ranges(h), os.path.join(DUMP_TO, h, DUMP_MARKS_DIR))
        if found:
            DUMP_MARKS[h] = dump_marks(CACHES[h], os.path.join(DUMP_TO, h), in_flight=list(found))
        for r, job in found.items():
            out["dump", h, r] = InFlight(job, slot_of(_LIVE[job], plugin_comment("dump", h, r), MARK_SLOTS) or "")
    return out


# squeue first: without Slurm, or with no job of this user, no claim is looked at
_LIVE = live_jobs() if workflow.is_main_process else {}
IN_FLIGHT = {**_dumps_in_flight(), **in_flight(_claims(), MARK_SLOTS, live=_LIVE)} if _LIVE else {}


def _with_slot(mark, slot):
    return f"{mark.rsplit('.', 1)[0]}.{slot}"


# An awaited dump or train job writes its mark in the slot it was submitted with: ask for that one
# (also for a range that asked for none: so gather's inputs are the same in the next run).
for (_kind, _h, _name), _f in IN_FLIGHT.items():
    if _kind == "dump" and _f.slot:
        _mark = os.path.join(DUMP_TO, _h, DUMP_MARKS_DIR, f"{_name}.{_f.slot}")
        DUMP_MARKS[_h] = [m for m in DUMP_MARKS[_h] if _range_of(m) != _name] + [_mark]
    elif _kind == "train" and _f.slot:
        TRAIN_JOBS[_h, _name] = dataclasses.replace(TRAIN_JOBS[_h, _name], mark=_with_slot(TRAIN_JOBS[_h, _name].mark, _f.slot))


def in_flight_job(kind, hash, name=""):
    return IN_FLIGHT[kind, hash, name].job


def awaited(kind, within=None, then=None):
    """The {hash} constraint of the await job of `kind`, the name of a job rule. A hash with a job
    of that kind in flight; with `then` (one job per range, group or SAE), a lookahead that the path
    goes on with /<within>/<name><then> for a name in flight (no other one of that hash)."""
    names = {}
    for k, h, name in IN_FLIGHT:
        if k == kind:
            names.setdefault(h, []).append(re.escape(name))
    rest = "".join(re.escape(os.sep + d) for d in [within] if d) + re.escape(os.sep)
    alts = [
        h + (f"(?={rest}(?:{'|'.join(sorted(n))}){re.escape(then)})" if then is not None else "")
        for h, n in sorted(names.items())
    ]
    return "|".join(alts) or "(?!)"
