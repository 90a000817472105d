"""Is a shard file still the one the loader opened? Identity and size checks, and the one-line
:class:`LoaderError` that names the shard and says what happened to it.

A loader records each shard's identity (device and inode) when it is created. A shard opened
later must have that identity: a file renamed over it (a new inode) is "replaced", never read
(its bytes could be anything: zeros, another shard). A shard already open keeps its old inode
(its bytes stay readable and are the ones that were validated), and the readers look again
before each read (:func:`problem`), so a replacement is reported within one read.

A shard truncated while it is read: reads with preadv come back short, MADV_POPULATE_READ fails
with EFAULT, and a copy out of the mapping raises SIGBUS, which the C kernel turns into
``BusError`` (see _native.c, "SIGBUS guard"); each of them becomes a LoaderError naming the
shard (:func:`read_error`).
"""

from __future__ import annotations

import os

from actcache.errors import LoaderError, os_error_text

Identity = tuple[int, int]  # (st_dev, st_ino)

FIX = (
    "do not rewrite, replace or remove a cache's shards while it is read; check the cache with "
    "`actcache verify --deep DIR` and re-dump the shards it reports"
)


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def identities(path: str, names: list[str]) -> list[Identity]:
    """The identity of each shard file now (one stat each)."""
    out = []
    for name in names:
        try:
            out.append(identity(os.stat(os.path.join(path, name))))
        except OSError as err:
            raise LoaderError(f"cannot open shard {name} in {path}: {os_error_text(err)}; {FIX}") from None
    return out


def open_shard(path: str, name: str, expected: Identity, size: int) -> int:
    """A read-only descriptor of the shard, checked to be the file the loader was created with
    and at least ``size`` bytes long; LoaderError naming it otherwise."""
    try:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
    except OSError as err:
        raise LoaderError(f"cannot open shard {name} in {path}: {os_error_text(err)}; {FIX}") from None
    try:
        st = os.fstat(fd)
        bad = _compare(st, expected, st.st_size, size)
        if bad:
            raise LoaderError(f"shard {name} in {path} {bad}; {FIX}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def problem(path: str, name: str, fd: int | None, expected: Identity, size: int) -> str | None:
    """What is wrong with the shard now (removed, replaced, truncated), or None. ``fd``: the
    descriptor the loader reads it through (its size is the one that matters), if open."""
    try:
        st = os.stat(os.path.join(path, name))
    except FileNotFoundError:
        return "was removed after the loader opened it"
    except OSError as err:
        return f"cannot be looked at ({os_error_text(err)})"
    try:
        now = os.fstat(fd).st_size if fd is not None else st.st_size
    except OSError as err:
        return f"cannot be looked at ({os_error_text(err)})"
    return _compare(st, expected, now, size)


def _compare(st: os.stat_result, expected: Identity, now: int, size: int) -> str | None:
    if identity(st) != tuple(expected):
        return (
            f"was replaced after the loader opened the cache (a new file under its name: inode {st.st_ino}, "
            f"not {expected[1]})"
        )
    if now < size:
        return f"is {now:,} bytes but {size:,} are needed: it was truncated after the loader opened the cache"
    return None


def check(path: str, name: str, fd: int | None, expected: Identity, size: int) -> None:
    """Raise a LoaderError naming the shard when :func:`problem` finds something."""
    bad = problem(path, name, fd, expected, size)
    if bad:
        raise LoaderError(f"shard {name} in {path} {bad}; {FIX}")


def read_error(path: str, name: str, fd: int | None, expected: Identity, size: int, err: BaseException) -> LoaderError:
    """The LoaderError for a read of the shard that failed with ``err`` (a BusError from a
    copy out of its mapping, a short or failed preadv): what is wrong with the file now, or, if
    nothing is, the error itself."""
    bad = problem(path, name, fd, expected, size)
    cause = f"{type(err).__name__}: {err}"
    if bad:
        return LoaderError(f"shard {name} in {path} {bad} ({cause}); {FIX}")
    return LoaderError(f"could not read shard {name} in {path} ({cause}); {FIX}")
