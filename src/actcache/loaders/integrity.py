"""Is a shard file still the one the loader opened? The loaders' side of :mod:`actcache.shardguard`
(identity: device, inode, size and change time) and the one-line :class:`LoaderError` that names
the shard and says what happened to it.

A loader records each shard's identity when it is created. A shard opened later must have that
identity: a file renamed over it (a new inode) is "replaced", never read (its bytes could be
anything: zeros, another shard), and one written to meanwhile (its change time moved) is
"written to". A shard already open keeps its old inode, and the readers look again before each
read (:func:`problem`) and, through its descriptor, before each batch is handed out
(``ShardMaps.unchanged``), so a rewrite in place during a copy is refused, never handed out.

A shard truncated while it is read: reads with preadv come back short, MADV_POPULATE_READ fails
with EFAULT, and a copy out of the mapping raises SIGBUS, which the C kernel turns into
``BusError`` (see _native.c, "SIGBUS guard"); each of them becomes a LoaderError naming the
shard (:func:`read_error`).
"""

from __future__ import annotations

import os

from actcache.errors import LoaderError, os_error_text
from actcache.shardguard import FIX, Identity, ShardChangedError, change, fd_change, identities, identity, open_shard

__all__ = [
    "FIX", "Identity", "ShardChangedError", "check", "fd_change", "identities", "identity", "open_shard", "problem",
    "read_error",
]  # fmt: skip


def problem(path: str, name: str, fd: int | None, expected: Identity, size: int) -> str | None:
    """What is wrong with the shard now (removed, replaced, truncated, written to), or None.
    ``fd``: the descriptor the loader reads it through (its size and change time matter), if open."""
    try:
        st = os.stat(os.path.join(path, name))
    except FileNotFoundError:
        return "was removed after the loader opened it"
    except OSError as err:
        return f"cannot be looked at ({os_error_text(err)})"
    if fd is None:
        return change(st, expected, size)
    if (st.st_dev, st.st_ino) != tuple(expected[:2]):
        return change(st, expected, size)  # (names the new inode)
    return fd_change(fd, expected, size)


def check(path: str, name: str, fd: int | None, expected: Identity, size: int) -> None:
    """Raise a LoaderError naming the shard when :func:`problem` finds something."""
    bad = problem(path, name, fd, expected, size)
    if bad:
        raise ShardChangedError(f"shard {name} in {path} {bad}; {FIX}")


def read_error(path: str, name: str, fd: int | None, expected: Identity, size: int, err: BaseException) -> LoaderError:
    """The LoaderError for a read of the shard that failed with ``err`` (a BusError from a
    copy out of its mapping, a short or failed preadv): what is wrong with the file now, or, if
    nothing is, the error itself."""
    bad = problem(path, name, fd, expected, size)
    cause = f"{type(err).__name__}: {err}"
    if bad:
        return ShardChangedError(f"shard {name} in {path} {bad} ({cause}); {FIX}")
    return LoaderError(f"could not read shard {name} in {path} ({cause}); {FIX}")
