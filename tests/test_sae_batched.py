"""Several SAEs stepped as one batched module (actcache.sae.batched) equal stepping them one by one:
in memory for every objective and decode mode, and through train_group, where a preempted
batched run also resumes to the uninterrupted run's weights exactly."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from actcache.rundir import run_dir
from actcache.sae.batched import BatchedSAEs, batch_key, choose_batching
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE, SAEConfig
from actcache.sae.objectives import make_objective
from actcache.sae.optim import make_optimizer, train_step
from actcache.sae.train import Preempted, train_group
from test_sae_resume import stop_after
from test_sae_train import dictionary_cache

CASES = {  # name -> (activation, decode, objective kwargs per SAE)
    "topk-dense": ("topk", "dense", [{}, {"aux_coeff": 0.1}, {}]),
    "topk-sparse": ("topk", "sparse", [{}, {"aux_coeff": 0.1}, {}]),
    "batchtopk-sparse": ("batchtopk", "sparse", [{}, {}, {"aux_coeff": 0.0}]),
    "relu": ("relu", "dense", [{"l1_coeff": 1e-3}, {"l1_coeff": 1e-2}, {"l1_coeff": 0.0}]),
    "jumprelu": ("jumprelu", "dense", [{"l0_coeff": 1e-3}, {"l0_coeff": 1e-2, "preact_coeff": 1e-4}, {"l0_coeff": 0.0}]),
    "matryoshka": ("matryoshka", "dense", [{}, {"prefix_weights": [2.0, 1.0]}, {}]),
}  # fmt: skip


def _build(activation: str, decode: str, kws: list[dict], dtype: str, precision: str = "fp32"):
    saes, objs, opts = [], [], []
    for seed, kw in enumerate(kws):
        extra = {"matryoshka_prefixes": (16, 64)} if activation == "matryoshka" else {}
        k = None if activation in ("relu", "jumprelu") else 4
        cfg = SAEConfig(d_vit=16, width=64, activation=activation, k=k, seed=seed, dtype=dtype, **extra)
        sae = SAE(cfg).set_compute(decode, precision)
        saes.append(sae)
        objs.append(make_objective(sae, dead_tokens_threshold=100, aux_tokens=100, **kw))
        opts.append(make_optimizer(sae, lr=1e-2))
    return saes, objs, opts


def _run_both(activation, decode, kws, dtype, precision="fp32", steps=6):
    gen = torch.Generator().manual_seed(1)
    x_BD = torch.randn(50, 16, generator=gen, dtype=torch.float64).to(getattr(torch, dtype))
    scales = [1.0, 0.5, 1.0]
    one = _build(activation, decode, kws, dtype, precision)
    many = _build(activation, decode, kws, dtype, precision)
    stack = BatchedSAEs(many[0], many[2])
    losses_one, losses_many = [], []
    for _ in range(steps):
        losses_one.append([train_step(s, o, opt, x_BD, max_grad_norm=0.5, sparsity_scale=sc)
                           for s, o, opt, sc in zip(*one, scales, strict=True)])  # fmt: skip
        losses_many.append(stack.step(many[1], x_BD, lr=1e-2, sparsity_scales=scales, max_grad_norm=0.5))
    stack.scatter()
    return one, many, losses_one, losses_many


@pytest.mark.parametrize("case", list(CASES))
def test_batched_multi_sae_step_equals_separate_steps_in_float64(case):
    activation, decode, kws = CASES[case]
    one, many, l_one, l_many = _run_both(activation, decode, kws, "float64")
    for step_one, step_many in zip(l_one, l_many, strict=True):
        for a, b in zip(step_one, step_many, strict=True):
            for name, va in a.to_dict().items():
                assert b.to_dict()[name] == pytest.approx(va, rel=1e-12, abs=1e-15), name
    for sa, sb, oa, ob in zip(one[0], many[0], one[2], many[2], strict=True):
        assert sa.W_dec.grad is not None  # trained
        for name, t in sa.state_dict().items():
            torch.testing.assert_close(sb.state_dict()[name], t, rtol=1e-12, atol=1e-14, equal_nan=True, msg=name)
        for p, q in zip(sa.parameters(), sb.parameters(), strict=True):  # Adam's state came back out too
            torch.testing.assert_close(ob.state[q]["exp_avg_sq"], oa.state[p]["exp_avg_sq"], rtol=1e-12, atol=1e-20)
    if activation in ("topk", "batchtopk", "matryoshka"):
        assert any(float(out.aux) > 0 for step in l_one for out in step)  # AuxK ran on dead latents


def test_batched_step_in_float32_and_bf16_within_rounding():
    for precision, tol in (("fp32", 1e-5), ("bf16", 1e-2)):
        one, many, _, _ = _run_both("topk", "sparse", CASES["topk-sparse"][2], "float32", precision, steps=3)
        for sa, sb in zip(one[0], many[0], strict=True):
            torch.testing.assert_close(sb.W_dec, sa.W_dec, rtol=tol, atol=tol)


def test_only_equal_shapes_and_optimizer_settings_share_a_stack():
    a, b = SAE(SAEConfig(d_vit=8, width=16, k=2, seed=0)), SAE(SAEConfig(d_vit=8, width=16, k=2, seed=1))
    c = SAE(SAEConfig(d_vit=8, width=32, k=2))
    key = [batch_key(s, make_optimizer(s, lr=1e-3)) for s in (a, b, c)]
    assert key[0] == key[1] != key[2]
    assert batch_key(a, make_optimizer(a, lr=1e-3, betas=(0.8, 0.99))) != key[0]
    assert [choose_batching(m, "cpu", 8) for m in ("on", "off", "auto")] == [True, False, False]
    assert not choose_batching("auto", "cuda", 8) and not choose_batching("on", "cuda", 1)  # auto: nowhere measured faster yet


TRAIN = {"batch_size": 128, "steps": 20, "log_every": 10, "ckpt_every": 10, "eval_frac": 0.1, "dead_tokens": 500,
         "deterministic": True, "lr": 3e-3, "warmup_steps": 5, "lr_decay": "linear", "width": 64,
         "saes": [{"activation": "topk", "k": 4, "sweep": {"seed": [0, 1]}},
                  {"activation": "relu", "l1_coeff": 1e-3}]}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path, _ = dictionary_cache(tmp_path_factory.mktemp("batched") / "cache", n_imgs=120, imgs_per_shard=64)
    return path


def _weights(cache, runs, runs_to) -> dict:
    return {r.sae_id: SAE.load(run_dir(runs_to, os.path.basename(cache), r)).state_dict() for r in runs}


def test_train_group_batched_equals_one_by_one_and_resumes_exactly(cache, tmp_path, caplog):
    runs = {m: expand_train_section({**TRAIN, "batch_saes": m}, "t.yaml") for m in ("on", "off")}
    with caplog.at_level(logging.INFO, logger="actcache.sae.train"):
        train_group(cache, runs["on"], tmp_path / "on", device="cpu")
    assert "1 stack(s) of SAEs stepped as one batched module, 1 SAE(s) alone" in caplog.text
    train_group(cache, runs["off"], tmp_path / "off", device="cpu")
    on, off = _weights(cache, runs["on"], tmp_path / "on"), _weights(cache, runs["off"], tmp_path / "off")
    assert on.keys() == off.keys() and len(on) == 3
    for sid in on:
        for name, t in off[sid].items():
            torch.testing.assert_close(on[sid][name], t, rtol=1e-5, atol=1e-6, equal_nan=True, msg=f"{sid} {name}")
    with pytest.raises(Preempted):
        train_group(cache, runs["on"], tmp_path / "resumed", device="cpu", stop=stop_after(15))
    train_group(cache, runs["on"], tmp_path / "resumed", device="cpu")
    resumed = _weights(cache, runs["on"], tmp_path / "resumed")
    for sid in on:
        for name, t in on[sid].items():
            torch.testing.assert_close(resumed[sid][name], t, rtol=0, atol=0, equal_nan=True, msg=f"{sid} {name}")
