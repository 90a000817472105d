"""scripts/bench_loader_floor.py's lower bound does the loader's work: every patch-token vector of
the layer read copied exactly once (its checksum against the cache's own bytes)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location(
        "bench_loader_floor", os.path.join(ROOT, "scripts", "bench_loader_floor.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n_layers", [1, 4])
def test_floor_epoch_copies_every_vector_of_the_layer_once(floor, tmp_path, n_layers):
    bl = floor.bl
    path = bl.build(str(tmp_path), 0.012, n_layers, 0.004)  # a few images over several shards
    from actcache.cache import ActivationCache

    c = ActivationCache.open(path)
    md = c.metadata
    assert len(c.shards) > 1
    li = list(md.layers).index(bl.LAYER)
    want = 0.0
    for s in c.shards:
        shape = (s.n_imgs, len(md.layers), bl.T, bl.D)  # a shard file may be longer than its images
        a = np.fromfile(os.path.join(path, s.name), np.float32, count=int(np.prod(shape))).reshape(shape)
        want += float(a[:, li, 1:, :].sum(dtype=np.float64))
    got = floor.floor_epoch(path, batch_size=100, checksum=True)
    assert got["examples"] == md.n_imgs * (bl.T - 1)
    assert got["sum"] == pytest.approx(want, rel=1e-9)
