"""actcache.ckptid: a local checkpoint is identified by its files, not its path."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import yaml
from safetensors.torch import load_file, save_file
from tests.fixtures_vit import make_checkpoint

from actcache.ckptid import SOURCE_FILE, checkpoint_digest, checkpoint_source, record_source
from actcache.config import load_experiment
from actcache.errors import ConfigError
from actcache.plan import experiment_metadata, plan_from_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-clip"), "clip")


def _project(root, ckpt_src: str, dump_to: str) -> str:
    """A project with its checkpoint inside (models/tiny-clip, written relative); returns config.yaml."""
    shutil.copytree(ckpt_src, os.path.join(root, "models", "tiny-clip"))
    os.makedirs(os.path.join(root, "config", "experiments"))
    exp = {
        "vit": {"family": "clip", "ckpt": "models/tiny-clip", "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4},
    }
    with open(os.path.join(root, "config", "experiments", "e.yaml"), "w") as fd:
        yaml.safe_dump(exp, fd)
    cfg = {"dump_to": dump_to, "runs_to": os.path.join(root, "runs"), "experiments": ["config/experiments/e.yaml"]}
    with open(os.path.join(root, "config", "config.yaml"), "w") as fd:
        yaml.safe_dump(cfg, fd)
    return os.path.join(root, "config", "config.yaml")


def test_two_clones_get_one_hash_and_overwritten_weights_a_new_one(tmp_path, ckpt):
    dump_to = str(tmp_path / "shared-cache")
    a = _project(tmp_path / "clone-a", ckpt, dump_to)
    shutil.copytree(tmp_path / "clone-a", tmp_path / "clone-b")
    (pa,), (pb,) = plan_from_config(a), plan_from_config(str(tmp_path / "clone-b" / "config" / "config.yaml"))
    assert pa.hash == pb.hash and pa.exp.vit.ckpt != pb.exp.vit.ckpt  # one cache for both paths
    assert pa.metadata.vit_ckpt == "sha256:" + checkpoint_digest(pa.exp.vit.ckpt)

    # weights overwritten in place (same names, one value changed): a new hash
    weights = os.path.join(pa.exp.vit.ckpt, "model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    (pa2,) = plan_from_config(a)
    assert pa2.hash != pa.hash and pa2.metadata.vit_ckpt != pa.metadata.vit_ckpt
    (pb2,) = plan_from_config(str(tmp_path / "clone-b" / "config" / "config.yaml"))
    assert pb2.hash == pb.hash  # the other clone's checkpoint did not change


def test_digests_are_remembered_by_size_and_mtime(tmp_path, ckpt):
    memo = str(tmp_path / "memo")
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    for dirpath, _, files in os.walk(path):  # aged: a file that just changed is not remembered
        for f in files:
            os.utime(os.path.join(dirpath, f), (1_700_000_000, 1_700_000_000))
    first = checkpoint_digest(path, memo)
    (memo_file,) = os.listdir(memo)
    assert checkpoint_digest(path, memo) == first == checkpoint_digest(path)
    # the memo is used: a planted digest for an unchanged file is believed (what makes planning fast) ...
    with open(os.path.join(memo, memo_file)) as fd:
        doc = json.load(fd)
    doc["config.json"][3] = "0" * 64
    with open(os.path.join(memo, memo_file), "w") as fd:
        json.dump(doc, fd)
    assert checkpoint_digest(path, memo) != first
    # ... and a file rewritten (new mtime) is read again
    os.utime(os.path.join(path, "config.json"), (1_700_000_100, 1_700_000_100))
    assert checkpoint_digest(path, memo) == first


def test_eval_and_visuals_find_the_checkpoint_a_dump_recorded(tmp_path, ckpt):
    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    exp_file = tmp_path / "e.yaml"
    exp_file.write_text(yaml.safe_dump({
        "vit": {"family": "clip", "ckpt": path, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4},
    }))  # fmt: skip
    md = experiment_metadata(load_experiment(str(exp_file)))
    cache_dir = str(tmp_path / "cache")
    os.makedirs(cache_dir)
    with pytest.raises(ConfigError, match=r"does not say where it lies"):
        checkpoint_source(md.vit_ckpt, cache_dir)
    record_source(cache_dir, md.vit_ckpt, path)
    assert checkpoint_source(md.vit_ckpt, cache_dir) == path
    assert checkpoint_source("openai/clip-vit-base-patch16", None) == "openai/clip-vit-base-patch16"
    os.rename(path, path + "-moved")
    with pytest.raises(ConfigError, match=rf"{SOURCE_FILE}: the checkpoint directory .* no longer holds"):
        checkpoint_source(md.vit_ckpt, cache_dir)


def _old_version_cache(new_dir: str, ckpt_path: str) -> str:
    """``new_dir`` turned into what a dump made when ``vit_ckpt`` was the checkpoint's path: the
    directory named by that metadata's hash, its checksum records labelled with it."""
    from actcache import checksums
    from actcache.protocol import Metadata

    old_md = dataclasses.replace(Metadata.load(new_dir), vit_ckpt=ckpt_path)
    old_dir = os.path.join(os.path.dirname(new_dir), old_md.hash)
    os.rename(new_dir, old_dir)
    os.remove(os.path.join(old_dir, SOURCE_FILE))
    old_md.dump(old_dir)
    records = checksums.record_dir(old_dir)
    for name in os.listdir(records):
        rec = checksums.read_record(records, name.removesuffix(".json"))
        checksums.write_record(records, dataclasses.replace(rec, cache=old_md.hash))
    return old_dir


