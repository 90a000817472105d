"""Per-latent label probes (actcache.sae.probes) through the held-out evaluation: a latent that is
a class indicator is found and named, k-sparse probes separate the classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actcache.sae.evaluate import evaluate
from actcache.sae.probes import average_precision
from test_sae_evaluate import identity_sae

N_IMGS, TOKENS, D = 60, 4, 8


def labelled_batches(labels: np.ndarray, seed: int = 0):
    """Tokens of each image: uniform noise in [0, 0.5), plus 1 on dimension 5 for class-1 images."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N_IMGS, TOKENS, D, generator=g) * 0.5
    x[torch.from_numpy(labels == 1), :, 5] += 1.0
    img = torch.arange(N_IMGS).repeat_interleave(TOKENS)
    flat = x.reshape(-1, D)
    return [{"act": flat[s : s + 32], "image_i": img[s : s + 32]} for s in range(0, len(flat), 32)]


def test_a_latent_equal_to_a_class_indicator_is_that_class_best_latent():
    labels = np.arange(N_IMGS) % 3
    ev = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, labels=(labels, ["cat", "dog", "eel"]))
    pr = ev["probes"]
    best = {b["name"]: b for b in pr["best_latent_per_class"]}
    assert best["dog"]["latent"] == 5 and best["dog"]["ap"] >= 0.99
    assert pr["latent_best_class"][5] == 1
    assert pr["sparse_probe_acc"]["1"] > 0.6  # dog vs rest is separable by one latent; cat/eel are noise
    assert set(pr["sparse_probe_acc"]) == {"1", "2", "5", "20"}
    assert pr["n_images"] == N_IMGS and pr["n_classes"] == 3


def test_images_without_a_label_are_left_out_of_the_probes():
    labels = np.arange(N_IMGS) % 2
    labels[:10] = -1
    ev = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, labels=(labels, ["a", "b"]))
    assert ev["probes"]["n_images"] == N_IMGS - 10 and ev["n_tokens"] == N_IMGS * TOKENS


def test_average_precision_known_values():
    score = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.1, 0.9], [0.0, 0.8]])
    pos = torch.tensor([True, True, False, False])
    ap = average_precision(score, pos)
    assert ap[0] == pytest.approx(1.0) and ap[1] == pytest.approx((1 / 3 + 2 / 4) / 2)


def test_a_latent_that_never_fires_is_no_class_best_latent_even_on_class_sorted_images():
    labels = np.repeat([0, 1, 2], 20)  # held-out images in index order follow the classes
    ev = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, labels=(labels, ["a", "b", "c"]))
    assert ev["probes"]["best_latent_per_class"][1]["latent"] == 5
    score = torch.zeros(60, 2)
    score[:, 1] = torch.rand(60)
    ap = average_precision(score, torch.from_numpy(labels == 0))
    assert ap[0] == pytest.approx(1 / 3)  # constant: the AP of a random ranking
