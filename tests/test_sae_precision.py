"""The ``precision`` and ``decode`` train keys: existing ids unchanged, bf16 on the CPU with float32
weights and state, tf32 a no-op on the CPU, and the sync-free trainer path (pinned feed, deferred
finiteness check, lagged dead count) run on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from actcache.errors import TrainError
from actcache.rundir import run_dir
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE, SAEConfig
from actcache.sae.objectives import make_objective
from actcache.sae.optim import make_optimizer, train_step
from actcache.sae.train import GroupTrainer
from actcache.writer import synthetic_metadata, write_cache
from test_sae_resume import collect

SECTION = {"batch_size": 1024, "steps": 100,
           "saes": [{"activation": "topk", "k": 16, "exp_factor": 8}, {"activation": "relu", "l1_coeff": 1e-3, "width": 512}]}  # fmt: skip


def ids(**extra) -> list[tuple[str, str]]:
    return [(r.sae_id, r.group_id) for r in expand_train_section({**SECTION, **extra}, "x.yaml")]


def test_ids_of_existing_configs_are_unchanged():
    # computed before the keys existed
    assert ids() == [("2faf9887fd9c", "Lauto-image-2e496002"), ("9d86d354fba8", "Lauto-image-2e496002")]
    assert ids(precision="fp32", decode="auto") == ids()


def test_precision_changes_the_sae_and_group_ids_and_decode_only_the_group():
    base = ids()
    bf16 = ids(precision="bf16")
    assert all(b[0] != a[0] and b[1] != a[1] for a, b in zip(base, bf16, strict=True))
    dense = ids(decode="dense")
    assert [d[0] for d in dense] == [a[0] for a in base]
    assert dense[0][1] != base[0][1]


def test_bad_precision_names_the_key():
    with pytest.raises(Exception, match="key 'precision' must be one of fp32, tf32, bf16"):
        expand_train_section({**SECTION, "precision": "fp16"}, "x.yaml")


def step_once(precision: str, decode: str = "dense"):
    sae = SAE(SAEConfig(d_vit=32, width=256, activation="topk", k=8)).set_compute(decode, precision)
    obj, opt = make_objective(sae, dead_tokens_threshold=64, aux_tokens=64), make_optimizer(sae, lr=1e-3)
    x_BD = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    sae.init_b_dec(x_BD)
    outs = [train_step(sae, obj, opt, x_BD, max_grad_norm=1.0) for _ in range(3)]
    return sae, opt, outs[-1]


@pytest.mark.parametrize("decode", ["dense", "sparse", "hybrid"])
def test_bf16_runs_on_the_cpu_with_float32_weights_state_and_loss(decode):
    sae, opt, out = step_once("bf16", decode)
    ref, _, ref_out = step_once("fp32", decode)
    assert float(out.aux) > 0  # latents died: AuxK ran in bf16 too
    assert all(p.dtype == torch.float32 for p in sae.parameters())
    assert all(v.dtype == torch.float32 for st in opt.state.values() for k, v in st.items() if k != "step")
    assert out.loss.dtype == torch.float32 and out.mse.dtype == torch.float32
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(256), atol=1e-6)  # normalised in float32
    with sae.autocast():
        assert (sae.W_enc.T[:1] @ sae.W_enc[:, :1]).dtype == torch.bfloat16
    assert not torch.equal(sae.W_enc, ref.W_enc)  # the matmuls were rounded to bf16 ...
    assert abs(float(out.mse) - float(ref_out.mse)) < 0.05 * float(ref_out.mse)  # ... and stay close


def test_tf32_is_exact_fp32_on_the_cpu():
    sae, _, _ = step_once("tf32")
    ref, _, _ = step_once("fp32")
    for a, b in zip(sae.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.backends.cuda.matmul.allow_tf32 is False  # restored after each step


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("prec")
    md = synthetic_metadata(64, layers=(-2,), n_patches_per_img=16, d_vit=16, seed=0, max_patches_per_shard=32 * 17)

    def fill(a, b):
        return np.random.default_rng(a).standard_normal((b - a, 1, md.n_tokens_per_img, 16), dtype=np.float32)

    return write_cache(str(root), md, fill)


TRAIN = {"batch_size": 64, "steps": 24, "width": 64, "k": 4, "log_every": 6, "ckpt_every": 6, "eval_frac": 0.1,
         "dead_tokens": 200, "lr": 3e-3, "saes": [{"activation": "topk"}, {"activation": "batchtopk"}]}  # fmt: skip


def train(cache, out, sync_free=False, stop=None, **keys):
    runs = expand_train_section({**TRAIN, **keys}, "t.yaml")
    t = GroupTrainer(cache, runs, out, device="cpu", stop=stop)
    t.sync_free = sync_free
    try:
        t.run()
    except TrainError:
        if stop is None:
            raise
    return runs


def stop_at(n):
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] >= n

    return stop


@pytest.mark.parametrize(
    "keys,sync_free",
    [({"precision": "bf16"}, False), ({"precision": "tf32", "decode": "sparse"}, False),
     ({"precision": "bf16", "decode": "sparse"}, True), ({}, True)],
)  # fmt: skip
def test_every_precision_resumes_to_identical_weights(cache, tmp_path, keys, sync_free):
    runs = train(cache, tmp_path / "ref", sync_free, **keys)
    want = collect(cache, runs, tmp_path / "ref")
    train(cache, tmp_path / "cut", sync_free, stop=stop_at(10), **keys)
    assert not os.path.exists(os.path.join(run_dir(tmp_path / "cut", os.path.basename(cache), runs[0]), "done.json"))
    train(cache, tmp_path / "cut", sync_free, **keys)
    got = collect(cache, runs, tmp_path / "cut")
    for sid in want:
        for name, t in want[sid]["state"].items():
            assert torch.equal(got[sid]["state"][name].nan_to_num(), t.nan_to_num()), (sid, name)
        assert got[sid]["metrics"] == want[sid]["metrics"]


def test_sync_free_path_equals_the_plain_path_while_no_latent_is_dead(cache, tmp_path):
    runs = train(cache, tmp_path / "a", dead_tokens=10**9)
    train(cache, tmp_path / "b", sync_free=True, dead_tokens=10**9)
    a, b = collect(cache, runs, tmp_path / "a"), collect(cache, runs, tmp_path / "b")
    for sid in a:
        for name, t in a[sid]["state"].items():
            assert torch.equal(b[sid]["state"][name].nan_to_num(), t.nan_to_num()), (sid, name)


def test_sync_free_path_reports_a_nan_batch_by_its_step(tmp_path):
    md = synthetic_metadata(64, layers=(-2,), n_patches_per_img=16, d_vit=16, seed=0, max_patches_per_shard=32 * 17)

    def fill(a, b):
        x = np.random.default_rng(a).standard_normal((b - a, 1, md.n_tokens_per_img, 16), dtype=np.float32)
        x[:, :, 3, 5] = np.nan  # every image: every batch has a NaN
        return x

    cache = write_cache(str(tmp_path / "c"), md, fill)
    runs = expand_train_section(TRAIN, "t.yaml")
    t = GroupTrainer(cache, runs, tmp_path / "runs", device="cpu")
    t.sync_free = True
    with pytest.raises(TrainError, match=r"NaN or Inf in the batch of step 0; not training through it"):
        t.run()
    assert not os.path.exists(os.path.join(run_dir(tmp_path / "runs", md.hash, runs[0]), "metrics.jsonl"))
