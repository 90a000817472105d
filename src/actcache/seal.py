"""`actcache seal DIR`: add checksum records to a cache that has none, after a full verification.

Every byte is read once (``verify --deep``); only a cache without problems is sealed, and only
shards without a record get one (existing records were just checked), or a record listing its
blocks' digests where an older one did not (``verify_reads`` checks blocks). A shard that changed
while it was read is a problem of the scan (deepscan.py): nothing is written for a short or
changed read. A cache actcache wrote
keeps its records in ``<DIR>/.checksums/``. A saev cache is never written into: its records go
to a directory the user names (``--to``), and ``verify --deep --checksums`` reads them there.
"""

from __future__ import annotations

import os

from actcache import checksums
from actcache.errors import ConfigError
from actcache.validate import Report, check_dir


def seal(path: str | os.PathLike, to: str | None = None) -> tuple[Report, list[str]]:
    """(report, shard names sealed now); nothing is written when the report has problems."""
    path = os.fspath(path)
    rep = check_dir(path)
    if not rep.ok:
        return rep, []
    if rep.metadata.foreign and to is None:
        raise ConfigError(
            f"{path} is a saev cache, and actcache never writes into a cache it did not create. Keep its "
            f"checksums elsewhere: `actcache seal {path} --to DIR`, then check them with "
            f"`actcache verify --deep {path} --checksums DIR`."
        )
    if to is not None and _inside(to, path):
        raise ConfigError(f"--to {to}: inside the cache {path}; name a directory outside it.")
    rep = check_dir(path, deep=True, checksums_dir=to)
    if not rep.ok:
        return rep, []
    directory = to or checksums.record_dir(path)
    new = [name for name in rep.digests if _needs_record(directory, name)]
    for name in new:
        checksums.write_record(directory, rep.digests[name])
    return rep, new


def _inside(child: str, parent: str) -> bool:
    parent, child = os.path.realpath(parent), os.path.realpath(child)
    return os.path.commonpath([parent, child]) == parent


def _needs_record(directory: str, name: str) -> bool:
    rec = checksums.read_record(directory, name)
    return rec is None or rec.blocks is None
