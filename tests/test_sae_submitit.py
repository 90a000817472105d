"""submitit: a training job that is preempted (SIGUSR2, as Slurm sends before a time limit or on
preemption) checkpoints, requeues itself and continues from its checkpoint.

Two runs of the same scenario: on submitit's LocalExecutor (no Slurm needed; the signal is sent
to the job's process as Slurm would), and on the real local Slurm cluster (scripts/slurm/up.sh),
where ``job._interrupt()`` signals through ``scancel`` and submitit requeues with ``scontrol``.
Both jobs are launched through scripts/sweep.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from actcache.rundir import run_dir
from actcache.sae import checkpoint as ckpt
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE
from actcache.sae.submit import TrainJob
from actcache.sae.train import train_group
from test_sae_train import dictionary_cache

REPO = Path(__file__).resolve().parents[1]
TRAIN = {"batch_size": 128, "steps": 120, "width": 128, "k": 4, "log_every": 20, "ckpt_every": 20,
         "eval_frac": 0.1, "dead_tokens": 1000, "deterministic": True}  # fmt: skip


def sweep_module():
    spec = importlib.util.spec_from_file_location("actcache_sweep", REPO / "scripts" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path, _ = dictionary_cache(tmp_path_factory.mktemp("submitit") / "cache", n_imgs=200, imgs_per_shard=64)
    return path


def test_trainjob_pickles_and_checkpoint_returns_a_fresh_job(cache, tmp_path):
    import submitit

    runs = expand_train_section(TRAIN, "t.yaml")
    job = TrainJob(cache, runs, tmp_path)
    job._stop = True
    again = pickle.loads(pickle.dumps(job))
    assert again.runs == job.runs and again._stop is False
    delayed = job.checkpoint()
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    fresh = delayed.function
    assert isinstance(fresh, TrainJob) and fresh.run_configs() == runs and fresh.cache_dir == job.cache_dir


def test_sweep_script_dry_run_lists_groups_and_skips_finished_ones(cache, tmp_path, capsys):
    sweep = sweep_module()
    spec = tmp_path / "sweep.yaml"
    spec.write_text(json.dumps({**TRAIN, "steps": 5, "sweep": {"k": [2, 4]}, "saes": [{}, {"batch_size": 64}]}))
    argv = ["--cache", cache, "--train", str(spec), "--runs-to", str(tmp_path / "runs"), "--dry-run"]
    assert sweep.main(argv) == 0
    err = capsys.readouterr().err
    assert len(re.findall(r"^group Lauto-image-[0-9a-f]{8}: 2 SAE\(s\)", err, re.M)) == 2
    ((gid, members),) = sweep.plan(cache, json.loads(spec.read_text()), "s", str(tmp_path / "runs"))[:1]
    train_group(cache, members, tmp_path / "runs", device="cpu")
    assert sweep.main(argv) == 0
    assert len(re.findall(r"^group ", capsys.readouterr().err, re.M)) == 1  # the finished group is skipped
    assert sweep.main([*argv[:3], str(tmp_path / "missing.yaml"), *argv[4:]]) == 2


def wait_for(pred, timeout: float, what: str, job=None):
    deadline = time.monotonic() + timeout
    while not pred():
        if job is not None and job.done():
            pytest.fail(f"job ended while waiting for {what}:\n{job.stderr() or ''}\n{job.stdout() or ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}" + (f":\n{job.stderr() or ''}" if job else ""))
        time.sleep(0.05)


def check_resumed(cache, runs_to, job, log_text: str) -> None:
    (run,) = expand_train_section(TRAIN, "t.yaml")
    d = run_dir(runs_to, os.path.basename(cache), run)
    stopped = [int(x) for x in re.findall(r"preempted at step (\d+): checkpoint written", log_text)]
    resumed = [int(x) for x in re.findall(r"resuming 1 SAE\(s\) at step (\d+)", log_text)]
    assert stopped and resumed == stopped[:1], log_text[-3000:]
    assert 0 < resumed[0] < TRAIN["steps"]
    assert os.path.exists(os.path.join(d, "done.json"))
    steps = [json.loads(x)["step"] for x in open(os.path.join(d, "metrics.jsonl"))]
    assert steps == list(range(20, 121, 20))  # no step logged twice, none missing
    # deterministic loader on CPU: the same weights as a run that was never interrupted
    ref = train_group(cache, [run], runs_to / "ref", device="cpu")[0]
    for name, t in SAE.load(ref).state_dict().items():
        torch.testing.assert_close(SAE.load(d).state_dict()[name], t, rtol=0, atol=0, equal_nan=True)
    assert ckpt.steps(d)[-1] == TRAIN["steps"] and len(ckpt.steps(d)) == 2  # keep_checkpoints: 2


def task_pids(controller_pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{controller_pid}/task"):
        with open(f"/proc/{controller_pid}/task/{tid}/children") as fh:
            out += [int(x) for x in fh.read().split()]
    return out


def test_local_executor_job_checkpoints_requeues_and_resumes(cache, tmp_path):
    sweep = sweep_module()
    todo = sweep.plan(cache, TRAIN, "t.yaml", str(tmp_path))
    assert len(todo) == 1
    ex = sweep.make_executor(str(tmp_path / "submitit"), "local", timeout_min=10, cpus_per_task=2)
    ((gid, job),) = sweep.launch(cache, todo, str(tmp_path), ex, device="cpu")
    (run,) = todo[0][1]
    d = run_dir(tmp_path, os.path.basename(cache), run)
    wait_for(lambda: ckpt.steps(d), 120, "the first checkpoint", job)
    (task,) = task_pids(job._process.pid)
    os.kill(task, signal.SIGUSR2)  # what Slurm sends signal_delay_s before the time limit
    job.result()
    check_resumed(cache, tmp_path, job, (job.stderr() or "") + (job.stdout() or ""))


@pytest.mark.slurm
def test_slurm_job_is_preempted_requeued_and_resumes(cache, tmp_path):
    from slurm_fixture import start_cluster

    cluster = start_cluster()
    sweep = sweep_module()
    todo = sweep.plan(cache, TRAIN, "t.yaml", str(tmp_path))
    ex = sweep.make_executor(str(tmp_path / "submitit"), "slurm", partition=cluster.partition,
                             account=cluster.account, timeout_min=10, cpus_per_task=2, mem_gb=2)  # fmt: skip
    ((gid, job),) = sweep.launch(cache, todo, str(tmp_path), ex, device="cpu")
    (run,) = todo[0][1]
    d = run_dir(tmp_path, os.path.basename(cache), run)
    wait_for(lambda: ckpt.steps(d), 180, "the first checkpoint", job)
    job._interrupt()  # scancel --signal TERM, then USR2 (preemption)

    # Slurm holds a requeued job for ~2 minutes (BeginTime); let it start at once.
    def pending() -> bool:
        out = cluster.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], check=False).stdout.strip()
        return out == "PENDING"

    wait_for(pending, 120, "the requeued job to be pending")
    cluster.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"])
    job.result()
    # -D: every run of the job, the requeued one included
    rows = cluster.sacct("-D", "-j", str(job.job_id), fields="JobID,State",
                         until=lambda rs: any(r["State"] == "COMPLETED" for r in rs))  # fmt: skip
    assert [r["State"] for r in rows] == ["REQUEUED", "COMPLETED"], rows
    check_resumed(cache, tmp_path, job, (job.stderr() or "") + (job.stdout() or ""))
