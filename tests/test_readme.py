"""README's blocks marked `<!-- runnable -->` run as written in a fresh shell: `bash` with the
system's PATH only (no virtual env activated), in a fresh copy of the repository whose `.venv` is
the Python running these tests. Only cheap blocks are marked (demo assets, plan, a dry run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from tests.workflow_helpers import REPO

MARK = "<!-- runnable -->"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def runnable_blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fd:
        text = fd.read()
    return re.findall(re.escape(MARK) + r"\s*\n```bash\n(.*?)^```", text, re.S | re.M)


def repo_files() -> list[str]:
    """The repository's files as a fresh clone has them (tracked, plus new ones not ignored)."""
    proc = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [f for f in proc.stdout.splitlines() if os.path.isfile(os.path.join(REPO, f))]


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("clone") / "actcache"
    for f in repo_files():
        os.makedirs(os.path.dirname(root / f), exist_ok=True)
        shutil.copy2(os.path.join(REPO, f), root / f)
    os.symlink(sys.prefix, root / ".venv")  # what scripts/setup.sh made: a venv with actcache installed
    return root


def fresh_shell(root, script: str) -> subprocess.CompletedProcess:
    # PYTHONPATH: the copy's own sources, as the editable install of a real clone points at them
    env = {
        "HOME": str(root.parent),
        "PATH": SYSTEM_PATH,
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(root / "src"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_readme_marks_runnable_blocks_that_activate_the_venv_first():
    blocks = runnable_blocks()
    assert blocks, f"README.md has no {MARK} block"
    assert all(b.splitlines()[0] == "source .venv/bin/activate" for b in blocks)


def test_a_fresh_shell_finds_no_actcache_before_activating(fresh_copy):
    proc = fresh_shell(fresh_copy, "command -v actcache || command -v snakemake")
    assert proc.returncode != 0, proc.stdout  # so the blocks below prove the activation works


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.splitlines()[1].split()[0:2][-1])
def test_readme_block_runs_as_written_in_a_fresh_shell(fresh_copy, block):
    proc = fresh_shell(fresh_copy, block)
    assert proc.returncode == 0, f"{block}\n--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert "command not found" not in proc.stderr


def test_worked_example_shows_the_example_experiment_whole():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fd:
        text = fd.read()
    with open(os.path.join(REPO, "docs", "examples", "imagenet-dinov2.yaml"), encoding="utf-8") as fd:
        example = fd.read()
    assert f"```yaml\n{example}```" in text  # the file the runnable block plans, as shown
