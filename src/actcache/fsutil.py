"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the directory.

A reader never sees half a file; a killed writer leaves only a temporary name (``.*.tmp-*``),
which :func:`remove_stale_temps` cleans up and no reader mistakes for a finished file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import time

TMP_MARK = ".tmp-"


def tmp_name(path: str) -> str:
    """A unique temporary sibling of ``path`` (hidden, with the writer's pid)."""
    directory, base = os.path.split(path)
    host = socket.gethostname().replace("-", "_")
    return os.path.join(directory, f".{base}{TMP_MARK}{host}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb"):
    """Open a temporary sibling for writing; on success fsync + rename it to ``path``.

    On any exception the temporary file is removed and ``path`` is untouched.
    """
    tmp = tmp_name(path)
    fd = open(tmp, mode)
    try:
        yield fd
        fd.flush()
        os.fsync(fd.fileno())
        fd.close()
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except BaseException as err:
        # closing may fail again (e.g. the flush of a full disk); the temp must still go
        with contextlib.suppress(OSError):
            fd.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            # a write, flush or fsync error (ENOSPC, EIO) names no file: name the one being written
            raise OSError(err.errno, err.strerror or os.strerror(err.errno), path) from err
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_open(path, "wb") as fd:
        fd.write(data)


def is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def remove_stale_temps(directory: str, only_dead_writers: bool = True, max_age_s: float = 6 * 3600) -> list[str]:
    """Remove temporary files left by killed writers; returns the names removed.

    With ``only_dead_writers`` a temp is kept while its writer may still be working: on this
    host, while the writer's pid is alive; from another host (a shared filesystem), until it is
    ``max_age_s`` old.
    """
    removed = []
    me = socket.gethostname().replace("-", "_")
    for name in sorted(os.listdir(directory)):
        if not is_temp(name):
            continue
        if only_dead_writers:
            host, _, rest = name.rsplit(TMP_MARK, 1)[1].partition("-")
            pid_part = rest.split("-", 1)[0]
            if host == me:
                if pid_part.isdigit() and pid_alive(int(pid_part)):
                    continue
            else:
                try:
                    age = time.time() - os.stat(os.path.join(directory, name)).st_mtime
                except FileNotFoundError:
                    continue
                if age < max_age_s:
                    continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat") as fd:
            state = fd.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, IndexError, PermissionError):
        return False


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (statvfs's
    f_bavail: a quota set elsewhere, as on many clusters, is not seen). A path not created yet:
    its nearest existing parent's filesystem."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (1 KiB = 1024 B), one decimal."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


HASH_CHUNK = 8 * 2**20


def sha256_file(path: str, regular_only: bool = False) -> tuple[str, int]:
    """(sha256 hex digest, bytes read) of a file, read in HASH_CHUNK pieces; ``regular_only``:
    IsADirectoryError for anything but a regular file (a FIFO or device is never read)."""
    import stat

    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        if regular_only and not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise IsADirectoryError(f"{path}: not a regular file")
        while chunk := fh.read(HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n
