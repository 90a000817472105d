"""End to end on a real Slurm cluster: the workflow through snakemake-executor-plugin-slurm with
profiles/osc, unmodified, fitted to the local cluster of scripts/slurm/up.sh by the site file
profiles/sites/local-slurm.env (as README shows for any cluster): account, partition, GPU
requests, cancellation, restarts after a killed snakemake, logs of every attempt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import REPO, job_counts, write_project

import slurm_fixture
from actcache import ActivationCache

slurm_cluster = slurm_fixture.slurm_cluster
pytestmark = pytest.mark.slurm

SITE_FILE = os.path.join(REPO, "profiles", "sites", "local-slurm.env")
FAST_POLLS = os.path.join(REPO, "tests", "slurm_polls.py")  # snakemake, polling Slurm every few seconds
RUN_TIMEOUT_S = 420  # a kill switch only: jobs take seconds each on an idle machine


def site_env() -> dict[str, str]:
    """The environment with profiles/sites/local-slurm.env applied (what `source` would do)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(SITE_FILE) as fd:
        for line in fd:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.strip().split("=", 1)
                env[k] = v
    return env


def osc_cmd(cfg: str, *args: str, timeout: int = RUN_TIMEOUT_S) -> list[str]:
    # Only command-line flags on top of the profile (and polls capped, FAST_POLLS): fast status checks for a private cluster.
    return [
        "timeout", "-s", "KILL", str(timeout), sys.executable, FAST_POLLS, "-s", os.path.join(REPO, "Snakefile"),
        "--configfile", cfg, "-d", os.path.dirname(cfg), "--profile", os.path.join(REPO, "profiles", "osc"),
        "--slurm-init-seconds-before-status-checks", "2", "--latency-wait", "5", *args,
    ]  # fmt: skip


def run_osc(cfg: str, *args: str, timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        osc_cmd(cfg, *args, timeout=timeout), capture_output=True, text=True, env=site_env(), cwd=os.path.dirname(cfg)
    )


def start_osc(cfg: str, *args: str, timeout: int = RUN_TIMEOUT_S) -> subprocess.Popen:
    log = open(os.path.join(os.path.dirname(cfg), "snakemake.out"), "w")
    return subprocess.Popen(
        osc_cmd(cfg, *args, timeout=timeout), stdout=log, stderr=subprocess.STDOUT, env=site_env(),
        cwd=os.path.dirname(cfg),
    )  # fmt: skip


def output_of(cfg: str) -> str:
    with open(os.path.join(os.path.dirname(cfg), "snakemake.out")) as fd:
        return fd.read()


def dump_project(tmp_path, n_imgs: int = 40, name: str = "onslurm") -> str:
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    exp = {
        "name": name,
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
        "data": {"kind": "synthetic", "n_imgs": n_imgs, "seed": 2, "size": 40},
        "cache": {  # device cpu: the test cluster's GPUs are Slurm's bookkeeping only (a CPU torch)
            "max_patches_per_shard": 10 * 17, "batch_size": 10, "n_workers": 0, "shards_per_job": 1, "device": "cpu",
        },
    }  # fmt: skip
    return write_project(str(tmp_path / "proj"), {name: exp})


def plan_of(cfg: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "plan", "--config", cfg, "--json"],
        capture_output=True, text=True, check=True, env=site_env(),
    )  # fmt: skip
    (p,) = json.loads(proc.stdout)
    return p


