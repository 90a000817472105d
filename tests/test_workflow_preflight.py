"""Never pay twice (profiles/local): a job failing on a user error (actcache exits 2) is not run
again; a path a job will read that is missing stops the dry run and `actcache plan` first."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import PIL.Image
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import TWO_AT_A_TIME, snakemake, write_project

from actcache.plan import plan_from_config

TRAIN = {"layer": -1, "steps": 4, "batch_size": 16, "exp_factor": 2, "sweep": {"k": [4]}}


def image_folder(root: str, n: int, corrupt: int) -> str:
    """n small PNGs in one class folder; image `corrupt` is a PNG header followed by garbage."""
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "cls"))
    for i in range(n):
        path = os.path.join(root, "cls", f"img{i:03d}.png")
        if i == corrupt:
            with open(path, "wb") as fd:
                fd.write(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
        else:
            PIL.Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8), "RGB").save(path)
    return os.path.join(root, "cls", f"img{corrupt:03d}.png")


def test_dump_failing_on_a_corrupt_image_runs_once_despite_retries(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    bad = image_folder(str(tmp_path / "imgs"), n=4, corrupt=2)
    exp = {
        "name": "bad",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "image_folder", "root": str(tmp_path / "imgs")},
        # one shard of 4 images, one dump job
        "cache": {"max_patches_per_shard": 4 * 17, "batch_size": 4, "n_workers": 0, "shards_per_job": 1},
    }
    cfg = write_project(str(tmp_path), {"bad": exp})
    proc = snakemake(cfg, "--retries", "1", *TWO_AT_A_TIME)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    logs = sorted(glob.glob(str(tmp_path / "logs" / "dump" / "*" / "000000-000001.*.attempt*.log")))
    assert len(logs) == 2, (logs, out[-3000:])  # Snakemake did retry the job ...
    first, second = (open(p).read() for p in logs)
    assert ".attempt1." in logs[0] and ".attempt2." in logs[1]
    assert bad in first and "actcache dump: error" in first  # ... whose first attempt named the image
    # ... but the retry ran no dump: it stopped at once, saying why
    assert "actcache dump" not in second and "not retried: an earlier attempt failed with a user error" in second
    assert "not retried" in out
    assert len(glob.glob(str(tmp_path / "logs" / "dump" / "*" / "*.user-error"))) == 1


def test_missing_eval_cache_is_one_line_in_the_dry_run_and_in_plan(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    data = {"kind": "synthetic", "n_imgs": 8, "seed": 1, "size": 40}
    vit = {"family": "clip", "ckpt": ckpt, "layers": [-1]}
    val = {"name": "val", "vit": vit, "data": dict(data, seed=2)}
    cfg = write_project(str(tmp_path), {"val": val})
    (p,) = plan_from_config(cfg)
    good = {"name": "wf", "vit": vit, "data": data, "train": dict(TRAIN, eval_cache=p.cache_dir)}
    cfg = write_project(str(tmp_path), {"val": val, "wf": good})
    proc = snakemake(cfg, "-n")
    assert proc.returncode == 0, proc.stderr[-3000:]  # a cache this workflow dumps is fine
    typo = str(tmp_path / "cache" / "nope")
    cfg = write_project(str(tmp_path), {"wf": dict(good, train=dict(TRAIN, eval_cache=typo))})
    for proc in (snakemake(cfg, "-n"), plan_cli(cfg)):
        out = proc.stdout + proc.stderr
        errors = [line for line in out.splitlines() if "error" in line]
        assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
        (line,) = errors
        assert "wf.yaml" in line and "'train.eval_cache'" in line and repr(typo) in line and "shards.json" in line
        assert "Traceback" not in out


def plan_cli(cfg: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "actcache.cli", "plan", "--config", cfg, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(cfg))


def test_min_job_age_warning_uses_the_status_check_delay_in_force(tmp_path, monkeypatch):
    """A cluster (scontrol and sacctmgr on PATH) whose MinJobAge is 200 s: a 70 s status-check delay is
    too long (the plugin falls back to sacct under 3 x 70 s), the 66 s the warning suggests and the
    profile's own delay are not. One of 60 s is too short for any delay (the plugin may wait 180 s)."""
    from actcache.slurmjobs import site_warnings

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = {"scontrol": 'echo "MinJobAge               = ${FAKE_MIN_JOB_AGE:-200} sec"', "sacctmgr": "echo proj1"}
    for name, body in fake.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ACTCACHE_SLURM_ACCOUNT", "proj1")
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    exp = {
        "name": "wf",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8},
    }
    cfg = write_project(str(tmp_path), {"wf": exp})
    proc = snakemake(cfg, "-n", "--slurm-init-seconds-before-status-checks", "70", profile="osc")
    (line,) = [x for x in proc.stderr.splitlines() if "MinJobAge" in x]
    assert proc.returncode == 0 and "under 3 x 70 s" in line and "--slurm-init-seconds-before-status-checks 66" in line
    proc = snakemake(cfg, "-n", profile="osc")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actcache: warning" not in proc.stderr, proc.stderr[-3000:]
    monkeypatch.setenv("FAKE_MIN_JOB_AGE", "60")
    for delay in (10, 40):
        (line,) = [w for w in site_warnings(status_init_s=delay) if "MinJobAge" in w]
        assert "waits up to 180 s" in line and "at least 300 s" in line and "--slurm-init" not in line


def test_sbatch_extra_joins_the_site_flags_of_a_rule_and_warns_on_a_plugin_managed_one(tmp_path):
    from actcache.slurmjobs import extra_warnings, sbatch_extra, status_init_in_force

    env = {
        "ACTCACHE_SLURM_RESERVATION": "hack day",
        "ACTCACHE_SLURM_EXTRA": " --exclusive ",
        "ACTCACHE_SLURM_DUMP_EXTRA": "-J x",
    }
    assert sbatch_extra("dump", env) == "--reservation='hack day' --exclusive -J x"
    assert sbatch_extra("train", env) == "--reservation='hack day' --exclusive"
    assert sbatch_extra("train", {}) is None
    (line,) = extra_warnings(env, ["dump", "train"])  # -J is the job name, which the plugin sets
    assert line.startswith("ACTCACHE_SLURM_DUMP_EXTRA='-J x'") and "job name" in line
    assert extra_warnings({"ACTCACHE_SLURM_EXTRA": "--exclusive"}, ["dump"]) == []
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "profile.yaml").write_text("slurm-init-seconds-before-status-checks: 13\n")
    site = str(tmp_path / "site")
    assert status_init_in_force(["snakemake", "--profile", site], {}) == 13  # the profile's key
    assert (
        status_init_in_force(["snakemake", "--profile", site, "--slurm-init-seconds-before-status-checks=7"], {}) == 7
    )
    assert status_init_in_force(["snakemake"], {"SNAKEMAKE_PROFILE": site}) == 13
    assert status_init_in_force(["snakemake"], {}) == 40  # the plugin's default
