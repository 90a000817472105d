"""A dump killed with SIGKILL at many moments resumes to the same cache; two dumps at once agree.

Each dump is a real `python -m actcache.cli dump` process (its own process group, so its image
loading worker dies with it). Kills land at seeded random moments: while Python imports, while
the model loads, in the middle of a shard (a temporary file exists) and right after shards finish.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from actcache.config import load_experiment
from actcache.dump import dump_shards
from actcache.protocol import SHARDS_FILE, Metadata
from actcache.writer import gather, shard_is_complete
from fixtures_vit import make_checkpoint
from test_dump import ROOT, hash_dirs, make_images, shard_files, temp_files, write_experiment

N_IMGS = 160  # 40 shards of 4 images, batches of 2: the work phase lasts a second or two


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    ckpt = make_checkpoint(str(root / "ckpt"), "clip")
    make_images(str(root / "imgs"), n=N_IMGS, seed=1)
    exp = write_experiment(root / "exp.yaml", ckpt, root / "imgs", batch_size=2, n_workers=1)
    ref = dump_shards(load_experiment(exp), None, str(root / "ref"), progress=False)  # uninterrupted
    gather(ref)
    return exp, ref, shard_files(ref)


def start_dump(exp, dump_to, log_path, shards=None) -> subprocess.Popen:
    # a killed dump cannot remove its multiprocessing temp dir (/tmp/pymp-*): keep it in the test's
    tmp = os.path.join(os.path.dirname(log_path), "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": tmp}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "actcache.cli", "dump", "--experiment", exp, "--dump-to", dump_to, "--no-progress",
             *(["--shards", shards] if shards else [])],
            stdout=log, stderr=log, env=env, cwd=ROOT, start_new_session=True,
        )  # fmt: skip


def n_complete(path, md) -> int:
    return sum(shard_is_complete(path, md, i) for i in range(md.n_shards)) if path else 0


def wait_for(proc, cond, timeout=60.0) -> bool:
    """Poll ``cond()`` every 2 ms until it holds (True) or the process ends (False)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise AssertionError("dump did not reach the kill point in time")


def test_sigkill_at_many_moments_then_rerun(tmp_path, setup):
    exp, ref, ref_shards = setup
    md = Metadata.load(ref)
    rng = random.Random(20261122)
    dump_to = str(tmp_path / "d")
    chains = [dump_to]
    log_path = tmp_path / "dump.log"
    seen = {"startup": 0, "model-load": 0, "mid-shard": 0, "after-shards": 0}
    kills = 0
    # Moments: 2 while importing, 1 while the model loads, then alternately mid-shard/after shards
    # (scripts/chaos.py's kill-dump row draws 20 moments the same way).
    plan = ["startup"] * 2 + ["model-load"] + ["mid-shard", "after-shards"] * 2
    left_temp = 0
    retries = 4  # a moment the dump had already passed (it ran faster than the draw) is tried again
    while plan:
        moment = plan.pop(0)
        (path,) = hash_dirs(dump_to) or [None]
        before = n_complete(path, md)
        if before == md.n_shards:  # everything written already: kill a fresh dump
            dump_to = str(tmp_path / f"d{kills}")
            chains.append(dump_to)
            path, before = None, 0
        proc = start_dump(exp, dump_to, log_path)

        def hdir(dump_to=dump_to):
            dirs = hash_dirs(dump_to)
            return dirs[0] if dirs else None

        if moment == "startup":
            time.sleep(rng.uniform(0.1, 3.0))
            reached = proc.poll() is None
        elif moment == "model-load":
            reached = wait_for(proc, lambda: hdir() and os.path.exists(os.path.join(hdir(), "metadata.json")))
            time.sleep(rng.uniform(0.0, 1.0))
        elif moment == "mid-shard":
            reached = wait_for(proc, lambda: hdir() and temp_files(hdir()))
            time.sleep(rng.uniform(0.0, 0.005))
        else:
            target = before + rng.randint(1, 4)
            reached = wait_for(proc, lambda target=target: n_complete(hdir(), md) >= target)
            time.sleep(rng.uniform(0.0, 0.02))
        if reached:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        assert rc in (0, -signal.SIGKILL), open(log_path).read()[-3000:]
        if rc == -signal.SIGKILL:
            kills += 1
            seen[moment] += 1
        elif retries > 0:
            retries -= 1
            plan.append(moment)
        path = hdir()
        if path is not None:
            left_temp += bool(temp_files(path))
            # Whatever survives a kill is either complete and right, or a temporary name.
            for name, data in shard_files(path).items():
                assert data == ref_shards[name], f"{name} after a kill at {moment}"
            assert all(n.startswith(".") or n.endswith((".bin", ".json", ".npy")) for n in os.listdir(path))
    assert kills >= 7 and seen["startup"] >= 2 and seen["mid-shard"] >= 2 and seen["after-shards"] >= 2, seen
    assert left_temp >= 1  # at least one kill really landed inside a shard

    print(f"kills: {kills} {seen}, {left_temp} left a temporary file, {len(chains)} cache(s)")
    for d in chains:
        proc = start_dump(exp, d, log_path)
        assert proc.wait(timeout=120) == 0, open(log_path).read()[-3000:]
        (path,) = hash_dirs(d)
        assert shard_files(path) == ref_shards and not temp_files(path)
        gather(path)
        assert open(os.path.join(path, SHARDS_FILE)).read() == open(os.path.join(ref, SHARDS_FILE)).read()


