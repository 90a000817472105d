"""Checkpoints fall back: each is verified against its manifest on resume; a damaged newest one is
skipped with a warning naming it and the run resumes, bit-identically, from the one before; with
none valid, one clear error names them (actcache.sae.checkpoint, sae/checkpoint_faults.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from actcache.errors import LoaderError, TrainError
from actcache.loaders.faults import damage_shard
from actcache.rundir import MANIFEST_FILE, POSITION_FILE, run_dir
from actcache.sae import checkpoint as ckpt
from actcache.sae.checkpoint_faults import CORRUPTIONS, corrupt, resume_trial
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE
from actcache.sae.train import Preempted, train_group
from test_sae_resume import stop_after
from test_sae_train import dictionary_cache

TRAIN = {"batch_size": 64, "steps": 20, "width": 64, "k": 4, "log_every": 5, "ckpt_every": 5, "eval_frac": 0.1,
         "eval_tokens": 256, "deterministic": True, "lr": 3e-3}  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(cache, runs, final weights of an uninterrupted run, a run stopped at step 15: [10, 15])."""
    root = tmp_path_factory.mktemp("fallback")
    cache, _ = dictionary_cache(root / "cache", n_imgs=120, imgs_per_shard=40)
    runs = expand_train_section(TRAIN, "t.yaml")
    train_group(cache, runs, root / "ref", device="cpu")
    want = SAE.load(run_dir(root / "ref", os.path.basename(cache), runs[0])).state_dict()
    with pytest.raises(Preempted):
        train_group(cache, runs, root / "stopped", device="cpu", stop=stop_after(15))
    stopped = run_dir(root / "stopped", os.path.basename(cache), runs[0])
    assert ckpt.steps(stopped) == [10, 15]  # keep_checkpoints: 2 by default
    return cache, runs, want, stopped


def test_every_corruption_of_the_newest_checkpoint_falls_back_to_the_one_before(setup, tmp_path, caplog):
    _, _, _, stopped = setup
    for kind in CORRUPTIONS:
        d = str(tmp_path / kind)
        shutil.copytree(stopped, d)
        corrupt(ckpt.step_dir(d, 15), kind)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actcache.sae.checkpoint"):
            assert ckpt.valid_steps(d, set_aside=True) == [10], kind
        (warning,) = caplog.records
        assert "step-00000015" in warning.getMessage() and "damaged" in warning.getMessage(), kind
        assert ckpt.steps(d) == [10] and os.path.isdir(ckpt.step_dir(d, 15) + ".invalid"), kind


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_to_identical_weights(setup, tmp_path):
    """checkpoint_faults.resume_trial: stopped at 15 ([10, 15] kept), state.pt of step 15 cut (torch.load
    would raise EOFError / UnpicklingError): the run warns, resumes at 10 and ends as an
    uninterrupted one; step 15 is written again."""
    cache, runs, want, _ = setup
    res = resume_trial(cache, runs, str(tmp_path), "state-truncated", stop_at=15, reference={runs[0].sae_id: want})
    assert (res["outcome"], res["damaged"], res["start"], res["identical"]) == ("resumed", 15, 10, True), res
    (warning,) = res["warnings"]
    assert "step-00000015 is damaged: state.pt" in warning
    d = run_dir(tmp_path / "state-truncated", os.path.basename(cache), runs[0])
    assert ckpt.steps(d) == [15, 20]


def test_no_valid_checkpoint_is_one_clear_error_naming_them(setup, tmp_path):
    cache, runs, _, stopped = setup
    out = tmp_path / "runs"
    d = run_dir(out, os.path.basename(cache), runs[0])
    shutil.copytree(stopped, d)
    corrupt(ckpt.step_dir(d, 15), "weights-header")
    corrupt(ckpt.step_dir(d, 10), "position-garbled")
    with pytest.raises(TrainError) as err:
        train_group(cache, runs, out, device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "step-00000010" in msg and "step-00000015" in msg and "not valid JSON" in msg
    assert "sae.safetensors: its checksum differs" in msg and "delete" in msg


def test_a_checkpoint_from_before_manifests_is_verified_by_loading_it(setup, tmp_path):
    _, _, _, stopped = setup
    d = str(tmp_path / "old")
    shutil.copytree(stopped, d)
    for step in (10, 15):  # as an older version wrote them: no manifest, and the position says none
        c = ckpt.step_dir(d, step)
        os.unlink(os.path.join(c, MANIFEST_FILE))
        with open(os.path.join(c, POSITION_FILE)) as fh:
            pos = json.load(fh)
        pos.pop("manifest")
        with open(os.path.join(c, POSITION_FILE), "w") as fh:
            json.dump(pos, fh)
    corrupt(ckpt.step_dir(d, 15), "state-truncated")
    assert ckpt.valid_steps(d) == [10]
    assert "cannot be loaded" in ckpt.problem(d, 15)


def test_a_shard_damaged_during_training_stops_it_with_a_loader_error_and_a_checkpoint(setup, tmp_path):
    """A shard replaced under a running trainer: one line naming it, and the steps done so far
    kept in a checkpoint (not a multiple of ckpt_every) to resume from once the cache is fixed."""
    cache, runs, _, _ = setup
    src = str(tmp_path / os.path.basename(cache))
    shutil.copytree(cache, src)
    calls = [0]

    def damage_at_step_7() -> bool:
        calls[0] += 1
        if calls[0] == 7:
            damage_shard(os.path.join(src, "acts000001.bin"), "replace")
        return False

    with pytest.raises(LoaderError) as err:
        train_group(src, runs, tmp_path / "runs", device="cpu", stop=damage_at_step_7)
    assert "acts000001.bin" in str(err.value) and "after it was opened" in str(err.value) and "\n" not in str(err.value)
    d = run_dir(tmp_path / "runs", os.path.basename(cache), runs[0])
    last = ckpt.steps(d)[-1]
    assert 7 <= last < TRAIN["steps"] and last % TRAIN["ckpt_every"] and ckpt.problem(d, last) is None
