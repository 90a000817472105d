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

Rewrites in place (the file keeps its inode; shardguard.py): "rewrite" copies another shard's
bytes over it (same size), "regrow" truncates it to a third and extends it again with zeros,
"flip" flips one bit at a random offset among its images' bytes. A trial ``(loader, damage,
"before")`` damages the shard after the reference pass and before the loader is made (only a
checksum can tell: run it on a sealed cache with ``verify_reads="first"``, the spec's default);
"during" (the default) from inside the loader as above. Loader "cache" reads the cache with
``ActivationCache`` a few images at a time and damages the shard after its first reads, and
"indexed" reads items of an ``IndexedDataset``.
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
REWRITES = ("rewrite", "regrow", "flip")  # in place: the inode stays
LOADERS = ("shuffled", "ordered")
READERS = (*LOADERS, "cache", "indexed")
GOOD = ("LoaderError", "finished")  # outcomes that are not failures


def damage_shard(path: str, how: str, valid: int | None = None, seed: int = 0) -> None:
    """Damage one shard file: "truncate" (to a third, not page aligned), "replace" (a zero-filled
    file of the same size renamed over it: a new inode), "unreadable" (mode 000), and in place
    (``REWRITES``; ``valid``: bytes of its images, where a flip lands): "rewrite" (a neighbouring
    shard's bytes copied over it), "regrow" (cut to a third, then extended with zeros), "flip"."""
    size = os.path.getsize(path)
    if how in REWRITES:
        _rewrite(path, how, size, valid or size, seed)
    elif how == "truncate":
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


def _rewrite(path: str, how: str, size: int, valid: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    if how == "regrow":
        os.truncate(path, size // 3 + 1)
        os.truncate(path, size)
        return
    fd = os.open(path, os.O_RDWR)
    try:
        if how == "flip":
            at = rng.randrange(valid)
            byte = os.pread(fd, 1, at)[0] ^ (1 << rng.randrange(8))
            os.pwrite(fd, bytes([byte]), at)
            return
        folder, name = os.path.split(path)
        others = sorted(n for n in os.listdir(folder) if n.startswith("acts") and n.endswith(".bin") and n != name)
        with open(os.path.join(folder, rng.choice(others)), "rb") as fh:  # as `cp other.bin this.bin` does
            os.pwrite(fd, fh.read(size).ljust(size, b"\0"), 0)
    finally:
        os.close(fd)


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


def run_trials(
    cache_dir: str, trials: list[tuple], workdir: str, timeout_s: float = 120.0, verify_reads: str = "first",
    seed: int = 0,
) -> list[dict]:  # fmt: skip
    """Run (loader, damage[, when]) trials on copies of ``cache_dir`` in one child process; one
    result per trial (see the module doc). A child that dies leaves "crash" for the trials it did
    not report, one that runs out of time "hang"."""
    spec = {"cache": os.path.abspath(cache_dir), "workdir": os.path.abspath(workdir), "trials": trials,
            "verify_reads": verify_reads, "seed": seed}  # fmt: skip
    cmd = [sys.executable, "-m", "actcache.loaders.faults", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err, missing = proc.returncode, proc.stdout, proc.stderr, "crash"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        rc, err, missing = None, "", "hang"
    results = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    for t in trials[len(results) :]:
        results.append({"loader": t[0], "damage": t[1], "outcome": missing, "message": err[-2000:]})
    for r in results:
        r["rc"] = rc
    return results


def _loader(kind: str, path: str, verify_reads: str = "off"):
    from actcache.loaders import OrderedLoader, ShuffledLoader

    if kind in ("cache", "indexed"):
        return _Reader(kind, path, verify_reads)
    if kind == "shuffled":  # a small shuffle buffer: shards are read again and again
        return ShuffledLoader(path, batch_size=64, layer="all", buffer_bytes=64 * 2**10, run_bytes=8 * 2**10,
                              n_readers=1, batch_timeout_s=30, seed=3, verify_reads=verify_reads)  # fmt: skip
    return OrderedLoader(path, batch_size=64, layer="all", io="mmap", batch_timeout_s=30, n_readers=1,
                         verify_reads=verify_reads)  # fmt: skip


class _Reader:
    """ActivationCache ("cache": 3 images per read) or IndexedDataset ("indexed": 7 items per
    batch) as a loader: batches of arrays, and the loaders' "gather" hook before each read."""

    def __init__(self, kind: str, path: str, verify_reads: str):
        from actcache.cache import ActivationCache
        from actcache.loaders import IndexedDataset

        self.kind, self.debug_hook = kind, None
        self.cache = ActivationCache.open(path, verify_reads=verify_reads)
        self.ds = IndexedDataset(self.cache, layer="all") if kind == "indexed" else None

    def __iter__(self):
        md, step = self.cache.metadata, 3 if self.kind == "cache" else 7
        n = md.n_imgs if self.ds is None else len(self.ds)
        for k, a in enumerate(range(0, n, step)):
            b = min(n, a + step)
            shard = a // md.n_imgs_per_shard if self.ds is None else self.ds.sel.decode(a)[0] // md.n_imgs_per_shard
            if self.debug_hook is not None:
                self.debug_hook("gather", {"batch": k, "shards": [int(shard)]})
            if self.ds is None:
                yield {"act": _Arr(self.cache[a:b])}
            else:
                yield {"act": _Arr(np.stack([self.ds[i]["act"].numpy() for i in range(a, b)]))}

    def close(self) -> None:
        self.cache.close()


class _Arr:  # (what _collect expects of a batch's act: .numpy())
    def __init__(self, a: np.ndarray):
        self.a = a

    def numpy(self) -> np.ndarray:
        return self.a


def _collect(loader) -> list[np.ndarray]:
    return [b["act"].numpy().copy() for b in loader]


def _trial(cache: str, workdir: str, i: int, kind: str, damage: str, when: str = "during", verify_reads: str = "off",
           seed: int = 0) -> dict:  # fmt: skip
    from actcache.errors import LoaderError

    top = os.path.join(workdir, f"trial-{i:03d}-{kind}-{damage}")
    path = os.path.join(top, os.path.basename(os.path.normpath(cache)))  # (keeps its hash name)
    shutil.copytree(cache, path)
    ref = _collect(_loader(kind, path))
    if when == "before":  # after the reference pass, before the loader is made
        from actcache.protocol import Metadata

        md = Metadata.load(path)
        victim = seed % md.n_shards
        n_imgs = min(md.n_imgs_per_shard, md.n_imgs - victim * md.n_imgs_per_shard)
        damage_shard(os.path.join(path, f"acts{victim:06d}.bin"), damage, n_imgs * md.bytes_per_img, seed)
    ld = _loader(kind, path, verify_reads)
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
            valid = ld.cache.shards[shard].n_imgs * ld.cache.metadata.bytes_per_img
            damage_shard(os.path.join(path, names[shard]), damage, valid, seed)
            done.append(names[shard])

    if when == "during":
        ld.debug_hook = hook
    else:
        done.append(names[seed % len(names)])
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
    if any(t[1] == "unreadable" for t in spec["trials"]):
        drop_file_override()
    vr, seed = spec.get("verify_reads", "off"), spec.get("seed", 0)
    for i, t in enumerate(spec["trials"]):
        when = t[2] if len(t) > 2 else "during"
        res = _trial(spec["cache"], spec["workdir"], i, t[0], t[1], when, vr, seed + i)
        print(json.dumps({**res, "when": when}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
