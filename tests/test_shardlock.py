"""Per-shard locks: a dump skips a shard another process is writing, then waits for it and writes
what that process left unfinished."""

from __future__ import annotations

import os
import threading
import time

import pytest

from actcache.config import load_experiment
from actcache.dump import dump_shards
from actcache.plan import DUMP_MARKS, experiment_metadata
from actcache.protocol import shard_name
from actcache.shardlock import ShardLocks
from actcache.validate import check_dir
from actcache.writer import gather, shard_is_complete
from fixtures_vit import make_checkpoint
from test_dump import make_images, shard_files, write_experiment


def test_a_held_lock_is_refused_to_another_holder_until_released(tmp_path):
    a, b = ShardLocks(str(tmp_path / "marks")), ShardLocks(str(tmp_path / "marks"))
    assert a.try_acquire("acts000001.bin")
    assert not b.try_acquire("acts000001.bin") and b.try_acquire("acts000002.bin")
    released = []
    waiter = threading.Thread(target=lambda: (b.wait("acts000001.bin"), released.append(time.monotonic())))
    waiter.start()
    time.sleep(0.3)
    assert not released  # still held
    t_release = time.monotonic()
    a.release("acts000001.bin")
    waiter.join(timeout=10)
    assert released and released[0] >= t_release
    assert b.try_acquire("acts000001.bin")
    b.release_all()


def test_where_no_lock_can_be_taken_the_dump_goes_on_without_locks_and_says_so(tmp_path, caplog):
    (tmp_path / "marks").write_text("a file where the lock directory should be")
    locks = ShardLocks(str(tmp_path / "marks"))
    assert locks.try_acquire("acts000000.bin") and locks.try_acquire("acts000000.bin")
    assert not locks.enabled and caplog.text.count("dumping without per-shard locks") == 1
    locks.wait("acts000000.bin")  # returns at once


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    root = tmp_path_factory.mktemp("lock")
    ckpt = make_checkpoint(str(root / "ckpt"), "clip")
    make_images(str(root / "imgs"))
    return load_experiment(write_experiment(root / "exp.yaml", ckpt, root / "imgs"))


def test_dump_skips_a_locked_shard_then_writes_it_when_its_holder_stops_without_it(tmp_path, exp, caplog):
    dump_to = str(tmp_path / "d")
    md = experiment_metadata(exp)
    path = os.path.join(dump_to, md.hash)
    other = ShardLocks(os.path.join(path, DUMP_MARKS))  # "another dump" holding shard 2, never writing it
    assert other.try_acquire(shard_name(2))
    done = threading.Event()
    runner = threading.Thread(target=lambda: (dump_shards(exp, None, dump_to, n_workers=0, progress=False), done.set()))
    caplog.set_level("INFO", logger="actcache.dump")
    runner.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "waiting for the other dump writing acts000002.bin" not in caplog.text:
        time.sleep(0.05)
    assert "being written by another dump" in caplog.text and not done.is_set()
    assert [shard_is_complete(path, md, i) for i in range(md.n_shards)] == [True, True, False, True, True, True]
    other.release_all()  # the other dump dies without finishing shard 2
    runner.join(timeout=120)
    assert done.is_set() and len(shard_files(path)) == md.n_shards
    gather(path)
    assert check_dir(path, deep=True).checksums == f"checksums of all {md.n_shards} shard(s) match"
