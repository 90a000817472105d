"""Helpers for workflow tests: a throwaway project (config + experiments) and snakemake calls.

Every snakemake call runs under `timeout -s KILL` (the slurm executor can otherwise loop forever
when accounting is broken).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAKEMAKE = os.path.join(os.path.dirname(sys.executable), "snakemake")


def write_project(root, experiments: dict[str, dict], dump_to=None, runs_to=None) -> str:
    """Write <root>/config.yaml and <root>/experiments/NAME.yaml; returns the config path."""
    os.makedirs(os.path.join(root, "experiments"), exist_ok=True)
    files = []
    for name, doc in experiments.items():
        path = os.path.join(root, "experiments", f"{name}.yaml")
        with open(path, "w") as fd:
            yaml.safe_dump(doc, fd, sort_keys=False)
        files.append(path)
    cfg = {
        "dump_to": dump_to or os.path.join(root, "cache"),
        "runs_to": runs_to or os.path.join(root, "runs"),
        "experiments": files,
    }
    cfg_path = os.path.join(root, "config.yaml")
    with open(cfg_path, "w") as fd:
        yaml.safe_dump(cfg, fd, sort_keys=False)
    return cfg_path


# A run with profiles/local on the test machine's 2 CPU cores: two jobs at a time, one thread each.
# The profile's own limits (one job at a time on the one GPU, several threads each) would run the
# tiny test jobs one after the other, each mostly Python importing torch and transformers.
# Pass it after any targets: --set-threads takes every word that follows it.
ONE_THREAD = ("dump=1", "train=1", "report=1", "spliced_eval=1")
TWO_AT_A_TIME = ("--cores", "2", "--resources", "gpu=2", "--set-threads", *ONE_THREAD)


def snakemake(cfg_path: str, *args: str, profile: str = "local", timeout: int = 600, workdir: str | None = None):
    workdir = workdir or os.path.dirname(cfg_path)
    cmd = [
        "timeout",
        "-s",
        "KILL",
        str(timeout),
        SNAKEMAKE,
        "-s",
        os.path.join(REPO, "Snakefile"),
        "--configfile",
        cfg_path,
        "-d",
        workdir,
        "--profile",
        os.path.join(REPO, "profiles", profile),
        *args,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)


def job_counts(output: str) -> dict[str, int]:
    """Rule -> job count from snakemake's "Job stats" table ({} when there is nothing to do)."""
    counts = {}
    m = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\n\s*total\s+\d+", output, re.S)
    if not m:
        return counts
    for line in m.group(1).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


def dump_ranges(output: str) -> list[str]:
    """The shard ranges (A-B tags) of the dump jobs a dry run lists (from their output marks, in
    either slot: actcache.plan.MARK_SLOTS)."""
    ranges = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        if block.startswith("rule dump:"):
            m = re.search(r"output: .*\.actcache-dump/(\d{6}-\d{6})\.(?:done|redo)", block)
            if m:
                ranges.append(m.group(1))
    return sorted(ranges)
