"""`actcache train`: SAEs trained through the real loader on a real cache recover a known sparse
dictionary; sweeps expand into groups with stable ids; metrics, checkpoints, eval and done files;
bad input fails with a clear error.

Recovery data: N_TRUE unit directions in d=D, each example a non-negative mix of K_TRUE of them
(coefficients uniform in [0.5, 1.5]), written as a cache through ``writer.write_cache`` (16 patch
tokens + a CLS token per image). The issue suggests 1024 directions in d=128; at that size one
SAE needs several minutes on 2 shared CPU cores, so the test uses 256 directions in d=64 with a
2x over-complete SAE (the same ratios as tests/test_sae_modeling.py, which trains in memory);
scripts/check_recovery.py runs the full size and records it in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import yaml

from actcache import cli
from actcache.errors import ConfigError, TrainError
from actcache.rundir import done_paths, run_dir
from actcache.sae.config import FIELDS, RunConfig, expand_train_section, groups
from actcache.sae.modeling import SAE
from actcache.sae.train import train_group
from actcache.writer import synthetic_metadata, write_cache

N_TRUE, D, K_TRUE, N_PATCHES = 256, 64, 8, 16


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


# ---- helpers shared with the other test_sae_* modules ------------------------------------------


def true_dictionary(seed: int = 0, n_true: int = N_TRUE, d: int = D) -> np.ndarray:
    rng = np.random.default_rng([seed, 1])
    dirs = rng.standard_normal((n_true, d))
    return (dirs / np.linalg.norm(dirs, axis=1, keepdims=True)).astype(np.float32)


def dictionary_fill(dirs: np.ndarray, n_tokens: int, n_layers: int = 1, k: int = K_TRUE, seed: int = 0):
    """fill(start, end) for write_cache: image i's tokens depend only on (seed, i)."""
    n_true, d = dirs.shape

    def fill(start: int, end: int) -> np.ndarray:
        out = np.empty((end - start, n_layers, n_tokens, d), np.float32)
        for j, i in enumerate(range(start, end)):
            rng = np.random.default_rng([seed, i])
            m = n_layers * n_tokens
            idx = np.argsort(rng.random((m, n_true)), axis=1)[:, :k]
            coef = rng.uniform(0.5, 1.5, (m, k)).astype(np.float32)
            out[j] = np.einsum("mk,mkd->md", coef, dirs[idx]).reshape(n_layers, n_tokens, d)
        return out

    return fill


def dictionary_cache(root, n_imgs: int = 2048, layers=(-2,), d: int = D, seed: int = 0, imgs_per_shard: int = 512,
                     metadata=None):  # fmt: skip
    """A real cache of dictionary activations; returns (cache dir, true directions)."""
    dirs = true_dictionary(seed, d=d)
    md = metadata or synthetic_metadata(
        n_imgs, layers=layers, n_patches_per_img=N_PATCHES, d_vit=d, seed=seed,
        max_patches_per_shard=imgs_per_shard * (N_PATCHES + 1) * len(layers),
    )  # fmt: skip
    path = write_cache(root, md, dictionary_fill(dirs, md.n_tokens_per_img, len(md.layers), seed=seed))
    return path, dirs


def recovery(sae: SAE, dirs: np.ndarray) -> float:
    """Mean over true directions of the best cosine similarity with a decoder row."""
    w = sae.W_dec.detach().double()
    w = w / w.norm(dim=1, keepdim=True)
    return float((torch.from_numpy(dirs).double() @ w.T).max(1).values.mean())


