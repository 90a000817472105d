"""How long a short Slurm job's end takes to be noticed, at two status-check delays of the osc profile.

    python scripts/bench_slurm_polls.py [--stages 3] [--rounds 2] [--delays 40,10]

On the local Slurm of scripts/slurm/up.sh (started if needed), a chain of ``--stages`` short jobs
(each ``sleep 1``; the job's own snakemake start makes it last ~10-20 s) runs through
``snakemake --profile profiles/osc`` with profiles/sites/local-slurm.env, once per delay
(``--slurm-init-seconds-before-status-checks``) per round, alternating. Noticed after = the time
Snakemake logs "Finished jobid" minus the job's End in sacct (both to the second). The first
delay is the reference: the plugin's default, which the profile used before.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib

PROFILE = os.path.join(benchlib.ROOT, "profiles", "osc")
RUN_TIMEOUT_S = 900


def snakefile(stages: int) -> str:
    rules = [f'rule all:\n    input: "s{stages}.txt"\n']
    for i in range(1, stages + 1):
        inp = f'    input: "s{i - 1}.txt"\n' if i > 1 else ""
        rules.append(f'rule s{i}:\n{inp}    output: "s{i}.txt"\n    shell: "sleep 1; touch {{output}}"\n')
    return "\n".join(rules)


def check_times(delay: int, n: int) -> list[int]:
    """Seconds after a submission at which the plugin checks, while no job ends: ``delay``, then
    each wait 10 s longer (up to 180 s)."""
    out, t, wait = [], 0, delay
    for _ in range(n):
        t += wait
        out.append(t)
        wait = min(wait + 10, 180)
    return out


def _when(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%a %b %d %H:%M:%S %Y").timestamp()


def one_run(workdir: str, delay: int) -> tuple[float, list[float]]:
    """Wall seconds of the whole chain, and each job's noticed-after seconds."""
    for f in os.listdir(workdir):  # a fresh run: no outputs, no .snakemake
        path = os.path.join(workdir, f)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif f != "Snakefile":
            os.unlink(path)
    cmd = [
        "timeout", "-s", "KILL", str(RUN_TIMEOUT_S), sys.executable, "-m", "snakemake", "--profile", PROFILE,
        "-d", workdir, "-s", os.path.join(workdir, "Snakefile"), "--slurm-init-seconds-before-status-checks",
        str(delay),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=benchlib.site_env(), cwd=workdir)
    wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed (rc={proc.returncode}):\n{log[-4000:]}")
    slurm_id = dict(re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", log))
    finished = {m.group(2): _when(m.group(1)) for m in re.finditer(r"\[(.+?)\]\nFinished jobid: (\d+)", log)}
    ends = {}
    deadline = time.monotonic() + 30
    while len(ends) < len(slurm_id) and time.monotonic() < deadline:  # accounting is written asynchronously
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-o", "JobID,End", "-j", ",".join(slurm_id.values())],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        rows = [r.split("|") for r in out.split()]
        ends = {j: datetime.datetime.fromisoformat(e).timestamp() for j, e in rows if e[:1].isdigit()}
        time.sleep(0.5)
    return wall, [finished[job] - ends[sid] for job, sid in slurm_id.items() if sid in ends and job in finished]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--delays", default="40,10", help="reference first")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    delays = [int(d) for d in args.delays.split(",")]
    up = subprocess.run(
        ["bash", os.path.join(benchlib.ROOT, "scripts", "slurm", "up.sh")], capture_output=True, text=True
    )
    if up.returncode != 0:
        raise SystemExit(f"the local Slurm did not start:\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    load0 = os.getloadavg()[0]
    walls: dict[int, list[float]] = {d: [] for d in delays}
    noticed: dict[int, list[float]] = {d: [] for d in delays}
    with tempfile.TemporaryDirectory(prefix="bench-slurm-polls-") as workdir:
        with open(os.path.join(workdir, "Snakefile"), "w") as fd:
            fd.write(snakefile(args.stages))
        for r in range(args.rounds):
            for d in delays if r % 2 == 0 else delays[::-1]:
                wall, lat = one_run(workdir, d)
                walls[d].append(wall)
                noticed[d] += lat
                print(
                    f"round {r + 1} delay {d} s: wall {wall:.1f} s, noticed after {[round(x) for x in lat]} s",
                    flush=True,
                )
    ref = delays[0]
    rows = [
        {
            "delay s": d,
            "jobs": len(noticed[d]),
            "noticed after, median s": statistics.median(noticed[d]),
            "max s": max(noticed[d]),
            "chain wall, median s": statistics.median(walls[d]),
            "noticed / ref": statistics.median(noticed[d]) / statistics.median(noticed[ref]),
            "wall / ref": statistics.median(walls[d]) / statistics.median(walls[ref]),
        }
        for d in delays
    ]
    new = delays[-1]
    checks = [
        benchlib.check(
            f"a short job's end noticed <= 0.5 x as late at the profile's {new} s as at {ref} s (median)",
            rows[-1]["noticed / ref"], 0.5, f"x ref ({rows[-1]['noticed after, median s']:.0f} s vs "
            f"{rows[0]['noticed after, median s']:.0f} s)", at_least=False,
        )
    ]  # fmt: skip
    setup = [
        f"Local single-node Slurm (scripts/slurm/up.sh), profiles/osc with profiles/sites/local-slurm.env; a chain of "
        f"{args.stages} jobs (sleep 1 each, ~10-20 s with the job's own snakemake start), run {args.rounds} times per "
        "delay, alternating.",
        "delay: --slurm-init-seconds-before-status-checks (the plugin's wait while idle and after a check that saw a "
        "job end; +10 s after each that saw none, up to 180 s). Reference: 40 s, the plugin's default and the "
        "profile's before.",
        "noticed after: Snakemake's 'Finished jobid' log time minus the job's sacct End (1 s resolution); chain wall: "
        "the whole snakemake run.",
        f"1-minute load average at the start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ]
    schedule = {d: ", ".join(str(t) for t in check_times(d, 4)) for d in delays}
    conclusions = [c.bullet() for c in checks] + [
        "Checks after a submission (no job ending meanwhile): "
        + "; ".join(f"delay {d} s: {schedule[d]} s" for d in delays)
        + ". A job is noticed at the first check after its end, so the gain depends on its length: "
        "largest for jobs of a few seconds, none for those ending just before a check of the reference."
    ]
    body = benchlib.section_body(setup, [benchlib.table(rows)], conclusions)
    print(body)
    if not args.no_record:
        # the summary table at the top is the lead's: this section's line goes there by hand
        benchlib.record("slurm-polls", "Slurm status polling: a short job's end noticed, by status-check delay", body)


if __name__ == "__main__":
    main()
