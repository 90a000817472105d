"""The held-out split: a seeded random, label-stratified subset of images, the same for every SAE
of a cache, recorded in run.json and never trained on."""

from __future__ import annotations

import json
import os

import numpy as np

from actcache.sae.config import expand_train_section
from actcache.sae.split import HeldoutBatches, heldout_images, image_runs
from actcache.sae.train import train_group
from conftest import make_cache


def test_split_of_a_class_sorted_dataset_draws_every_class_in_proportion():
    labels = np.repeat([0, 1, 2], [80, 80, 40])  # sorted by class, as an image folder is
    held = heldout_images(200, 0.1, labels)
    assert len(held) == 20 and np.array_equal(held, np.sort(held))
    assert np.bincount(labels[held]).tolist() == [8, 8, 4]
    assert np.array_equal(held, heldout_images(200, 0.1, labels))  # a fixed rule: same every time
    assert not np.array_equal(held, np.arange(180, 200))  # not the last images


def test_split_without_labels_is_random_and_never_everything():
    held = heldout_images(100, 0.05)
    assert len(held) == 5 and held.max() < 100 and len(set(held.tolist())) == 5
    assert len(heldout_images(2, 0.9)) == 1 and len(heldout_images(100, 0.0)) == 0
    assert image_runs(np.array([1, 2, 3, 7, 9, 10])) == [(1, 4), (7, 8), (9, 11)]


def test_heldout_batches_yield_exactly_the_heldout_vectors(tmp_path):
    path, md, acts = make_cache(tmp_path, n_imgs=10, layers=(3, 7), n_patches=4, d=8, imgs_per_shard=4)
    from actcache.cache import ActivationCache

    imgs = np.array([1, 4, 9])
    batches = list(HeldoutBatches(ActivationCache.open(path), imgs, "image", 7, False, batch_size=8))
    act = np.concatenate([b["act"].numpy() for b in batches])
    np.testing.assert_array_equal(act, acts[imgs, 1, 1:].reshape(-1, 8))
    assert np.concatenate([b["image_i"].numpy() for b in batches]).tolist() == [1] * 4 + [4] * 4 + [9] * 4
    assert batches[0]["patch_i"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_every_sae_of_a_labelled_cache_records_the_same_stratified_split(tmp_path):
    labels = np.repeat([0, 1], [30, 10])
    path, _, _ = make_cache(tmp_path / "c", n_imgs=40, layers=(7,), n_patches=4, d=8, imgs_per_shard=16,
                            labels=labels, class_names=["a", "b"])  # fmt: skip
    train = {"layer": 7, "batch_size": 16, "steps": 3, "width": 16, "k": 2, "log_every": 3, "ckpt_every": 3,
             "eval_frac": 0.2, "sweep": {"k": [2, 3]}}  # fmt: skip
    dirs = train_group(path, expand_train_section(train, "t.yaml"), tmp_path / "runs", device="cpu")
    splits = [json.load(open(os.path.join(d, "run.json")))["split"] for d in dirs]
    assert splits[0] == splits[1] and splits[0]["n_heldout"] == 8
    assert np.bincount(labels[splits[0]["heldout_images"]]).tolist() == [6, 2]
    ev = json.load(open(os.path.join(dirs[0], "eval.json")))
    assert ev["n_heldout_images"] == 8 and ev["n_tokens"] == 8 * 4
    assert ev["probes"]["n_images"] == 8 and len(ev["probes"]["latent_best_class"]) == 16  # the labels are probed
