"""A checkpoint's identity in a cache's metadata: what it holds, not where it lies.

A hub id is its own identity (``vit_ckpt`` as written, so existing caches keep their hash). A local
checkpoint directory is identified by ``sha256:<64 hex>``, a digest of its config and weight files
(relative name, size and sha256 of each; see :data:`IDENTITY_SUFFIXES`): the same checkpoint in two
clones, or under two absolute paths, gives one cache hash, and weights overwritten in place give a
new one. The digest of each file is remembered by (size, mtime, inode) under ``<dump_to>/.listings``,
so planning reads the weights only when they changed.

The metadata then no longer says where the checkpoint lies: a dump records the directory it read
in the cache's ``checkpoint.json`` (:func:`record_source`), and :func:`checkpoint_source` finds it
again for `eval` and `visuals`, checking it still holds those files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from actcache.errors import ConfigError
from actcache.fsutil import atomic_write_bytes, sha256_file

DIGEST_PREFIX = "sha256:"
SOURCE_FILE = "checkpoint.json"  # in <HASH>/: the local directory a dump read the checkpoint from
# Files that make a checkpoint: configs (config.json, preprocessor_config.json, indexes) and weights.
IDENTITY_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".npz")
_RACY_S = 2.0  # a file modified this recently may change within its mtime tick: not remembered
log = logging.getLogger(__name__)


def is_digest(vit_ckpt: str) -> bool:
    return vit_ckpt.startswith(DIGEST_PREFIX)


def checkpoint_identity(ckpt: str, memo_dir: str | None = None) -> str:
    """``vit_ckpt`` for the metadata: a hub id as is, a local directory as ``sha256:<digest>``."""
    from actcache.models import is_local_checkpoint

    if not is_local_checkpoint(ckpt):
        return ckpt
    return DIGEST_PREFIX + checkpoint_digest(os.path.expanduser(ckpt), memo_dir)


def identity_files(path: str) -> list[str]:
    """Relative names ("/" separators, sorted) of the config and weight files under ``path``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, path)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in filenames:
            if not name.startswith(".") and name.endswith(IDENTITY_SUFFIXES):
                if os.path.isfile(os.path.join(dirpath, name)):
                    out.append(prefix + name)
    return sorted(out)


def checkpoint_digest(path: str, memo_dir: str | None = None) -> str:
    """sha256 over each identity file's relative name, size and sha256 (64 hex digits)."""
    path = os.path.normpath(os.path.abspath(path))
    memo_path = None
    memo: dict = {}
    if memo_dir is not None:
        name = "ckpt-" + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".json"
        memo_path = os.path.join(memo_dir, name)
        memo = _read_memo(memo_path)
    files = identity_files(path)
    if not files:
        raise ConfigError(f"checkpoint directory {path!r} holds no config or weight files; point vit.ckpt at one")
    total = hashlib.sha256()
    fresh: dict = {}
    for rel in files:
        full = os.path.join(path, rel)
        try:
            st = os.stat(full)
            stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
            known = memo.get(rel)
            digest = known[3] if isinstance(known, list) and known[:3] == stamp else _file_sha256(full)
        except OSError as e:
            raise ConfigError(f"cannot read checkpoint file {full!r} ({e.strerror}); fix its permissions") from None
        if time.time() - st.st_mtime_ns / 1e9 > _RACY_S:
            fresh[rel] = [*stamp, digest]
        total.update(f"{rel}\0{st.st_size}\0{digest}\n".encode("utf-8", "surrogateescape"))
    if memo_path is not None and fresh != memo:
        try:
            os.makedirs(memo_dir, exist_ok=True)
            atomic_write_bytes(memo_path, json.dumps(fresh, sort_keys=True).encode("utf-8"))
        except OSError as e:  # only a saving: the next plan reads the weights again
            log.debug("cannot remember checkpoint digests in %s (%s)", memo_path, e)
    return total.hexdigest()


def _read_memo(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _file_sha256(path: str) -> str:
    return sha256_file(path)[0]


def record_source(cache_dir: str, vit_ckpt: str, ckpt: str) -> None:
    """Write ``<cache_dir>/checkpoint.json``: the local directory the dump reads ``vit_ckpt`` from."""
    if not is_digest(vit_ckpt):
        return
    doc = {"vit_ckpt": vit_ckpt, "path": os.path.normpath(os.path.abspath(os.path.expanduser(ckpt)))}
    atomic_write_bytes(os.path.join(cache_dir, SOURCE_FILE), json.dumps(doc, indent=2).encode("utf-8"))


def copy_source(src_dir: str, dest_dir: str) -> None:
    """A cache made from another (convert) records where the same checkpoint lies."""
    try:
        with open(os.path.join(src_dir, SOURCE_FILE), "rb") as f:
            raw = f.read(1 << 16)
    except FileNotFoundError:
        return
    atomic_write_bytes(os.path.join(dest_dir, SOURCE_FILE), raw)


def checkpoint_source(vit_ckpt: str, cache_dir: str | None) -> str:
    """The hub id or local directory to load ``vit_ckpt`` of a cache from: a hub id (or a path, in a
    cache written before content identity) as is; a digest from the cache's ``checkpoint.json``,
    checked to still hold those files."""
    if not is_digest(vit_ckpt):
        return vit_ckpt
    from actcache.docfiles import load_json_file

    where = os.path.join(cache_dir or ".", SOURCE_FILE)
    if cache_dir is None or not os.path.isfile(where):
        raise ConfigError(
            f"the cache's checkpoint is {vit_ckpt}, a local directory, and {where} does not say where it lies; "
            "dump the cache again from that checkpoint (it is found, not recomputed)"
        )
    doc = load_json_file(where, ConfigError, "checkpoint record")
    path = doc.get("path") if isinstance(doc, dict) else None
    if not isinstance(path, str) or doc.get("vit_ckpt") != vit_ckpt:
        raise ConfigError(f"{where}: not a record of checkpoint {vit_ckpt}; delete it and dump again to rewrite it")
    if not os.path.isdir(path) or DIGEST_PREFIX + checkpoint_digest(path) != vit_ckpt:
        raise ConfigError(
            f"{where}: the checkpoint directory {path!r} no longer holds the files of {vit_ckpt} (moved or "
            "overwritten); put them back there, or dump from the new location to record it"
        )
    return path