def test_a_cache_dumped_under_the_path_identity_is_adopted_not_dumped_again(tmp_path, ckpt):
    from actcache.dump import dump_shards
    from actcache.validate import validate_dir

    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    exp_file = tmp_path / "e.yaml"
    doc = {
        "vit": {"family": "clip", "ckpt": path, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4, "n_workers": 0, "device": "cpu"},
    }
    exp_file.write_text(yaml.safe_dump(doc))
    exp = load_experiment(str(exp_file))
    dump_to = str(tmp_path / "d")
    new_dir = dump_shards(exp, None, dump_to, progress=False)
    old_dir = _old_version_cache(new_dir, path)
    inodes = {n: os.stat(os.path.join(old_dir, n)).st_ino for n in os.listdir(old_dir) if n.endswith(".bin")}

    (p,) = plan_from_config(_config(tmp_path, exp_file, dump_to))
    assert p.cache_dir == new_dir and p.status()["state"] == "missing"
    (note,) = p.notes()
    assert note.startswith(f"{old_dir} holds this cache") and "the dump adopts it" in note

    assert dump_shards(exp, None, dump_to, progress=False) == new_dir  # adopted: renamed, nothing recomputed
    assert not os.path.exists(old_dir)
    assert {n: os.stat(os.path.join(new_dir, n)).st_ino for n in inodes} == inodes
    from actcache.writer import gather

    gather(new_dir)
    validate_dir(new_dir, deep=True)  # the checksum records now name the new hash
    assert checkpoint_source(p.metadata.vit_ckpt, new_dir) == path

    # the same layers under another spelling: noted, not silently a second cache
    doc["vit"]["layers"] = [2]  # block 2 of 3 is -1
    exp_file.write_text(yaml.safe_dump(doc))
    (p2,) = plan_from_config(_config(tmp_path, exp_file, dump_to))
    assert p2.hash != p.hash
    assert p2.notes() == [
        f"a cache of the same layers spelled [-1] exists at {new_dir}; write vit.layers: [-1] to use it"
    ]


def test_a_path_identity_cache_is_not_adopted_when_the_weights_changed_after_its_dump(tmp_path, ckpt, caplog):
    from actcache.dump import dump_shards

    path = str(tmp_path / "c")
    shutil.copytree(ckpt, path)
    exp_file = tmp_path / "e.yaml"
    exp_file.write_text(yaml.safe_dump({
        "vit": {"family": "clip", "ckpt": path, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 4, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4, "n_workers": 0, "device": "cpu"},
    }))  # fmt: skip
    exp = load_experiment(str(exp_file))
    dump_to = str(tmp_path / "d")
    old_dir = _old_version_cache(dump_shards(exp, None, dump_to, progress=False), path)
    t = os.stat(os.path.join(old_dir, "metadata.json")).st_mtime + 10
    os.utime(os.path.join(path, "model.safetensors"), (t, t))  # written after that dump began
    (p,) = plan_from_config(_config(tmp_path, exp_file, dump_to))
    (note,) = p.notes()
    assert "'model.safetensors' changed after that dump began: not adopted" in note
    new_dir = dump_shards(exp, None, dump_to, progress=False)
    assert os.path.isdir(old_dir) and new_dir != old_dir and "not adopted" in caplog.text


def _config(tmp_path, exp_file, dump_to) -> str:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump({"dump_to": dump_to, "runs_to": str(tmp_path / "runs"), "experiments": [str(exp_file)]})
    )
    return str(cfg)


def test_plan_relist_lists_an_image_folder_again(tmp_path, ckpt, capsys):
    import PIL.Image

    from actcache.cli import main

    imgs = tmp_path / "imgs" / "a" / "b"
    imgs.mkdir(parents=True)
    for i in range(20):
        PIL.Image.new("RGB", (8, 8)).save(imgs / f"f{i:02d}.png")
    t = (1_700_000_000, 1_700_000_000)
    for d in (imgs, imgs.parent, imgs.parent.parent):
        os.utime(d, t)
    exp_file = tmp_path / "e.yaml"
    exp_file.write_text(yaml.safe_dump({
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "image_folder", "root": str(tmp_path / "imgs")},
    }))  # fmt: skip
    argv = ["plan", "--experiment", str(exp_file), "--dump-to", str(tmp_path / "d"), "--runs-to", str(tmp_path / "r")]
    assert main(argv) == 0
    # renamed, then the folder's mtime set back by hand: a change no check of the stored listing sees
    # (f01 is not among the files it samples, and the folder holds as many images as before)
    os.rename(imgs / "f01.png", imgs / "f01b.png")
    os.utime(imgs, t)
    (listing,) = (tmp_path / "d" / ".listings").glob("imagefolder-*.json")
    for extra, name in (([], "a/b/f01.png"), (["--relist"], "a/b/f01b.png")):
        assert main([*argv, *extra]) == 0
        assert name in json.loads(listing.read_text())["files"]
    capsys.readouterr()
