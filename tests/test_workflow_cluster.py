"""Workflow behaviour that matters on a cluster, checked with profiles/local: `actcache plan
--failures` shows what failed and why (that the job layout is not part of a cache's outputs is
checked on the finished project of test_workflow.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import snakemake, write_project


def dump_only(ckpt: str, shards_per_job: int) -> dict:
    return {
        "name": "layout",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
        "data": {"kind": "synthetic", "n_imgs": 30, "seed": 3, "size": 40},
        "cache": {
            "max_patches_per_shard": 10 * 17, "batch_size": 10, "n_workers": 0, "shards_per_job": shards_per_job,
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-clip"), "clip")


def plan_cli(cwd: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actcache.cli", "plan", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_plan_failures_lists_the_failed_job_with_its_log_tail(tmp_path, ckpt):
    # plan reads only the checkpoint's config.json; the dump job then fails loading its weights
    broken = str(tmp_path / "broken-clip")
    subprocess.run(["cp", "-r", ckpt, broken], check=True)
    for f in os.listdir(broken):
        if f.endswith((".safetensors", ".bin")):
            with open(os.path.join(broken, f), "wb") as fd:
                fd.write(b"not a checkpoint")
    cfg = write_project(str(tmp_path), {"layout": dump_only(broken, 3)})
    proc = snakemake(cfg, "--cores", "1")
    assert proc.returncode != 0
    shown = plan_cli(str(tmp_path), "--failures")
    assert shown.returncode == 0, shown.stderr
    assert "1 failed job(s)" in shown.stdout and "rule dump" in shown.stdout, shown.stdout
    assert ".actcache-dump/000000-000003.done" in shown.stdout  # the failed job's output
    # the tail of the attempt's rule log: which attempt it was, and the dump's own error
    assert "attempt 1, Slurm job none" in shown.stdout
    assert "| " in shown.stdout.split("last")[1] and "Error" in shown.stdout.split("last")[1], shown.stdout


def test_plan_failures_without_a_run_says_so(tmp_path):
    shown = plan_cli(str(tmp_path), "--failures")
    assert shown.returncode == 0 and "no failed jobs" in shown.stdout
