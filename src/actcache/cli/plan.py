"""`actcache plan`: per experiment, its cache hash, directory and status, and its SAEs.

`actcache plan --failures`: the failed jobs of the last workflow run in the current directory,
with the tail of each one's logs. Where Slurm is installed and a site's settings are in the
environment (an ACTCACHE_SLURM_* variable: a cluster run is meant), plan warns (on stderr) as the
dry run does when the Slurm account is unset or unknown; a local run gets no such warning."""

from __future__ import annotations

import json
import os

from actcache.errors import ConfigError
from actcache.plan import cache_summary, caches_from_config, check_eval_caches, plan, plan_from_config, plan_summary


def _print_row(r: dict) -> None:
    st = r["cache"]
    print(f"{r['experiment']}  ({r['file']})")
    print(f"  hash      {r['hash']}")
    print(f"  dir       {r['dir']}")
    print(
        f"  cache     {st['state']} ({st['shards_done']}/{st['n_shards']} shards, {r['dump_jobs']} dump job(s), "
        f"{r['dump_jobs_to_run']} to run)"
    )
    _print_size(r["size"], os.path.dirname(r["dir"]))
    for note in r["notes"]:
        print(f"  note      {note}")
    _print_training(r["training"])


def _print_size(size: dict, dump_to: str) -> None:
    from actcache.fsutil import fmt_bytes

    to_write, free = size["bytes_to_write"], size["free_bytes"]
    print(
        f"  size      {fmt_bytes(size['bytes'])} in {size['n_shards']} shard(s), {fmt_bytes(to_write)} still to write"
    )
    fits = "" if to_write <= free else f"  (does not fit: {fmt_bytes(to_write - free)} short)"
    print(f"  free      {fmt_bytes(free)} on {dump_to}{fits}")


def _print_training(training: list[dict]) -> None:
    if training:
        done = sum(t["done"] for t in training)
        print(f"  training  {done} of {len(training)} SAE(s) done")
        for t in training:
            print(f"    {'done   ' if t['done'] else 'pending'}  {t['sae_id']}  {t['title']}  group {t['group']}")


def _warn_slurm_site(env=None) -> None:
    """The Slurm account and MinJobAge warnings of the dry run, for a cluster run only."""
    import shutil
    import sys

    env = os.environ if env is None else env
    if shutil.which("sbatch") is None or not any(k.startswith("ACTCACHE_SLURM_") for k in env):
        return
    from actcache.slurmjobs import site_warnings

    for w in site_warnings(env):
        print(f"actcache: warning: {w}", file=sys.stderr)


def cmd_plan(args) -> int:
    if getattr(args, "failures", False):
        return print_failures(os.getcwd())
    dump_to, runs_to = args.dump_to, args.runs_to
    external = []
    if args.experiment and not os.path.exists(args.config):
        if not (dump_to and runs_to):
            raise ConfigError("--experiment without a workflow config needs --dump-to and --runs-to.")
        planned = plan(args.experiment, dump_to, runs_to, relist=args.relist)
    else:
        planned = plan_from_config(args.config, dump_to, runs_to, args.experiment or None, relist=args.relist)
        if not args.experiment:
            external = caches_from_config(args.config, runs_to)
    check_eval_caches(planned + external)  # the paths the training jobs read, as the dry run checks
    caches = [cache_summary(c) for c in external]
    rows = [plan_summary(p) for p in planned]
    _warn_slurm_site()
    if args.json:
        print(json.dumps(rows + caches, indent=2))
        return 0
    for r in rows:
        _print_row(r)
    for c in caches:
        _print_cache_row(c)
    return 0


def _print_cache_row(c: dict) -> None:
    print(f"existing cache  {c['cache']}  (train: {c['file']})")
    print(f"  hash      {c['hash']}")
    _print_training(c["training"])


# ---- `actcache plan --failures` ------------------------------------------------------------------

FAILURE_TAIL_LINES = 15


def failed_jobs(workdir: str) -> tuple[str | None, list[dict]]:
    """The newest Snakemake log under ``workdir`` that reports failed jobs, and those jobs (the last
    report of each output, in order): rule, wildcards, message, output, and log files."""
    import glob
    import re

    logs = sorted(glob.glob(os.path.join(workdir, ".snakemake", "log", "*.snakemake.log")), key=os.path.getmtime)
    for path in reversed(logs):
        with open(path, errors="replace") as fd:
            text = fd.read()
        jobs: dict[str, dict] = {}
        for m in re.finditer(r"^Error in rule (\S+):\n((?:    .*\n)+)", text, re.M):
            fields = dict(re.findall(r"^    (\w+): (.*)$", m.group(2), re.M))
            logs_ = re.sub(r"\s*\(check log file\(s\) for error details\)$", "", fields.get("log", ""))
            job = {
                "rule": m.group(1),
                "wildcards": fields.get("wildcards", ""),
                "message": fields.get("message", ""),
                "output": fields.get("output", ""),
                "logs": [f.strip() for f in logs_.split(",") if f.strip()],
            }
            jobs.pop(job["output"], None)  # a retry's report replaces the attempt before it
            jobs[job["output"]] = job
        if jobs:
            return path, list(jobs.values())
    return None, []


def attempt_logs(log: str) -> list[str]:
    """Every attempt's copy of a rule log (see ATTEMPT_LOG in workflow/rules/common.smk), oldest first."""
    import glob

    base = log[: -len(".log")] if log.endswith(".log") else log
    return sorted(glob.glob(glob.escape(base) + ".attempt*.log"), key=os.path.getmtime)


def _head(path: str) -> str:
    try:
        with open(path, errors="replace") as fd:
            return fd.readline().rstrip("\n")
    except OSError:
        return ""


def _tail(path: str, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as fd:
            return fd.read().splitlines()[-n:]
    except OSError as err:
        return [f"(cannot read: {err.strerror})"]


def print_failures(workdir: str, tail: int = FAILURE_TAIL_LINES) -> int:
    log, jobs = failed_jobs(workdir)
    if not jobs:
        print(f"no failed jobs in the Snakemake logs under {os.path.join(workdir, '.snakemake', 'log')}")
        return 0
    print(f"{len(jobs)} failed job(s) in {log}")
    for job in jobs:
        print(f"\nrule {job['rule']}  {job['wildcards'] or job['output']}".rstrip())
        if job["message"] not in ("", "None"):
            print(f"  message  {job['message']}")
        for f in job["logs"]:
            path = f if os.path.isabs(f) else os.path.join(workdir, f)
            older = [a for a in attempt_logs(path) if not os.path.samefile(a, path)] if os.path.exists(path) else []
            for a in older:
                print(f"  earlier attempt: {a}")
            first = _head(path)
            if first.startswith("attempt "):  # the rule logs' first line (workflow/rules/common.smk)
                print(f"  {first}")
            print(f"  --- last {tail} lines of {f}")
            for line in _tail(path, tail):
                print(f"  | {line}")
    return 0
