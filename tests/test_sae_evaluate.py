"""Held-out metrics (actcache.sae.evaluate): known answers for an identity SAE and a shrunk one,
each statistic defined once with its window, and the decoder's largest row cosine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actcache.sae.evaluate import evaluate, max_decoder_cos
from actcache.sae.modeling import SAE, SAEConfig


def identity_sae(d: int, scale: float = 1.0) -> SAE:
    """width = d, encoder = I, decoder = scale * I, ReLU, no biases."""
    sae = SAE(SAEConfig(d_vit=d, width=d, activation="relu", normalize_decoder=False))
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(d))
        sae.W_dec.copy_(scale * torch.eye(d))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def test_identity_sae_on_non_negative_inputs_has_zero_fvu_and_unit_cosine():
    x = torch.rand(500, 6, generator=torch.Generator().manual_seed(0))
    ev = evaluate(identity_sae(6), [x[:200], x[200:]], dense_frac=0.5)
    assert ev["fvu"] == ev["nmse"] == pytest.approx(0.0, abs=1e-10)
    assert ev["explained_variance"] == pytest.approx(1.0)
    assert ev["cos_x_xhat"] == pytest.approx(1.0) and ev["norm_ratio"] == pytest.approx(1.0)
    assert ev["recon_bias"] == pytest.approx(1.0)
    assert ev["n_dead"] == 0 and ev["dead_fraction"] == 0.0
    assert ev["n_dense"] == 6 and ev["dense_fraction"] == 1.0  # every coordinate is non-zero
    assert ev["max_decoder_cos"] == pytest.approx(0.0, abs=1e-6)  # orthogonal rows
    assert "500 held-out tokens" in ev["definitions"]["n_dead"]


def test_a_shrunk_reconstruction_shows_in_norm_ratio_and_bias():
    x = torch.rand(300, 4, generator=torch.Generator().manual_seed(1)) + 0.1
    ev = evaluate(identity_sae(4, scale=0.5), [x], dense_frac=0.5)
    assert ev["norm_ratio"] == pytest.approx(0.5) and ev["recon_bias"] == pytest.approx(0.5)
    assert ev["cos_x_xhat"] == pytest.approx(1.0)
    assert ev["fvu"] > 0.5


def test_dead_latents_are_those_that_never_fire_on_the_heldout_tokens():
    x = torch.rand(100, 5)
    x[:, 2] = -1.0  # ReLU: latent 2 never fires
    ev = evaluate(identity_sae(5), [x], dense_frac=0.5)
    assert ev["n_dead"] == 1 == ev["freq_hist"]["n_never"] and ev["dead_fraction"] == pytest.approx(0.2)


def test_max_decoder_cos_finds_the_closest_pair_across_chunks():
    W = torch.nn.functional.normalize(torch.randn(300, 16, generator=torch.Generator().manual_seed(2)), dim=1)
    W[250] = W[3] * 2.0 + 1e-3  # nearly parallel to row 3, in another chunk
    ref = (W / W.norm(dim=1, keepdim=True)) @ (W / W.norm(dim=1, keepdim=True)).T
    ref.fill_diagonal_(-2)
    assert max_decoder_cos(W, chunk=64) == pytest.approx(float(ref.max()), abs=1e-6)
    assert max_decoder_cos(W, chunk=64) > 0.99 and math.isnan(max_decoder_cos(W[:1]))


def test_the_dead_count_reads_its_whole_window_and_almost_dead_is_below_one_per_million():
    x = torch.zeros(40, 3)
    x[:, 0] = 1.0  # latent 0 fires on every evaluated token
    past_cap = torch.zeros(10, 3)
    past_cap[:2, 1] = 1.0  # latent 1 fires twice, on held-out tokens past the cap
    training = torch.zeros(1_000_001, 3)
    training[0, 2] = 1.0  # latent 2 fires once in more than a million training tokens: almost dead
    ev = evaluate(identity_sae(3), [torch.cat([x, past_cap])], dense_frac=0.5, max_tokens=40,
                  window={"training": [training]})  # fmt: skip
    assert ev["n_tokens"] == 40 and ev["dead_window_tokens"] == 1_000_051
    assert ev["n_dead"] == 0 and ev["n_almost_dead"] == 1 and ev["freq_hist"]["n_never"] == 0
    assert "50 held-out tokens (all of them) and 1,000,001 training tokens" in ev["dead_definition"]
    alone = evaluate(identity_sae(3), [x], dense_frac=0.5)
    assert alone["n_dead"] == 2 and alone["n_almost_dead"] == 0  # its window: the 40 tokens


def test_window_batches_fill_the_window_with_the_skipped_held_out_then_training_images(tmp_path):
    from actcache.cache import ActivationCache
    from actcache.sae.split import HeldoutBatches, window_batches
    from conftest import make_cache

    path, _, _ = make_cache(tmp_path / "c", n_imgs=40, layers=(7,), n_patches=4, d=8, imgs_per_shard=16)
    cache = ActivationCache.open(path)
    held = np.arange(0, 40, 4)
    capped = HeldoutBatches(cache, held, "image", 7, False, 16, max_tokens=14)  # 4 of the 10 held-out images
    win = window_batches(cache, held, capped.imgs, "image", 7, False, 16, min_tokens=100)
    assert sorted(np.r_[capped.imgs, win["held-out"].imgs].tolist()) == held.tolist()
    extra = win["training"].imgs
    assert len(extra) == 15 and not set(extra.tolist()) & set(held.tolist())  # 10 * 4 + 15 * 4 = 100 tokens
    whole = window_batches(cache, held, held, "image", 7, False, 16, min_tokens=10**6)
    assert set(whole) == {"training"} and len(whole["training"].imgs) == 30  # the whole cache when smaller


def test_token_kinds_and_saelens_names_are_reported_beside_ours():
    x = torch.rand(60, 4, generator=torch.Generator().manual_seed(3)) + 0.1
    patch_i = torch.arange(60) % 6 - 1  # CLS (-1) then five patches, per image
    ev = evaluate(identity_sae(4, scale=0.5), [{"act": x, "image_i": torch.arange(60) // 6, "patch_i": patch_i}],
                  dense_frac=0.5)  # fmt: skip
    sse = float(((0.5 * x - x) ** 2).sum())
    assert ev["mse_per_token"] == pytest.approx(sse / 60) and ev["mse"] == pytest.approx(sse / 240)
    assert ev["nmse_sq_norm"] == pytest.approx(sse / float((x**2).sum()), rel=1e-6)
    kinds = ev["by_token_kind"]
    cls = x[patch_i < 0]
    assert kinds["cls"]["n_tokens"] == 10 and kinds["patch"]["n_tokens"] == 50
    assert ev["mean_norm_x_hat"] == pytest.approx(0.5 * ev["mean_norm_x"], rel=1e-6)
    assert kinds["cls"]["mean_norm_x"] == pytest.approx(float(cls.norm(dim=1).mean()), rel=1e-6)
    assert kinds["cls"]["mean_norm_x_hat"] == pytest.approx(0.5 * kinds["cls"]["mean_norm_x"], rel=1e-6)
    var = float(((cls - cls.mean(0)) ** 2).sum())
    assert kinds["cls"]["fvu"] == pytest.approx(float(((0.5 * cls - cls) ** 2).sum()) / var, rel=1e-5)
    assert "sum ||x||^2" in ev["definitions"]["nmse"] and "SAELens" in ev["definitions"]["mse_per_token"]
    assert "by_token_kind" not in evaluate(identity_sae(4), [x], dense_frac=0.5)  # one kind: not split
