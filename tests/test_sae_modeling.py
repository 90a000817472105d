"""SAE modeling, objectives and optimizer pieces (actcache.sae), on in-memory data only.

The dictionary-recovery tests use 256 ground-truth unit directions in d=64 (not 1024 in d=128:
that is ~8x the compute per step and too slow for a unit test on 2 CPU cores). Each example is a
non-negative mix of exactly 8 directions with coefficients in [0.5, 1.5]. Score: the mean over
true directions of the best cosine similarity with any decoder row.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from actcache.errors import ConfigError, TrainError
from actcache.sae import (
    SAE,
    LRSchedule,
    SAEConfig,
    auxk_loss,
    geometric_median,
    make_objective,
    make_optimizer,
    sparsity_warmup,
    train_step,
)

N_TRUE, D, K_TRUE = 256, 64, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread per test


def synthetic(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(true directions (N_TRUE, D), examples (n, D)): each a mix of K_TRUE directions. Made once
    per process (several recovery tests share it); each call gets its own copies."""
    dirs, x = _synthetic(n, seed)
    return dirs.clone(), x.clone()


@functools.lru_cache(maxsize=2)
def _synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(N_TRUE, D, generator=g)
    dirs /= dirs.norm(dim=1, keepdim=True)
    idx = k_smallest(torch.rand(n, N_TRUE, generator=g), K_TRUE)
    coef = torch.rand(n, K_TRUE, generator=g) + 0.5
    return dirs, (coef[:, :, None] * dirs[idx]).sum(1)


def k_smallest(r_NM: torch.Tensor, k: int) -> torch.Tensor:
    """``r_NM.argsort(1)[:, :k]`` (the same indices in the same order, ties lower index first)
    without sorting whole rows."""
    idx_NK = r_NM.topk(k, dim=1, largest=False, sorted=False).indices.sort(dim=1).values
    return idx_NK.gather(1, r_NM.gather(1, idx_NK).sort(dim=1, stable=True).indices)


def recovery(sae: SAE, dirs: torch.Tensor) -> float:
    w = sae.W_dec.detach()
    w = w / w.norm(dim=1, keepdim=True)
    return float((dirs @ w.T).max(1).values.mean())