def assert_cache_verifies(cfg: str, n_imgs: int) -> None:
    p = plan_of(cfg)
    assert p["cache"]["state"] == "complete", p
    verify = subprocess.run(
        [sys.executable, "-m", "actcache.cli", "verify", "--deep", p["dir"]], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout
    assert ActivationCache.open(p["dir"]).n_imgs == n_imgs


def my_jobs() -> dict[str, str]:
    """Job id -> state of every queued or running job."""
    out = subprocess.run(["squeue", "-h", "-o", "%A %T"], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def wait_until(what: str, cond, timeout_s: float = 120.0, proc: subprocess.Popen | None = None, cfg=None):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            pytest.fail(f"gave up waiting for {what}\n{output_of(cfg)[-4000:] if cfg else ''}", pytrace=False)
        time.sleep(0.3)


def claims(cfg: str) -> dict[str, str]:
    """Range tag -> job id of the dump jobs that have started their dump (their claim files)."""
    p = plan_of(cfg)
    d = os.path.join(p["dir"], ".actcache-dump")
    if not os.path.isdir(d):
        return {}
    out = {}
    for f in os.listdir(d):
        if f.endswith(".job"):
            with open(os.path.join(d, f)) as fd:
                out[f[: -len(".job")]] = fd.read().strip()
    return out


def dump_jobs_in_sacct(slurm_cluster, start: str) -> list[dict]:
    rows = slurm_cluster.sacct("-S", start, fields="JobID,JobName,State,ExitCode,Comment", wait_s=5)
    return [r for r in rows if r["Comment"].startswith("rule_dump")]


def test_dump_jobs_run_on_slurm_with_the_osc_profile_and_cancelled_ones_are_retried(slurm_cluster, tmp_path):
    """The osc profile's dump jobs reach Slurm with the site's account, partition and a GPU; a
    running and a pending one cancelled with scancel are submitted again, and the cache verifies.
    Every job keeps its Slurm log, and each attempt its rule log."""
    cfg = dump_project(tmp_path, n_imgs=30)  # 3 shards, 3 dump jobs on 2 GPUs: one waits
    dry = run_osc(cfg, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert job_counts(dry.stdout + dry.stderr)["dump"] == 3
    assert "warning" not in dry.stderr  # the site file names a known account
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    proc = start_osc(cfg)
    try:
        # running: a job whose dump has started (it wrote its claim); pending: one still queued
        rng, running = next(iter(wait_until("a dump to start", lambda: claims(cfg), proc=proc, cfg=cfg).items()))
        pending = wait_until(
            "a pending dump job", lambda: [j for j, st in my_jobs().items() if st == "PENDING"], proc=proc, cfg=cfg
        )[0]
        subprocess.run(["scancel", running, pending], check=True)
        rc = proc.wait(timeout=RUN_TIMEOUT_S + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output_of(cfg)
    assert rc == 0, out[-5000:]
    assert re.search(rf"SLURM-job '{running}' failed, SLURM status is: 'CANCELLED'", out), out[-5000:]
    assert re.search(rf"SLURM-job '{pending}' failed, SLURM status is: 'CANCELLED'", out), out[-5000:]
    assert_cache_verifies(cfg, 30)

    rows = slurm_cluster.sacct(
        "-S", start, "-a", fields="JobID,JobName,State,ExitCode,Account,Partition,AllocTRES,Comment", wait_s=30,
        until=lambda rows: sum(r["State"] == "COMPLETED" for r in rows) >= 4,
    )  # fmt: skip
    dumps = [r for r in rows if r["Comment"].startswith("rule_dump")]
    states = sorted(r["State"].split()[0] for r in dumps)
    assert states.count("CANCELLED") == 2 and states.count("COMPLETED") == 3, rows
    done = [r for r in dumps if r["State"] == "COMPLETED"]
    for r in done:
        assert r["ExitCode"] == "0:0", r
        assert r["Account"] == slurm_cluster.account and r["Partition"] == slurm_cluster.partition
        assert "gres/gpu=1" in r["AllocTRES"], r  # the GPU request reached Slurm
    assert any(r["Comment"].startswith("rule_gather") and r["State"] == "COMPLETED" for r in rows), rows
    # The Slurm log of every job is kept, successful ones too.
    logs = {f for _, _, fs in os.walk(tmp_path / "proj" / ".snakemake" / "slurm_logs") for f in fs}
    assert {r["JobID"] + ".log" for r in done} <= logs, logs
    # Both attempts of the cancelled running range kept their rule log; the first one names its job.
    p = plan_of(cfg)
    log_dir = tmp_path / "proj" / "logs" / "dump" / p["hash"]
    attempts = sorted(f for f in os.listdir(log_dir) if f.startswith(rng) and ".attempt" in f)
    assert [a.split(".attempt")[1][0] for a in attempts] == ["1", "2"], attempts
    assert f"Slurm job {running}" in (log_dir / attempts[0]).read_text()


def test_killed_snakemake_rerun_waits_for_in_flight_jobs(slurm_cluster, tmp_path):
    cfg = dump_project(tmp_path, n_imgs=30)  # 3 shards, 3 dump jobs on 2 GPUs: one waits
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    proc = start_osc(cfg)
    try:
        pending = wait_until(
            "a pending dump job", lambda: [j for j, st in my_jobs().items() if st == "PENDING"], proc=proc, cfg=cfg
        )[0]
        # held, it stays queued whatever the load: the rerun must find it by its job comment
        subprocess.run(["scontrol", "hold", pending], check=True)
        # SIGKILL the snakemake under `timeout` (its only child), as a lost login session would
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fd:
            (child,) = fd.read().split()
        os.kill(int(child), signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the rerun plans to wait for the killed run's jobs, on the login node, instead of new ones
    dry = run_osc(cfg, "-n")
    assert job_counts(dry.stdout + dry.stderr).get("await_dump", 0) >= 1, dry.stdout[-3000:]
    assert f"waiting for Slurm job {pending}" not in dry.stdout  # a dry run does not wait
    subprocess.run(["scontrol", "release", pending], check=True)
    locked = run_osc(cfg)
    assert locked.returncode != 0 and "--unlock" in locked.stderr, locked.stderr[-3000:]
    assert "never submitted twice" in locked.stderr
    assert run_osc(cfg, "--unlock").returncode == 0
    rerun = run_osc(cfg)
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-4000:]
    assert_cache_verifies(cfg, 30)
    rows = dump_jobs_in_sacct(slurm_cluster, start)
    per_range = {}
    for r in rows:
        m = re.search(r"(\d{6}-\d{6})", r["Comment"])
        per_range.setdefault(m.group(1) if m else r["Comment"], []).append(r)
    assert len(rows) == 3 and sorted(per_range) == ["000000-000001", "000001-000002", "000002-000003"], rows
    assert all(len(jobs) == 1 for jobs in per_range.values()), rows  # no second job for any range


def test_scancel_of_a_train_job_checkpoints_and_the_retry_resumes(slurm_cluster, tmp_path):
    cfg = dump_project(tmp_path, n_imgs=40)
    exp_file = os.path.join(os.path.dirname(cfg), "experiments", "onslurm.yaml")
    import yaml

    with open(exp_file) as fd:
        doc = yaml.safe_load(fd)
    doc["train"] = {
        "layer": -2, "batch_size": 64, "steps": 1000, "buffer_bytes": 1 << 20, "eval_frac": 0.1,
        "eval_tokens": 256, "exp_factor": 2, "dead_tokens": 512, "log_every": 25, "ckpt_every": 100000,
        "sweep": {"k": [4]},
    }  # fmt: skip
    with open(exp_file, "w") as fd:
        yaml.safe_dump(doc, fd)
    # the cache first, without Slurm: this test is about the training job
    p = plan_of(cfg)
    dump_to = os.path.dirname(p["dir"])
    for cmd in (["dump", "--experiment", exp_file, "--dump-to", dump_to, "--no-progress"], ["gather", p["dir"]]):
        subprocess.run([sys.executable, "-m", "actcache.cli", *cmd], check=True, capture_output=True, env=site_env())
    proc = start_osc(cfg, "--until", "train")
    log_dir = tmp_path / "proj" / "logs" / "train" / p["hash"]

    def training_job():
        logs = sorted(log_dir.glob("*.attempt1.*.log")) if log_dir.is_dir() else []
        text = logs[0].read_text() if logs else ""
        m = re.search(r"Slurm job (\d+)", text)
        return m.group(1) if m and re.search(r"step \d+/1000", text) else None

    try:
        job = wait_until("training to log a step", training_job, timeout_s=240, proc=proc, cfg=cfg)
        subprocess.run(["scancel", job], check=True)
        rc = proc.wait(timeout=RUN_TIMEOUT_S + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output_of(cfg)
    assert rc == 0, out[-5000:]
    first, second = sorted(log_dir.glob("*.attempt*.log"))
    assert "got SIGTERM: checkpointing" in first.read_text(), first.read_text()[-3000:]
    m = re.search(r"resuming 1 SAE\(s\) at step (\d+)", second.read_text())
    assert m and int(m.group(1)) > 0, second.read_text()[-3000:]
    (sae,) = plan_of(cfg)["training"]
    assert sae["done"], sae


def test_dry_run_stops_on_a_partition_gpu_model_or_account_the_cluster_lacks(slurm_cluster, tmp_path):
    """With the osc profile, `snakemake -n` asks the local Slurm whether the site settings fit it:
    a wrong partition, GPU model or account is one line naming the variable to set, exit status 2."""
    cfg = dump_project(tmp_path, n_imgs=10)
    cases = {
        "ACTCACHE_SLURM_GPU_PARTITION": ("gpu", "names no partition of this cluster (GPU partitions you may use: "),
        "ACTCACHE_SLURM_GPU_MODEL": ("a100", "matches no node of partition debug (its GPUs have no model name)"),
        "ACTCACHE_SLURM_ACCOUNT": ("nosuchproject", "is not a Slurm account of user root (sacctmgr: "),
    }
    for var, (value, why) in cases.items():
        dry = subprocess.run(
            osc_cmd(cfg, "-n", timeout=120), capture_output=True, text=True, env={**site_env(), var: value},
            cwd=os.path.dirname(cfg),
        )  # fmt: skip
        lines = [line for line in dry.stderr.splitlines() if line.startswith("actcache: Slurm site:")]
        assert dry.returncode == 2 and len(lines) == 1, dry.stderr[-3000:]
        assert lines[0].startswith(f"actcache: Slurm site: {var}={value} {why}"), lines
        assert lines[0].endswith((f"set {var} to one of them", f"unset {var}")), lines  # the fix names it too
        assert "job stats" not in dry.stdout.lower()  # stopped before planning any job
