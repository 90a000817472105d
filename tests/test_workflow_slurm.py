"""End to end on a real Slurm cluster: the workflow through snakemake-executor-plugin-slurm with a
profile like profiles/osc (account, partition, GPU requests), on the local cluster that
scripts/slurm/up.sh starts."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import job_counts, snakemake, write_project

import slurm_fixture
from actcache import ActivationCache

slurm_cluster = slurm_fixture.slurm_cluster
pytestmark = pytest.mark.slurm


def test_workflow_runs_dump_jobs_on_slurm(slurm_cluster, tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    exp = {
        "name": "onslurm",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
        "data": {"kind": "synthetic", "n_imgs": 30, "seed": 2, "size": 40},
        "cache": {"max_patches_per_shard": 10 * 17, "batch_size": 10, "n_workers": 0, "shards_per_job": 2},
    }
    cfg = write_project(str(tmp_path / "proj"), {"onslurm": exp})
    dry = snakemake(cfg, "-n", profile="test-slurm")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert job_counts(dry.stdout + dry.stderr)["dump"] == 2  # 3 shards, 2 per job
    start = (datetime.datetime.now() - datetime.timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%S")
    proc = snakemake(cfg, profile="test-slurm", timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    rows = slurm_cluster.sacct(
        "-S",
        start,
        "-a",
        fields="JobID,JobName,State,ExitCode,Comment,Account,Partition,AllocTRES",
        wait_s=30,
        until=lambda rows: (
            sum("dump" in r["Comment"] for r in rows) >= 2 and all(r["State"] == "COMPLETED" for r in rows)
        ),
    )
    dumps = [r for r in rows if "dump" in r["Comment"]]
    assert len(dumps) == 2, rows
    for r in dumps:
        assert r["State"] == "COMPLETED" and r["ExitCode"] == "0:0", r
        assert r["Account"] == slurm_cluster.account and r["Partition"] == slurm_cluster.partition
        assert "gres/gpu=1" in r["AllocTRES"], r  # the GPU request reached Slurm
    assert any("gather" in r["Comment"] for r in rows), rows

    planned = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "plan", "--config", cfg, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    import json

    (p,) = json.loads(planned.stdout)
    assert p["cache"]["state"] == "complete"
    verify = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "verify", "--deep", p["dir"]], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout
    assert ActivationCache.open(p["dir"]).n_imgs == 30
    assert os.path.exists(os.path.join(p["dir"], "acts000002.bin"))
