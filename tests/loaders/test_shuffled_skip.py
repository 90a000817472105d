"""ShuffledLoader with skip_imgs (a held-out split): the skipped images never appear, every other
example appears exactly once per epoch, with its values."""

from __future__ import annotations

import numpy as np
import pytest

from actcache.loaders import ShuffledLoader
from actcache.loaders.plan import drop_images
from conftest import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("skip"), n_imgs=37, layers=(3, 7), n_patches=6, d=8, imgs_per_shard=10)


def test_drop_images_splits_runs_around_skipped_images():
    runs = np.array([[0, 0, 4, 0, 8], [1, 2, 3, 1, 6]], np.int64)  # per_img 2
    out = drop_images(runs, 2, [np.array([1]), np.array([3])])
    assert out.tolist() == [[0, 0, 1, 0, 2], [0, 2, 2, 0, 4], [1, 2, 1, 1, 2], [1, 4, 1, 0, 2]]


@pytest.mark.parametrize("io", ["mmap", "read"])
def test_skipped_images_never_appear_and_the_rest_once(cache, io):
    path, md, acts = cache
    skip = np.array([0, 5, 9, 10, 11, 23, 36])
    loader = ShuffledLoader(path, batch_size=13, layer="all", buffer_bytes=6000, run_bytes=700, seed=3,
                            skip_imgs=skip, io=io)  # fmt: skip
    seen = []
    for b in loader:
        img, patch, layer = (b[k].numpy() for k in ("image_i", "patch_i", "layer"))
        li = np.array([md.layers.index(v) for v in layer])
        np.testing.assert_array_equal(b["act"].numpy(), acts[img, li, patch + 1])
        seen += list(zip(img.tolist(), patch.tolist(), li.tolist(), strict=True))
    keep = sorted(set(range(37)) - set(skip.tolist()))
    assert sorted(seen) == [(i, p, li) for i in keep for p in range(6) for li in range(2)]
    assert loader.n_examples == len(keep) * 12
