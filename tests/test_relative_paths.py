"""One rule for relative paths in an experiment: they are read from the project root (the folder
holding config/config.yaml), whatever the current directory; a path that only the current
directory has is an error, never silently used (and hashed)."""

from __future__ import annotations

import os

import pytest
import yaml

from actcache.config import load_experiment, project_root
from actcache.errors import ConfigError


def _project(root) -> str:
    os.makedirs(root / "config" / "experiments")
    (root / "config" / "config.yaml").write_text(yaml.safe_dump({"dump_to": "cache", "runs_to": "runs"}))
    exp = root / "config" / "experiments" / "e.yaml"
    exp.write_text(yaml.safe_dump({
        "vit": {"family": "clip", "ckpt": "openai/clip-vit-base-patch16", "layers": [-1]},
        "data": {"kind": "image_folder", "root": "data/imgs"},
        "dump_to": "data/cache",
    }))  # fmt: skip
    return str(exp)


def test_relative_paths_are_read_from_the_project_root_whatever_the_cwd(tmp_path, monkeypatch):
    exp = _project(tmp_path / "proj")
    os.makedirs(tmp_path / "proj" / "data" / "imgs")
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere)
    monkeypatch.chdir(elsewhere)
    assert project_root(exp) == str(tmp_path / "proj")
    e = load_experiment(exp)
    assert e.data.root == str(tmp_path / "proj" / "data" / "imgs")
    assert e.dump_to == str(tmp_path / "proj" / "data" / "cache")
    assert e.vit.ckpt == "openai/clip-vit-base-patch16"  # a hub id stays as written


def test_a_relative_path_only_the_current_directory_has_is_a_one_line_error(tmp_path, monkeypatch):
    exp = _project(tmp_path / "proj")
    os.makedirs(tmp_path / "elsewhere" / "data" / "imgs")  # a same-named folder under the cwd only
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as info:
        load_experiment(exp)
    msg = str(info.value)
    assert msg.startswith(f"{exp}: key 'data.root' is 'data/imgs': relative paths in an experiment are read from "
                          f"the project root {tmp_path / 'proj'}") and "\n" not in msg  # fmt: skip
    assert "Write the path relative to the project root, or absolute." in msg
