"""Shard mappings (actcache.loaders.maps.ShardMaps): 2 MiB blocks counted per run, mapped by
their first user and unmapped with their last, and pinned ahead of a read."""

from __future__ import annotations

import os

import pytest

from actcache.loaders.maps import HUGE, ShardMaps
from conftest import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("maps"), n_imgs=37, layers=(3, 7), n_patches=6, d=8, imgs_per_shard=10)


def test_blocks_stay_mapped_while_any_run_uses_them(cache):
    """ShardMaps' 2 MiB block counts: a block is mapped once, by its first user, and unmapped
    with its last one."""
    path = cache[0]
    names = sorted(f for f in os.listdir(path) if f.startswith("acts"))
    sizes = [3 * HUGE + 1000] * len(names)  # a short last block
    m = ShardMaps(path, names, sizes, mode="huge")
    assert m.block_new_bytes(0, 10, HUGE + 5) == 2 * HUGE
    new, s, e = m.block_acquire(0, 10, HUGE + 5)  # blocks 0, 1
    assert new == 2 * HUGE and s.tolist() == [0, HUGE] and e.tolist() == [HUGE, 2 * HUGE]
    assert m.block_new_bytes(0, HUGE, 3 * HUGE + 1000) == HUGE + 1000  # block 2 and the short one
    new, s, e = m.block_acquire(0, HUGE, 3 * HUGE + 1000)  # blocks 1 (shared), 2, 3
    assert new == HUGE + 1000 and s.tolist() == [2 * HUGE, 3 * HUGE] and e.tolist() == [3 * HUGE, 3 * HUGE + 1000]
    assert m.block_release(0, 10, HUGE + 5) == HUGE  # block 0 goes, block 1 stays (shared)
    assert m.block_new_bytes(0, 0, 2 * HUGE) == HUGE
    assert m.block_release(0, HUGE, 3 * HUGE + 1000) == 3 * HUGE + 1000 - HUGE
    assert m.block_new_bytes(0, 0, 3 * HUGE + 1000) == 3 * HUGE + 1000
    m.close()


def test_a_pinned_block_stays_mapped_until_its_pinning_run_is_released(cache):
    """block_pin holds the blocks of a span that some run maps (no new bytes), block_acquire with
    those pins counts only the rest, and the pinned blocks outlive their first user."""
    path = cache[0]
    names = sorted(f for f in os.listdir(path) if f.startswith("acts"))
    m = ShardMaps(path, names, [4 * HUGE] * len(names), mode="huge")
    assert m.block_acquire(0, 0, 2 * HUGE)[0] == 2 * HUGE  # run A: blocks 0, 1
    pins = m.block_pin(0, HUGE, 4 * HUGE)  # run B (blocks 1-3) next in line: block 1 is mapped
    assert pins.tolist() == [1]
    assert m.block_new_bytes(0, HUGE, 4 * HUGE) == 2 * HUGE  # what reading B still adds
    assert m.block_release(0, 0, 2 * HUGE) == HUGE  # A goes: block 0 is unmapped, block 1 is not
    new, s, e = m.block_acquire(0, HUGE, 4 * HUGE, pinned=pins)
    assert new == 2 * HUGE and s.tolist() == [2 * HUGE, 3 * HUGE]  # block 1 is not mapped again
    assert m.block_release(0, HUGE, 4 * HUGE) == 3 * HUGE  # B goes: all three, block 1 once
    assert m.block_new_bytes(0, 0, 4 * HUGE) == 4 * HUGE
    m.close()
