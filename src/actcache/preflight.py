"""Filesystem preconditions, checked before any job runs and before anything is written.

`actcache plan`, the workflow's parse (`snakemake -n` included), `actcache dump` and `actcache
train` call these first: an experiment's inputs exist (``data.root``, ``data.path``, a local
``vit.ckpt``) and the roots it writes to (``dump_to``, ``runs_to``) can be created and written.
Each failure is one ConfigError line naming the file the value came from, the key as written
there, the value and the fix. The checks only read: a missing root is fine when its nearest
existing parent is a writable directory (the jobs create it).
"""

from __future__ import annotations

import dataclasses
import os

from actcache.errors import ConfigError

COMMAND_LINE = "command line"


@dataclasses.dataclass(frozen=True)
class Setting:
    """A value and where the user wrote it: a file (or the command line) and the key as written."""

    value: str
    source: str  # "config/config.yaml", an experiment YAML, or COMMAND_LINE
    key: str  # "dump_to" in a file, "--dump-to" on the command line

    def fail(self, problem: str, fix: str) -> ConfigError:
        if self.source == COMMAND_LINE:
            return ConfigError(f"{self.key} {self.value!r}: {problem}; give {self.key} a directory you can write.")
        return ConfigError(f"{self.source}: key '{self.key}' is {self.value!r}: {problem}; {fix}.")


def root_setting(exp, key: str, override: str | None = None) -> Setting:
    """The ``dump_to``/``runs_to`` a command uses: its ``--dump-to``/``--runs-to`` value when given,
    else the experiment file's key."""
    if override:
        return Setting(override, COMMAND_LINE, "--" + key.replace("_", "-"))
    return Setting(getattr(exp, key) or "", exp.source, key)


_FIX = {
    "dump_to": "set dump_to to a directory you can write (on a cluster, a shared scratch filesystem)",
    "runs_to": "set runs_to to a directory you can write",
}


def check_writable_dir(s: Setting) -> None:
    """``s.value`` is a writable directory, or can be made one by creating the missing part."""
    fix = _FIX.get(s.key, f"set {s.key} to a directory you can write")
    path = os.path.abspath(os.path.expanduser(s.value))
    existing = path
    while not os.path.lexists(existing):  # the nearest existing ancestor is where mkdir writes
        existing = os.path.dirname(existing)
    where = "it" if existing == path else existing
    if not os.path.isdir(existing):
        raise s.fail(f"{where} is not a directory", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        problem = "is on a read-only filesystem" if read_only else "is not writable by this user"
        raise s.fail(f"{where} {problem}", fix)


def check_inputs(exp) -> None:
    """The experiment's image dataset and local checkpoint directory exist (read-only checks)."""
    from actcache.images import HfDiskDataset, ImageFolder

    if isinstance(exp.data, ImageFolder) and not os.path.isdir(exp.data.root):
        hint = _demo_hint(exp.data.root, os.path.join("demo", "images"), "")
        raise Setting(exp.data.root, exp.source, "data.root").fail(
            "no such directory", f"set data.root to an image folder (images at any depth){hint}"
        )
    if isinstance(exp.data, HfDiskDataset) and not os.path.exists(exp.data.path):
        raise Setting(exp.data.path, exp.source, "data.path").fail(
            "no such dataset", "set data.path to a folder written by `datasets.save_to_disk`"
        )
    _check_checkpoint(exp)


def _check_checkpoint(exp) -> None:
    from actcache.models import is_local_checkpoint

    ckpt = exp.vit.ckpt
    if not is_local_checkpoint(ckpt):
        return  # a hub id: describe_checkpoint says whether it can be read
    path = os.path.expanduser(ckpt)
    s = Setting(ckpt, exp.source, "vit.ckpt")
    fix = "set vit.ckpt to a folder written by `save_pretrained`, or a hub id such as openai/clip-vit-base-patch16"
    if not os.path.isdir(path):
        hint = _demo_hint(path, os.path.join("demo", "models", f"tiny-{exp.vit.family}"), exp.vit.family)
        raise s.fail("no such directory", fix + hint)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise s.fail("that directory holds no config.json", fix)


def _demo_hint(path: str, tail: str, family: str) -> str:
    if not os.path.normpath(path).endswith(tail):
        return ""
    flag = f" --family {family}" if family and family != "clip" else ""
    return f" (the offline demo's: `actcache demo-assets{flag}` writes it)"


def check_listed_once(files: list[str], base_dir: str, listed_in: Setting) -> None:
    """No experiment file is listed twice (two spellings of one file count as one)."""
    seen: dict[str, str] = {}
    for f in files:
        real = os.path.realpath(f if os.path.isabs(f) else os.path.join(base_dir, f))
        if real in seen:
            twice = (
                f"{f!r} is listed twice" if seen[real] == f else f"{seen[real]!r} and {f!r} (one file) are both listed"
            )
            where = listed_in.key if listed_in.source == COMMAND_LINE else f"{listed_in.source}: key '{listed_in.key}'"
            raise ConfigError(f"{where}: {twice}; list each experiment once (delete the repeat).")
        seen[real] = f