def test_two_dumps_of_overlapping_ranges_at_once_write_each_shard_once(tmp_path, setup):
    # Per-shard locks: a dump skips the shards the other is writing, then waits for them.
    exp, ref, ref_shards = setup
    dump_to = str(tmp_path / "d")
    logs = [tmp_path / f"dump{i}.log" for i in range(2)]
    procs = [start_dump(exp, dump_to, logs[0]), start_dump(exp, dump_to, logs[1], shards="10:")]
    for log, proc in zip(logs, procs, strict=True):
        assert proc.wait(timeout=120) == 0, open(log).read()[-3000:]
    (path,) = hash_dirs(dump_to)
    assert shard_files(path) == ref_shards and not temp_files(path)
    writes = sum(" wrote acts" in line for log in logs for line in open(log))
    skips = sum("being written by another dump" in line for log in logs for line in open(log))
    print(f"{writes} shard writes for {len(ref_shards)} shards; {skips} skipped while another dump wrote them")
    assert len(ref_shards) <= writes <= 1.05 * len(ref_shards), writes
    gather(path)


def test_shared_memory_of_killed_workers_is_removed_and_live_segments_stay(tmp_path):
    """A worker SIGKILLed between making a batch's segment file and unlinking it leaves the file
    (seen once in CI: torch_<pid>_<random>_13 after a kill of this module's test). The next dump
    removes such files: creator dead, mapped and opened by nobody. Live ones stay."""
    import mmap

    from actcache.dump import remove_dead_segments

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = child.pid
    shm = tmp_path / "shm"
    shm.mkdir()
    names = {
        "leaked": f"torch_{dead}_1234_13",
        "open": f"torch_{dead}_1234_14",  # still open in this process
        "mapped": f"torch_{dead}_1234_15",  # mapped here, its file descriptor closed
        "live creator": f"torch_{os.getpid()}_1234_16",
        "not torch's": f"other_{dead}_1234_17",
        "just made": f"torch_{dead}_1234_18",  # too new to judge (another pid namespace may be making it)
    }
    old = time.time() - 10
    for key, name in names.items():
        (shm / name).write_bytes(b"x" * 4096)
        if key != "just made":
            os.utime(shm / name, (old, old))
    fd = os.open(shm / names["open"], os.O_RDONLY)
    with open(shm / names["mapped"], "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert remove_dead_segments(str(shm)) == [names["leaked"]]
        assert sorted(p.name for p in shm.iterdir()) == sorted(n for k, n in names.items() if k != "leaked")
        assert remove_dead_segments(str(shm)) == []  # nothing more to remove
    finally:
        os.close(fd)
        m.close()
    # once nobody holds them, the dead creator's files go as well; a fresh one once it is old enough
    assert sorted(remove_dead_segments(str(shm))) == sorted([names["open"], names["mapped"]])
    assert remove_dead_segments(str(shm), min_age_s=0) == [names["just made"]]
    assert remove_dead_segments(str(tmp_path / "missing")) == []
