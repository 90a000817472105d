"""A run directory is owned by one train (train.lock) and read within bounds; its final weights
are checked against the size and sha256 done.json records. Damage is one line (exit 2), never a
traceback or a silently different SAE. scripts/chaos.py runs the same families by the dozen."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actcache import cli
from actcache.errors import ActCacheError
from actcache.rundir import (
    CONFIG_FILE,
    DONE_FILE,
    EVAL_FILE,
    LOCK_FILE,
    METRICS_FILE,
    RUN_FILE,
    WEIGHTS_FILE,
    RunDirError,
    load_run,
    read_metrics,
    run_dir,
)
from actcache.runlock import RunLock
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE
from actcache.sae.on_cache import train_on_cache
from conftest import make_cache

TRAIN = {"layer": 7, "batch_size": 16, "steps": 4, "log_every": 2, "ckpt_every": 2, "eval_frac": 0.2,
         "b_dec_init": "mean", "buffer_bytes": 20000, "saes": [{"activation": "topk", "width": 12, "k": 3}]}  # fmt: skip
FUZZ = settings(max_examples=15, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cache, train file, runs_to, run directory) of one tiny finished SAE."""
    tmp = tmp_path_factory.mktemp("trained")
    cache, _, _ = make_cache(tmp / "c", n_imgs=20, layers=(7,), n_patches=4, d=8, imgs_per_shard=10)
    train_file = tmp / "train.yaml"
    train_file.write_text(yaml.safe_dump({"train": TRAIN}))
    (d,) = train_on_cache(cache, str(train_file), runs_to=str(tmp / "runs"))
    return cache, str(train_file), str(tmp / "runs"), d


def copy_run(src: str, dst) -> str:
    os.makedirs(dst)
    for name in (RUN_FILE, CONFIG_FILE, WEIGHTS_FILE, DONE_FILE, EVAL_FILE, METRICS_FILE):
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
            b.write(a.read())
    return str(dst)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


# ---- the final weights' record -----------------------------------------------------------------


def test_done_json_records_the_final_weights_and_they_load(trained):
    d = trained[3]
    files = json.load(open(os.path.join(d, DONE_FILE)))["files"]
    assert files[WEIGHTS_FILE]["bytes"] == os.path.getsize(os.path.join(d, WEIGHTS_FILE))
    assert len(files[WEIGHTS_FILE]["sha256"]) == 64 and set(files) == {WEIGHTS_FILE, CONFIG_FILE}
    assert SAE.load(d).cfg.width == 12


