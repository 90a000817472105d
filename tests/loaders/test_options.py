"""LoaderOptions (actcache.loaders.options): the options both loaders share, checked once, in a
module light enough for config validation to import."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from actcache.errors import ConfigError
from actcache.loaders import OrderedLoader, ShuffledLoader, kernels, maps
from actcache.loaders.options import COLD_READS, PREFETCH_SCHEMES, LoaderOptions
from conftest import ROOT, make_cache


def test_importing_the_options_loads_neither_torch_nor_the_c_kernel():
    code = (
        "import sys, actcache.loaders.options\n"
        "heavy = [m for m in ('actcache._native', 'torch', 'numpy', 'actcache.loaders.kernels') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == ""


def test_the_package_still_gives_its_public_names():
    import actcache.loaders as loaders

    assert loaders.ShuffledLoader is ShuffledLoader and loaders.OrderedLoader is OrderedLoader
    assert loaders.IndexedDataset.__name__ == "IndexedDataset" and loaders.LoaderOptions is LoaderOptions
    assert set(loaders.__all__) <= set(dir(loaders))
    with pytest.raises(AttributeError, match="no_such_name"):
        loaders.no_such_name  # noqa: B018


def test_allowed_values_are_also_found_where_they_used_to_be():
    assert kernels.PREFETCH_SCHEMES is PREFETCH_SCHEMES and maps.COLD_READS is COLD_READS


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(batch_size=0), "batch_size=0 must be an integer >= 1"),
        (dict(batch_timeout_s="soon"), "batch_timeout_s='soon' must be a number"),
        (dict(n_threads=1.5), "n_threads=1.5 must be an integer"),
        (dict(n_readers=0), "n_readers=0 must be an integer >= 1"),
        (dict(read_ahead=0), "read_ahead=0"),
        (dict(evict="yes"), "evict='yes' must be true or false"),
    ],
)
def test_a_bad_shared_option_is_a_config_error_naming_it(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoaderOptions(**kw)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoaderOptions().batch_size = 3


@pytest.mark.parametrize("cls", [OrderedLoader, ShuffledLoader])
def test_both_loaders_hand_their_shared_keywords_to_the_options(tmp_path, cls):
    path, _, _ = make_cache(tmp_path, n_imgs=6, layers=(3, 7), n_patches=4, d=8, imgs_per_shard=4)
    kw = dict(batch_size=5, layer=7, patches="all", drop_last=True, batch_timeout_s=9.0, n_threads=1, read_ahead=3)
    with cls(path, n_readers=2, evict=True, world_size=2, rank=1, **kw) as ld:
        want = LoaderOptions(n_readers=2, evict=True, world_size=2, rank=1, **kw)
        assert ld.options == want
        assert (ld.batch_size, ld.layer, ld.patches, ld.n_readers, ld.evict) == (5, 7, "all", 2, True)
        assert ld.world.rank == 1 and ld.world.world_size == 2