def train_on_synthetic(cfg: SAEConfig, steps: int, lr: float, l1_coeff=None, sparsity_warmup_steps=0):
    torch.manual_seed(0)
    dirs, x = synthetic(32768)
    sae = SAE(cfg)
    sae.init_b_dec(x[:2048])
    obj = make_objective(sae, l1_coeff=l1_coeff)
    opt = make_optimizer(sae, lr)
    sched = LRSchedule(lr=lr, warmup_steps=50, total_steps=steps, decay="linear", final_frac=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        sched.apply(opt, step)
        x_BD = x[torch.randint(0, x.shape[0], (512,), generator=g)]
        out = train_step(sae, obj, opt, x_BD, sparsity_scale=sparsity_warmup(step, sparsity_warmup_steps))
    return sae, dirs, out, x


# -- dictionary recovery ----------------------------------------------------------------------------


def test_topk_recovers_dictionary():
    cfg = SAEConfig(d_vit=D, width=2 * N_TRUE, activation="topk", k=K_TRUE, seed=0)
    sae, dirs, out, _ = train_on_synthetic(cfg, steps=500, lr=1e-2)
    score = recovery(sae, dirs)
    print(f"topk recovery {score:.4f} nmse {float(out.nmse):.3f}")
    assert score >= 0.9
    assert float(out.l0) == K_TRUE


def test_batchtopk_recovers_dictionary_and_infers_with_threshold():
    cfg = SAEConfig(d_vit=D, width=2 * N_TRUE, activation="batchtopk", k=K_TRUE, seed=0)
    sae, dirs, out, x = train_on_synthetic(cfg, steps=700, lr=1e-2)
    score = recovery(sae, dirs)
    sae.eval()
    with torch.no_grad():
        l0_eval = float((sae.encode(x[:4096]) != 0).sum(1).float().mean())
    print(f"batchtopk recovery {score:.4f} nmse {float(out.nmse):.3f} eval l0 {l0_eval:.2f}")
    assert score >= 0.9
    # The threshold learned in training gives about k latents per example without a batch.
    assert K_TRUE / 2 <= l0_eval <= 2 * K_TRUE
    # Calibrated on one batch with the final weights (as the trainer does after its last step),
    # another batch's L0 is k: the training EMA lags the weights, the calibration does not.
    sae.train()
    th = sae.calibrate_threshold_(x[4096:8192])
    sae.eval()
    with torch.no_grad():
        f_cal = sae.encode(x[4096:8192])
        l0_same = float((f_cal != 0).sum(1).float().mean())
        l0_other = float((sae.encode(x[:4096]) != 0).sum(1).float().mean())
    assert th == pytest.approx(float(f_cal[f_cal != 0].min()), rel=0.01)  # k per example: the kept minimum
    assert abs(l0_same - K_TRUE) <= 2 / 4096 and abs(l0_other - K_TRUE) <= 0.15


def test_relu_recovers_dictionary():
    # ReLU + L1 first goes through a slow dense phase (l0 ~100 after the tied init), so it gets
    # more steps and a higher lr than the TopK variants (at lr 1e-2 it needs ~2000 steps); the
    # threshold is the same 0.9. Its l0 stays well above 8: small false-positive activations from
    # interference between directions, which the L1 term shrinks but does not remove.
    cfg = SAEConfig(d_vit=D, width=2 * N_TRUE, activation="relu", seed=0)
    sae, dirs, out, _ = train_on_synthetic(cfg, steps=1000, lr=3e-2, l1_coeff=6e-3, sparsity_warmup_steps=100)
    score = recovery(sae, dirs)
    print(f"relu recovery {score:.4f} nmse {float(out.nmse):.3f} l0 {float(out.l0):.1f}")
    assert score >= 0.9


# -- activations ------------------------------------------------------------------------------------


def small(activation="topk", k=3, width=32, d=16, seed=0, **kw) -> SAE:
    return SAE(
        SAEConfig(d_vit=d, width=width, activation=activation, k=None if activation == "relu" else k, seed=seed, **kw)
    )


def test_k_smallest_equals_the_first_k_of_argsort():
    g = torch.Generator().manual_seed(3)
    r_NM = torch.rand(4096, N_TRUE, generator=g)
    r_NM[0, :20] = 0.5  # ties: lower index first, as argsort gives them here
    assert torch.equal(k_smallest(r_NM, K_TRUE), r_NM.argsort(1)[:, :K_TRUE])


def test_topk_keeps_exactly_k_largest_per_example():
    sae = small("topk", k=3)
    with torch.no_grad():
        sae.b_enc.fill_(10.0)  # every pre-activation positive, so relu zeroes none of the kept ones
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    f = sae.encode(x)
    assert ((f != 0).sum(1) == 3).all()
    kept = torch.sort((f != 0).nonzero()[:, 1].view(20, 3), dim=1).values
    top = torch.sort(sae.pre_acts(x).topk(3, dim=1).indices, dim=1).values
    assert torch.equal(kept, top)


def test_batchtopk_keeps_b_times_k_in_train_and_uses_threshold_in_eval():
    sae = small("batchtopk", k=3)
    with torch.no_grad():
        sae.b_enc.fill_(10.0)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    sae.eval()
    with pytest.raises(TrainError, match="threshold"):
        sae.encode(x)  # not estimated yet
    sae.train()
    f = sae.encode(x)
    assert int((f != 0).sum()) == 20 * 3
    assert len(set((f != 0).sum(1).tolist())) > 1  # the budget is shared, not per example
    kept = f[f != 0]
    assert float(sae.threshold) == pytest.approx(float(kept.detach().min()))  # first estimate: the min kept
    sae.eval()
    pre = sae.pre_acts(x)
    f_eval = sae.encode(x)
    assert torch.equal(f_eval, pre * (pre > sae.threshold))
    # the EMA moves towards each new batch's minimum kept value
    sae.train()
    before = float(sae.threshold)
    f2 = sae.encode(x * 3).detach()
    m2 = float(f2[f2 != 0].min())
    assert float(sae.threshold) == pytest.approx(0.99 * before + 0.01 * m2, rel=1e-5)


def test_relu_encode_is_relu_of_pre_acts():
    sae = small("relu")
    x = torch.randn(8, 16)
    assert torch.equal(sae.encode(x), torch.relu(sae.pre_acts(x)))
    x_hat, f, aux = sae(x)
    assert torch.allclose(x_hat, f @ sae.W_dec + sae.b_dec)
    assert aux["pre_BS"].shape == (8, 32)


def test_init_is_tied_with_unit_decoder_rows():
    sae = small()
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(32))
    assert torch.equal(sae.W_enc, sae.W_dec.T)
    assert not sae.b_enc.any() and not sae.b_dec.any()
    assert torch.equal(small(seed=1).W_dec, small(seed=1).W_dec)
    assert not torch.equal(small(seed=1).W_dec, small(seed=2).W_dec)


