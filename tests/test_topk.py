"""Streaming per-latent statistics (actcache.topk) against a brute-force computation.

Small real caches are streamed through the OrderedLoader (batch sizes that split images across
batches included) into a real SAE; the brute force encodes every token of the whole cache at
once and sorts. Top images, scores, per-token activations, frequencies, means and histograms
must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actcache.loaders import OrderedLoader
from actcache.sae.modeling import SAE, SAEConfig
from actcache.topk import HIST_EDGES, HIST_EDGES32, N_BINS, LatentStats, LatentSummary
from actcache.visuals import compute_stats
from conftest import make_cache

K = 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("topk"), n_imgs=23, layers=(3, 7), n_patches=9, d=8, imgs_per_shard=5)


def make_sae(activation: str, width: int = 24, seed: int = 0) -> SAE:
    cfg = SAEConfig(d_vit=8, width=width, activation=activation, k=3 if activation == "topk" else None, seed=seed)
    sae = SAE(cfg).eval()
    with torch.no_grad():
        if activation == "relu":  # from rare to common latents: some fire on fewer than K images, some never
            sae.b_enc.copy_(torch.linspace(-3.5, -0.5, width))
    return sae


def tokens(acts, patches: str, layer_idx: int) -> np.ndarray:
    """(N, T, D) tokens the loader yields for ``patches`` (the cache has a CLS token first)."""
    x = acts[:, layer_idx]
    return {"image": x[:, 1:], "all": x, "cls": x[:, :1]}[patches]


def brute_force(sae: SAE, x_NTD: np.ndarray, k: int = K) -> dict:
    N, T, D = x_NTD.shape
    with torch.no_grad():
        f = sae.encode(torch.from_numpy(x_NTD.reshape(-1, D))).numpy().reshape(N, T, -1)
    S = f.shape[2]
    score = f.max(1)  # (N, S) image score = max over its tokens
    out = {"top": [], "fire_count": (f > 0).sum((0, 1)), "f": f}
    out["mean"] = np.where(
        out["fire_count"] > 0, np.where(f > 0, f, 0).sum((0, 1)) / np.maximum(out["fire_count"], 1), 0
    )
    hist = np.zeros((S, N_BINS), np.int64)
    for s in range(S):
        order = np.argsort(-score[:, s], kind="stable")
        order = order[score[order, s] > 0][:k]
        out["top"].append(order)
        v = f[:, :, s][f[:, :, s] > 0]
        b = np.clip(np.searchsorted(HIST_EDGES32, v.astype(np.float32), side="right") - 1, 0, N_BINS - 1)
        hist[s] = np.bincount(b, minlength=N_BINS)
    out["hist"] = hist
    return out


def check(res: LatentSummary, want: dict, n_imgs: int) -> None:
    f = want["f"]
    T = f.shape[1]
    assert res.n_imgs == n_imgs and res.n_tokens == n_imgs * T
    np.testing.assert_array_equal(res.fire_count, want["fire_count"])
    np.testing.assert_allclose(res.freq, want["fire_count"] / (n_imgs * T))
    np.testing.assert_allclose(res.mean_act, want["mean"], rtol=1e-5)
    np.testing.assert_array_equal(res.hist, want["hist"])
    n_partial = 0
    for s, order in enumerate(want["top"]):
        n = len(order)
        n_partial += n < K
        np.testing.assert_array_equal(res.top_img[s, :n], order, err_msg=f"latent {s}")
        assert (res.top_img[s, n:] == -1).all() and (res.top_score[s, n:] == 0).all()
        np.testing.assert_allclose(res.top_score[s, :n], f[order, :, s].max(1), rtol=1e-5)
        np.testing.assert_allclose(res.top_acts[s, :n], f[order, :, s], rtol=1e-5, atol=1e-6)
        assert (res.top_acts[s, n:] == 0).all()
        if n:
            assert res.max_act[s] == res.top_score[s, 0]
    return n_partial


@pytest.mark.parametrize(
    "patches,activation,batch_size",
    [
        ("image", "topk", 9 * 4),  # whole images per batch
        ("image", "topk", 7),  # images split across batches
        ("image", "relu", 50),
        ("all", "relu", 13),
        ("all", "topk", 10 * 23),  # the whole cache in one batch
        ("cls", "relu", 4),
    ],
)
def test_stream_equals_brute_force(cache, patches, activation, batch_size):
    path, md, acts = cache
    sae = make_sae(activation)
    loader = OrderedLoader(path, batch_size=batch_size, patches=patches, layer=7)
    T = {"image": 9, "all": 10, "cls": 1}[patches]
    st = LatentStats(24, T, K)
    with torch.no_grad():
        for b in loader:
            st.update(sae.encode(b["act"]), b["image_i"])
    want = brute_force(sae, tokens(acts, patches, 1))
    n_partial = check(st.result(), want, md.n_imgs)
    if activation == "relu" and patches != "cls":
        assert n_partial > 0  # the test covers latents firing on fewer than K images


def test_compute_stats_several_saes_one_pass(cache):
    """What `actcache visuals` runs: one pass, several SAEs of different widths."""
    path, md, acts = cache
    from actcache.cache import ActivationCache

    saes = [make_sae("topk", 24, seed=1), make_sae("relu", 40, seed=2)]
    results = compute_stats(ActivationCache.open(path), saes, "image", 3, False, k=K, batch_images=3)
    for sae, res in zip(saes, results, strict=True):
        check(res, brute_force(sae, tokens(acts, "image", 0)), md.n_imgs)


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    st = LatentStats(6, 4, 3)
    f = torch.from_numpy(np.maximum(rng.standard_normal((40, 6)), 0).astype(np.float32))
    st.update(f, torch.arange(10).repeat_interleave(4))
    res = st.result()
    res.save(tmp_path / "latents.npz")
    back = LatentSummary.load(str(tmp_path / "latents.npz"))
    for name in ("fire_count", "act_sum", "hist", "top_img", "top_score"):
        np.testing.assert_array_equal(getattr(back, name), getattr(res, name))
    np.testing.assert_allclose(back.top_acts, res.top_acts, rtol=1e-3)  # stored as float16
    np.testing.assert_array_equal(back.hist_edges, HIST_EDGES)
    with np.load(tmp_path / "latents.npz") as z:
        np.testing.assert_allclose(z["freq"], res.freq)
        np.testing.assert_allclose(z["mean_act"], res.mean_act)


def test_histogram_clamps_out_of_range_values():
    st = LatentStats(1, 1, 1)
    st.update(torch.tensor([[1e-9], [1e9], [1.0]]), torch.arange(3))
    h = st.result().hist[0]
    assert h[0] == 1 and h[-1] == 1 and h[16] == 1 and h.sum() == 3  # 1.0 = 10^0 starts bin (0 - -4) * 4


def test_bad_order_and_incomplete_image_are_errors():
    st = LatentStats(3, 4, 2)
    with pytest.raises(ValueError, match="storage order"):
        st.update(torch.ones(8, 3), torch.tensor([0, 0, 1, 1, 1, 1, 2, 2]))
    st = LatentStats(3, 4, 2)
    st.update(torch.ones(6, 3), torch.tensor([0, 0, 0, 0, 1, 1]))
    with pytest.raises(ValueError, match="incomplete"):
        st.result()


def test_quantile_samples_are_real_firing_tokens_in_ordered_bins_between_median_and_max(cache):
    from actcache.topk import QUANTILE_LANES, median_act, quantile_examples

    path, md, acts = cache
    sae = make_sae("relu", seed=3)
    st = LatentStats(24, 9, K)
    with torch.no_grad():
        for b in OrderedLoader(path, batch_size=13, patches="image", layer=7):
            st.update(sae.encode(b["act"]), b["image_i"])
    res = st.result()
    f = brute_force(sae, tokens(acts, "image", 1))["f"]  # (N, T, S)
    assert res.q_img.shape == (24, N_BINS, QUANTILE_LANES)
    ok = res.q_img >= 0
    s_idx = np.nonzero(ok)[0]
    np.testing.assert_allclose(res.q_act[ok], f[res.q_img[ok], res.q_tok[ok], s_idx], rtol=1e-6)
    # every sampled token lies in its histogram bin; every non-empty bin has min(R, count) samples
    h_idx = np.nonzero(ok)[1]
    assert np.all(res.q_act[ok] >= HIST_EDGES32[h_idx] * (h_idx > 0)) and np.all(res.q_act[ok] > 0)
    np.testing.assert_array_equal(ok.sum(2) > 0, res.hist > 0)
    med = median_act(res.hist)
    n_examples = 0
    for s in np.flatnonzero(res.fire_count):
        fs = np.sort(f[:, :, s][f[:, :, s] > 0])
        true_med = fs[(len(fs) + 1) // 2 - 1]  # the value where the count reaches half (the lower median)
        assert true_med / 10**0.25 <= med[s] * (1 + 1e-6) and med[s] <= true_med * 10**0.25 * (1 + 1e-6)
        bins = quantile_examples(res, int(s))
        assert len(bins) == 5
        los = [b["lo"] for b in bins]
        assert los == sorted(los) and bins[-1]["hi"] == pytest.approx(float(res.max_act[s]))
        assert los[0] == pytest.approx(min(med[s], res.max_act[s]))
        for b in bins:
            for e in b["examples"]:
                assert b["lo"] <= e["act"] <= b["hi"]
                assert e["act"] == pytest.approx(float(f[e["img"], e["tok"], s]), rel=1e-6)
                n_examples += 1
    assert n_examples > 0


def test_explorable_images_keep_each_tokens_top_latents_equal_to_encode(cache):
    from actcache.topk import IMAGE_TOP, PATCH_TOP

    path, md, acts = cache
    sae = make_sae("relu", seed=4)
    explore = [0, 5, 22]
    st = LatentStats(24, 9, K, explore=explore)
    with torch.no_grad():
        for b in OrderedLoader(path, batch_size=7, patches="image", layer=7):
            st.update(sae.encode(b["act"]), b["image_i"])
    res = st.result()
    f = brute_force(sae, tokens(acts, "image", 1))["f"]
    np.testing.assert_array_equal(res.ex_img, explore)
    assert res.ex_ids.shape == (3, 9, PATCH_TOP) and res.ex_top_ids.shape == (3, IMAGE_TOP)
    for e, i in enumerate(explore):
        for t in range(9):
            ids = res.ex_ids[e, t][res.ex_ids[e, t] >= 0]
            want = np.argsort(-f[i, t], kind="stable")[:PATCH_TOP]
            want = want[f[i, t, want] > 0]
            np.testing.assert_allclose(res.ex_acts[e, t, : len(ids)], f[i, t, want], atol=1e-5)
            np.testing.assert_allclose(f[i, t, ids], res.ex_acts[e, t, : len(ids)], atol=1e-5)
            assert len(ids) == len(want)
        mx = f[i].max(0)
        ids = res.ex_top_ids[e][res.ex_top_ids[e] >= 0]
        assert len(ids) == min(IMAGE_TOP, int((mx > 0).sum()))
        np.testing.assert_allclose(res.ex_top_acts[e, : len(ids)], mx[ids], atol=1e-6)
        assert np.all(np.diff(res.ex_top_acts[e, : len(ids)]) <= 0)


def test_summary_without_the_explorer_fields_still_loads(tmp_path):
    st = LatentStats(6, 4, 3)
    st.update(torch.rand(8, 6), torch.arange(2).repeat_interleave(4))
    res = st.result()
    assert res.has_explorer_stats
    old = {n: getattr(res, n) for n in ("fire_count", "act_sum", "hist", "top_img", "top_score", "top_acts")}
    np.savez_compressed(tmp_path / "old.npz", version=np.int64(1), n_tokens=np.int64(8), n_imgs=np.int64(2),
                        hist_edges=HIST_EDGES, **old)  # fmt: skip
    back = LatentSummary.load(str(tmp_path / "old.npz"))
    assert not back.has_explorer_stats and back.q_img is None
    res.save(tmp_path / "new.npz")
    new = LatentSummary.load(str(tmp_path / "new.npz"))
    assert new.has_explorer_stats
    np.testing.assert_array_equal(new.q_img, res.q_img)


def test_quantile_samples_are_uniform_over_the_stream():
    """300 latents firing equally on each of 1,000 tokens (one bin), fed in 20 batches: their
    3 x 300 sampled tokens spread evenly over the stream (no bias to early or late batches)."""
    from actcache.topk import QUANTILE_LANES

    st = LatentStats(300, 1, 1)
    for b in range(20):
        st.update(torch.ones(50, 300), torch.arange(50 * b, 50 * (b + 1)))
    res = st.result()
    h = int(np.flatnonzero(res.hist[0])[0])
    picked = res.q_img[:, h, :].ravel()
    assert picked.shape == (300 * QUANTILE_LANES,) and picked.min() >= 0
    assert abs(picked.mean() - 499.5) < 4 * 289 / np.sqrt(len(picked))
    assert np.histogram(picked, bins=4, range=(0, 1000))[0].min() > 0.8 * len(picked) / 4
