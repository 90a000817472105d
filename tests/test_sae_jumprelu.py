"""JumpReLU SAEs (Rajamanoharan et al. 2024): the straight-through threshold gradients, dictionary
recovery with learned thresholds, an l0_coeff sweep trained in one loader pass, the L0 warm-up,
the train keys (and the SAE ids they leave alone), save/load and exact resume.

In-memory data: tests/test_sae_modeling.py's 256 unit directions in d=64, 8 per example.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from actcache.errors import ConfigError, TrainError
from actcache.rundir import run_dir
from actcache.sae import SAE, LRSchedule, SAEConfig, make_objective, make_optimizer, sparsity_warmup, train_step
from actcache.sae.config import RunConfig, expand_train_section
from actcache.sae.modeling import JUMPRELU_BANDWIDTH_REL, JUMPRELU_INIT_REL, HeavisideStep
from actcache.sae.train import Preempted, train_group
from test_sae_modeling import K_TRUE, N_TRUE, D, recovery, synthetic
from test_sae_resume import assert_same, collect, stop_after
from test_sae_train import dictionary_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread per test


def jump(width=8, d=4, **kw) -> SAE:
    return SAE(SAEConfig(d_vit=d, width=width, activation="jumprelu", **kw))


def test_forward_gates_at_the_threshold_and_gradients_follow_the_rectangle_kernel():
    sae = jump(width=3, jumprelu_init_threshold=0.5, jumprelu_bandwidth=0.2, jumprelu_param="log")
    pre_BS = torch.tensor([[0.45, 0.55, 1.0], [0.2, 0.62, -1.0]], requires_grad=True)
    f_BS = sae.activate(pre_BS)
    assert torch.equal(f_BS.detach(), torch.tensor([[0.0, 0.55, 1.0], [0.0, 0.62, 0.0]]))
    f_BS.sum().backward()
    assert torch.equal(pre_BS.grad, torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))  # the gate
    # d f / d theta = -theta/eps per pre within eps/2 of theta (0.45, 0.55; not 0.62, 1.0), and
    # d theta / d log theta = theta:  -(0.5 / 0.2) * 0.5 per such entry
    want = torch.tensor([-1.25, -1.25, 0.0])
    torch.testing.assert_close(sae.log_threshold.grad, want)


def test_l0_penalty_pushes_thresholds_up_and_warm_up_scales_it():
    sae = jump(width=16, d=8, jumprelu_init_threshold=0.1, jumprelu_bandwidth=1.0, jumprelu_param="log")
    x = torch.randn(64, 8)
    obj = make_objective(sae, l0_coeff=0.1)
    out = obj(sae, x, sparsity_scale=0.0)
    assert float(out.extras["l0_penalty"]) == 0.0 and torch.equal(out.loss.detach(), out.mse)
    assert float(out.extras["threshold_mean"]) == pytest.approx(0.1)
    full = obj(sae, x, sparsity_scale=1.0)
    var_x = float(x.var(0, unbiased=False).mean())
    assert float(full.extras["l0_penalty"]) == pytest.approx(0.1 * var_x * float(full.l0), rel=1e-5)
    # the L0 term alone: its gradient raises every threshold and never reaches the encoder
    _, _, aux = sae(x)
    HeavisideStep.apply(aux["pre_BS"], sae.jumprelu_threshold(), 1.0).sum(1).mean().backward()
    assert bool((sae.log_threshold.grad <= 0).all()) and float(sae.log_threshold.grad.sum()) < 0
    assert sae.W_enc.grad is None and sae.b_enc.grad is None
    with pytest.raises(ConfigError, match="jumprelu SAE needs l0_coeff"):
        make_objective(sae)
    with pytest.raises(ConfigError, match="only used by jumprelu"):
        make_objective(SAE(SAEConfig(d_vit=8, width=16, activation="topk", k=2)), l0_coeff=0.1)


def test_preact_penalty_raises_pre_activations_of_latents_below_threshold():
    sae = jump(width=16, d=8, jumprelu_init_threshold=5.0, jumprelu_param="log")  # nothing fires
    x = torch.randn(64, 8)
    out = make_objective(sae, l0_coeff=0.0, preact_coeff=1.0)(sae, x)
    assert float(out.l0) == 0.0 and float(out.extras["preact"]) > 0
    out.loss.backward()
    assert float(sae.b_enc.grad.max()) < 0  # gradient descent raises every pre-activation
    assert float(sae.log_threshold.grad.min()) > 0  # ... and lowers every threshold


def test_auxk_reaches_only_latents_quiet_for_aux_tokens_and_leaves_the_forward_alone():
    sae = jump(width=16, d=8)
    x = torch.randn(256, 8)
    sae.init_jumprelu_(x)
    with torch.no_grad():
        sae.threshold_rel[:8] = 1e-4  # latents 0-7 fire on about half the batch, 8-15 on none
        sae.threshold_rel[8:] = 10.0
    obj = make_objective(sae, l0_coeff=0.0, aux_tokens=512)
    first = obj(sae, x)  # 256 quiet tokens: not yet in the AuxK term
    assert float(first.aux) == 0.0
    out = obj(sae, x)  # 512: now they are
    fired_S = (sae(x)[1] != 0).any(0)
    assert bool(fired_S[:8].all()) and not bool(fired_S[8:].any())
    assert 0 < float(out.aux) <= 1.5  # a normalised MSE of the residual
    lagged = make_objective(sae, l0_coeff=0.0, aux_tokens=512)
    lagged.stats.lag_host_reads = True  # as on CUDA: the quiet count read a step late, without waiting
    assert [float(lagged(sae, x).aux) for _ in range(3)] == [0.0, 0.0, pytest.approx(float(out.aux), rel=1e-6)]
    out.loss.backward()
    assert float(sae.W_enc.grad[:, 8:].abs().sum()) > 0 and float(sae.W_dec.grad[8:].abs().sum()) > 0
    # the firing latents get the reconstruction's gradient only, and the loss is the MSE plus the term
    ref = jump(width=16, d=8)
    ref.load_state_dict(sae.state_dict())
    ref._jr_ready = True
    mse_only = make_objective(ref, l0_coeff=0.0, aux_coeff=0.0)(ref, x)
    mse_only.loss.backward()
    torch.testing.assert_close(sae.b_enc.grad[:8], ref.b_enc.grad[:8])
    assert float(ref.b_enc.grad[8:].abs().sum()) == 0.0  # without the term the quiet latents get nothing
    var_x = float((x - x.mean(0)).pow(2).mean())
    assert float(out.loss.detach()) == pytest.approx(float(mse_only.loss.detach()) + var_x * float(out.aux), rel=1e-5)


def test_checkpoint_without_the_auxk_state_is_refused_in_one_line_and_kept(cache, tmp_path, monkeypatch):
    # a checkpoint written before the AuxK term (and its window) existed is not continued with it
    from actcache.sae.objectives import Objective

    (run,) = expand_train_section({**TRAIN, "steps": 20}, "t.yaml")
    monkeypatch.setattr(Objective, "state_dict", lambda self: {"stats": self.stats.state_dict()})
    with pytest.raises(Preempted):
        train_group(cache, [run], tmp_path, device="cpu", stop=stop_after(10))
    monkeypatch.undo()
    with pytest.raises(TrainError, match=r"before AuxK's window .* delete .*checkpoints to train the SAE again") as err:
        train_group(cache, [run], tmp_path, device="cpu")
    assert "\n" not in str(err.value)
    d = run_dir(tmp_path, os.path.basename(cache), run)
    assert os.listdir(os.path.join(d, "checkpoints")) == ["step-00000010"]


RECIPE_INIT = 0.5  # the recovery recipe's initial threshold (also scripts/check_recovery.py)


def test_jumprelu_recovers_dictionary_and_learns_its_thresholds():
    torch.manual_seed(0)
    dirs, x = synthetic(32768)
    # A threshold below most pre-activations at the start: latents that begin above it get MSE
    # gradients and stay alive, where a high initial threshold leaves many that never fire.
    sae = jump(width=2 * N_TRUE, d=D, jumprelu_init_threshold=RECIPE_INIT, jumprelu_bandwidth=1.0)
    sae.init_b_dec(x[:2048])
    obj = make_objective(sae, l0_coeff=1e-2, dead_tokens_threshold=100_000)
    opt = make_optimizer(sae, 1e-2)
    steps = 1000
    sched = LRSchedule(lr=1e-2, warmup_steps=50, total_steps=steps, decay="linear", final_frac=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        sched.apply(opt, step)
        x_BD = x[torch.randint(0, x.shape[0], (512,), generator=g)]
        out = train_step(sae, obj, opt, x_BD, sparsity_scale=sparsity_warmup(step, 200))
    score = recovery(sae, dirs)
    theta_S = sae.jumprelu_threshold().detach()
    print(f"jumprelu recovery {score:.4f} nmse {float(out.nmse):.3f} l0 {float(out.l0):.1f} "
          f"theta mean {float(theta_S.mean()):.3f} sd {float(theta_S.std()):.3f}")  # fmt: skip
    assert score >= 0.9
    assert K_TRUE / 2 <= float(out.l0) <= 2 * K_TRUE
    # the thresholds moved away from their initial value, each its own way
    assert float((theta_S - RECIPE_INIT).abs().mean()) > 0.02 and float(theta_S.std()) > 0.01
    sae.eval()  # inference needs nothing but the weights: the same gate
    with torch.no_grad():
        f_NS = sae.encode(x[:16384])
    assert float((f_NS[:4096] != 0).sum(1).float().mean()) == pytest.approx(float(out.l0), rel=0.3)
    n_dead = int((f_NS == 0).all(0).sum())  # never fire on the sample, as eval.json counts them
    print(f"jumprelu dead latents {n_dead} of {sae.cfg.width}")
    assert n_dead <= 0.1 * sae.cfg.width


# ---- through `train_group`: a sweep in one pass, metrics, eval, resume --------------------------

TRAIN = {"batch_size": 128, "steps": 40, "width": 128, "log_every": 10, "ckpt_every": 10, "eval_frac": 0.1,
         "dead_tokens": 500, "lr": 3e-2, "warmup_steps": 5, "lr_decay": "linear", "activation": "jumprelu",
         "l0_coeff": 1e-2, "l0_warmup_steps": 10, "preact_coeff": 1e-4}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path, _ = dictionary_cache(tmp_path_factory.mktemp("jumprelu") / "cache", n_imgs=200, imgs_per_shard=64)
    return path


def test_l0_falls_monotonically_across_an_l0_coeff_sweep_trained_in_one_pass(cache, tmp_path):
    train = {**TRAIN, "steps": 150, "ckpt_every": 1000, "log_every": 50, "preact_coeff": 0.0,
             "sweep": {"l0_coeff": [1e-3, 4e-3, 1.6e-2, 6.4e-2]}}  # fmt: skip
    runs = expand_train_section(train, "t.yaml")
    assert len({r.group_id for r in runs}) == 1
    dirs = train_group(cache, runs, tmp_path, device="cpu")
    l0s = []
    for d in dirs:
        ev = json.load(open(os.path.join(d, "eval.json")))
        lines = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        assert {"l0_penalty", "preact", "threshold_mean"} <= set(lines[-1])
        assert lines[-1]["threshold_mean"] != pytest.approx(1.0)
        l0s.append(ev["l0"])
    print("held-out l0 by l0_coeff:", l0s)
    assert all(a > b for a, b in zip(l0s, l0s[1:], strict=False)), l0s


def test_l0_warm_up_ramps_the_penalty(cache, tmp_path):
    (run,) = expand_train_section({**TRAIN, "steps": 20, "log_every": 1, "l0_warmup_steps": 10}, "t.yaml")
    assert run.sparsity_warmup_steps == 10
    (d,) = train_group(cache, [run], tmp_path, device="cpu")
    pen = [json.loads(x)["l0_penalty"] for x in open(os.path.join(d, "metrics.jsonl"))]
    assert pen[0] == 0.0 and all(p > 0 for p in pen[1:])  # step 0: scale 0; then rising to full


def test_save_load_keeps_the_thresholds(tmp_path):
    sae = jump(width=16, d=8, jumprelu_init_threshold=0.3, jumprelu_bandwidth=0.1)
    sae.init_jumprelu_(torch.randn(32, 8))
    with torch.no_grad():
        sae.threshold_rel.add_(0.01 * torch.randn(16))
    sae.save(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["activation"] == "jumprelu" and cfg["jumprelu_bandwidth"] == 0.1 and "matryoshka_prefixes" not in cfg
    assert cfg["jumprelu_param"] == "direct"
    loaded = SAE.load(tmp_path / "s")
    assert torch.equal(loaded.jumprelu_threshold(), sae.jumprelu_threshold()) and loaded.cfg == sae.cfg
    x = torch.randn(32, 8)
    assert torch.equal(loaded.eval().encode(x), sae.eval().encode(x))
    topk = SAE(SAEConfig(d_vit=8, width=16, activation="topk", k=2))
    assert not {"log_threshold", "threshold_rel"} & set(topk.state_dict())  # other SAEs keep their tensors
    assert "jumprelu_bandwidth" not in topk.cfg.to_dict() and "jumprelu_param" not in topk.cfg.to_dict()


def test_sae_saved_with_log_thresholds_loads_as_written(tmp_path):
    # an SAE saved before the direct threshold: config.json has no jumprelu_param, tensors log theta
    old = jump(width=16, d=8, jumprelu_init_threshold=0.3, jumprelu_bandwidth=0.1, jumprelu_param="log")
    with torch.no_grad():
        old.log_threshold.add_(0.1 * torch.randn(16))
    old.save(tmp_path / "s")
    cfg_path = tmp_path / "s" / "config.json"
    doc = json.loads(cfg_path.read_text())
    del doc["jumprelu_param"]
    cfg_path.write_text(json.dumps(doc))
    loaded = SAE.load(tmp_path / "s")
    assert loaded.cfg.jumprelu_param == "log"
    assert torch.equal(loaded.jumprelu_threshold(), old.jumprelu_threshold())
    x = torch.randn(32, 8)
    assert torch.equal(loaded.eval().encode(x), old.eval().encode(x))


def test_preempted_jumprelu_group_resumes_to_identical_weights(cache, tmp_path):
    runs = expand_train_section({**TRAIN, "sweep": {"l0_coeff": [3e-3, 1e-2]}}, "t.yaml")
    train_group(cache, runs, tmp_path / "ref", device="cpu")
    want = collect(cache, runs, tmp_path / "ref")
    with pytest.raises(Preempted):
        train_group(cache, runs, tmp_path / "cut", device="cpu", stop=stop_after(25))
    train_group(cache, runs, tmp_path / "cut", device="cpu")
    got = collect(cache, runs, tmp_path / "cut")
    assert_same(got, want)
    for r in runs:  # the objective's own metrics too
        lines = [open(os.path.join(run_dir(p, os.path.basename(cache), r), "metrics.jsonl")).read()
                 for p in (tmp_path / "ref", tmp_path / "cut")]  # fmt: skip
        assert [
            {k: v for k, v in json.loads(x).items() if k in ("l0_penalty", "preact", "threshold_mean")}
            for x in lines[0].splitlines()
        ] == [  # fmt: skip
            {k: v for k, v in json.loads(x).items() if k in ("l0_penalty", "preact", "threshold_mean")}
            for x in lines[1].splitlines()
        ]


def test_checkpoint_with_log_thresholds_is_refused_in_one_line_and_kept(cache, tmp_path, monkeypatch):
    # a checkpoint written by the log-theta recipe (as before the direct threshold) is not resumed
    # with the direct one: one clear line naming the fix, and the checkpoint stays where it is
    (run,) = expand_train_section({**TRAIN, "steps": 20}, "t.yaml")
    direct = RunConfig.sae_config
    monkeypatch.setattr(RunConfig, "sae_config", lambda self, d: dataclasses.replace(direct(self, d), jumprelu_param="log"))
    with pytest.raises(Preempted):
        train_group(cache, [run], tmp_path, device="cpu", stop=stop_after(10))
    monkeypatch.setattr(RunConfig, "sae_config", direct)
    with pytest.raises(TrainError, match=r"log theta .* delete .*checkpoints to train the SAE again") as err:
        train_group(cache, [run], tmp_path, device="cpu")
    assert "\n" not in str(err.value)
    d = run_dir(tmp_path, os.path.basename(cache), run)
    assert os.listdir(os.path.join(d, "checkpoints")) == ["step-00000010"]


# ---- keys and ids ---------------------------------------------------------------------------------


def test_existing_sae_ids_do_not_change():
    # computed on the code before the jumprelu/matryoshka keys existed
    train = {"steps": 100, "batch_size": 256, "layer": -2,
             "saes": [{"activation": "topk", "k": 16, "width": 512},
                      {"activation": "relu", "width": 512, "l1_coeff": 1e-3, "l1_warmup_steps": 5},
                      {"activation": "batchtopk", "k": 8, "exp_factor": 4}]}  # fmt: skip
    runs = expand_train_section(train, "x.yaml")
    assert [r.sae_id for r in runs] == ["b4c63eb724ee", "f2d2c0b64c91", "18cab986588d"]
    assert {r.group_id for r in runs} == {"L-2-image-d5e49d00"}
    assert (RunConfig().sae_id, RunConfig().group_id) == ("fd273e09c2f9", "Lauto-image-6cde478e")
    (a,) = expand_train_section({"steps": 10, "activation": "jumprelu", "l0_coeff": 1e-3}, "x.yaml")
    (b,) = expand_train_section({"steps": 10, "activation": "jumprelu", "l0_coeff": 1e-3, "jumprelu_bandwidth": 0.5},
                                "x.yaml")  # fmt: skip
    assert a.sae_id != b.sae_id and a.group_id == b.group_id  # per-SAE keys: one loader pass
    assert a.sae_id == "91dfa10cac71"  # the id the default was issued with
    # the former defaults (1.0), written out, now train differently from the default (scaled from
    # the data): they must not share its id, or two SAEs of one sweep would share a run folder
    (c,) = expand_train_section({"steps": 10, "activation": "jumprelu", "l0_coeff": 1e-3, "jumprelu_bandwidth": 1.0,
                                 "jumprelu_init_threshold": 1.0}, "x.yaml")  # fmt: skip
    assert c.sae_id != a.sae_id


@pytest.mark.parametrize(
    "train, match",
    [
        ({"activation": "jumprelu"}, r"x\.yaml: train: activation jumprelu needs 'l0_coeff'"),
        ({"activation": "jumprelu", "l0_coeff": 1e-3, "k": 4}, r"key 'k' is only for activation .*not jumprelu"),
        ({"activation": "topk", "l0_coeff": 1e-3}, r"key 'l0_coeff' is only for activation jumprelu, not topk"),
        ({"activation": "relu", "l1_coeff": 1e-3, "preact_coeff": 1.0}, r"key 'preact_coeff' is only for .*jumprelu"),
        ({"activation": "jumprelu", "l0_coeff": -1.0}, r"key 'l0_coeff' must be in \[0, 10000\]"),
        ({"activation": "jumprelu", "l0_coeff": 1e-3, "jumprelu_bandwidth": 0}, r"'jumprelu_bandwidth' must be > 0"),
        ({"activation": "jumprelu", "l0_coeff": 1e-3, "l0_warmup_steps": -1}, r"'l0_warmup_steps' must be >= 0"),
    ],
)
def test_bad_jumprelu_keys_name_file_and_key(train, match):
    with pytest.raises(ConfigError, match=match):
        expand_train_section({"steps": 10, **train}, "x.yaml")


def test_init_threshold_is_the_configured_value():
    sae = jump(width=4, jumprelu_init_threshold=0.25, jumprelu_bandwidth=0.5)
    with pytest.raises(TrainError, match="no threshold yet"):
        sae.jumprelu_threshold()
    sae.init_jumprelu_(torch.randn(16, 4))
    assert torch.allclose(sae.jumprelu_threshold(), torch.full((4,), 0.25))
    assert float(sae.bandwidth) == 0.5
    legacy = jump(width=4, jumprelu_init_threshold=0.25, jumprelu_param="log")
    assert math.isclose(float(legacy.log_threshold.detach()[0]), math.log(0.25), rel_tol=1e-6)


def test_threshold_and_bandwidth_default_to_the_data_scale():
    # null keys: the first train-mode batch sets both relative to its RMS pre-activation, so a
    # rescaled input gives the same gates (scale-free init)
    x = torch.randn(64, 8)
    saes = [jump(width=16, d=8, seed=3) for _ in range(2)]
    codes = []
    for sae, c in zip(saes, (1.0, 1000.0), strict=True):
        f_BS = sae.train()(x * c)[1]
        rms = float(sae.pre_acts(x * c).detach().pow(2).mean().sqrt())
        assert float(sae.jumprelu_threshold()[0]) == pytest.approx(JUMPRELU_INIT_REL * rms, rel=1e-5)
        assert float(sae.bandwidth) == pytest.approx(JUMPRELU_BANDWIDTH_REL * rms, rel=1e-5)
        codes.append(f_BS != 0)
    assert torch.equal(codes[0], codes[1]) and 0 < float(codes[0].float().mean()) < 1
    free = jump(width=16, d=8, normalize_decoder=False)  # decoder rows free: they start at norm 0.1, encoder tied
    torch.testing.assert_close(free.W_dec.norm(dim=1), torch.full((16,), 0.1))
    assert torch.equal(free.W_enc, free.W_dec.T)


def test_l0_coeff_moves_l0_monotonically_over_two_decades():
    # tests/test_sae_modeling.py's dictionary, default init: L0 falls as l0_coeff rises 1e-3 -> 1e-1
    torch.manual_seed(0)
    _, x = synthetic(8192)
    l0s = []
    for coeff in (1e-3, 1e-2, 1e-1):
        sae = jump(width=N_TRUE, d=D)
        sae.init_b_dec(x[:2048])
        obj, opt = make_objective(sae, l0_coeff=coeff), make_optimizer(sae, 2e-3)
        g = torch.Generator().manual_seed(1)
        for _ in range(100):
            train_step(sae, obj, opt, x[torch.randint(0, x.shape[0], (256,), generator=g)], max_grad_norm=1.0)
        with torch.no_grad():
            l0s.append(float((sae.eval().encode(x[-2048:]) != 0).sum(1).float().mean()))
    print("held-out l0 by l0_coeff 1e-3, 1e-2, 1e-1:", l0s)
    assert l0s[0] > l0s[1] > l0s[2] > 0 and l0s[0] > 4 * l0s[2], l0s
