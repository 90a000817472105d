"""What the workflow asks Slurm: site warnings, dump jobs still in flight, and waiting for them.

- :func:`site_warnings`: the account the profile will charge is unset or unknown to the cluster
  (``sacctmgr``), or MinJobAge is too short for the profile's ``squeue`` status check. Printed by
  the dry run and by ``actcache plan``; they warn, never fail.
- Claims: a dump job under Slurm writes its job id to ``<HASH>/.actcache-dump/<A-B>.job`` before
  it starts. :func:`in_flight_claims` finds the ranges whose claiming job is still running, or
  whose job is still queued (by the job comment the plugin sets; one ``squeue`` call), so a
  rerun after a killed snakemake waits for that job
  (``python -m actcache.slurmjobs await ...``, rule ``await_dump``) instead of submitting a
  second job for the same range.
Every Slurm command is optional: where it is missing or fails, nothing is in flight and there is
nothing to warn about.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import subprocess
import sys
import time

ACCOUNT_VAR = "ACTCACHE_SLURM_ACCOUNT"
CLAIM_SUFFIX = ".job"
STATUS_INIT_S = 40  # profiles/osc: slurm-init-seconds-before-status-checks
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


def site_warnings(env=None, status_init_s: int = STATUS_INIT_S) -> list[str]:
    """One line per problem of the Slurm site settings that would show only at submission."""
    env = os.environ if env is None else env
    out = []
    account = env.get(ACCOUNT_VAR, "")
    known = user_accounts()
    if not account:
        hint = f" (yours: {', '.join(sorted(known))})" if known else ""
        out.append(
            f"{ACCOUNT_VAR} is not set: the Slurm plugin will guess the account from your last job; "
            f"export {ACCOUNT_VAR}=<your project>{hint}."
        )
    elif known is not None and account.lower() not in known:
        out.append(
            f"{ACCOUNT_VAR}={account} is not one of your Slurm accounts ({', '.join(sorted(known))}); "
            "submission will fail. Set it to one of them."
        )
    age = min_job_age_s()
    if age is not None and age < 3 * status_init_s:
        out.append(
            f"Slurm's MinJobAge is {age} s, under 3 x {status_init_s} s: the plugin then checks job status with "
            "sacct, which does not see a cancelled job as ended. Ask for a longer MinJobAge, or lower "
            "slurm-init-seconds-before-status-checks."
        )
    return out


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


def in_flight_claims(ranges: dict[str, list[str]], marks_dirs: dict[str, str]) -> dict[str, dict[str, str]]:
    """hash -> {range tag: job id} for the given unfinished ranges that a live Slurm job is dumping:
    one that claimed the range (running), or one whose comment, set by the Snakemake plugin to the
    rule and its wildcards, names the range (still queued, so without a claim yet)."""
    if not any(ranges.values()):
        return {h: {} for h in ranges}
    live = live_jobs()
    if not live:
        return {h: {} for h in ranges}
    out: dict[str, dict[str, str]] = {}
    for h, tags in ranges.items():
        found = out.setdefault(h, {})
        for r in tags:
            job = read_claim(claim_path(marks_dirs[h], r))
            if job in live:
                found[r] = job
        by_comment = {c: j for j, c in live.items() if c.startswith(f"rule_dump_wildcards_{h}_")}
        for comment, job in by_comment.items():
            for r in tags:
                if r not in found and comment.startswith(f"rule_dump_wildcards_{h}_{r}_"):
                    found[r] = job
    return out


def await_job(job: str, mark: str, poll_s: float = 10.0) -> int:
    """Wait until Slurm job ``job`` has left the queue; 0 when it left ``mark`` behind."""
    print(f"waiting for Slurm job {job} (started by an earlier snakemake) to finish {mark}", flush=True)
    while job in live_jobs():
        time.sleep(poll_s)
    if os.path.exists(mark):
        print(f"Slurm job {job} finished {mark}", flush=True)
        return 0
    print(f"Slurm job {job} ended without finishing {mark}; the next run dumps this range again", flush=True)
    return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m actcache.slurmjobs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("await", help="wait for a dump job of an earlier run; exit 0 when it wrote its mark")
    a.add_argument("job")
    a.add_argument("mark")
    a.add_argument("--poll-s", type=float, default=10.0)
    sub.add_parser("warnings", help="print the site warnings")
    args = ap.parse_args(argv)
    if args.cmd == "await":
        return await_job(args.job, args.mark, args.poll_s)
    for w in site_warnings():
        print(f"warning: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