def write_experiment(tmp_path, train: dict, n_imgs: int = 2048, d: int = D, layers=(-2,), name: str = "exp") -> str:
    """An experiment YAML whose 'model' is a config-only CLIP checkpoint (d, 3 blocks, 16 patches)."""
    ck = tmp_path / f"ckpt-{d}"
    if not ck.exists():
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps({
            "model_type": "clip_vision_model", "hidden_size": d, "num_hidden_layers": 3, "num_attention_heads": 2,
            "intermediate_size": d, "image_size": 32, "patch_size": 8, "num_channels": 3,
        }))  # fmt: skip
        (ck / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 32, "width": 32},
            "size": {"shortest_edge": 32}, "do_center_crop": True, "do_resize": True, "do_normalize": True,
            "do_rescale": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
        }))  # fmt: skip
    doc = {"name": name, "vit": {"family": "clip", "ckpt": str(ck), "layers": list(layers)},
           "data": {"kind": "synthetic", "n_imgs": n_imgs}, "train": train}  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def experiment_cache(exp_path: str, dump_to, seed: int = 0):
    """Write the experiment's cache (its real metadata and hash) with dictionary activations."""
    from actcache.config import load_experiment
    from actcache.plan import experiment_metadata

    md = experiment_metadata(load_experiment(exp_path))
    return dictionary_cache(dump_to, metadata=md, seed=seed)


def train_cli(*argv: str) -> int:
    return cli.main(["train", *argv])


# ---- dictionary recovery through `actcache train` ----------------------------------------------

RECOVERY = {
    # activation: (train section, threshold); batch 1024, lr 1e-2 warming up over 50 steps, then a
    # linear decay to 10%. The in-memory sweep behind these (same data): topk 400 steps -> 0.99,
    # batchtopk 400 -> 0.95, relu 800 -> 0.93.
    "topk": ({"activation": "topk", "k": K_TRUE, "steps": 400}, 0.9),
    "batchtopk": ({"activation": "batchtopk", "k": K_TRUE, "steps": 400}, 0.9),
    # ReLU + L1 leaves its dense phase later: twice the steps, a higher lr and an L1 warm-up.
    "relu": ({"activation": "relu", "l1_coeff": 5e-3, "lr": 3e-2, "l1_warmup_steps": 100, "steps": 800}, 0.9),
}


@pytest.fixture(scope="module")
def recovery_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recovery")
    base = {"batch_size": 1024, "width": 2 * N_TRUE, "lr": 1e-2, "warmup_steps": 50, "lr_decay": "linear",
            "final_lr_frac": 0.1, "log_every": 100, "ckpt_every": 500, "eval_frac": 0.05,
            "dead_tokens": 200_000}  # fmt: skip
    exps = {}
    for act, (extra, _) in RECOVERY.items():
        exps[act] = write_experiment(tmp, {**base, **extra}, name=f"rec-{act}")
    path, dirs = experiment_cache(exps["topk"], tmp / "cache")
    return tmp, exps, path, dirs


@pytest.mark.parametrize("activation", list(RECOVERY))
def test_train_recovers_the_true_dictionary(recovery_setup, activation):
    tmp, exps, cache_path, dirs = recovery_setup
    exp = exps[activation]
    assert train_cli("--experiment", exp, "--dump-to", str(tmp / "cache"), "--runs-to", str(tmp / "runs"),
                     "--device", "cpu") == 0  # fmt: skip
    from actcache.config import load_experiment

    (run,) = expand_train_section(load_experiment(exp).train, exp)
    d = run_dir(tmp / "runs", os.path.basename(cache_path), run)
    sae = SAE.load(d)
    score = recovery(sae, dirs)
    with open(os.path.join(d, "eval.json")) as fh:
        ev = json.load(fh)
    print(f"{activation}: recovery {score:.4f}, held-out nmse {ev['nmse']:.3f} l0 {ev['l0']:.1f}")
    assert score >= RECOVERY[activation][1]
    # held-out evaluation: a random 5% of images, never trained on
    assert ev["n_heldout_images"] == 102 and ev["n_tokens"] == 102 * N_PATCHES
    assert ev["nmse"] < 0.35
    if activation == "topk":
        assert ev["l0"] == K_TRUE
    elif activation == "batchtopk":
        assert K_TRUE / 2 <= ev["l0"] <= 2 * K_TRUE  # the learned threshold, no batch needed


# ---- outputs --------------------------------------------------------------------------------------


@pytest.fixture
def small_cache(tmp_path):
    path, dirs = dictionary_cache(tmp_path / "cache", n_imgs=200, imgs_per_shard=64)
    return path, dirs


def small_runs(**kw) -> list[RunConfig]:
    train = {"batch_size": 128, "steps": 30, "width": 128, "k": 4, "log_every": 10, "ckpt_every": 20,
             "eval_frac": 0.1, "dead_tokens": 1000, **kw}  # fmt: skip
    return expand_train_section(train, "test.yaml")


