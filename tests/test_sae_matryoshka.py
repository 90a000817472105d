"""Matryoshka BatchTopK SAEs (Bussmann et al. 2025): nested prefix reconstructions, the weighted
loss, dictionary recovery with the BatchTopK inference threshold, per-prefix FVU in the metrics,
list-valued keys in sweeps, and exact resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from actcache.errors import ConfigError
from actcache.sae import SAE, LRSchedule, SAEConfig, make_objective, make_optimizer, train_step
from actcache.sae.config import RunConfig, expand_train_section
from actcache.sae.train import Preempted, train_group
from test_sae_modeling import K_TRUE, N_TRUE, D, recovery, synthetic
from test_sae_resume import assert_same, collect, stop_after
from test_sae_train import dictionary_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread per test


def mat(width=32, d=8, k=3, prefixes=(4, 16, 32), **kw) -> SAE:
    return SAE(SAEConfig(d_vit=d, width=width, activation="matryoshka", k=k, matryoshka_prefixes=prefixes, **kw))


def test_prefix_reconstructions_decode_only_the_first_m_latents():
    sae = mat()
    f_BS = torch.relu(torch.randn(5, 32))
    for m, x_hat_BD in zip((4, 16, 32), sae.decode_prefixes(f_BS, (4, 16, 32)), strict=True):
        masked = f_BS.clone()
        masked[:, m:] = 0
        torch.testing.assert_close(x_hat_BD, sae.decode(masked), rtol=1e-5, atol=1e-5)


def test_loss_is_the_weighted_mean_of_prefix_mses_and_one_prefix_is_batchtopk():
    x = torch.randn(64, 8)
    sae = mat()
    obj = make_objective(sae, prefix_weights=[2, 1, 1])
    out = obj(sae, x)
    var_x = float(x.var(0, unbiased=False).mean())
    fvu = [float(out.extras[f"nmse_prefix_{m}"]) for m in (4, 16, 32)]
    assert fvu[2] == pytest.approx(float(out.nmse), rel=1e-5)  # the last prefix is the whole SAE
    want = var_x * (0.5 * fvu[0] + 0.25 * fvu[1] + 0.25 * fvu[2])  # no dead latent yet: no AuxK
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-5)
    one = SAE(SAEConfig(d_vit=8, width=32, activation="matryoshka", k=3))
    btk = SAE(SAEConfig(d_vit=8, width=32, activation="batchtopk", k=3))
    assert one.cfg.matryoshka_prefixes == (32,)
    a, b = make_objective(one)(one, x), make_objective(btk)(btk, x)
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-6) and torch.equal(
        one.threshold, btk.threshold
    )
    with pytest.raises(ConfigError, match="3 prefixes"):
        make_objective(sae, prefix_weights=[1, 1])


def test_matryoshka_recovers_dictionary_and_infers_with_threshold():
    torch.manual_seed(0)
    dirs, x = synthetic(32768)
    width = 2 * N_TRUE
    sae = mat(width=width, d=D, k=K_TRUE, prefixes=(width // 4, width // 2, width), seed=0)
    sae.init_b_dec(x[:2048])
    obj = make_objective(sae, dead_tokens_threshold=100_000, aux_tokens=100_000)  # AuxK revives latents left unused
    opt = make_optimizer(sae, 1e-2)
    steps = 700
    sched = LRSchedule(lr=1e-2, warmup_steps=50, total_steps=steps, decay="linear", final_frac=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        sched.apply(opt, step)
        out = train_step(sae, obj, opt, x[torch.randint(0, x.shape[0], (512,), generator=g)], max_grad_norm=1.0)
    score = recovery(sae, dirs)
    fvu = [float(out.extras[f"nmse_prefix_{m}"]) for m in sae.cfg.matryoshka_prefixes]
    sae.eval()
    with torch.no_grad():
        l0_eval = float((sae.encode(x[:4096]) != 0).sum(1).float().mean())
    print(f"matryoshka recovery {score:.4f} fvu per prefix {[round(v, 3) for v in fvu]} eval l0 {l0_eval:.2f}")
    assert score >= 0.9
    assert all(a > b for a, b in zip(fvu, fvu[1:], strict=False))  # each prefix adds to the reconstruction
    assert K_TRUE / 2 <= l0_eval <= 2 * K_TRUE


# ---- keys: a list is one value at entry level, a grid in sweep: -----------------------------------


def test_prefixes_are_a_value_in_an_entry_and_a_grid_in_a_sweep():
    base = {"steps": 10, "width": 64, "activation": "matryoshka", "k": 4}
    (one,) = expand_train_section({**base, "matryoshka_prefixes": [16, 64], "matryoshka_weights": ["1", 3]}, "x.yaml")
    assert one.matryoshka_prefixes == (16, 64) and one.matryoshka_weights == (1.0, 3.0)
    assert one.sae_config(8).matryoshka_prefixes == (16, 64)
    assert RunConfig.from_dict(json.loads(json.dumps(one.to_dict()))) == one  # run.json round trip
    two = expand_train_section({**base, "sweep": {"matryoshka_prefixes": [[16, 64], [8, 32, 64]]}}, "x.yaml")
    assert [r.matryoshka_prefixes for r in two] == [(16, 64), (8, 32, 64)]
    assert len({r.sae_id for r in two}) == 2 and len({r.group_id for r in two}) == 1
    (plain,) = expand_train_section({**base, "activation": "batchtopk"}, "x.yaml")
    (default,) = expand_train_section(base, "x.yaml")
    assert default.sae_config(8).matryoshka_prefixes == (64,) and default.sae_id != plain.sae_id


@pytest.mark.parametrize(
    "train, match",
    [
        (
            {"sweep": {"matryoshka_prefixes": [16, 64]}},
            r"sweep: key 'matryoshka_prefixes' takes a list as ONE value, so its sweep is a list of such lists",
        ),
        ({"matryoshka_prefixes": [16, 32]}, r"'matryoshka_prefixes' = \[16, 32\] must end with the width 64"),
        ({"matryoshka_prefixes": [32, 16, 64]}, r"must be increasing sizes"),
        ({"matryoshka_prefixes": [16, 64.5]}, r"must be list of int or null, got \[16, 64.5\]"),
        ({"matryoshka_prefixes": [16, 64], "matryoshka_weights": [1]}, r"has 1 values for 2 prefixes"),
        ({"matryoshka_weights": [-1]}, r"'matryoshka_weights' must hold items in \[0, 10000\]"),
        ({"activation": "topk", "matryoshka_prefixes": [16, 64]}, r"only for activation matryoshka, not topk"),
    ],
)
def test_bad_matryoshka_keys_name_file_and_key(train, match):
    with pytest.raises(ConfigError, match=match):
        expand_train_section({"steps": 10, "width": 64, "activation": "matryoshka", "k": 4, **train}, "x.yaml")


def test_prefixes_must_end_at_the_width_from_exp_factor():
    with pytest.raises(ConfigError, match=r"increase from >= 1 to the width 128"):
        expand_train_section({"steps": 10, "exp_factor": 2, "activation": "matryoshka", "matryoshka_prefixes": [16, 64]},
                             "x.yaml", d_vit=64)  # fmt: skip


# ---- through `train_group`: metrics, eval, resume ---------------------------------------------------

TRAIN = {"batch_size": 128, "steps": 40, "width": 128, "k": 4, "log_every": 10, "ckpt_every": 10, "eval_frac": 0.1,
         "dead_tokens": 500, "lr": 3e-3, "warmup_steps": 5, "lr_decay": "linear", "activation": "matryoshka",
         "sweep": {"matryoshka_prefixes": [[16, 128], [8, 32, 128]]}}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path, _ = dictionary_cache(tmp_path_factory.mktemp("matryoshka") / "cache", n_imgs=200, imgs_per_shard=64)
    return path


def test_preempted_matryoshka_group_resumes_to_identical_weights_and_metrics(cache, tmp_path):
    runs = expand_train_section(TRAIN, "t.yaml")
    ref = train_group(cache, runs, tmp_path / "ref", device="cpu")
    want = collect(cache, runs, tmp_path / "ref")
    with pytest.raises(Preempted):
        train_group(cache, runs, tmp_path / "cut", device="cpu", stop=stop_after(25))
    cut = train_group(cache, runs, tmp_path / "cut", device="cpu")
    assert_same(collect(cache, runs, tmp_path / "cut"), want)
    for r, a, b in zip(runs, ref, cut, strict=True):
        lines_a = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl"))]
        lines_b = [json.loads(x) for x in open(os.path.join(b, "metrics.jsonl"))]
        keys = [f"nmse_prefix_{m}" for m in r.matryoshka_prefixes]
        assert [[x[k] for k in keys] for x in lines_a] == [[x[k] for k in keys] for x in lines_b]
        assert lines_a[-1][keys[0]] > lines_a[-1][keys[-1]]
        ev = json.load(open(os.path.join(a, "eval.json")))
        assert 0 < ev["l0"] and ev["nmse"] < 1.0  # eval mode: the inference threshold
        assert SAE.load(a).cfg.matryoshka_prefixes == r.matryoshka_prefixes


# ---- feature absorption (Chanin et al. 2024's toy) -------------------------------------------------

N_PARENTS, N_CHILDREN, D_TOY, W_TOY = 8, 8, 96, 80


def hierarchy(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent directions (P, D), examples (n, D)). Orthonormal parents and children; each parent
    is active with probability 1/P, and then exactly one of its children with it (a child never
    fires without its parent, a parent never alone); coefficients uniform in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    q_DD, _ = torch.linalg.qr(torch.randn(D_TOY, D_TOY, generator=g))
    parents_PD = q_DD[:N_PARENTS]
    children_PCD = q_DD[N_PARENTS : N_PARENTS * (N_CHILDREN + 1)].reshape(N_PARENTS, N_CHILDREN, D_TOY)
    on_NP1 = (torch.rand(n, N_PARENTS, 1, generator=g) < 1 / N_PARENTS).float()
    child_NP = torch.randint(0, N_CHILDREN, (n, N_PARENTS), generator=g)
    a_NP1, b_NP1 = (torch.rand(n, N_PARENTS, 1, generator=g) + 0.5 for _ in range(2))
    picked_NPD = children_PCD[torch.arange(N_PARENTS)[None], child_NP]
    return parents_PD, (on_NP1 * (a_NP1 * parents_PD + b_NP1 * picked_NPD)).sum(1)


def best_cosine(rows_SD: torch.Tensor, dirs_PD: torch.Tensor) -> float:
    """Mean over the directions of their best cosine with a row (as ``recovery`` does)."""
    rows_SD = rows_SD.detach() / rows_SD.detach().norm(dim=1, keepdim=True)
    return float((dirs_PD @ rows_SD.T).max(1).values.mean())


def train_toy(sae: SAE, x_ND: torch.Tensor, **objective_kw) -> SAE:
    sae.init_b_dec(x_ND[:2048])
    obj, opt = make_objective(sae, dead_tokens_threshold=2048, aux_tokens=2048, **objective_kw), make_optimizer(sae, 1e-2)
    sched = LRSchedule(lr=1e-2, warmup_steps=20, total_steps=1000, decay="linear", final_frac=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(1000):
        sched.apply(opt, step)
        train_step(sae, obj, opt, x_ND[torch.randint(0, x_ND.shape[0], (256,), generator=g)])
    return sae


def test_first_prefix_recovers_parents_that_plain_batchtopk_absorbs():
    # k = 1 while the data has two active features on average: a plain SAE does best with one
    # latent per parent+child pair (absorption), so no decoder row points at a parent. With the
    # first prefix weighted up, that prefix alone must reconstruct, which only parents can do well.
    parents_PD, x_ND = hierarchy(16384)
    width, first = W_TOY, 2 * N_PARENTS
    mat_sae = train_toy(mat(width=width, d=D_TOY, k=1, prefixes=(first, width)), x_ND, prefix_weights=[4, 1])
    plain = train_toy(SAE(SAEConfig(d_vit=D_TOY, width=width, activation="batchtopk", k=1)), x_ND)
    score_mat, score_plain = best_cosine(mat_sae.W_dec[:first], parents_PD), best_cosine(plain.W_dec, parents_PD)
    print(f"parents recovered: matryoshka first {first} latents {score_mat:.3f}, batchtopk all {score_plain:.3f}")
    assert score_mat >= 0.9
    assert score_plain <= score_mat - 0.1


def test_eval_json_and_the_page_hold_each_prefix_fvu():
    from actcache.sae.evaluate import evaluate
    from actcache.visuals import heldout_rows

    torch.manual_seed(0)
    sae = mat(width=32, d=8, k=3, prefixes=(4, 16, 32)).eval()
    sae.threshold.fill_(0.1)  # the inference threshold training would have set
    x_ND = torch.randn(300, 8)
    ev = evaluate(sae, [x_ND[:128], x_ND[128:]])
    with torch.no_grad():
        f_NS = sae(x_ND)[1]
        (x4_ND, *_) = sae.decode_prefixes(f_NS, (4, 16, 32))
    total = float((x_ND - x_ND.mean(0)).pow(2).sum())
    assert ev["nmse_prefix_4"] == pytest.approx(float((x4_ND - x_ND).pow(2).sum()) / total, rel=1e-5)
    assert ev["nmse_prefix_32"] == pytest.approx(ev["nmse"], rel=1e-6)  # the last prefix is the whole SAE
    assert "first m latents" in ev["definitions"]["nmse_prefix"]
    rows = heldout_rows(ev)
    assert rows["FVU, first 4 latents"].startswith(f"{ev['nmse_prefix_4']:.4f} (") and "FVU, first 32 latents" in rows
