"""IndexedDataset: len and __getitem__ agree for every patches x layer combination."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from actcache.errors import ConfigError, ProtocolError
from actcache.loaders import IndexedDataset
from conftest import make_cache


@pytest.mark.parametrize("cls", [True, False])
@pytest.mark.parametrize("patches,layer", list(itertools.product(["cls", "image", "all"], [3, 7, "all"])))
def test_every_combination(tmp_path, cls, patches, layer):
    path, md, ref = make_cache(tmp_path, cls=cls, n_imgs=6, imgs_per_shard=4)
    if patches == "cls" and not cls:
        with pytest.raises(ConfigError, match="no CLS token"):
            IndexedDataset(path, patches=patches, layer=layer)
        return
    ds = IndexedDataset(path, patches=patches, layer=layer)
    layer_pos = [0, 1] if layer == "all" else [md.layers.index(layer)]
    T = md.n_tokens_per_img
    tokens = {"cls": [0], "image": list(range(int(cls), T)), "all": list(range(T))}[patches]
    expected = [(i, lp, t) for i in range(md.n_imgs) for lp in layer_pos for t in tokens]
    assert len(ds) == len(expected)
    for k in [0, 1, len(ds) // 2, len(ds) - 1]:
        item = ds[k]
        i, lp, t = expected[k]
        assert item["image_i"] == i and item["layer"] == md.layers[lp] and item["token"] == t
        assert item["patch_i"] == t - int(cls)
        assert item["act"].dtype == torch.float32 and item["act"].shape == (md.d_vit,)
        np.testing.assert_array_equal(item["act"].numpy(), ref[i, lp, t])
    # Every item, once, through a torch DataLoader.
    seen = torch.cat([b["act"] for b in torch.utils.data.DataLoader(ds, batch_size=7)])
    want = np.stack([ref[i, lp, t] for i, lp, t in expected])
    np.testing.assert_array_equal(seen.numpy(), want)
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds[-1]["image_i"] == md.n_imgs - 1


def test_bad_options(small_cache):
    path = small_cache[0]
    with pytest.raises(ConfigError, match="patches='tokens'"):
        IndexedDataset(path, patches="tokens")
    with pytest.raises(ProtocolError, match=r"\[3, 7\]"):
        IndexedDataset(path, layer=-2)
