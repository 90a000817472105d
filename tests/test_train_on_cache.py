"""train_on_cache: the train: section of a YAML trained on a given cache (v1 or saev 2.1), with
resume and held-out evaluation; nothing written into a saev cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from actcache import cli
from actcache.cli import main as actcache_main
from actcache.errors import ConfigError
from actcache.sae.modeling import SAE
from actcache.sae.on_cache import train_on_cache
from actcache.sae.train import Preempted
from conftest import make_cache
from saev_fixture import tree_state, write_saev_cache

TRAIN = {"layer": 7, "batch_size": 16, "steps": 6, "log_every": 2, "ckpt_every": 3, "eval_frac": 0.2,
         "b_dec_init": "mean", "buffer_bytes": 20000,
         "saes": [{"activation": "relu", "width": 12, "l1_coeff": 1.0e-3}, {"activation": "topk", "width": 12, "k": 3}]}  # fmt: skip


def write_yaml(path, doc) -> str:
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("kind", ["v1", "saev"])
def test_trains_resumes_and_evaluates_on_a_given_cache(tmp_path, kind):
    if kind == "saev":
        cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    else:
        cache, _, _ = make_cache(tmp_path / "c", n_imgs=20, layers=(3, 7), n_patches=4, d=8, imgs_per_shard=6)
    before = tree_state(tmp_path / "c")
    train_file = write_yaml(tmp_path / "train.yaml", {"train": TRAIN})
    dirs = train_on_cache(cache, train_file, runs_to=str(tmp_path / "runs"))
    assert len(dirs) == 2 and all(os.path.dirname(d) == str(tmp_path / "runs" / os.path.basename(cache)) for d in dirs)
    for d in dirs:
        ev = json.load(open(os.path.join(d, "eval.json")))
        assert ev["n_heldout_images"] == 4 and ev["n_tokens"] == 4 * 4 and ev["nmse"] >= 0
    done = {d: os.stat(os.path.join(d, "done.json")).st_mtime_ns for d in dirs}
    assert train_on_cache(cache, train_file, runs_to=str(tmp_path / "runs")) == dirs  # done: skipped
    assert done == {d: os.stat(os.path.join(d, "done.json")).st_mtime_ns for d in dirs}
    if kind == "saev":
        assert tree_state(tmp_path / "c") == before


def test_an_experiment_yaml_gives_its_train_section_and_runs_to(tmp_path):
    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    exp = {"vit": {"family": "clip", "ckpt": "unused", "layers": [7]}, "runs_to": str(tmp_path / "r"),
           "train": {**TRAIN, "saes": [{"activation": "batchtopk", "width": 12, "k": 3}]}}  # fmt: skip
    dirs = train_on_cache(cache, write_yaml(tmp_path / "exp.yaml", exp))
    assert len(dirs) == 1 and dirs[0].startswith(str(tmp_path / "r"))
    assert os.path.exists(os.path.join(dirs[0], "done.json"))


def test_a_file_without_train_or_runs_to_is_a_clear_error(tmp_path):
    cache, _, _ = write_saev_cache(tmp_path / "c")
    with pytest.raises(ConfigError, match="needs a 'train:' mapping"):
        train_on_cache(cache, write_yaml(tmp_path / "a.yaml", {"vit": {}}))
    with pytest.raises(ConfigError, match="give runs_to"):
        train_on_cache(cache, write_yaml(tmp_path / "b.yaml", {"train": TRAIN}))
    with pytest.raises(ConfigError, match=r"'layer' = 5.*\[3, 7\]"):
        train_on_cache(cache, write_yaml(tmp_path / "c.yaml", {"train": {**TRAIN, "layer": 5}}), runs_to="r")


def test_visuals_of_an_sae_trained_on_a_saev_cache(tmp_path, capsys):
    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    train = {**TRAIN, "saes": [{"activation": "topk", "width": 12, "k": 3}]}
    (run_dir,) = train_on_cache(cache, write_yaml(tmp_path / "t.yaml", {"train": train}), runs_to=str(tmp_path / "r"))
    assert cli.main(["visuals", run_dir, "--latents", "3"]) == 2  # saev's dataset config is never unpickled
    assert "opaque string" in capsys.readouterr().err
    assert cli.main(["visuals", run_dir, "--latents", "3", "--no-images"]) == 0
    assert os.path.isfile(os.path.join(run_dir, "visuals", "index.html"))


def test_a_stopped_run_on_a_saev_cache_resumes_to_the_same_weights(tmp_path):
    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    train_file = write_yaml(
        tmp_path / "t.yaml", {"train": {**TRAIN, "saes": [{"activation": "topk", "width": 12, "k": 3}]}}
    )
    (whole,) = train_on_cache(cache, train_file, runs_to=str(tmp_path / "a"))
    polls = iter(range(100))
    with pytest.raises(Preempted):
        train_on_cache(cache, train_file, runs_to=str(tmp_path / "b"), stop=lambda: next(polls) == 2)
    (resumed,) = train_on_cache(cache, train_file, runs_to=str(tmp_path / "b"))
    a, b = SAE.load(whole).state_dict(), SAE.load(resumed).state_dict()
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # topk keeps a NaN threshold


def test_train_cache_command(tmp_path, capsys):
    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    train_file = write_yaml(
        tmp_path / "t.yaml", {"train": {**TRAIN, "saes": [{"activation": "topk", "width": 12, "k": 2}]}}
    )
    argv = ["train", "--cache", cache, "--train", train_file, "--runs-to", str(tmp_path / "r"), "--device", "cpu"]
    assert actcache_main(argv) == 0
    (printed,) = capsys.readouterr().out.split()
    assert os.path.isfile(os.path.join(printed, "done.json"))
    assert actcache_main(argv[:3] + argv[5:]) == 2
    assert "needs --train FILE" in capsys.readouterr().err


def test_workflow_caches_entry_is_planned_trained_and_reported_without_dumping(tmp_path):
    """config.yaml's `caches:` names a saev cache: plan and the dry run list its training job and no
    dump; the workflow trains, evaluates and renders its SAE (no images: saev's dataset is opaque)
    and never writes into the cache."""
    from workflow_helpers import TWO_AT_A_TIME, job_counts, snakemake

    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    before = tree_state(tmp_path / "c")
    train_file = write_yaml(tmp_path / "train.yaml", {"train": {**TRAIN, "saes": TRAIN["saes"][1:]}})
    cfg = write_yaml(tmp_path / "config.yaml", {"dump_to": str(tmp_path / "dump"), "runs_to": str(tmp_path / "runs"),
                                                "caches": [{"dir": cache, "train": train_file}]})  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "actcache.cli", "plan", "--config", cfg, "--json"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["cache"] == cache and row["hash"] == os.path.basename(cache) and len(row["training"]) == 1
    dry = snakemake(cfg, "-n")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert job_counts(dry.stdout).get("train") == 1 and "dump" not in job_counts(dry.stdout)
    assert f"--cache {cache}" in dry.stdout or row["training"][0]["group"] in dry.stdout
    sae_dir = row["training"][0]["dir"]
    run = snakemake(cfg, os.path.join(sae_dir, "visuals.html"), *TWO_AT_A_TIME)  # train, then its page
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.load(open(os.path.join(sae_dir, "eval.json")))["nmse"] >= 0
    assert os.path.isfile(os.path.join(sae_dir, "visuals.html"))
    left = job_counts(snakemake(cfg, "-n").stdout)  # only the sweep plots: no spliced eval (no images)
    assert left == {"sweep_report": 1, "all": 1}, left
    assert tree_state(tmp_path / "c") == before and not os.path.exists(tmp_path / "dump")


def test_workflow_caches_entry_errors_name_the_key(tmp_path):
    cache, _, _ = write_saev_cache(tmp_path / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    for entry, key in (({"dir": str(tmp_path / "nope"), "train": cache}, "caches[0].dir"),
                       ({"dir": cache, "train": str(tmp_path / "nope.yaml")}, "caches[0].train"),
                       ({"dir": cache}, "caches[0].train"), ({"dir": cache, "trian": "x"}, "caches[0].trian")):  # fmt: skip
        cfg = write_yaml(tmp_path / "config.yaml", {"dump_to": "d", "runs_to": "r", "caches": [entry]})
        proc = subprocess.run([sys.executable, "-m", "actcache.cli", "plan", "--config", cfg],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 2 and key in proc.stderr and "config.yaml" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