def test_a_flipped_weight_is_refused_by_load_and_export_naming_the_file(trained, tmp_path, capsys):
    d = copy_run(trained[3], tmp_path / "run")
    w = os.path.join(d, WEIGHTS_FILE)
    flip(w, os.path.getsize(w) - 5)  # a weight's byte: the header still parses
    with pytest.raises(RunDirError, match="sha256 differs"):
        SAE.load(d)
    assert cli.main(["export", d, "--to", "saelens", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert w in err and "sha256" in err and len(err.strip().splitlines()) == 1
    assert not any(n.endswith(".safetensors") for _, _, fs in os.walk(tmp_path) for n in fs if "out" in _)


def test_a_cut_weights_file_names_both_sizes(trained, tmp_path):
    d = copy_run(trained[3], tmp_path / "run")
    w = os.path.join(d, WEIGHTS_FILE)
    os.truncate(w, os.path.getsize(w) // 2)
    with pytest.raises(RunDirError, match=r"bytes, done.json records"):
        SAE.load(d)


def test_an_old_run_without_the_record_warns_and_still_checks_the_header(trained, tmp_path, caplog):
    d = copy_run(trained[3], tmp_path / "run")
    done = json.load(open(os.path.join(d, DONE_FILE)))
    del done["files"]
    json.dump(done, open(os.path.join(d, DONE_FILE), "w"))
    with caplog.at_level(logging.WARNING):
        assert SAE.load(d).cfg.width == 12
    assert "records no checksum" in caplog.text
    w = os.path.join(d, WEIGHTS_FILE)
    flip(w, 3)  # the header's length: not safetensors any more
    with pytest.raises(RunDirError, match="not a readable safetensors file"):
        SAE.load(d)


# ---- one owner per run -------------------------------------------------------------------------


def _run_dir_of(trained, runs_to: str) -> str:
    cache, train_file = trained[0], trained[1]
    (run,) = expand_train_section(TRAIN, train_file, layers=(7,), d_vit=8)
    return run_dir(runs_to, os.path.basename(cache), run)


def test_a_second_train_of_an_owned_run_exits_2_naming_the_owner(trained, tmp_path, capsys):
    runs_to = str(tmp_path / "runs")
    d = _run_dir_of(trained, runs_to)
    owner = RunLock()
    owner.acquire(d)  # a flock of its own open file: conflicts with train's, as another process's does
    try:
        rc = cli.main(["train", "--cache", trained[0], "--train", trained[1], "--runs-to", runs_to, "--device", "cpu"])
        err = capsys.readouterr().err
    finally:
        owner.close()
    assert rc == 2 and f"host {socket.gethostname()}, pid {os.getpid()}" in err and "--wait-for-lock" in err
    assert len(err.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(d, RUN_FILE))  # nothing written by the refused train


def test_wait_for_lock_starts_when_the_owner_ends(trained, tmp_path):
    runs_to = str(tmp_path / "runs")
    d = _run_dir_of(trained, runs_to)
    owner = RunLock()
    owner.acquire(d)
    threading.Timer(0.5, owner.close).start()
    rc = cli.main(["train", "--cache", trained[0], "--train", trained[1], "--runs-to", runs_to, "--device", "cpu",
                   "--wait-for-lock"])  # fmt: skip
    assert rc == 0 and os.path.exists(os.path.join(d, DONE_FILE))
    assert [m["step"] for m in read_metrics(d)] == [2, 4]
    with open(os.path.join(d, LOCK_FILE)) as fh:
        assert fh.read().split()[1] == str(os.getpid())


# ---- bounded, typed run files ------------------------------------------------------------------


@pytest.mark.parametrize("name", [RUN_FILE, EVAL_FILE, DONE_FILE, CONFIG_FILE, METRICS_FILE])
def test_a_run_file_linked_to_dev_zero_is_refused_unread(trained, tmp_path, name):
    d = copy_run(trained[3], tmp_path / "run")
    os.remove(os.path.join(d, name))
    os.symlink("/dev/zero", os.path.join(d, name))
    with pytest.raises(ActCacheError, match="not a regular file"):
        run = load_run(d)
        run.eval(), run.sae_config(), read_metrics(d)
        SAE.load(d)


@pytest.mark.parametrize("field,value", [("layer", "7"), ("layer", 10**400), ("run", [1]), ("cache", 3),
                                         ("sae_id", {"a": 1}), ("run", {"scale_norm": "yes"})],
                         ids=["layer-str", "layer-400-digits", "run-list", "cache-int", "sae_id-dict", "scale_norm-str"])  # fmt: skip
def test_run_json_fields_of_the_wrong_type_are_one_line(trained, tmp_path, capsys, field, value):
    d = copy_run(trained[3], tmp_path / "run")
    info = json.load(open(os.path.join(d, RUN_FILE)))
    info[field] = value
    with open(os.path.join(d, RUN_FILE), "w") as fh:
        fh.write(json.dumps(info))
    with pytest.raises(RunDirError, match=f"{RUN_FILE}: .*{field}"):
        assert load_run(d).name is None  # raises first
    assert cli.main(["visuals", d, "--plots-only"]) == 2
    assert RUN_FILE in capsys.readouterr().err


# ---- fuzz: run files and safetensors headers ---------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(name=st.sampled_from([RUN_FILE, DONE_FILE, EVAL_FILE, CONFIG_FILE, METRICS_FILE]),
       doc=json_values, raw=st.binary(max_size=64), use_raw=st.booleans())  # fmt: skip
def test_fuzzed_run_files_give_no_traceback(trained, tmp_path_factory, name, doc, raw, use_raw):
    d = copy_run(trained[3], tmp_path_factory.mktemp("fz") / "run")
    with open(os.path.join(d, name), "wb") as fh:
        fh.write(raw if use_raw else json.dumps(doc).encode())
    try:
        run = load_run(d)
        run.name, run.label(), run.eval(), read_metrics(d)
        SAE.load(d)
    except ActCacheError as err:
        assert "\n" not in str(err)


@FUZZ
@given(at=st.integers(0, 200), byte=st.integers(0, 255), old_run=st.booleans())
def test_fuzzed_safetensors_headers_give_one_line(trained, tmp_path_factory, at, byte, old_run):
    d = copy_run(trained[3], tmp_path_factory.mktemp("fz") / "run")
    if old_run:  # no record: the header parser alone stands between the damage and the SAE
        done = json.load(open(os.path.join(d, DONE_FILE)))
        done.pop("files")
        json.dump(done, open(os.path.join(d, DONE_FILE), "w"))
    w = os.path.join(d, WEIGHTS_FILE)
    with open(w, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([byte]))
    try:
        SAE.load(d)
    except ActCacheError as err:
        assert "\n" not in str(err) and (WEIGHTS_FILE in str(err) or CONFIG_FILE in str(err))


# ---- a checkpoint that matches its manifest but will not load ----------------------------------


def test_an_unloadable_checkpoint_falls_back_to_the_one_before(trained, tmp_path, caplog):
    import argparse
    import shutil

    import torch

    from actcache.sae import checkpoint as ckpt

    cache, train_file, runs_to, d0 = trained
    shutil.copytree(runs_to, tmp_path / "runs")
    d = str(tmp_path / "runs" / os.path.relpath(d0, runs_to))
    for name in (DONE_FILE, EVAL_FILE):
        os.remove(os.path.join(d, name))
    assert ckpt.steps(d) == [2, 4]
    step4 = ckpt.step_dir(d, 4)
    torch.save({"optimizer": argparse.Namespace(a=1)}, os.path.join(step4, "state.pt"))  # not weights-only
    with open(os.path.join(step4, "manifest.json"), "wb") as fh:
        fh.write(ckpt._manifest(step4, 4))  # the manifest matches: only loading can tell
    with caplog.at_level(logging.WARNING):
        train_on_cache(cache, train_file, runs_to=str(tmp_path / "runs"))
    assert "cannot be loaded" in caplog.text and os.path.isdir(step4 + ".invalid")
    assert os.path.exists(os.path.join(d, DONE_FILE)) and [m["step"] for m in read_metrics(d)] == [2, 4]


def test_visuals_reuse_recomputes_a_truncated_latents_npz(trained, tmp_path, caplog):
    d = copy_run(trained[3], tmp_path / "run")
    assert cli.main(["visuals", d, "--latents", "3", "--no-images", "--device", "cpu"]) == 0
    npz = os.path.join(d, "visuals", "latents.npz")
    os.truncate(npz, os.path.getsize(npz) // 2)
    with caplog.at_level(logging.WARNING):
        assert cli.main(["visuals", d, "--latents", "3", "--no-images", "--device", "cpu", "--reuse"]) == 0
    assert "latents.npz is damaged" in caplog.text
    with open(os.path.join(d, "visuals", "summary.json")) as fh:
        assert json.load(fh)["reused"] is False
    with open(npz, "rb") as fh:
        assert fh.read(2) == b"PK" and os.path.getsize(npz) > 0  # written whole again


# ---- verify reads labels the way train does ----------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "fifo", "float"])
def test_verify_refuses_labels_train_would_refuse(tmp_path, capsys, damage):
    import numpy as np

    labels = np.arange(6) % 2
    cache, _, _ = make_cache(tmp_path / "c", n_imgs=6, layers=(7,), labels=labels, class_names=["a", "b"])
    assert cli.main(["verify", cache]) == 0
    npy = os.path.join(cache, "labels.npy")
    if damage == "truncate":
        os.truncate(npy, 100)
    elif damage == "fifo":  # np.load would block on it
        os.remove(npy)
        os.mkfifo(npy)
    else:
        np.save(npy, labels.astype(np.float32))
    capsys.readouterr()
    assert cli.main(["verify", cache]) == 1
    assert "labels.npy" in capsys.readouterr().out


@pytest.mark.parametrize("data", [["a", "b"], "images", [["kind", "image_folder"], ["root", "x"]], 3])
def test_experiment_data_that_is_not_a_mapping_is_one_line(tmp_path, capsys, data):
    exp = tmp_path / "e.yaml"
    exp.write_text(yaml.safe_dump({"vit": {"family": "clip", "ckpt": "x", "layers": [1]}, "data": data}))
    assert cli.main(["plan", "--experiment", str(exp), "--dump-to", str(tmp_path), "--runs-to", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{exp}: key 'data' is" in err and "give a mapping" in err and len(err.strip().splitlines()) == 1


# ---- ENOSPC names the file ---------------------------------------------------------------------


def test_a_full_disk_during_convert_names_the_shard(tmp_path):
    import sys

    from conftest import in_mount_namespace

    cache, md, _ = make_cache(tmp_path / "c", n_imgs=40, layers=(7,), n_patches=16, d=64, imgs_per_shard=10)
    out = tmp_path / "out"
    out.mkdir()
    script = f'mount -t tmpfs -o size=80k tmpfs {out} || exit 99; "$@"'  # room for 2 of the 4 shards
    got = in_mount_namespace(script, [sys.executable, "-m", "actcache.cli", "convert", cache, "--dtype", "float16",
                                      "--to", out])  # fmt: skip
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    (line,) = [ln for ln in got.stderr.splitlines() if "error:" in ln]
    assert "No space left on device" in line and "/acts00000" in line and ".bin:" in line, line


# ---- bounds at plan time -----------------------------------------------------------------------


@pytest.mark.parametrize("train,want", [
    ({"width": 2**40}, "key 'width' must be in [1, "), ({"exp_factor": 1e300}, "key 'exp_factor' must be in (0, 4096]"),
    ({"lr": 1e308}, "key 'lr' must be in (0, 1]"), ({"aux_coeff": 1e9}, "key 'aux_coeff' must be in [0, 10000]"),
    ({"width": 2**24}, "needs 2,048.3 GiB to train (weights, gradients and Adam's two moments: 4 x 137,455,734,784 "),
])  # fmt: skip
def test_unbounded_train_settings_are_refused_with_the_figure(train, want):
    from actcache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^x\.yaml: train: ") as got:
        expand_train_section({"steps": 10, **train}, "x.yaml", d_vit=4096)
    assert want in str(got.value)
    if "GiB" in want:
        assert "more than the 192 GiB of the largest device" in str(got.value)


def test_a_million_dump_workers_is_refused_by_plan(tmp_path, capsys):
    exp = tmp_path / "e.yaml"
    exp.write_text(yaml.safe_dump({"vit": {"family": "clip", "ckpt": "x", "layers": [1]},
                                   "data": {"kind": "image_folder", "root": "x"}, "cache": {"n_workers": 1000000}}))  # fmt: skip
    assert cli.main(["plan", "--experiment", str(exp), "--dump-to", str(tmp_path), "--runs-to", str(tmp_path)]) == 2
    assert "key 'cache.n_workers' must be in [0, 256], got 1000000" in capsys.readouterr().err
