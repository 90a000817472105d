"""Sparse decoding of the TopK family: the same loss and gradients as dense decoding (float64 to
1e-12, float32 to 1e-6, relative to the tensor's norm), AuxK included, and the auto rule."""

from __future__ import annotations

import pytest
import torch

from actcache.errors import ConfigError
from actcache.sae.modeling import SAE, Codes, SAEConfig, SparseDecode, SparseEncode, choose_decode
from actcache.sae.objectives import make_objective
from actcache.sae.optim import make_optimizer, train_step

TOL = {"float64": 1e-12, "float32": 1e-6}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def loss_and_grads(activation: str, dtype: str, decode: str, dead_every: int | None):
    cfg = SAEConfig(d_vit=48, width=768, activation=activation, k=12, dtype=dtype)
    sae = SAE(cfg).set_compute(decode=decode)
    x_BD = torch.randn(96, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(cfg.torch_dtype)
    sae.init_b_dec(x_BD)
    obj = make_objective(sae, dead_tokens_threshold=10**6, aux_tokens=10**6)
    if dead_every is not None:  # some latents dead: the AuxK term is active
        obj.stats.tokens_since_fired_S[::dead_every] = 10**6
    out = obj(sae, x_BD)
    out.loss.backward()
    return out, {n: p.grad for n, p in sae.named_parameters()}, sae.threshold, obj.stats


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("activation", ["topk", "batchtopk"])
@pytest.mark.parametrize("dead_every", [None, 3])
@pytest.mark.parametrize("decode", ["sparse", "hybrid"])
def test_sparse_decoding_gives_the_dense_loss_and_gradients(activation, dtype, dead_every, decode):
    dense, g_dense, th_dense, st_dense = loss_and_grads(activation, dtype, "dense", dead_every)
    sparse, g_sparse, th_sparse, st_sparse = loss_and_grads(activation, dtype, decode, dead_every)
    tol = TOL[dtype]
    # firing statistics taken from the codes equal those of the dense f_BS
    assert torch.equal(st_sparse.tokens_since_fired_S, st_dense.tokens_since_fired_S)
    assert torch.equal(st_sparse.freq_S, st_dense.freq_S)
    assert (float(sparse.aux) > 0) == (dead_every is not None)
    for name in ("loss", "mse", "aux", "l0", "l1"):
        assert rel_err(getattr(sparse, name).detach(), getattr(dense, name).detach()) <= tol, name
    for name, g in g_dense.items():
        assert rel_err(g_sparse[name], g) <= tol, name
    torch.testing.assert_close(th_sparse, th_dense, rtol=0, atol=0, equal_nan=True)


def test_sparse_autograd_functions_pass_gradcheck():
    gen = torch.Generator().manual_seed(0)
    b, d, s, k = 5, 6, 20, 3
    W_SD = torch.randn(s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    W_DS = torch.randn(d, s, generator=gen, dtype=torch.float64, requires_grad=True)
    b_S = torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
    x_BD = torch.randn(b, d, generator=gen, dtype=torch.float64, requires_grad=True)
    b_dec_D = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True)
    idx_BK = torch.stack([torch.randperm(s, generator=gen)[:k] for _ in range(b)])
    codes = Codes.per_row(idx_BK)
    val_N = torch.randn(b * k, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, w: SparseDecode.apply(v, w, codes), (val_N, W_SD))

    def enc(x, b_dec, w, bias):
        return SparseEncode.apply(x, b_dec, w, bias, ((x - b_dec) @ w + bias).detach(), codes)

    assert torch.autograd.gradcheck(enc, (x_BD, b_dec_D, W_DS, b_S))
    assert torch.autograd.gradcheck(lambda b_dec: enc(x_BD.detach(), b_dec, W_DS, b_S), (b_dec_D,))


def test_batchtopk_codes_give_examples_their_own_counts():
    pre_BS = torch.tensor([[5.0, 4.0, 0.0], [0.1, 0.2, 0.3], [3.0, 0.0, 6.0]])
    codes = Codes.from_flat(pre_BS.reshape(-1).topk(4).indices, width=3, batch=3)
    assert codes.row_N.tolist() == [0, 0, 2, 2]
    assert codes.col_N.tolist() == [0, 1, 0, 2]
    assert codes.offsets_B.tolist() == [0, 2, 2]  # example 1 has no code: an empty bag


def test_sparse_training_follows_dense_training():
    x_BD = torch.randn(128, 32, generator=torch.Generator().manual_seed(1))
    saes = []
    for decode in ("dense", "sparse"):
        sae = SAE(SAEConfig(d_vit=32, width=256, activation="topk", k=8)).set_compute(decode=decode)
        obj, opt = make_objective(sae, dead_tokens_threshold=300, aux_tokens=300), make_optimizer(sae, lr=1e-3)
        sae.init_b_dec(x_BD)
        for _ in range(20):
            out = train_step(sae, obj, opt, x_BD, max_grad_norm=1.0)
        saes.append((sae, out))
    (dense, d_out), (sparse, s_out) = saes
    assert float(d_out.aux) > 0  # latents died and AuxK ran on both paths
    assert rel_err(sparse.W_dec.detach(), dense.W_dec.detach()) < 1e-4
    assert abs(float(s_out.mse) - float(d_out.mse)) <= 1e-4 * float(d_out.mse)


def test_auto_decode_takes_sparse_for_a_small_k_over_width():
    assert choose_decode("auto", "topk", 32, 12288) == "sparse"
    assert choose_decode("auto", "batchtopk", 32, 256) == "dense"
    assert choose_decode("auto", "relu", None, 12288) == "dense"
    assert choose_decode("dense", "topk", 32, 12288) == "dense"


def test_auto_decode_takes_hybrid_only_on_cuda_in_reduced_precision():
    assert choose_decode("auto", "topk", 32, 12288, "cuda", "bf16") == "hybrid"
    assert choose_decode("auto", "topk", 32, 12288, "cuda", "tf32") == "hybrid"
    assert choose_decode("auto", "topk", 32, 12288, "cuda", "fp32") == "sparse"
    assert choose_decode("auto", "topk", 32, 12288, "cpu", "bf16") == "sparse"
    assert choose_decode("auto", "batchtopk", 32, 256, "cuda", "bf16") == "dense"
    with pytest.raises(ConfigError, match="hybrid"):
        choose_decode("hybrid", "jumprelu", None, 1024)


def test_hybrid_weight_gradients_pass_gradcheck():
    gen = torch.Generator().manual_seed(1)
    b, d, s, k = 4, 5, 16, 3
    W_SD = torch.randn(s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    W_DS = torch.randn(d, s, generator=gen, dtype=torch.float64, requires_grad=True)
    b_S = torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
    x_BD = torch.randn(b, d, generator=gen, dtype=torch.float64)
    b_dec_D = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True)
    codes = Codes.per_row(torch.stack([torch.randperm(s, generator=gen)[:k] for _ in range(b)]))
    val_N = torch.randn(b * k, generator=gen, dtype=torch.float64, requires_grad=True)
    f64 = torch.float64
    assert torch.autograd.gradcheck(lambda v, w: SparseDecode.apply(v, w, codes, f64), (val_N, W_SD))

    def enc(b_dec, w, bias):
        return SparseEncode.apply(x_BD, b_dec, w, bias, ((x_BD - b_dec) @ w + bias).detach(), codes, f64)

    assert torch.autograd.gradcheck(enc, (b_dec_D, W_DS, b_S))


def test_sparse_objective_builds_no_dense_codes_matrix():
    sae = SAE(SAEConfig(d_vit=16, width=128, activation="topk", k=4)).set_compute(decode="sparse")
    x_BD = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    _, f_BS, aux = sae(x_BD, dense_f=False)
    assert f_BS is None and aux["val_N"].shape == (8 * 4,)
    out = make_objective(sae)(sae, x_BD)
    assert float(out.l0) <= 4.0 and float(out.l1) > 0
    with pytest.raises(ConfigError, match="needs activation topk or batchtopk"):
        choose_decode("sparse", "relu", None, 1024)


def test_batchtopk_eval_mode_decodes_densely_with_its_threshold():
    sae = SAE(SAEConfig(d_vit=16, width=128, activation="batchtopk", k=4)).set_compute(decode="sparse")
    x_BD = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    sae(x_BD)  # a train-mode forward sets the threshold
    sae.eval()
    with torch.no_grad():
        x_hat_BD, f_BS, _ = sae(x_BD)
    pre_BS = sae.pre_acts(x_BD)
    torch.testing.assert_close(f_BS, pre_BS * (pre_BS > sae.threshold))
    torch.testing.assert_close(x_hat_BD, f_BS @ sae.W_dec + sae.b_dec)
