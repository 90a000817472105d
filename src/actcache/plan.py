"""Experiment config -> Metadata, hash and shard ranges, without loading model weights.

The model's dimensions come from its config.json (actcache.models.describe_checkpoint); the image
count from the dataset listing (actcache.images.count_images, cached).
"""

from __future__ import annotations

import os

from actcache.config import Experiment
from actcache.protocol import Metadata


def experiment_metadata(exp: Experiment, listing_cache: str | None = None) -> Metadata:
    from actcache.images import count_images, metadata_data
    from actcache.models import describe_checkpoint, resolve_layers

    dims = describe_checkpoint(exp.vit.family, exp.vit.ckpt)
    resolve_layers(exp.vit.layers, dims.n_layers)  # a layer beyond the model's depth fails here
    return Metadata(
        vit_family=exp.vit.family,
        vit_ckpt=exp.vit.ckpt,
        layers=tuple(exp.vit.layers),
        n_patches_per_img=dims.n_patches_per_img,
        cls_token=dims.cls_token,
        d_vit=dims.d_vit,
        n_imgs=count_images(exp.data, listing_cache=listing_cache),
        max_patches_per_shard=exp.cache.max_patches_per_shard,
        data=metadata_data(exp.data),
    )


def shard_ranges(md: Metadata, shards_per_job: int) -> list[tuple[int, int]]:
    """[(A, B), ...] covering every shard, ``shards_per_job`` shards per dump job."""
    return [(a, min(a + shards_per_job, md.n_shards)) for a in range(0, md.n_shards, shards_per_job)]


def default_listing_cache(dump_to: str) -> str:
    return os.path.join(dump_to, ".listings")