def test_one_pass_trains_a_sweep_and_writes_every_output(small_cache, tmp_path):
    path, _ = small_cache
    runs = small_runs(sweep={"k": [2, 4], "lr": [1e-3, 3e-3]})
    assert len(runs) == 4 and len(groups(runs)) == 1
    dirs = train_group(path, runs, tmp_path / "runs", device="cpu")
    h = os.path.basename(path)
    assert dirs == [run_dir(tmp_path / "runs", h, r) for r in runs]
    for r, d in zip(runs, dirs, strict=True):
        assert sorted(os.listdir(d)) == ["checkpoints", "config.json", "done.json", "eval.json", "metrics.jsonl",
                                         "run.json", "sae.safetensors", "train.lock"]  # fmt: skip
        lines = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        assert [x["step"] for x in lines] == [10, 20, 30]
        for key in ("mse", "nmse", "l0", "l1", "n_dead", "n_dense", "wait_s", "wait_frac", "lr", "steps_per_s"):
            assert key in lines[-1], key
        assert lines[-1]["l0"] == r.k
        ckpts = sorted(os.listdir(os.path.join(d, "checkpoints")))
        assert ckpts == ["step-00000020", "step-00000030"]  # the newest keep_checkpoints (2)
        pos = json.load(open(os.path.join(d, "checkpoints", "step-00000030", "position.json")))
        assert pos["step"] == 30 and set(pos["loader"]) == {"epoch", "batch"}
        ev = json.load(open(os.path.join(d, "eval.json")))
        assert ev["n_heldout_images"] == 20 and ev["n_tokens"] == 20 * N_PATCHES and ev["width"] == 128
        assert sum(ev["freq_hist"]["counts"]) + ev["freq_hist"]["n_never"] == 128
        assert ev["n_dead"] == ev["freq_hist"]["n_never"]
        done = json.load(open(os.path.join(d, "done.json")))
        assert done["sae_id"] == r.sae_id and done["steps"] == 30
        meta = json.load(open(os.path.join(d, "run.json")))
        assert meta["run"] == r.to_dict() and meta["cache_hash"] == h and meta["layer"] == -2
    # the documented group output
    assert all(os.path.exists(p) for p in done_paths(tmp_path / "runs", h, runs))
    # one loader pass fed all four: the same loader wait and timing on every SAE's lines
    waits = [[json.loads(x)["wait_s"] for x in open(os.path.join(d, "metrics.jsonl"))] for d in dirs]
    assert all(w == waits[0] for w in waits)


def test_changed_hyperparameter_gets_a_new_id_and_leaves_other_runs_alone(small_cache, tmp_path):
    path, _ = small_cache
    (a,) = small_runs()
    train_group(path, [a], tmp_path / "runs", device="cpu")
    d_a = run_dir(tmp_path / "runs", os.path.basename(path), a)
    before = {f: os.stat(os.path.join(d_a, f)).st_mtime_ns for f in ("sae.safetensors", "done.json", "metrics.jsonl")}
    (b,) = small_runs(lr=1e-3)
    assert b.sae_id != a.sae_id and b.group_id == a.group_id
    (c,) = small_runs(log_every=5)  # logistics do not change the weights: same SAE id
    assert c.sae_id == a.sae_id
    train_group(path, [a, b], tmp_path / "runs", device="cpu")  # a is done: skipped, untouched
    after = {f: os.stat(os.path.join(d_a, f)).st_mtime_ns for f in before}
    assert after == before
    assert os.path.exists(os.path.join(run_dir(tmp_path / "runs", os.path.basename(path), b), "done.json"))


