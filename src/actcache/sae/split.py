"""The held-out split of a cache: which images every SAE of the cache is evaluated on.

    held_BI = heldout_images(n_imgs, eval_frac, labels)   # sorted image indices, never trained on

A seeded random subset of ``n_eval = min(n_imgs - 1, max(1, floor(n_imgs * eval_frac)))``
images, stratified by label when the cache has labels (``labels.npy``; -1, unlabelled, is a
stratum of its own): each stratum gives its share of n_eval (largest remainders first), drawn
at random within it. The rule is fixed (seed :data:`SPLIT_SEED`) and depends only on n_imgs,
eval_frac and the labels, so every SAE of a cache with the same eval_frac gets the same split
and no key is hashed for it. run.json records the rule and the count.
"""

from __future__ import annotations

import math

import numpy as np

SPLIT_SEED = 0x5E1D
RULE = "random, stratified by label"


def n_heldout(n_imgs: int, eval_frac: float) -> int:
    if eval_frac <= 0 or n_imgs < 2:
        return 0
    return min(n_imgs - 1, max(1, int(math.floor(n_imgs * eval_frac))))


def heldout_images(n_imgs: int, eval_frac: float, labels: np.ndarray | None = None) -> np.ndarray:
    """Sorted int64 image indices held out for evaluation (see the module docstring)."""
    n_eval = n_heldout(n_imgs, eval_frac)
    rng = np.random.default_rng([SPLIT_SEED, n_imgs])
    if n_eval == 0:
        return np.zeros(0, np.int64)
    if labels is None:
        return np.sort(rng.permutation(n_imgs)[:n_eval]).astype(np.int64)
    labels = np.asarray(labels, np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (n_eval / n_imgs)
    take = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - take), kind="stable")
    take[order[: n_eval - int(take.sum())]] += 1
    picked = []
    for c, k in zip(classes.tolist(), take.tolist(), strict=True):
        members = np.flatnonzero(labels == c)
        picked.append(members[rng.permutation(len(members))[:k]])
    return np.sort(np.concatenate(picked)).astype(np.int64)


def image_runs(imgs: np.ndarray) -> list[tuple[int, int]]:
    """Sorted image indices -> maximal contiguous ranges [a, b)."""
    if len(imgs) == 0:
        return []
    breaks = np.flatnonzero(np.diff(imgs) != 1) + 1
    starts, ends = np.r_[imgs[0], imgs[breaks]], np.r_[imgs[breaks - 1] + 1, imgs[-1] + 1]
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


class HeldoutBatches:
    """The selected vectors of ``imgs`` (a cache's held-out images) as loader-style batches:
    dicts of "act" (float32 (B, D)), "image_i" and "patch_i", image-major as the loaders order
    them. ``max_tokens`` keeps a seeded random subset of the images that holds that many
    examples, so a capped evaluation still draws from every class."""

    def __init__(self, cache, imgs, patches: str, layer, scale_norm: bool, batch_size: int,
                 max_tokens: int | None = None):  # fmt: skip
        from actcache.loaders.common import Selection

        self.cache, self.sel, self.batch_size = cache, Selection(cache.metadata, patches, layer), batch_size
        imgs = np.asarray(imgs, np.int64)
        if max_tokens is not None:
            keep = -(-max_tokens // self.sel.per_img)
            imgs = np.sort(imgs[np.random.default_rng([SPLIT_SEED, 1]).permutation(len(imgs))[:keep]])
        self.imgs = imgs
        self.scale = None
        if scale_norm:
            from actcache.stats import scale_factors

            self.scale = np.asarray(scale_factors(cache, self.sel), np.float32)

    def _image(self, i: int) -> np.ndarray:
        sel = self.sel
        a_LTD = np.asarray(self.cache[int(i)])[sel.layer_idx, sel.token_start : sel.token_start + sel.n_tokens]
        a_LTD = a_LTD.astype(np.float32, copy=False)
        if self.scale is not None:
            a_LTD = a_LTD * self.scale[:, None, None]
        return a_LTD.reshape(-1, a_LTD.shape[-1])

    def __iter__(self):
        import torch

        sel = self.sel
        patch = np.tile(np.arange(sel.n_tokens) + sel.token_start - int(sel.metadata.cls_token), len(sel.layer_idx))
        per_batch = max(1, self.batch_size // sel.per_img)
        for s in range(0, len(self.imgs), per_batch):
            chunk = self.imgs[s : s + per_batch]
            yield {
                "act": torch.from_numpy(np.concatenate([self._image(i) for i in chunk])),
                "image_i": torch.from_numpy(np.repeat(chunk, sel.per_img)),
                "patch_i": torch.from_numpy(np.tile(patch, len(chunk)).astype(np.int64)),
            }

    def close(self) -> None:
        pass


def window_batches(cache, heldout, visited, patches: str, layer, scale_norm: bool, batch_size: int,
                   min_tokens: int) -> dict[str, HeldoutBatches]:  # fmt: skip
    """The batches that widen a capped held-out pass over ``visited`` into the dead count's firing
    window (actcache.sae.evaluate): the held-out images the pass skipped, then a seeded random
    sample of the other images until the window holds ``min_tokens`` examples (or every image)."""
    from actcache.loaders.common import Selection

    per_img = Selection(cache.metadata, patches, layer).per_img
    heldout = np.asarray(heldout, np.int64)
    rest = np.setdiff1d(heldout, np.asarray(visited, np.int64))
    others = np.setdiff1d(np.arange(cache.n_imgs, dtype=np.int64), heldout)
    need = max(0, -(-(min_tokens - len(heldout) * per_img) // per_img))
    pick = np.sort(others[np.random.default_rng([SPLIT_SEED, 2]).permutation(len(others))[:need]])
    args = (patches, layer, scale_norm, batch_size)
    out = {"held-out": HeldoutBatches(cache, rest, *args)} if len(rest) else {}
    return out | ({"training": HeldoutBatches(cache, pick, *args)} if len(pick) else {})