def test_wrong_input_width_is_a_train_error():
    with pytest.raises(TrainError, match="d_vit=16"):
        small()(torch.randn(4, 15))


# -- decoder constraint -----------------------------------------------------------------------------


def test_normalize_decoder_gives_unit_rows():
    sae = small()
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(32, 1) * 5 + 0.1)
    sae.normalize_decoder_()
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(32), atol=1e-6)


def test_remove_parallel_grads_makes_grads_orthogonal_to_rows():
    sae = small()
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(32, 1) + 0.5)  # also correct for rows that are not unit norm
    g = torch.randn(32, 16)
    sae.W_dec.grad = g.clone()
    sae.remove_parallel_grads_()
    w = sae.W_dec.detach()
    assert (sae.W_dec.grad * w).sum(1).abs().max() < 1e-5
    # only the parallel part was removed
    par = ((g * w).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True)) * w
    assert torch.allclose(sae.W_dec.grad, g - par, atol=1e-6)


def test_train_step_keeps_unit_norm_rows():
    sae = small("topk", k=3)
    obj = make_objective(sae)
    opt = make_optimizer(sae, lr=1e-2)
    for _ in range(5):
        train_step(sae, obj, opt, torch.randn(64, 16), max_grad_norm=1.0)
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(32), atol=1e-5)


# -- b_dec init -------------------------------------------------------------------------------------


def test_geometric_median_is_robust_to_an_outlier():
    g = torch.Generator().manual_seed(0)
    center = torch.full((16,), 2.0)
    x = center + 0.1 * torch.randn(200, 16, generator=g)
    x[0] = 1e4  # one wild outlier
    gm = geometric_median(x)
    assert (gm - center).norm() < 0.1
    assert (x.mean(0) - center).norm() > 100
    sae = small()
    sae.init_b_dec(x)
    assert torch.allclose(sae.b_dec.detach(), gm)
    sae.init_b_dec(x, method="mean")
    assert torch.allclose(sae.b_dec.detach(), x.mean(0))
    with pytest.raises(ConfigError, match="geometric_median"):
        sae.init_b_dec(x, method="median")
    with pytest.raises(TrainError, match="NaN"):
        sae.init_b_dec(torch.full((4, 16), float("nan")))


# -- objectives -------------------------------------------------------------------------------------


def test_auxk_is_zero_without_dead_latents_and_positive_with():
    sae = small("topk", k=2, width=64)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    fresh = make_objective(sae)  # 10M-token window: nothing can be dead yet
    out = fresh(sae, x)
    assert float(out.aux) == 0.0 and float(out.n_dead) == 0
    assert float(out.loss.detach()) == pytest.approx(float(out.mse))

    eager = make_objective(sae, dead_tokens_threshold=1, aux_tokens=1)  # not firing in this batch = dead
    out = eager(sae, x)
    n_dead = int(out.n_dead)
    assert n_dead >= 64 - 8 * 2
    assert float(out.aux) > 0
    assert float(out.loss.detach()) > float(out.mse)
    # the aux term trains the dead latents: only their decoder rows get a gradient from it
    sae.zero_grad()
    dead = eager.stats.dead_mask()
    x_hat, _, aux = sae(x)
    auxk_loss(sae, x, x_hat, aux["pre_BS"], dead, k_aux=8).backward()
    row_grad = sae.W_dec.grad.norm(dim=1)
    assert (row_grad[~dead] == 0).all() and (row_grad[dead] > 0).any()