def test_loader_io_keys_reach_the_loaders_and_change_neither_weights_nor_ids(small_cache, tmp_path, monkeypatch):
    from actcache.loaders import OrderedLoader, ShuffledLoader

    path, _ = small_cache
    (a,) = small_runs(steps=10)
    (b,) = small_runs(steps=10, n_readers=1, cold_read="fault", batch_timeout_s="1e3", prefetch="heads")
    assert (b.n_readers, b.cold_read, b.batch_timeout_s, b.prefetch) == (1, "fault", 1000.0, "heads")
    assert b.sae_id == a.sae_id  # how batches are read is not what they are
    assert b.group_id == a.group_id  # nor which group: editing them reruns no job (config.groups
    # refuses one group whose members disagree on them: one loader per group)
    # ids issued before these keys existed are unchanged while the keys keep their defaults
    # (values computed at 3787731, the commit before they were added)
    (c,) = small_runs(steps=10, n_readers=None, cold_read="read", batch_timeout_s=30, prefetch="auto")
    assert (c.sae_id, c.group_id) == (a.sae_id, a.group_id)
    old = RunConfig(layer=-2, batch_size=256, steps=10, data_seed=3)
    assert (old.sae_id, old.group_id) == ("20212b9625f0", "L-2-image-2c089e81")
    assert (RunConfig().sae_id, RunConfig().group_id) == ("fd273e09c2f9", "Lauto-image-6cde478e")

    seen = []
    for cls in (OrderedLoader, ShuffledLoader):
        real = cls.__init__

        def spy(self, *args, _real=real, **kw):
            keys = ("n_readers", "cold_read", "batch_timeout_s", "prefetch")
            seen.append((type(self).__name__, {k: kw.get(k) for k in keys}))
            _real(self, *args, **kw)

        monkeypatch.setattr(cls, "__init__", spy)
    (d_a,) = train_group(path, [a], tmp_path / "a", device="cpu")
    (d_b,) = train_group(path, [b], tmp_path / "b", device="cpu")
    want = {"n_readers": 1, "cold_read": "fault", "batch_timeout_s": 1000.0, "prefetch": "heads"}
    assert ("ShuffledLoader", want) in seen
    # the held-out images are read directly (actcache.sae.split.HeldoutBatches), not by a loader
    assert [name for name, _ in seen] == ["ShuffledLoader", "ShuffledLoader"]
    wa, wb = SAE.load(d_a).state_dict(), SAE.load(d_b).state_dict()
    assert wa.keys() == wb.keys()
    for k in wa:  # bitwise (topk's unused threshold is NaN)
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_sweep_grid_groups_and_stable_ids():
    train = {
        "steps": 100, "batch_size": 256, "layer": -2,
        "sweep": {"lr": [1e-4, "3e-4"]},  # YAML reads 3e-4 as a string: accepted
        "saes": [
            {"activation": "topk", "k": 16, "width": 512},
            {"activation": "relu", "width": 512, "sweep": {"l1_coeff": [1e-3, 1e-2]}},
            {"activation": "topk", "k": 16, "width": 512, "layer": -1},
            {"activation": "topk", "k": 16, "width": 512, "batch_size": 512},
        ],
    }  # fmt: skip
    runs = expand_train_section(train, "x.yaml", layers=(-2, -1))
    assert len(runs) == 2 + 4 + 2 + 2
    assert [r.lr for r in runs[:2]] == [1e-4, 3e-4]
    g = groups(runs)
    assert [len(v) for v in g.values()] == [6, 2, 2]  # topk+relu share a stream; new layer / batch size: apart
    assert list(g)[1].startswith("L-1-image-")
    again = expand_train_section(yaml.safe_load(yaml.safe_dump(train)), "other.yaml", layers=(-2, -1))
    assert [r.sae_id for r in again] == [r.sae_id for r in runs]  # stable across processes and files
    assert list(groups(again)) == list(g)
    assert len({r.sae_id for r in runs}) == len(runs)
    assert RunConfig.from_dict(runs[3].to_dict()) == runs[3]
    # a sweep overrides a section default
    assert [r.k for r in expand_train_section({"steps": 1, "k": 4, "sweep": {"k": [1, 2]}}, "x.yaml")] == [1, 2]
    # n_tokens is sugar for steps
    (r,) = expand_train_section({"n_tokens": 1000, "batch_size": 256, "layer": -2}, "x.yaml")
    assert r.steps == 4


