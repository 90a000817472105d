"""export_saelens: SAELens folders (cfg.json, sae_weights.safetensors, README.md) for every objective,
read back by SAELens itself when it is installed (the ``saelens`` test extra) and always checked
against SAELens's documented format; push gives one clear error offline."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from actcache.cli import main as actcache_main
from actcache.errors import ActCacheError, ConfigError
from actcache.export import export_many, export_saelens, push
from actcache.sae.modeling import SAE
from actcache.sae.on_cache import train_on_cache
from saev_fixture import write_saev_cache

OBJECTIVES = {"relu": "standard", "topk": "topk", "batchtopk": "jumprelu", "jumprelu": "jumprelu", "matryoshka": "jumprelu"}
TRAIN = {"layer": 7, "batch_size": 16, "steps": 6, "eval_frac": 0.2, "b_dec_init": "mean", "buffer_bytes": 20000,
         "saes": [{"activation": "relu", "width": 12, "l1_coeff": 1.0e-3},
                  {"activation": "topk", "width": 12, "k": 3},
                  {"activation": "batchtopk", "width": 12, "k": 3, "scale_norm": True},
                  {"activation": "jumprelu", "width": 12, "l0_coeff": 1.0e-3, "jumprelu_init_threshold": 0.05},
                  {"activation": "matryoshka", "width": 12, "k": 3, "matryoshka_prefixes": [4, 12]}]}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cache, doc, _ = write_saev_cache(root / "c", n=20, E=6, layers=(3, 7), P=4, D=8)
    (root / "train.yaml").write_text(yaml.safe_dump({"train": TRAIN}))
    dirs = train_on_cache(cache, str(root / "train.yaml"), runs_to=str(root / "runs"))
    by_objective = {json.load(open(os.path.join(d, "run.json")))["run"]["activation"]: d for d in dirs}
    return by_objective, export_many(dirs, root / "out"), doc


def scale_of(out_dir: str, sae: SAE) -> float:
    """The scale folded into an export: W_dec was divided by it."""
    return float(
        sae.W_dec.detach().flatten()[0]
        / load_file(os.path.join(out_dir, "sae_weights.safetensors"))["W_dec"].flatten()[0]
    )


def saelens_reference(out_dir: str):
    """encode/decode written from SAELens's documented inference architectures (its SAE classes)."""
    cfg = json.load(open(os.path.join(out_dir, "cfg.json")))
    w = load_file(os.path.join(out_dir, "sae_weights.safetensors"))

    def encode(x):
        pre = (x - w["b_dec"] * cfg["apply_b_dec_to_input"]) @ w["W_enc"] + w["b_enc"]
        if cfg["architecture"] == "topk":
            vals, idx = pre.topk(cfg["k"], dim=-1)
            return torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        if cfg["architecture"] == "jumprelu":
            return pre.relu() * (pre > w["threshold"])
        return pre.relu()

    return encode, lambda f: f @ w["W_dec"] + w["b_dec"]


def test_folders_follow_the_saelens_format(runs):
    by_objective, outs, doc = runs
    assert sorted(os.path.basename(o) for o in outs) == sorted(os.path.basename(d) for d in by_objective.values())
    for objective, run_dir in by_objective.items():
        out = os.path.join(os.path.dirname(outs[0]), os.path.basename(run_dir))
        assert sorted(os.listdir(out)) == ["README.md", "cfg.json", "sae_weights.safetensors"]
        cfg = json.load(open(os.path.join(out, "cfg.json")))
        assert cfg["architecture"] == OBJECTIVES[objective] and (cfg["d_in"], cfg["d_sae"]) == (8, 12)
        assert (
            cfg["metadata"]["model_name"] == doc["ckpt"] and cfg["metadata"]["hook_name"] == "blocks.7.hook_resid_post"
        )
        shapes = {k: tuple(v.shape) for k, v in load_file(os.path.join(out, "sae_weights.safetensors")).items()}
        want = {"W_enc": (8, 12), "W_dec": (12, 8), "b_enc": (12,), "b_dec": (8,)}
        assert shapes == (want | {"threshold": (12,)} if OBJECTIVES[objective] == "jumprelu" else want)
        card = open(os.path.join(out, "README.md")).read()
        ev = json.load(open(os.path.join(run_dir, "eval.json")))
        for text in (doc["ckpt"], "block 7", "`image`", objective, os.path.basename(os.path.dirname(run_dir)),
                     f"{ev['nmse']:.6g}", "library_name: saelens"):  # fmt: skip
            assert text in card, text


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_documented_saelens_math_equals_ours(runs, objective):
    by_objective, outs, _ = runs
    run_dir = by_objective[objective]
    out = os.path.join(os.path.dirname(outs[0]), os.path.basename(run_dir))
    sae = SAE.load(run_dir).eval()
    encode, decode = saelens_reference(out)
    c = scale_of(out, sae)
    assert (c != 1.0) == (objective == "batchtopk")  # only that one trained with scale_norm
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        f = sae.encode(x * c)
        torch.testing.assert_close(encode(x), f, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode(f), sae.decode(f) / c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_saelens_loads_every_objective_and_agrees(runs, objective):
    sae_lens = pytest.importorskip("sae_lens", reason="the 'saelens' test extra is not installed")
    by_objective, outs, _ = runs
    run_dir = by_objective[objective]
    out = os.path.join(os.path.dirname(outs[0]), os.path.basename(run_dir))
    theirs = sae_lens.SAE.load_from_disk(out)
    assert theirs.cfg.architecture() == OBJECTIVES[objective]
    ours = SAE.load(run_dir).eval()
    c = scale_of(out, ours)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        f = ours.encode(x * c)
        torch.testing.assert_close(theirs.encode(x), f, atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs.decode(f), ours.decode(f) / c, atol=1e-5, rtol=0)


def test_unfinished_run_and_offline_push_are_clear_errors(runs, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="done.json: missing; the SAE has not finished"):
        export_saelens(tmp_path, tmp_path / "o")
    _, outs, _ = runs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ActCacheError) as err:
        push(outs[0], "someone/vit-saes")
    assert "\n" not in str(err.value) and "someone/vit-saes" in str(err.value) and "push again" in str(err.value)


def test_export_command_writes_one_folder_per_sae(runs, tmp_path, capsys):
    by_objective, _, _ = runs
    assert actcache_main(["export", *by_objective.values(), "--to", "saelens", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(tmp_path / "out" / os.path.basename(d)) for d in by_objective.values())
    assert all(os.path.isfile(os.path.join(p, "cfg.json")) for p in printed)
    (sweep,) = {os.path.dirname(d) for d in by_objective.values()}  # <runs_to>/<HASH>/, as eval and visuals take
    assert actcache_main(["export", sweep, "--to", "saelens", str(tmp_path / "all")]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(p.replace("/out/", "/all/") for p in printed)
    assert actcache_main(["export", *by_objective.values(), "--to", "onnx", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown export format" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "x")