def test_auxk_takes_the_latents_quiet_for_aux_tokens_not_the_dead_window():
    sae = small("topk", k=2, width=64)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    out = make_objective(sae, dead_tokens_threshold=10**7, aux_tokens=8)(sae, x)
    assert float(out.n_dead) == 0 and float(out.aux) > 0  # quiet for 8 tokens: in AuxK, not yet dead
    # the defaults: topk the dead window; batchtopk, matryoshka 80 x width; jumprelu 16 x width
    assert make_objective(sae, dead_tokens_threshold=1000).stats.quiet_tokens == 1000
    assert make_objective(small("batchtopk", k=2, width=64)).stats.quiet_tokens == 80 * 64
    jr = SAE(SAEConfig(d_vit=16, width=64, activation="jumprelu"))
    assert make_objective(jr, l0_coeff=1e-2).stats.quiet_tokens == 16 * 64
    # a checkpoint from before the window: continued where AuxK is as it was (topk at its default)
    old = {"stats": make_objective(sae).stats.state_dict()}
    assert make_objective(sae).incompatible(old) is None
    assert "before AuxK's window" in make_objective(sae, aux_tokens=8).incompatible(old)
    assert "before AuxK's window" in make_objective(small("batchtopk", k=2, width=64)).incompatible(old)
    assert make_objective(small("batchtopk", k=2, width=64), aux_coeff=0.0).incompatible(old) is None


