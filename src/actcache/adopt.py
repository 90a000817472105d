"""Caches dumped when a local checkpoint was identified by its path are adopted, not dumped again.

Before content identity (actcache.ckptid), ``vit_ckpt`` of a local checkpoint was its absolute
path. Such a cache, ``<dump_to>/<OLD>``, holds what the same experiment now plans as
``<dump_to>/<NEW>`` if the checkpoint's files did not change since that dump began. A dump then
renames the directory to ``<NEW>``, writes its new metadata.json and re-labels its checksum
records (their ``cache`` field), instead of computing every shard again.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from actcache.ckptid import identity_files, is_digest
from actcache.errors import ProtocolError
from actcache.protocol import METADATA_FILE, Metadata

log = logging.getLogger(__name__)


def path_identity(md: Metadata, ckpt: str) -> Metadata | None:
    """The metadata the same experiment had when a local checkpoint was named by its path."""
    if not is_digest(md.vit_ckpt):
        return None
    return dataclasses.replace(md, vit_ckpt=ckpt)  # as experiment_from_dict wrote it: absolute


def adoptable(dump_to: str, md: Metadata, ckpt: str) -> tuple[str | None, str]:
    """(the old cache directory that a dump would adopt, or None; why not, when there is one that cannot be)."""
    old_md = path_identity(md, ckpt)
    if old_md is None or os.path.exists(os.path.join(dump_to, md.hash)):
        return None, ""
    old = os.path.join(dump_to, old_md.hash)
    if not _holds(old, old_md):
        return None, ""
    began_ns = os.stat(os.path.join(old, METADATA_FILE)).st_mtime_ns
    path = os.path.expanduser(old_md.vit_ckpt)
    changed = [f for f in identity_files(path) if os.stat(os.path.join(path, f)).st_mtime_ns > began_ns]
    if changed:
        return None, (
            f"{old} was dumped from {path} by path, and {changed[0]!r} changed after that dump began: "
            "not adopted (its activations may be of other weights)"
        )
    return old, ""


def adopt(dump_to: str, md: Metadata, ckpt: str) -> str | None:
    """Rename an adoptable old cache to ``<dump_to>/<md.hash>`` with its new metadata and checksum
    records; returns the new directory, or None when there was nothing to adopt. An adoption killed
    after its rename is finished by the next call."""
    new = os.path.join(dump_to, md.hash)
    old_md = path_identity(md, ckpt)
    if old_md is not None and _holds(new, old_md):
        _relabel(new, md)
        return new
    old, why = adoptable(dump_to, md, ckpt)
    if why:
        log.warning("%s", why)
    if old is None:
        return None
    try:
        os.rename(old, new)
    except FileNotFoundError:  # another dump job adopted it first
        return None
    except OSError:
        if os.path.exists(new):  # ... and already wrote into the new directory
            return None
        raise
    n = _relabel(new, md)
    log.info("adopted %s (dumped when the checkpoint was named by its path) as %s, with %d checksum record(s)",
             old, new, n)  # fmt: skip
    return new


def _holds(directory: str, md: Metadata) -> bool:
    try:
        return Metadata.load(os.path.join(directory, METADATA_FILE)).to_dict() == md.to_dict()
    except (OSError, ProtocolError):
        return False


def _relabel(directory: str, md: Metadata) -> int:
    """Give ``directory`` the metadata ``md`` and its checksum records md's hash; returns how many records."""
    from actcache import checksums

    records = checksums.record_dir(directory)
    names = os.listdir(records) if os.path.isdir(records) else []
    shards = sorted(n.removesuffix(".json") for n in names if n.endswith(".json") and not n.startswith("."))
    for shard in shards:
        rec = checksums.read_record(records, shard)
        if rec is not None and rec.cache != md.hash:
            checksums.write_record(records, dataclasses.replace(rec, cache=md.hash))
    md.dump(directory)  # last: a directory holding the old metadata is an adoption to finish
    return len(shards)
