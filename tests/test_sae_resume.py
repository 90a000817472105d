"""Resume: an interrupted group restarts from its last checkpoint and the loader's (epoch, batch);
on CPU with the deterministic loader the final weights equal an uninterrupted run's exactly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from actcache.errors import EXIT_RETRY
from actcache.rundir import run_dir
from actcache.sae import checkpoint as ckpt
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE
from actcache.sae.train import Preempted, train_group
from conftest import in_mount_namespace
from test_sae_train import dictionary_cache, experiment_cache, train_cli, write_experiment

TRAIN = {"batch_size": 128, "steps": 40, "width": 128, "log_every": 10, "ckpt_every": 10, "eval_frac": 0.1,
         "dead_tokens": 500, "deterministic": True, "lr": 3e-3, "warmup_steps": 5, "lr_decay": "linear",
         "saes": [{"activation": "topk", "k": 4}, {"activation": "batchtopk", "k": 4},
                  {"activation": "relu", "l1_coeff": 1e-3, "l1_warmup_steps": 10}]}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path, _ = dictionary_cache(tmp_path_factory.mktemp("resume") / "cache", n_imgs=200, imgs_per_shard=64)
    return path


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory):
    """The uninterrupted run: {sae_id: state_dict}, {sae_id: metric lines}, {sae_id: eval}."""
    runs = expand_train_section(TRAIN, "t.yaml")
    out = tmp_path_factory.mktemp("reference")
    train_group(cache, runs, out, device="cpu")
    return runs, collect(cache, runs, out)


def collect(cache, runs, runs_to) -> dict:
    res = {}
    for r in runs:
        d = run_dir(runs_to, os.path.basename(cache), r)
        lines = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        with open(os.path.join(d, "eval.json")) as fh:
            ev = json.load(fh)
        res[r.sae_id] = {
            "state": SAE.load(d).state_dict(),
            "metrics": [{k: x[k] for k in ("step", "loss", "mse", "nmse", "l0", "l1", "n_dead", "lr")} for x in lines],
            "eval": {k: ev[k] for k in ("nmse", "l0", "n_dead", "freq_hist")},
        }
    return res


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for sid in want:
        for name, t in want[sid]["state"].items():
            torch.testing.assert_close(got[sid]["state"][name], t, rtol=0, atol=0, equal_nan=True, msg=f"{sid} {name}")
        assert got[sid]["metrics"] == want[sid]["metrics"], sid
        assert got[sid]["eval"] == want[sid]["eval"], sid


def stop_after(n: int):
    """A train_group ``stop`` callback, true from its n-th call on: train_group asks after each
    step, so a fresh run is preempted at step n."""
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= n

    return stop


def test_preempted_group_resumes_to_identical_weights(cache, reference, tmp_path):
    runs, want = reference
    with pytest.raises(Preempted) as err:
        train_group(cache, runs, tmp_path, device="cpu", stop=stop_after(25))
    assert err.value.step == 25
    for r in runs:
        d = run_dir(tmp_path, os.path.basename(cache), r)
        assert ckpt.steps(d) == [20, 25]  # the stop checkpoint and the one before (keep_checkpoints: 2)
        pos = ckpt.read_position(d, 25)
        assert pos["batches_per_epoch"] == 180 * 16 // 128  # 22: the stop came in the second epoch
        assert pos["loader"] == {"epoch": 1, "batch": 3}
        assert not os.path.exists(os.path.join(d, "done.json"))
    train_group(cache, runs, tmp_path, device="cpu")
    assert_same(collect(cache, runs, tmp_path), want)


def test_crash_between_two_saes_checkpoints_resumes_from_the_common_step(cache, reference, tmp_path, monkeypatch):
    runs, want = reference
    real_save, n = ckpt.save, {"calls": 0}

    def flaky_save(run_dir_, step, *a, **kw):
        if step == 30 and n["calls"] == 1:  # the second SAE's step-30 checkpoint: "killed"
            raise KeyboardInterrupt
        if step == 30:
            n["calls"] += 1
        return real_save(run_dir_, step, *a, **kw)

    monkeypatch.setattr(ckpt, "save", flaky_save)
    with pytest.raises(KeyboardInterrupt):
        train_group(cache, runs, tmp_path, device="cpu")
    monkeypatch.setattr(ckpt, "save", real_save)
    dirs = [run_dir(tmp_path, os.path.basename(cache), r) for r in runs]
    assert [ckpt.steps(d) for d in dirs] == [[10, 20, 30], [10, 20], [10, 20]]
    assert ckpt.common_step(dirs) == 20
    train_group(cache, runs, tmp_path, device="cpu")
    assert_same(collect(cache, runs, tmp_path), want)


def test_new_sae_joins_without_restarting_a_preempted_one(cache, reference, tmp_path, caplog):
    runs, want = reference
    first = runs[:1]
    with pytest.raises(Preempted):
        train_group(cache, first, tmp_path, device="cpu", stop=stop_after(15))
    # the others are added: the first resumes at 15 in one pass, the new ones start at 0 in another
    with caplog.at_level(logging.INFO, logger="actcache.sae.train"):
        train_group(cache, runs, tmp_path, device="cpu")
    assert "resuming 1 SAE(s) at step 15" in caplog.text
    assert_same(collect(cache, runs, tmp_path), want)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, json, torch
    torch.set_num_threads(2)
    from actcache.sae.config import RunConfig
    from actcache.sae.train import train_group
    runs = [RunConfig.from_dict(d) for d in json.loads(sys.argv[3])]
    train_group(sys.argv[1], runs, sys.argv[2], device="cpu")
    """
)