def test_auxk_revives_dead_latents():
    # Half the latents start with 20x smaller encoder columns: they never win a top-k slot, so they
    # die after the 4096-token window. With AuxK they learn to model the residual and fire again.
    dirs, x = synthetic(8192)
    n_dead = {}
    for coeff in (0.0, 1 / 32):
        sae = SAE(SAEConfig(d_vit=D, width=2 * N_TRUE, activation="topk", k=K_TRUE, seed=0))
        sae.init_b_dec(x[:2048])
        with torch.no_grad():
            sae.W_enc[:, N_TRUE:] *= 0.05
        obj = make_objective(sae, aux_coeff=coeff, dead_tokens_threshold=4096, aux_tokens=4096)
        opt = make_optimizer(sae, lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(150):
            out = train_step(sae, obj, opt, x[torch.randint(0, x.shape[0], (512,), generator=g)])
        n_dead[coeff] = int(out.n_dead)
    print("auxk n_dead", n_dead)
    assert n_dead[0.0] >= N_TRUE - 10  # without AuxK the weak half stays dead
    assert n_dead[1 / 32] < N_TRUE // 4


def test_metrics_definitions():
    sae = small("relu")
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1
    with torch.no_grad():
        sae.W_dec.zero_()
    sae.init_b_dec(x, method="mean")
    out = make_objective(sae, l1_coeff=0.0)(sae, x)
    assert float(out.nmse) == pytest.approx(1.0, rel=1e-5)  # predicting the mean explains nothing
    assert float(out.l1) == 0.0
    d = out.to_dict()
    assert set(d) == {"loss", "mse", "nmse", "l0", "l1", "n_dead", "n_dense", "aux"}
    assert all(isinstance(v, float) for v in d.values())


def test_relu_loss_is_mse_plus_weighted_l1():
    sae = small("relu")
    with torch.no_grad():
        sae.W_dec.mul_(torch.linspace(0.5, 2.0, 32)[:, None])
    x = torch.randn(16, 16)
    obj = make_objective(sae, l1_coeff=0.1)
    out = obj(sae, x, sparsity_scale=0.5)
    with torch.no_grad():
        f = sae.encode(x)
        l1 = (f * sae.W_dec.norm(dim=1)).sum(1).mean()
    assert float(out.l1) == pytest.approx(float(l1), rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(float(out.mse) + 0.05 * float(l1), rel=1e-5)
    assert float(out.l0) == pytest.approx(float((f != 0).sum(1).float().mean()))
    with pytest.raises(ConfigError, match="l1_coeff"):
        make_objective(sae)


def test_dense_latents_are_counted():
    sae = small("relu")
    with torch.no_grad():
        sae.b_enc.fill_(-100.0)
        sae.b_enc[:3] = 100.0  # three latents always fire
    obj = make_objective(sae, l1_coeff=0.0, dead_tokens_threshold=100, aux_tokens=100)
    for _ in range(3):
        out = obj(sae, torch.randn(64, 16))
    assert int(out.n_dense) == 3 and int(out.n_dead) == 29


# -- persistence ------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "topk", "batchtopk"])
def test_save_load_round_trip(tmp_path, activation):
    sae = small(activation, k=4)
    x = torch.randn(32, 16)
    with torch.no_grad():
        for p in sae.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sae(x)  # batchtopk: estimates the threshold
    sae.eval()
    sae.save(tmp_path / "sae")
    assert sorted(p.name for p in (tmp_path / "sae").iterdir()) == ["config.json", "sae.safetensors"]
    assert json.loads((tmp_path / "sae" / "config.json").read_text())["activation"] == activation
    loaded = SAE.load(tmp_path / "sae").eval()
    assert loaded.cfg == sae.cfg
    for a, b in zip(sae(x)[:2], loaded(x)[:2], strict=True):
        assert torch.equal(a, b)


def test_load_missing_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        SAE.load(tmp_path)


# -- config -----------------------------------------------------------------------------------------


def test_config_errors_name_the_fields():
    with pytest.raises(ConfigError, match=r"k=40.*width=32"):
        SAEConfig(d_vit=16, width=32, activation="topk", k=40)
    with pytest.raises(ConfigError, match=r"k=0"):
        SAEConfig(d_vit=16, width=32, activation="batchtopk", k=0)
    with pytest.raises(ConfigError, match=r"'gelu'.*relu.*topk.*batchtopk|relu.*topk.*batchtopk.*'gelu'"):
        SAEConfig(d_vit=16, width=32, activation="gelu", k=4)
    with pytest.raises(ConfigError, match="width"):
        SAEConfig(d_vit=16, width=0, activation="relu")
    with pytest.raises(ConfigError, match="width.*exp_factor"):
        SAEConfig(d_vit=16, activation="relu")
    with pytest.raises(ConfigError, match="k"):
        SAEConfig(d_vit=16, width=32, activation="topk")
    with pytest.raises(ConfigError, match="dtype"):
        SAEConfig(d_vit=16, width=32, activation="relu", dtype="float8")
    with pytest.raises(ConfigError, match="bogus"):
        SAEConfig.from_dict({"d_vit": 16, "width": 32, "activation": "relu", "bogus": 1})


def test_config_round_trip_and_defaults():
    cfg = SAEConfig(d_vit=16, exp_factor=4, activation="topk", k=8, seed=3)
    assert cfg.width == 64 and cfg.normalize_decoder is True
    assert SAEConfig(d_vit=16, width=64, activation="relu").normalize_decoder is False
    again = SAEConfig.from_json(json.dumps(cfg.to_dict()))
    assert again == cfg
    with pytest.raises(ConfigError, match="disagrees"):
        SAEConfig(d_vit=16, width=63, exp_factor=4, activation="relu")


# -- optim ------------------------------------------------------------------------------------------


def test_lr_schedule_and_sparsity_warmup():
    lin = LRSchedule(lr=1.0, warmup_steps=10, total_steps=110, decay="linear", final_frac=0.1)
    assert lin(0) == pytest.approx(0.1) and lin(9) == pytest.approx(1.0)
    assert lin(60) == pytest.approx(0.55) and lin(110) == pytest.approx(0.1) and lin(10_000) == pytest.approx(0.1)
    cos = LRSchedule(lr=2.0, warmup_steps=0, total_steps=100, decay="cosine", final_frac=0.0)
    assert cos(0) == pytest.approx(2.0) and cos(50) == pytest.approx(1.0) and cos(100) == pytest.approx(0.0)
    assert LRSchedule(lr=1.0, total_steps=5, decay="constant")(4) == 1.0
    with pytest.raises(ConfigError, match="decay"):
        LRSchedule(lr=1.0, decay="step")
    with pytest.raises(ConfigError, match="total_steps"):
        LRSchedule(lr=1.0, warmup_steps=10, total_steps=5)
    assert [sparsity_warmup(s, 4) for s in (0, 2, 4, 8)] == [0.0, 0.5, 1.0, 1.0]
    assert sparsity_warmup(0, 0) == 1.0
    opt = make_optimizer(small(), lr=1e-3, betas=(0.9, 0.99))
    assert lin.apply(opt, 60) == pytest.approx(0.55) and opt.param_groups[0]["lr"] == pytest.approx(0.55)
    with pytest.raises(ConfigError, match="lr"):
        make_optimizer(small(), lr=0)


@pytest.mark.parametrize("activation", ["topk", "batchtopk", "matryoshka"])
def test_fit_encoder_scale_is_the_least_squares_scale_of_the_tied_init(activation):
    _, x = synthetic(1024)
    sae = SAE(SAEConfig(d_vit=D, width=512, activation=activation, k=K_TRUE))
    sae.init_b_dec(x)
    tied_DS = sae.W_enc.detach().clone()

    def sq_error(scale: float) -> float:
        with torch.no_grad():
            sae.W_enc.copy_(tied_DS * scale)
            return float(sae._forward_dense(x)[0].sub(x).pow(2).sum())

    sae.train()
    s = sae.fit_encoder_scale_(x)
    assert torch.allclose(sae.W_enc.detach(), tied_DS * s)
    assert torch.isnan(sae.threshold)  # the fit leaves the inference threshold alone
    # the codes' decoder rows overlap in d=64, so the tied init overshoots: s < 1
    assert 0.3 < s < 0.95
    best = sq_error(s)
    assert best < sq_error(0.97 * s) and best < sq_error(1.03 * s) and best < sq_error(1.0)


def test_init_decoder_from_data_starts_a_fraction_of_rows_at_distinct_centred_examples():
    _, x = synthetic(256)
    sae = SAE(SAEConfig(d_vit=D, width=512, activation="topk", k=K_TRUE))
    sae.init_b_dec(x)
    random_SD = sae.W_dec.detach().clone()
    assert sae.init_decoder_from_data_(x, 0.25, seed=3) == 128
    changed_S = (sae.W_dec.detach() != random_SD).any(1)
    assert int(changed_S.sum()) == 128
    xc_ND = x - sae.b_dec.detach()
    cos_RN = sae.W_dec.detach()[changed_S] @ (xc_ND / xc_ND.norm(dim=1, keepdim=True)).T
    best = cos_RN.max(1)
    assert torch.allclose(best.values, torch.ones(128), atol=1e-5) and best.indices.unique().numel() == 128
    assert torch.equal(sae.W_enc.detach(), sae.W_dec.detach().T)  # tied again
    # the same seed picks the same rows and examples; fewer examples than rows: one row each
    again = SAE(SAEConfig(d_vit=D, width=512, activation="topk", k=K_TRUE))
    again.init_b_dec(x)
    again.init_decoder_from_data_(x, 0.25, seed=3)
    assert torch.equal(again.W_dec, sae.W_dec)
    assert again.init_decoder_from_data_(x[:64], 0.5, seed=0) == 64
    with pytest.raises(ConfigError, match="frac must be in"):
        sae.init_decoder_from_data_(x, 1.5, seed=0)


def test_fit_encoder_scale_refuses_activations_without_k():
    sae = SAE(SAEConfig(d_vit=8, width=16, activation="relu"))
    with pytest.raises(ConfigError, match="topk variants"):
        sae.fit_encoder_scale_(torch.randn(4, 8))
