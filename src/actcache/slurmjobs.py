"""What the workflow asks Slurm: site warnings, dump jobs still in flight, and waiting for them.

- :func:`site_warnings`: the account the profile will charge is unset or unknown to the cluster
  (``sacctmgr``), or MinJobAge is too short for the profile's ``squeue`` status check. Printed by
  the dry run and by ``actcache plan``; they warn, never fail.
- :func:`sbatch_extra`: the extra sbatch flags of one rule's jobs, from the site's environment
  variables (profiles/osc's ``slurm_extra``).
- Claims: a workflow job under Slurm (dump, gather, train, spliced_eval, report, sweep_report)
  writes its job id to a claim file beside its mark when it starts
  (``<HASH>/.actcache-dump/<name>.job``, ``<runs_to>/<HASH>/groups/<name>.job``).
  :func:`in_flight` finds the jobs whose claiming Slurm job is still running, or still queued (by
  the job comment the plugin sets; one ``squeue`` call), and checks that the Slurm job is this
  user's job of that rule and wildcards; so a rerun after a killed snakemake waits for that job
  (``python -m actcache.slurmjobs await ...``, the ``await_*`` rules) instead of submitting a
  second one.
Every Slurm command is optional: where it is missing or fails, nothing is in flight and there is
nothing to warn about.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import os
import re
import shlex
import subprocess
import sys
import time

ACCOUNT_VAR = "ACTCACHE_SLURM_ACCOUNT"
RESERVATION_VAR = "ACTCACHE_SLURM_RESERVATION"
EXTRA_VAR = "ACTCACHE_SLURM_EXTRA"  # every job; ACTCACHE_SLURM_<RULE>_EXTRA: one rule's jobs
JOB_RULES = ("dump", "gather", "train", "spliced_eval", "report", "sweep_report")  # profiles/osc's set-resources
CLAIM_SUFFIX = ".job"
STATUS_INIT_S = 40  # the plugin's default slurm-init-seconds-before-status-checks (profiles/osc sets its own)
POLL_MAX_S = 180  # plugin 2.8: its longest wait between two status checks
LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    """stdout of a Slurm command, or None where it is missing, fails or hangs."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def user_accounts() -> set[str] | None:
    """The Slurm accounts of this user (lower case), or None where sacctmgr cannot say."""
    out = _run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=Account"])
    if out is None:
        return None
    return {line.strip().lower() for line in out.splitlines() if line.strip()} or None


def min_job_age_s() -> int | None:
    out = _run(["scontrol", "show", "config"])
    m = re.search(r"^MinJobAge\s*=\s*(\d+)", out or "", re.M)
    return int(m.group(1)) if m else None


def rule_extra_var(rule: str) -> str:
    return f"ACTCACHE_SLURM_{rule.upper()}_EXTRA"


def sbatch_extra(rule: str, env=None) -> str | None:
    """The extra sbatch flags of ``rule``'s jobs (the plugin's ``slurm_extra``), or None for none:
    ``--reservation`` from ACTCACHE_SLURM_RESERVATION, then ACTCACHE_SLURM_EXTRA (every job), then
    ACTCACHE_SLURM_<RULE>_EXTRA (none for rule ""), the last two verbatim (e.g. ``--exclusive``)."""
    env = os.environ if env is None else env
    parts = [f"--reservation={shlex.quote(env[RESERVATION_VAR])}"] if env.get(RESERVATION_VAR) else []
    parts += [env.get(EXTRA_VAR) or "", (env.get(rule_extra_var(rule)) or "") if rule else ""]
    return " ".join(p.strip() for p in parts if p.strip()) or None


def _managed_flags():
    """sbatch flags the Slurm plugin sets itself and refuses in slurm_extra: {regex: what}."""
    try:
        from snakemake_executor_plugin_slurm.validation import get_forbidden_slurm_options
    except ImportError:
        return {}
    return get_forbidden_slurm_options()


def extra_warnings(env, rules) -> list[str]:
    """An extra-flags variable holding a flag the plugin manages (the job would fail at submission)."""
    out = []
    for var in dict.fromkeys([EXTRA_VAR, *(rule_extra_var(r) for r in rules)]):
        value = env.get(var) or ""
        for pattern, what in _managed_flags().items():
            if re.search(pattern, value):
                out.append(
                    f"{var}={value!r} sets the {what}, which the Slurm plugin sets itself and refuses there; "
                    "use the profile's variable for it (README, Slurm section) and drop it from "
                    f"{var}."
                )
                break
    return out


