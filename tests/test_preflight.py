"""A new user's mistakes, through `actcache plan` (and one through `snakemake -n`): exit status 2,
exactly one line on stderr naming the file and the key as the user wrote it, and nothing created
on disk. Read-only roots are real read-only bind mounts in a mount namespace of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import yaml
from tests.conftest import in_mount_namespace
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import REPO, SNAKEMAKE

from actcache.errors import ConfigError
from actcache.plan import plan_from_config
from actcache.preflight import COMMAND_LINE, Setting, check_writable_dir

EXPERIMENT = "config/experiments/first.yaml"
CONFIG = "config/config.yaml"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-clip"), "clip")


def write_project(root, ckpt: str) -> str:
    """A project laid out as the repository's: config/config.yaml, one experiment, an image folder."""
    os.makedirs(os.path.join(root, "config", "experiments"))
    os.makedirs(os.path.join(root, "images", "a"))
    rng = np.random.default_rng(0)
    for i in range(3):
        PIL.Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(f"{root}/images/a/{i}.png")
    exp = {
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2, -1]},
        "data": {"kind": "image_folder", "root": "images"},
        "cache": {"max_patches_per_shard": 340},
    }
    write_yaml(os.path.join(root, EXPERIMENT), exp)
    write_yaml(os.path.join(root, CONFIG), {"dump_to": "cache", "runs_to": "runs", "experiments": [EXPERIMENT]})
    return str(root)


def write_yaml(path: str, doc: dict) -> None:
    with open(path, "w") as fd:
        yaml.safe_dump(doc, fd, sort_keys=False)


def edit_yaml(path: str, change) -> None:
    with open(path) as fd:
        doc = yaml.safe_load(fd)
    change(doc)
    write_yaml(path, doc)


def tree(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def plan(root: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "actcache.cli", "plan"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root, env=env)


def image_folder_gone(root):
    os.rename(os.path.join(root, "images"), os.path.join(root, "moved"))


def checkpoint_gone(root):
    edit_yaml(os.path.join(root, EXPERIMENT), lambda d: d["vit"].update(ckpt="data/models/tiny-clip"))


def listed_twice(root):
    edit_yaml(os.path.join(root, CONFIG), lambda d: d["experiments"].append(EXPERIMENT))


def config_key_typo(root):
    edit_yaml(os.path.join(root, CONFIG), lambda d: d.update(dumpto=d.pop("dump_to")))


def layers_not_a_list(root):
    edit_yaml(os.path.join(root, EXPERIMENT), lambda d: d["vit"].update(layers="abc"))


# (mistake, file named, key as written, further words the line must hold)
MISTAKES = [
    (image_folder_gone, EXPERIMENT, "'data.root'", ["images", "no such directory"]),
    (checkpoint_gone, EXPERIMENT, "'vit.ckpt'", ["data/models/tiny-clip", "no such directory", "save_pretrained"]),
    (listed_twice, CONFIG, "'experiments'", ["listed twice"]),
    (config_key_typo, CONFIG, "'dumpto'", ["Did you mean 'dump_to'", "Allowed: caches, dump_to, experiments, runs_to"]),
    (layers_not_a_list, EXPERIMENT, "'vit.layers'", ["'abc'", "e.g. `layers: [-2]`"]),
]


@pytest.mark.parametrize("mistake,file,key,words", MISTAKES, ids=[m[0].__name__ for m in MISTAKES])
def test_plan_names_the_file_and_the_key_as_written_in_one_line(tmp_path, ckpt, mistake, file, key, words):
    root = write_project(tmp_path / "proj", ckpt)
    mistake(root)
    before = tree(root)
    proc = plan(root)
    line = one_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert file in line and key in line and all(w in line for w in words), line
    assert "vit_" not in line  # the metadata's names (vit_ckpt, vit_family) are not what the user wrote
    assert tree(root) == before


def test_a_checkpoint_of_another_family_is_named_by_the_keys_as_written(tmp_path, ckpt, monkeypatch):
    # in-process: transformers reads this checkpoint's config (a subprocess would import it again)
    root = write_project(tmp_path / "proj", ckpt)
    monkeypatch.chdir(root)
    edit_yaml(os.path.join(root, EXPERIMENT), lambda d: d["vit"].update(family="dinov2"))
    with pytest.raises(ConfigError) as info:
        plan_from_config(os.path.join(root, CONFIG))
    msg = str(info.value)
    assert msg.startswith(os.path.join(root, EXPERIMENT)) and "vit.ckpt" in msg and "set vit.family to 'clip'" in msg
    assert "vit_" not in msg and "\n" not in msg
    assert not os.path.exists(os.path.join(root, "cache"))


@pytest.mark.parametrize("key", ["dump_to", "runs_to"])
def test_read_only_root_fails_plan_in_one_line_and_creates_nothing(tmp_path, ckpt, key):
    root = write_project(tmp_path / "proj", ckpt)
    os.makedirs(os.path.join(root, "shelf"))
    edit_yaml(os.path.join(root, CONFIG), lambda d: d.update({key: "shelf/roots"}))
    before = tree(root)
    script = 'mount --bind -o ro "$1/shelf" "$1/shelf" && cd "$1" && exec "$2" -m actcache.cli plan'
    proc = in_mount_namespace(script, [root, sys.executable], timeout=120)
    line = one_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert CONFIG in line and f"key '{key}'" in line and "shelf/roots" in line and "read-only filesystem" in line
    assert f"set {key} to a directory you can write" in line
    assert tree(root) == before


def test_dry_run_says_a_config_key_typo_in_one_line_not_a_schema_dump(tmp_path, ckpt):
    root = write_project(tmp_path / "proj", ckpt)
    config_key_typo(root)
    before = tree(root)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [SNAKEMAKE, "-n", "-s", os.path.join(REPO, "Snakefile"), "-d", root]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    mine = [line for line in out.splitlines() if line.startswith("actcache: config error:")]
    assert len(mine) == 1 and CONFIG in mine[0] and "'dumpto'" in mine[0], out
    assert "Failed validating" not in out and "Traceback" not in out
    assert tree(root) == before


def test_a_root_under_a_file_names_the_flag_it_came_from(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    with pytest.raises(ConfigError) as info:
        check_writable_dir(Setting(str(tmp_path / "notes.txt" / "cache"), COMMAND_LINE, "--dump-to"))
    msg = str(info.value)
    assert msg.startswith("--dump-to ") and "notes.txt is not a directory" in msg and "a directory you can write" in msg
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