def test_group_flag_trains_one_group(tmp_path):
    train = {"batch_size": 128, "steps": 10, "width": 128, "k": 4, "eval_frac": 0.1, "log_every": 5,
             "saes": [{"layer": -2}, {"layer": -1}]}  # fmt: skip
    exp = write_experiment(tmp_path, train, n_imgs=100, layers=(-2, -1))
    path, _ = experiment_cache(exp, tmp_path / "cache")
    runs = expand_train_section(yaml.safe_load(open(exp))["train"], exp)
    gids = list(groups(runs))
    assert len(gids) == 2
    args = ["--experiment", exp, "--dump-to", str(tmp_path / "cache"), "--runs-to", str(tmp_path / "runs")]
    assert train_cli(*args, "--group", gids[1]) == 0
    done = [os.path.exists(p) for p in done_paths(tmp_path / "runs", os.path.basename(path), runs)]
    assert done == [False, True]
    assert train_cli(*args, "--group", "nope") == 2


def test_eval_on_a_separate_cache(small_cache, tmp_path):
    path, _ = small_cache
    other, _ = dictionary_cache(tmp_path / "other", n_imgs=40, imgs_per_shard=64, seed=1)
    (run,) = small_runs(eval_cache=other, steps=10)
    (d,) = train_group(path, [run], tmp_path / "runs", device="cpu")
    with open(os.path.join(d, "eval.json")) as fh:
        ev = json.load(fh)
    assert ev["cache"] == os.path.abspath(other) and ev["n_tokens"] == 40 * N_PATCHES
    assert ev["dead_window_tokens"] == (40 + 200) * N_PATCHES  # and the whole training cache, under 1M tokens
    assert json.load(open(os.path.join(d, "run.json")))["train_images"] == 200  # nothing held out


def test_wandb_is_optional_and_gets_every_metric(small_cache, tmp_path, monkeypatch):
    import sys
    import types

    path, _ = small_cache
    calls = {"init": [], "log": []}

    class FakeRun:
        def log(self, data, step):
            calls["log"].append((step, data))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls["init"].append(kw) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    runs = small_runs(wandb_project="sae-sweep", sweep={"k": [2, 4]})
    assert runs[0].sae_id == small_runs(sweep={"k": [2, 4]})[0].sae_id  # logging settings are not identity
    train_group(path, runs, tmp_path / "runs", device="cpu")
    assert len(calls["init"]) == 1 and calls["init"][0]["project"] == "sae-sweep"
    assert [s for s, _ in calls["log"]] == [10, 20, 30]
    assert {f"{runs[1].sae_id}/nmse", f"{runs[0].sae_id}/wait_frac"} <= set(calls["log"][-1][1])
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: training goes on without it
    train_group(path, small_runs(wandb_project="x", steps=10), tmp_path / "runs2", device="cpu")


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "train, match",
    [
        ({"steps": 10, "learning_rate": 1e-3}, r"x\.yaml: train: unknown key 'learning_rate'"),
        ({"steps": 10, "lr": "fast"}, r"x\.yaml: train: key 'lr' must be float"),
        ({"steps": 10, "activation": "gelu"}, r"key 'activation' must be one of relu, topk, batchtopk"),
        ({"steps": 10, "width": 64, "k": 65}, r"key 'k' = 65 is larger than the width 64"),
        ({"steps": 10, "activation": "relu"}, r"activation relu needs 'l1_coeff'"),
        ({"steps": 10, "saes": [{"k": 4}, {"kk": 4}]}, r"x\.yaml: train\.saes\[1\]: unknown key 'kk'"),
        ({"steps": 10, "sweep": {"lr": 1e-3}}, r"train\.sweep: key 'lr' must be a non-empty list"),
        (
            {"steps": 10, "saes": [{"k": 4}], "sweep": {"k": [1, 2]}},
            r"saes\[0\]: key 'k' is set both here and in train\.sweep",
        ),
        ({"batch_size": 128}, r"give 'steps' or 'n_tokens'"),
        ({"steps": 10, "saes": [{"k": 4}, {"k": 4}]}, r"the same SAE as"),
        ({"steps": 10, "layer": 5}, r"key 'layer' = 5 is not one of the experiment's layers \[-2\]"),
        ({"steps": 10, "cold_read": "direct"}, r"x\.yaml: train: key 'cold_read' must be one of read, fault"),
        ({"steps": 10, "prefetch": "l2"}, r"x\.yaml: train: key 'prefetch' must be one of auto, whole, heads"),
        ({"steps": 10, "n_readers": 0}, r"key 'n_readers' must be >= 1"),
        ({"steps": 10, "batch_timeout_s": 0}, r"key 'batch_timeout_s' must be > 0 \(or null"),
    ],
)
def test_bad_train_section_names_file_and_key(train, match):
    with pytest.raises(ConfigError, match=match):
        expand_train_section(train, "x.yaml", layers=(-2,))