def test_killed_process_resumes_from_its_last_checkpoint(cache, tmp_path):
    train = {**TRAIN, "steps": 120, "ckpt_every": 20, "log_every": 20, "saes": TRAIN["saes"][:1]}
    runs = expand_train_section(train, "t.yaml")
    ref = tmp_path / "ref"
    train_group(cache, runs, ref, device="cpu")
    want = collect(cache, runs, ref)

    out = tmp_path / "killed"
    d = run_dir(out, os.path.basename(cache), runs[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, cache, str(out), json.dumps([r.to_dict() for r in runs])]
    )
    try:
        deadline = time.monotonic() + 120
        while not any(s >= 20 for s in ckpt.steps(d)):
            assert proc.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = ckpt.steps(d)
    assert killed_at and killed_at[-1] < 120 and not os.path.exists(os.path.join(d, "done.json"))
    train_group(cache, runs, out, device="cpu")
    assert_same(collect(cache, runs, out), want)


def test_cli_checkpoints_and_exits_on_sigterm_then_resumes(tmp_path):
    train = {**TRAIN, "steps": 300, "ckpt_every": 1000, "log_every": 10, "saes": TRAIN["saes"][:1]}
    exp = write_experiment(tmp_path, train, n_imgs=200)
    path, _ = experiment_cache(exp, tmp_path / "cache")
    (run,) = expand_train_section(train, exp)
    d = run_dir(tmp_path / "runs", os.path.basename(path), run)
    argv = [
        "--experiment",
        exp,
        "--dump-to",
        str(tmp_path / "cache"),
        "--runs-to",
        str(tmp_path / "runs"),
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen([sys.executable, "-m", "actcache.cli", "train", *argv], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (
            not os.path.exists(os.path.join(d, "metrics.jsonl"))
            or os.path.getsize(os.path.join(d, "metrics.jsonl")) == 0
        ):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_RETRY, err  # not a user error: the workflow retries it
    assert "training stopped on request at step" in err
    (step,) = ckpt.steps(d)
    assert 10 <= step < 300  # written at the step where SIGTERM arrived (no periodic checkpoint before 1000)
    assert train_cli(*argv) == 0
    assert os.path.exists(os.path.join(d, "done.json"))


def test_full_disk_during_a_checkpoint_is_a_clear_error_and_a_rerun_resumes(tmp_path):
    # A real full disk: runs_to is a 1,200 KiB tmpfs in the trainer's own mount namespace (root).
    # One checkpoint (~810 KB: weights + optimizer state) fits, the next does not. The error names
    # the checkpoint and the step to resume from; the complete checkpoint survives; after the
    # filesystem grows the same command resumes and ends with the weights of an unhindered run.
    train = {"batch_size": 128, "steps": 60, "width": 512, "k": 4, "log_every": 10, "ckpt_every": 20, "eval_frac": 0.1}
    exp = write_experiment(tmp_path, train, n_imgs=512)
    path, _ = experiment_cache(exp, tmp_path / "cache")
    (run,) = expand_train_section(train, exp)
    argv = ["--experiment", exp, "--dump-to", str(tmp_path / "cache"), "--device", "cpu"]
    assert train_cli(*argv, "--runs-to", str(tmp_path / "ref")) == 0
    want = SAE.load(run_dir(tmp_path / "ref", os.path.basename(path), run))

    runs, out_dir = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    train_cmd = [sys.executable, "-m", "actcache.cli", "train", *argv, "--runs-to", str(runs)]
    script = (
        f"mount -t tmpfs -o size=1200k tmpfs {runs} || exit 99\n"
        '"$@"; echo "rc1=$?" >&2\n'
        f"find {runs} -printf 'file %P\\n' | sort\n"
        f"mount -o remount,size=64m {runs}\n"
        '"$@"; echo "rc2=$?" >&2\n'
        f"cp -r {runs} {out_dir}\n"
    )
    proc = in_mount_namespace(script, train_cmd)
    assert proc.returncode == 0 and "rc1=2" in proc.stderr and "rc2=0" in proc.stderr, proc.stderr[-3000:]
    first = proc.stderr.split("rc1=")[0]
    assert "Traceback" not in first, first[-3000:]
    assert "could not write the checkpoint of step 40" in first and "No space left on device (ENOSPC)" in first
    assert "re-run the same command: training resumes from its last complete checkpoint (step 20 here)" in first
    listed = [ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("file ")]
    ckpts = sorted({p.split("/checkpoints/")[1].split("/")[0] for p in listed if "/checkpoints/" in p})
    assert ckpts == ["step-00000020"], listed  # complete, and no temporary checkpoint directory
    d = run_dir(out_dir, os.path.basename(path), run)
    assert os.path.exists(os.path.join(d, "done.json"))
    got = SAE.load(d)
    for name, w in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], w, rtol=0, atol=0, equal_nan=True)