def site_warnings(env=None, status_init_s: int = STATUS_INIT_S, rules=JOB_RULES) -> list[str]:
    """One line per problem of the Slurm site settings that would show only at submission.
    ``status_init_s``: the plugin's slurm-init-seconds-before-status-checks in force; ``rules``:
    the rules whose ACTCACHE_SLURM_<RULE>_EXTRA to check."""
    env = os.environ if env is None else env
    out = []
    account = env.get(ACCOUNT_VAR, "")
    known = user_accounts()
    if not account:
        hint = f" (yours: {', '.join(sorted(known))})" if known else ""
        out.append(
            f"{ACCOUNT_VAR} is not set: jobs are submitted without an account, so Slurm charges your default "
            "account (the Slurm plugin's guess from your last job fails with plugin 2.8); "
            f"export {ACCOUNT_VAR}=<your project>{hint}."
        )
    elif known is not None and account.lower() not in known:
        out.append(
            f"{ACCOUNT_VAR}={account} is not one of your Slurm accounts ({', '.join(sorted(known))}); "
            "submission will fail. Set it to one of them."
        )
    age = min_job_age_s()
    if age is not None and age <= POLL_MAX_S:
        out.append(
            f"Slurm's MinJobAge is {age} s: squeue forgets a finished job after that, but the Slurm plugin waits up "
            f"to {POLL_MAX_S} s between two status checks of a long job, so a job can end unseen and the workflow "
            f"wait for it forever (under 3 x {status_init_s} s, slurm-init-seconds-before-status-checks, the plugin "
            "uses sacct instead, which does not see a cancelled job as ended). Ask your Slurm admins for a "
            "MinJobAge of at least 300 s (Slurm's default)."
        )
    elif age is not None and age < 3 * status_init_s:
        out.append(
            f"Slurm's MinJobAge is {age} s, under 3 x {status_init_s} s (slurm-init-seconds-before-status-checks): "
            "the plugin then checks job status with sacct, which does not see a cancelled job as ended. "
            f"Run snakemake with --slurm-init-seconds-before-status-checks {max(1, age // 3)}, or ask for a "
            f"MinJobAge of at least {3 * status_init_s} s."
        )
    return out + extra_warnings(env, rules)


STATUS_INIT_FLAG = "--slurm-init-seconds-before-status-checks"


def status_init_in_force(argv: list[str], env=None) -> int:
    """The plugin's first status-check delay that a snakemake started with ``argv`` uses: its
    command-line flag, else its profile's key (a profile given as a directory), else the plugin's
    default. Read from argv because Snakemake parses the workflow before it hands the plugin its
    settings."""
    env = os.environ if env is None else env
    flag, profile = _argv_value(argv, STATUS_INIT_FLAG), _argv_value(argv, "--profile") or env.get("SNAKEMAKE_PROFILE")
    if flag is None and profile:
        flag = _profile_value(profile, STATUS_INIT_FLAG[2:])
    try:
        return int(flag)
    except (TypeError, ValueError):
        return STATUS_INIT_S


