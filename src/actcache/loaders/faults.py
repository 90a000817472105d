"""Loader reliability trials: a shard truncated, replaced or made unreadable while a loader reads
it, in a child process, and what came of it. Used by the test suite and by scripts/chaos.py.

    results = run_trials(cache_dir, [("shuffled", "truncate"), ("ordered", "replace")], workdir)
    # -> [{"loader": "shuffled", "damage": "truncate", "outcome": "LoaderError", "message": ..., "rc": 0}, ...]

Each trial reads a fresh copy of the cache (under ``workdir``) once undamaged (the reference),
then again (one reader thread, so that no other opens a shard meanwhile), damaging one shard
from inside the loader, just before a copy thread copies its second batch (the ``gather`` debug
hook): "truncate" cuts the shard being copied to a third (the
check before the copy finds it; a cut after that check makes the copy fault, which the C kernel
turns into an error too), "replace" renames a zero-filled file of the same size over it; "unreadable" removes every permission from a shard not opened yet, at
the loader's first read (the child first drops the capabilities that let root read it anyway). Outcomes: "LoaderError" (one
line, naming the shard), "finished" (every batch equal to the reference: the loader read only
bytes it had opened before the damage), "wrong" (a batch differs: silently wrong data),
"error:<type>" (another exception), "crash" (the child died, e.g. of SIGBUS: ``rc`` is -7 or
135), "hang" (no result within ``timeout_s``).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np

DAMAGES = ("truncate", "replace", "unreadable")
LOADERS = ("shuffled", "ordered")
GOOD = ("LoaderError", "finished")  # outcomes that are not failures


def damage_shard(path: str, how: str) -> None:
    """Damage one shard file in place: "truncate" (to a third, not page aligned), "replace"
    (a zero-filled file of the same size renamed over it: a new inode), "unreadable" (mode 000)."""
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, size // 3 + 1)
    elif how == "replace":
        tmp = path + ".replacement"
        with open(tmp, "wb") as fh:
            fh.truncate(size)
        os.replace(tmp, path)
    elif how == "unreadable":
        os.chmod(path, 0)
    else:
        raise ValueError(f"damage {how!r} not in {DAMAGES}")


def drop_file_override() -> None:
    """Drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this process's effective set, so that
    file permissions hold even for root (a mode-000 file is then unreadable). No-op elsewhere."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0] &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def run_trials(cache_dir: str, trials: list[tuple[str, str]], workdir: str, timeout_s: float = 120.0) -> list[dict]:
    """Run (loader, damage) trials on copies of ``cache_dir`` in one child process; one result
    per trial (see the module doc). A child that dies leaves "crash" for the trials it did not
    report, one that runs out of time "hang"."""
    spec = {"cache": os.path.abspath(cache_dir), "workdir": os.path.abspath(workdir), "trials": trials}
    cmd = [sys.executable, "-m", "actcache.loaders.faults", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err, missing = proc.returncode, proc.stdout, proc.stderr, "crash"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        rc, err, missing = None, "", "hang"
    results = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    for loader, damage in trials[len(results) :]:
        results.append({"loader": loader, "damage": damage, "outcome": missing, "message": err[-2000:]})
    for r in results:
        r["rc"] = rc
    return results


def _loader(kind: str, path: str):
    from actcache.loaders import OrderedLoader, ShuffledLoader

    if kind == "shuffled":  # a small shuffle buffer: shards are read again and again
        return ShuffledLoader(path, batch_size=64, layer="all", buffer_bytes=64 * 2**10, run_bytes=8 * 2**10,
                              n_readers=1, batch_timeout_s=30, seed=3)  # fmt: skip
    return OrderedLoader(path, batch_size=64, layer="all", io="mmap", batch_timeout_s=30, n_readers=1)


def _collect(loader) -> list[np.ndarray]:
    return [b["act"].numpy().copy() for b in loader]


def _trial(cache: str, workdir: str, i: int, kind: str, damage: str) -> dict:
    from actcache.errors import LoaderError

    top = os.path.join(workdir, f"trial-{i:03d}-{kind}-{damage}")
    path = os.path.join(top, os.path.basename(os.path.normpath(cache)))  # (keeps its hash name)
    shutil.copytree(cache, path)
    ref = _collect(_loader(kind, path))
    ld = _loader(kind, path)
    names = [s.name for s in ld.cache.shards]
    done, once = [], threading.Lock()  # copy threads call the hook at once: exactly one shard is damaged

    def hook(stage, info):
        with once:
            if done:
                return
            if damage == "unreadable" and stage == "read":  # the first read: a shard not opened yet
                opened = set(ld._it.maps._fds) | {info["shard"]}
                shard = max(s for s in range(len(names)) if s not in opened)
            elif damage != "unreadable" and stage == "gather" and info["batch"] >= 1:
                shard = (info["shards"] or [0])[0]  # one the copy is about to read
            else:
                return
            damage_shard(os.path.join(path, names[shard]), damage)
            done.append(names[shard])

    ld.debug_hook = hook
    res = {"loader": kind, "damage": damage, "shard": None, "message": ""}
    try:
        got = _collect(ld)
        same = len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
        res["outcome"] = "finished" if same else "wrong"
    except LoaderError as err:
        res["outcome"], res["message"] = "LoaderError", str(err)
    except Exception as err:  # noqa: BLE001 - reported, not raised: the trial's result
        res["outcome"], res["message"] = f"error:{type(err).__name__}", str(err)
    finally:
        ld.close()
    res["shard"] = done[0] if done else None
    shutil.rmtree(top, ignore_errors=True)
    return res


def _child(spec: dict) -> int:
    if any(d == "unreadable" for _, d in spec["trials"]):
        drop_file_override()
    for i, (kind, damage) in enumerate(spec["trials"]):
        print(json.dumps(_trial(spec["cache"], spec["workdir"], i, kind, damage)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
