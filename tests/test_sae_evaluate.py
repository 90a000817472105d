"""Held-out metrics (actcache.sae.evaluate): known answers for an identity SAE and a shrunk one,
each statistic defined once with its window, and the decoder's largest row cosine."""

from __future__ import annotations

import math

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