def _argv_value(argv: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _profile_value(profile: str, key: str):
    import yaml

    for name in ("profile.yaml", "config.yaml"):
        try:
            with open(os.path.join(profile, name)) as fd:
                doc = yaml.safe_load(fd)
        except (OSError, yaml.YAMLError):
            continue
        return doc.get(key) if isinstance(doc, dict) else None
    return None


def claim_path(marks_dir: str, range_tag: str) -> str:
    return os.path.join(marks_dir, range_tag + CLAIM_SUFFIX)


def read_claim(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
        try:
            job = os.read(fd, 64).decode("ascii", "replace").strip()  # a job id: bounded (not /dev/zero)
        finally:
            os.close(fd)
    except OSError:
        return None
    return job if job.isdigit() else None


def live_jobs() -> dict[str, str]:
    """Job id -> comment of this user's queued or running Slurm jobs ({} without Slurm)."""
    out = _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%A|%T|%k"])
    rows = [line.split("|", 2) for line in (out or "").splitlines() if line.count("|") >= 2]
    return {job: comment.strip() for job, state, comment in rows if state.strip() in LIVE_STATES}


@dataclasses.dataclass(frozen=True)
class Claim:
    """A workflow job a Slurm job may already be doing: the claim file that job writes its id to
    when it starts, and the comment the Slurm plugin gives it (:func:`plugin_comment`), less a
    trailing ``_<slot>`` for a rule whose mark has slots."""

    path: str
    comment: str


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A live Slurm job doing a claimed job: its id, and the mark slot it writes ("" for none)."""

    job: str
    slot: str = ""


def plugin_comment(rule: str, *wildcards: str) -> str:
    """The job comment snakemake-executor-plugin-slurm sets: the rule and its wildcard values."""
    return f"rule_{rule}_wildcards_{'_'.join(wildcards)}".replace("/", "_") if wildcards else f"rule_{rule}"


def slot_of(comment: str, want: str, slots) -> str | None:
    """The slot of a job whose comment is ``want`` (then "") or ``want_<slot>``; None: another job."""
    if comment == want:
        return ""
    return next((s for s in slots if comment == f"{want}_{s}"), None)


def in_flight(claims: dict, slots=(), live: dict[str, str] | None = None) -> dict:
    """key -> InFlight for each claim that a live Slurm job of this user is doing: the job its
    claim file names, when that job's comment is the claim's (a stale claim of a finished job, or
    of an id Slurm gave to another job, is no claim), else a queued job with that comment (not
    started, so without a claim yet). ``live``: job id -> comment (default: :func:`live_jobs`)."""
    if not claims:
        return {}
    live = live_jobs() if live is None else live
    if not live:
        return {}
    by_comment: dict[str, str] = {}
    for job, comment in live.items():
        by_comment.setdefault(comment, job)
    out = {}
    for key, claim in claims.items():
        job = read_claim(claim.path)
        if job not in live or slot_of(live[job], claim.comment, slots) is None:
            wanted = [claim.comment, *(f"{claim.comment}_{s}" for s in slots)]
            job = next((by_comment[c] for c in wanted if c in by_comment), None)
        if job is not None:
            out[key] = InFlight(job, slot_of(live[job], claim.comment, slots))
    return out


def claimed_ranges(live: dict[str, str], hash: str, tags: list[str], marks_dir: str) -> dict[str, str]:
    """{range tag: job id} of the live jobs (``live``: job id -> comment) dumping a range of cache
    ``hash`` that overlaps one of the range tags ``tags``, also one of another job layout
    (``cache.shards_per_job``) under its own tag: a claim file names a running job (trusted while
    that job's comment names that range), the plugin's comment a queued one."""
    wanted = [_span(t) for t in tags]
    try:
        names = os.listdir(marks_dir)
    except OSError:
        names = []
    claimed = {n[: -len(CLAIM_SUFFIX)] for n in names if n.endswith(CLAIM_SUFFIX)}
    in_comment = re.compile(rf"rule_dump_wildcards_{re.escape(hash)}_(\d{{6}}-\d{{6}})_")
    queued = {m.group(1): j for j, c in sorted(live.items()) if (m := in_comment.match(c))}
    others = [(r, _span(r)) for r in (claimed | set(queued)) - set(tags)]  # ranges of another layout
    overlapping = [r for r, span in others if span and any(span[0] < b and a < span[1] for a, b in wanted)]
    found: dict[str, str] = {}
    for r in sorted([*tags, *overlapping]):
        job = read_claim(claim_path(marks_dir, r)) if r in claimed else None
        if job in live and live[job].startswith(f"rule_dump_wildcards_{hash}_{r}_"):  # the claiming job
            found[r] = job
        elif r in queued:
            found[r] = queued[r]
    return found


def _span(tag: str) -> tuple[int, int] | None:
    """A range tag ``AAAAAA-BBBBBB`` -> (A, B); None for any other name."""
    m = re.fullmatch(r"(\d{6})-(\d{6})", tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


def await_job(job: str, output: str, poll_s: float = 30.0) -> int:
    """Wait until Slurm job ``job`` has left the queue; 0 when it left ``output`` behind. Polls
    after 2 s, then twice as long each time, up to ``poll_s``: a short job is noticed soon."""
    print(f"waiting for Slurm job {job} (submitted by an earlier snakemake) to finish {output}", flush=True)
    wait_s = min(2.0, poll_s)
    while job in live_jobs():
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, poll_s)
    if os.path.exists(output):
        print(f"Slurm job {job} finished {output}", flush=True)
        return 0
    print(f"Slurm job {job} ended without finishing {output}; the next run does this job again", flush=True)
    return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m actcache.slurmjobs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("await", help="wait for a job of an earlier run; exit 0 when it wrote its output")
    a.add_argument("job")
    a.add_argument("output")
    a.add_argument("--poll-s", type=float, default=30.0)
    sub.add_parser("warnings", help="print the site warnings")
    args = ap.parse_args(argv)
    if args.cmd == "await":
        return await_job(args.job, args.output, args.poll_s)
    for w in site_warnings():
        print(f"warning: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
