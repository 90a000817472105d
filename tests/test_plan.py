"""actcache.plan: the demo's plan pinned, workflow marks that only read the disk, one job per group."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import REPO, write_project

from actcache.ckptid import checkpoint_digest
from actcache.demo import make_demo_assets
from actcache.plan import current_mark, other_mark, plan_from_config, train_jobs
from actcache.protocol import Metadata
from actcache.rundir import done_path, group_mark

# `actcache plan --json` on the demo (config/config.yaml), as main printed it before the run
# directory and CLI moved: the project root reads /PROJECT and the cache hash <HASH>.
DEMO_SAE_IDS = ("92a21d2a43a4", "344d5f1c8e16")
DEMO_GROUP = "L-2-image-38c6335e"
DEMO_PLAN = [
    {
        "experiment": "demo",
        "file": "/PROJECT/config/experiments/demo.yaml",
        "hash": "<HASH>",
        "dir": "data/cache/<HASH>",
        "cache": {"state": "missing", "shards_done": 0, "n_shards": 4, "gathered": False},
        "dump_jobs": 4,
        "notes": [],
        "dump_jobs_to_run": 4,
        "training": [
            {"sae_id": sae, "group": DEMO_GROUP, "title": f"topk k={k} width=256 layer -2", "objective": "topk",
             "k": k, "width": 256, "layer": -2, "dir": f"data/runs/<HASH>/{sae}", "done": False}
            for sae, k in zip(DEMO_SAE_IDS, (4, 8), strict=True)
        ],
    }
]
# The hash of the demo's metadata with the project root at /PROJECT and the checkpoint's digest
# zeroed (the metadata holds the image folder's path, so the hash depends on where the images lie;
# the checkpoint is named by the digest of its files, wherever it lies).
DEMO_HASH_AT_PROJECT = "e3fe28ccc147cdba9d3350a0dd1278887a99c2bcbcb96db8bd6f87ddfc02ccb6"


@pytest.fixture(scope="module")
def demo_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    shutil.copytree(os.path.join(REPO, "config"), root / "config")
    make_demo_assets(str(root / "data" / "demo"))
    return str(root)


def test_demo_plan_is_pinned(demo_project, monkeypatch):
    proc = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "plan", "--json"],
        capture_output=True, text=True, timeout=300, cwd=demo_project,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    text = proc.stdout.replace(demo_project, "/PROJECT").replace(row["hash"], "<HASH>")
    size = row.pop("size")  # what the cache costs: its bytes, and the free space on dump_to (varies)
    assert size["n_shards"] == 4 and size["bytes"] == size["bytes_to_write"] > 0 and size["free_bytes"] > 0
    assert {k: v for k, v in json.loads(text)[0].items() if k != "size"} == DEMO_PLAN[0]
    monkeypatch.chdir(demo_project)  # the demo's paths are relative to the project root
    (p,) = plan_from_config(os.path.join("config", "config.yaml"))
    assert p.hash == row["hash"]
    ckpt = os.path.join(demo_project, "data", "demo", "models", "tiny-clip")
    assert p.metadata.vit_ckpt == "sha256:" + checkpoint_digest(ckpt)  # the checkpoint's files, not its path
    moved = json.loads(json.dumps(p.metadata.to_dict()).replace(demo_project, "/PROJECT"))
    moved["vit_ckpt"] = "sha256:" + "0" * 64  # the digest holds transformers' version (config.json)
    assert Metadata.from_dict(moved).hash == DEMO_HASH_AT_PROJECT
    assert size["bytes"] == p.metadata.n_imgs * p.metadata.bytes_per_img


def touch(path: str, age_s: float = 0.0) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w"):
        pass
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_a_complete_job_keeps_its_newest_mark(tmp_path):
    base = str(tmp_path / "000000-000001")
    assert current_mark(base, complete=False) == base + ".done"  # nothing yet: the first slot
    touch(base + ".done")
    assert current_mark(base, complete=True) == base + ".done"
    touch(base + ".redo", age_s=60)  # an older mark left in the other slot
    assert current_mark(base, complete=True) == base + ".done"


def test_an_incomplete_job_is_asked_for_the_other_slot(tmp_path):
    base = str(tmp_path / "L-2-image-38c6335e")
    touch(base + ".done")
    assert current_mark(base, complete=False) == base + ".redo"
    assert other_mark(base + ".redo") == base + ".done"  # what that job deletes first
    os.remove(base + ".done")
    touch(base + ".redo")  # ... and then the job ran
    assert current_mark(base, complete=True) == base + ".redo"
    assert current_mark(base, complete=False) == base + ".done"
    assert sorted(os.listdir(tmp_path)) == ["L-2-image-38c6335e.redo"]  # reading wrote nothing


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-clip"), "clip")


def experiment(ckpt: str, name: str, ks: list[int]) -> dict:
    return {
        "name": name,
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8, "seed": 1, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4},
        "train": {"batch_size": 16, "steps": 2, "sweep": {"k": ks}},
    }


def test_experiments_sharing_a_cache_and_group_share_one_training_job(tmp_path, ckpt):
    cfg = write_project(str(tmp_path), {"a": experiment(ckpt, "a", [2, 4]), "b": experiment(ckpt, "b", [4, 8])})
    pa, pb = plan_from_config(cfg)
    runs_to = str(tmp_path / "runs")
    (job,) = train_jobs([pa, pb], runs_to)
    ids_a = [r.sae_id for r in pa.train_runs()]
    ids_b = [r.sae_id for r in pb.train_runs()]
    assert job.group_id == pa.train_runs()[0].group_id == pb.train_runs()[0].group_id
    assert job.experiments == (pa.exp.source, pb.exp.source)
    assert job.sae_ids == (*ids_a, ids_b[1])  # k=4 is the same SAE in both: trained once
    assert job.mark == group_mark(runs_to, pa.hash, job.group_id) + ".done"


def test_a_new_sae_in_a_finished_group_asks_for_a_new_mark(tmp_path, ckpt):
    cfg = write_project(str(tmp_path), {"a": experiment(ckpt, "a", [2, 4])})
    (p,) = plan_from_config(cfg)
    runs_to = str(tmp_path / "runs")
    (job,) = train_jobs([p], runs_to)
    for sae in job.sae_ids:  # as the trainer and the job leave them
        touch(done_path(os.path.join(runs_to, p.hash, sae)))
    touch(job.mark)
    assert train_jobs([p], runs_to)[0].mark == job.mark
    cfg = write_project(str(tmp_path), {"a": experiment(ckpt, "a", [2, 4, 8])})
    (p,) = plan_from_config(cfg)
    (grown,) = train_jobs([p], runs_to)
    assert grown.group_id == job.group_id and grown.mark == other_mark(job.mark)


def test_plan_warns_about_the_slurm_site_only_for_a_cluster_run(monkeypatch, capsys):
    import shutil

    from actcache.cli import plan as cli_plan

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # Slurm installed here
    cli_plan._warn_slurm_site(env={"PATH": "/usr/bin"})  # a local run: no site settings
    assert capsys.readouterr().err == ""
    cli_plan._warn_slurm_site(env={"ACTCACHE_SLURM_GPU_PARTITION": "gpu"})  # a cluster run
    assert "ACTCACHE_SLURM_ACCOUNT is not set" in capsys.readouterr().err


def test_auto_shards_per_job_fills_gib_per_job_and_an_integer_is_exact():
    from actcache.plan import shard_ranges
    from actcache.writer import synthetic_metadata

    # 17 tokens x 32 floats = 2,176 bytes per image; 4 images (8,704 bytes) per shard; 10 shards
    md = synthetic_metadata(40, d_vit=32, max_patches_per_shard=17 * 4)
    assert md.shard_nbytes == 8704 and md.n_shards == 10
    gib_3_shards = 3.5 * md.shard_nbytes / 2**30  # room for 3 whole shards, not 4
    assert shard_ranges(md, "auto", gib_3_shards) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shard_ranges(md, "auto", 1e-9) == [(i, i + 1) for i in range(10)]  # at least one shard
    assert shard_ranges(md, "auto", 64.0) == [(0, 10)]  # a small cache: one job
    assert shard_ranges(md, 4, 1e-9) == [(0, 4), (4, 8), (8, 10)]  # an integer ignores gib_per_job


def test_a_live_dump_job_of_another_layout_keeps_its_range_and_complete_shards_get_no_job(tmp_path, ckpt):
    """A rerun under a new job layout (here auto: one range of 4 shards, where the killed run had one
    job per shard) awaits the earlier run's live jobs on their own ranges, claimed (running) or named
    by their job comment (queued), and gives the rest new ranges cut around them; a complete shard
    outside them gets no job, and a finished job's old claim names no live job."""
    from actcache.plan import DUMP_MARKS, dump_marks
    from actcache.protocol import shard_name
    from actcache.slurmjobs import claimed_ranges

    doc = {**experiment(ckpt, "a", [2]), "data": {"kind": "synthetic", "n_imgs": 16, "seed": 1, "size": 40}}
    cfg = write_project(str(tmp_path), {"a": doc})
    (p,) = plan_from_config(cfg)
    assert p.ranges == ((0, 4),)  # 4 shards of a few KiB: one job under `auto`
    marks_dir = os.path.join(p.cache_dir, DUMP_MARKS)
    os.makedirs(marks_dir)
    for tag, job in (("000001-000002", "101"), ("000003-000004", "99")):  # 99: finished long ago
        with open(os.path.join(marks_dir, tag + ".job"), "w") as fd:
            fd.write(job + "\n")
    with open(os.path.join(p.cache_dir, shard_name(0)), "wb") as fd:  # shard 0 complete (its size)
        fd.truncate(p.metadata.shard_nbytes)
    live = {"101": "rule_dump_wildcards_{h}_000001-000002_done", "102": "rule_dump_wildcards_{h}_000002-000003_done",
            "103": "rule_dump_wildcards_0123abcd_000000-000004_done"}  # fmt: skip
    live = {j: c.format(h=p.hash) for j, c in live.items()}  # 103: a job of another cache
    unfinished = [os.path.basename(m).rsplit(".", 1)[0] for m in dump_marks(p, p.cache_dir)]
    assert unfinished == ["000000-000004"]
    in_flight = claimed_ranges(live, p.hash, unfinished, marks_dir)
    assert in_flight == {"000001-000002": "101", "000002-000003": "102"}
    marks = dump_marks(p, p.cache_dir, in_flight=list(in_flight))
    tags = [os.path.basename(m) for m in marks]
    assert tags == ["000001-000002.done", "000002-000003.done", "000003-000004.done"]
    assert claimed_ranges(live, p.hash, ["000003-000004"], marks_dir) == {}  # nothing live overlaps it
