"""Per-latent label probes (actcache.sae.probes) through the held-out evaluation: a latent that is
a class indicator is found and named, k-sparse probes separate the classes, a capped pass probes
exactly the images it visited whole, AP is tie-aware and every figure has n, chance and an interval."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from actcache.sae.evaluate import evaluate
from actcache.sae.probes import ap_with_interval, average_precision
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
    b = 19 / 59  # all 60 tied, 20 positives: the AP averaged over every order
    assert ap[0] == pytest.approx(b + (1 - b) * sum(1 / k for k in range(1, 61)) / 60)


def _ap_over_every_order(score: list[float], pos: list[bool]) -> float:
    aps = []
    for perm in itertools.permutations(range(len(score))):
        order = sorted(perm, key=lambda i: -score[i])  # stable: ties keep the permutation's order
        hit = np.array([pos[i] for i in order], float)
        aps.append((np.cumsum(hit) / np.arange(1, len(hit) + 1) * hit).sum() / hit.sum())
    return float(np.mean(aps))


def test_average_precision_is_the_mean_over_every_order_of_tied_scores():
    rng = np.random.default_rng(0)
    for _ in range(12):
        score, pos = rng.integers(0, 3, 6).astype(float), rng.random(6) < 0.5
        pos[0] = True
        got = average_precision(torch.tensor(score).unsqueeze(1), torch.from_numpy(pos))
        assert float(got[0]) == pytest.approx(_ap_over_every_order(score.tolist(), pos.tolist()), abs=1e-12)


def test_a_pure_noise_score_gets_an_ap_interval_that_contains_the_prevalence():
    rng = np.random.default_rng(5)
    pos = torch.from_numpy(rng.random(400) < 0.2)
    got = ap_with_interval(torch.from_numpy(rng.random(400)), pos)
    assert got["n"] == 400 and got["chance"] == pytest.approx(float(pos.double().mean()))
    assert got["ci95"][0] <= got["chance"] <= got["ci95"][1]
    sure = ap_with_interval(pos.double() + 0.01 * torch.from_numpy(rng.random(400)), pos)
    assert sure["ap"] == pytest.approx(1.0) and sure["ci95"][0] > 0.99


def test_every_probe_figure_carries_n_chance_and_an_interval():
    labels = np.arange(N_IMGS) % 3
    pr = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, labels=(labels, ["a", "b", "c"]))["probes"]
    assert pr["n_fit"] + pr["n_test"] == N_IMGS
    for b in pr["best_latent_per_class"]:
        assert b["n"] == pr["n_test"] and 0 < b["chance"] < 1 and b["ci95"][0] <= b["ap"] <= b["ci95"][1]
    assert pr["sparse_probe_chance"] == 0.5 and pr["sparse_probe_n"] == pr["n_test"]
    lo, hi = pr["sparse_probe_ci95"]["1"]
    assert lo <= pr["sparse_probe_acc"]["1"] <= hi


def test_a_capped_pass_probes_the_images_it_visited_whole_as_an_uncapped_pass_of_them_does():
    labels = np.arange(N_IMGS) % 3
    names = ["cat", "dog", "eel"]
    cap = 37 * TOKENS + 2  # 37 whole images and half of the 38th
    capped = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, max_tokens=cap, labels=(labels, names))
    pr = capped["probes"]
    assert pr["images"] == list(range(37)) and pr["n_images"] == 37
    only = np.where(np.isin(np.arange(N_IMGS), pr["images"]), labels, -1)
    full = evaluate(identity_sae(D), labelled_batches(labels), dense_frac=0.5, labels=(only, names))["probes"]
    assert full["images"] == pr["images"]
    for a, b in zip(pr["best_latent_per_class"], full["best_latent_per_class"], strict=True):
        assert a["latent"] == b["latent"] and a["ap"] == pytest.approx(b["ap"], abs=1e-6)
        assert a["ci95"] == pytest.approx(b["ci95"], abs=1e-6)
    assert pr["sparse_probe_acc"] == pytest.approx(full["sparse_probe_acc"], abs=1e-6)
    assert pr["latent_best_class"] == full["latent_best_class"]


def test_on_a_real_cache_a_capped_held_out_pass_probes_as_the_uncapped_pass_restricted_to_its_images(tmp_path):
    from actcache.cache import ActivationCache
    from actcache.sae.modeling import SAE, SAEConfig
    from actcache.sae.split import HeldoutBatches, heldout_images
    from conftest import make_cache

    labels = np.arange(40) % 2
    path, _, _ = make_cache(tmp_path / "c", n_imgs=40, layers=(7,), n_patches=4, d=8, imgs_per_shard=16,
                            labels=labels, class_names=["a", "b"])  # fmt: skip
    cache = ActivationCache.open(path)
    held = heldout_images(40, 0.5, labels)
    sae = SAE(SAEConfig(d_vit=8, width=16, activation="relu", seed=0))
    lab_I = np.where(np.isin(np.arange(40), held), labels, -1)
    capped = HeldoutBatches(cache, held, "image", 7, False, 16, max_tokens=30)  # 7 whole images, half of an 8th
    pr = evaluate(sae, capped, dense_frac=0.5, max_tokens=30, labels=(lab_I, ["a", "b"]))["probes"]
    assert pr["images"] == capped.imgs[:7].tolist()  # the half-visited 8th is not probed
    only = np.where(np.isin(np.arange(40), pr["images"]), labels, -1)
    full = evaluate(sae, HeldoutBatches(cache, held, "image", 7, False, 16), dense_frac=0.5, labels=(only, ["a", "b"]))
    got = full["probes"]
    assert got["images"] == pr["images"]
    for a, b in zip(pr["best_latent_per_class"], got["best_latent_per_class"], strict=True):
        assert a["latent"] == b["latent"] and a["ap"] == pytest.approx(b["ap"], abs=1e-6)
    assert pr["sparse_probe_acc"] == pytest.approx(got["sparse_probe_acc"], abs=1e-6)