def test_every_documented_key_is_a_runconfig_field():
    names = {f for f in RunConfig.__dataclass_fields__}
    assert set(FIELDS) - {"n_tokens"} == names


def test_layer_not_in_cache(small_cache, tmp_path):
    path, _ = small_cache
    with pytest.raises(TrainError, match=r"layer -1 is not in the cache .* recorded layers: \[-2\]"):
        train_group(path, small_runs(layer=-1), tmp_path / "runs", device="cpu")


def test_k_larger_than_width_from_exp_factor(small_cache, tmp_path):
    path, _ = small_cache
    runs = small_runs(width=None, exp_factor=0.5, k=40)  # width 32 on this d=64 cache
    with pytest.raises(ConfigError, match=r"k must satisfy 1 <= k <= width, got k=40 with width=32"):
        train_group(path, runs, tmp_path / "runs", device="cpu")


def test_cli_reports_a_bad_activation_without_traceback(tmp_path, capsys):
    exp = write_experiment(tmp_path, {"steps": 10, "activation": "gelu"}, n_imgs=10)
    assert train_cli("--experiment", exp, "--dump-to", str(tmp_path), "--runs-to", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "exp.yaml: train: key 'activation' must be one of relu, topk, batchtopk" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_activation_is_reported_with_its_image(tmp_path, bad):
    md = synthetic_metadata(120, layers=(-2,), n_patches_per_img=N_PATCHES, d_vit=D,
                            max_patches_per_shard=40 * (N_PATCHES + 1))  # fmt: skip
    clean = dictionary_fill(true_dictionary(), md.n_tokens_per_img)

    def fill(start, end):
        out = clean(start, end)
        if start <= 77 < end:
            out[77 - start, 0, 1 + 5, 3] = bad  # image 77, patch 5 (token 6: CLS first)
        return out

    path = write_cache(tmp_path / "cache", md, fill)
    runs = small_runs(steps=50, eval_frac=0.0)
    with pytest.raises(TrainError, match=r"NaN or Inf at image_i=77, patch_i=5"):
        train_group(path, runs, tmp_path / "runs", device="cpu")
    assert not os.path.exists(os.path.join(run_dir(tmp_path / "runs", os.path.basename(path), runs[0]), "done.json"))


def test_group_log_names_each_sae_and_prints_its_own_metrics(small_cache, tmp_path, caplog):
    import logging

    path, _ = small_cache
    runs = small_runs(steps=4, log_every=4, saes=[{"activation": "topk", "k": 8},
                                      {"activation": "jumprelu", "k": None, "l0_coeff": 1e-3},
                                      {"activation": "matryoshka", "k": 4, "matryoshka_prefixes": [32, 128]}])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="actcache.sae.train"):
        train_group(path, runs, tmp_path / "runs", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "actcache.sae.train"]
    d = os.path.basename(path)
    for r in runs:
        last = json.loads(open(os.path.join(run_dir(tmp_path / "runs", d, r), "metrics.jsonl")).readlines()[-1])
        (mine,) = [ln for ln in lines if ln.startswith(f"  {r.sae_id} ") and "step" not in ln and
                   f"l0 {last['l0']:.1f}" in ln]  # fmt: skip
        assert f"width=128{' prefixes=32,128' * (r.activation == 'matryoshka')} layer auto: nmse {last['nmse']:.4f}" in mine
    assert any("jumprelu l0_coeff=0.001 width=128" in ln and "None" not in ln for ln in lines), lines
    assert any("matryoshka k=4 width=128 prefixes=32,128" in ln and "nmse_prefix_32 " in ln for ln in lines), lines
