"""Partitioning an epoch over nodes x ranks x workers: disjoint, complete, lockstep batch counts."""

from __future__ import annotations

import itertools

import pytest

from actcache.errors import ConfigError
from actcache.loaders.partition import Partition, World


def check(n, world_size, n_workers, B, drop_last):
    p = Partition(n, World(0, world_size, 0, n_workers), B, drop_last)
    parts = p.all_parts()
    covered = []
    per_rank_batches = {}
    per_rank_incomplete = {}
    for wd, s, e, nb in parts:
        assert 0 <= s <= e <= n
        covered.append((s, e))
        size = e - s
        assert (nb - 1) * B < size <= nb * B or (size == 0 and nb == 0), (wd, s, e, nb)
        per_rank_batches[wd.rank] = per_rank_batches.get(wd.rank, 0) + nb
        per_rank_incomplete[wd.rank] = per_rank_incomplete.get(wd.rank, 0) + (size % B != 0)
    # disjoint and contiguous, in order
    covered.sort()
    for (_s0, e0), (s1, _) in itertools.pairwise(covered):
        assert e0 == s1
    total = sum(e - s for s, e in covered)
    assert total + p.n_dropped == n
    # lockstep: the same number of batches on every rank, at most one incomplete batch per rank
    assert len(set(per_rank_batches.values())) == 1
    assert all(v <= (0 if drop_last else 1) for v in per_rank_incomplete.values())
    if not drop_last:
        assert p.n_dropped < world_size
    else:
        assert p.n_dropped < world_size * B
    # DataLoader order: batch j of a rank comes from worker j % n_workers
    for r in range(world_size):
        counts = [p.n_batches(World(r, world_size, w, n_workers)) for w in range(n_workers)]
        nb = per_rank_batches[r]
        assert counts == [nb // n_workers + (w < nb % n_workers) for w in range(n_workers)]
    return p


@pytest.mark.parametrize("world_size,n_workers", [(1, 1), (2, 1), (3, 1), (1, 3), (2, 4), (8, 1), (4, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_parts_cover_epoch_with_equal_batch_counts(world_size, n_workers, drop_last):
    for n in [0, 1, 7, 64, 100, 101, 1000, 1003, 4097]:
        for B in [1, 3, 10, 64, 333]:
            check(n, world_size, n_workers, B, drop_last)


def test_exactly_once_when_divisible_enough():
    # leftover >= world size: nothing is dropped
    p = check(1003, 3, 1, 10, False)
    assert p.n_dropped == 0 and p.n_batches_per_rank == 34


def test_fewer_leftovers_than_ranks_are_dropped():
    p = check(101, 4, 1, 10, False)  # 101 = 2*4*10 + 21 -> 21 >= 4: kept
    assert p.n_dropped == 0
    p = check(82, 4, 1, 10, False)  # 82 = 2*4*10 + 2 -> 2 < 4 ranks: dropped
    assert p.n_dropped == 2 and p.n_batches_per_rank == 2


def test_composer_example_batch_size_hint():
    # composer's docstring: 8 samples, 3 workers, batch 2, drop_last -> no sample dropped
    p = Partition(8, World(0, 1, 0, 3), 2, drop_last=True)
    sizes = [e - s for _, s, e, _ in p.all_parts()]
    assert sizes == [4, 2, 2] and p.n_dropped == 0


def test_world_validation_and_helpers(monkeypatch):
    with pytest.raises(ConfigError, match="rank"):
        World(2, 2)
    with pytest.raises(ConfigError, match="worker_id"):
        World(0, 1, 3, 2)
    with pytest.raises(ConfigError, match="world_size"):
        World(0, 0)
    with pytest.raises(ConfigError, match="batch_size"):
        Partition(10, World(), 0)
    w = World.from_nodes(node=1, n_nodes=2, local_rank=3, ranks_per_node=4)
    assert (w.rank, w.world_size) == (7, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert World.from_env(worker_id=1, n_workers=2) == World(1, 3, 1, 2)
    assert World(1, 3, 1, 2).part == 3 and World(1, 3, 1, 2).n_parts == 6
