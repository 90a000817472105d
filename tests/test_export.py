"""export_saelens: SAELens folders (cfg.json, sae_weights.safetensors, README.md) for every objective,
read back by SAELens itself when it is installed (the ``saelens`` test extra) and always checked
against SAELens's documented format; the SAEs read layer -2 of a 12-block model, so the hook is
blocks.10; `export --push` uploads each SAE from the command line to a local stand-in of the Hub
API, and gives one clear error offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from actcache.cli import main as actcache_main
from actcache.errors import ActCacheError, ConfigError
from actcache.export import block_index, export_many, export_saelens, push
from actcache.protocol import Metadata
from actcache.sae.modeling import SAE
from actcache.sae.on_cache import train_on_cache
from fixtures_vit import make_checkpoint
from hub_standin import HubStandIn
from saev_fixture import write_saev_cache

OBJECTIVES = {
    "relu": "standard",
    "topk": "topk",
    "batchtopk": "jumprelu",
    "jumprelu": "jumprelu",
    "matryoshka": "jumprelu",
}
N_BLOCKS, ABS = 12, 10  # layer -2 of a 12-block model
TRAIN = {"layer": -2, "batch_size": 16, "steps": 6, "eval_frac": 0.2, "b_dec_init": "mean", "buffer_bytes": 20000,
         "saes": [{"activation": "relu", "width": 12, "l1_coeff": 1.0e-3},
                  {"activation": "topk", "width": 12, "k": 3},
                  {"activation": "batchtopk", "width": 12, "k": 3, "scale_norm": True},
                  {"activation": "jumprelu", "width": 12, "l0_coeff": 1.0e-3, "jumprelu_init_threshold": 0.05},
                  {"activation": "matryoshka", "width": 12, "k": 3, "matryoshka_prefixes": [4, 12]}]}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cache, doc, _ = write_saev_cache(root / "c", n=20, E=6, layers=(3, -2), P=4, D=8)
    (root / "train.yaml").write_text(yaml.safe_dump({"train": TRAIN}))
    dirs = train_on_cache(cache, str(root / "train.yaml"), runs_to=str(root / "runs"))
    by_objective = {json.load(open(os.path.join(d, "run.json")))["run"]["activation"]: d for d in dirs}
    return by_objective, export_many(dirs, root / "out", n_blocks=N_BLOCKS), doc


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
            cfg["metadata"]["model_name"] == doc["ckpt"]
            and cfg["metadata"]["hook_name"] == f"blocks.{ABS}.hook_resid_post"
            and (cfg["metadata"]["layer"], cfg["metadata"]["layer_as_configured"]) == (ABS, -2)
        )
        shapes = {k: tuple(v.shape) for k, v in load_file(os.path.join(out, "sae_weights.safetensors")).items()}
        want = {"W_enc": (8, 12), "W_dec": (12, 8), "b_enc": (12,), "b_dec": (8,)}
        assert shapes == (want | {"threshold": (12,)} if OBJECTIVES[objective] == "jumprelu" else want)
        card = open(os.path.join(out, "README.md")).read()
        ev = json.load(open(os.path.join(run_dir, "eval.json")))
        for text in (doc["ckpt"], f"block {ABS}", "layer -2", "`image`", objective,
                     os.path.basename(os.path.dirname(run_dir)), f"{ev['nmse']:.6g}", "library_name: saelens",
                     "base_model: test/tiny", "open_clip", "**Training data:** fake, 20 images"):  # fmt: skip
            assert text in card, text
        front = yaml.safe_load(card.split("---")[1])
        assert front["base_model"] == "test/tiny" and front["library_name"] == "saelens"
        for name in ("nmse", "l0", "n_dead", "n_dense"):  # every quoted metric has its definition and chance level
            row = next(line for line in card.splitlines() if line.startswith(f"| {name} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == 4 and cells[2] and cells[3], row
        assert f"over the {ev['n_tokens']:,} held-out tokens" in card


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
    meta = theirs.cfg.metadata  # kept on load only when cfg.json names a SAELens 6 format
    assert (meta.hook_name, meta.model_name) == (f"blocks.{ABS}.hook_resid_post", "hf-hub:test/tiny")
    assert (meta.context_size, meta.prepend_bos) == (5, False)
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
    assert actcache_main(["export", *by_objective.values(), "--to", "saelens", str(tmp_path / "no")]) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "layer -2 counts from the end" in err[0] and "--n-blocks" in err[0]
    assert not os.path.exists(tmp_path / "no")
    args = ["--to", "saelens", str(tmp_path / "out"), "--n-blocks", str(N_BLOCKS), "--dataset", "someone/images"]
    assert actcache_main(["export", *by_objective.values(), *args]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(tmp_path / "out" / os.path.basename(d)) for d in by_objective.values())
    assert all(os.path.isfile(os.path.join(p, "cfg.json")) for p in printed)
    with open(os.path.join(printed[0], "README.md"), encoding="utf-8") as fd:
        front = yaml.safe_load(fd.read().split("---")[1])
    assert front["datasets"] == ["someone/images"] and front["base_model"] == "test/tiny"
    (sweep,) = {os.path.dirname(d) for d in by_objective.values()}  # <runs_to>/<HASH>/, as eval and visuals take
    assert actcache_main(["export", sweep, "--to", "saelens", str(tmp_path / "all"), "--n-blocks", str(N_BLOCKS)]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(p.replace("/out/", "/all/") for p in printed)
    assert actcache_main(["export", *by_objective.values(), "--to", "onnx", str(tmp_path / "x")]) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "unknown export format" in err[0]
    assert not os.path.exists(tmp_path / "x")


def test_layer_from_the_end_is_the_block_of_the_checkpoints_depth(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "vit"), "clip")  # 3 blocks
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-1,), n_patches_per_img=16, cls_token=True, d_vit=32,
                  n_imgs=4, max_patches_per_shard=68, data={"__class__": "SyntheticImages", "n_imgs": 4})  # fmt: skip
    assert [block_index({"layer": layer}, md) for layer in (-1, -3, 0, 2)] == [2, 0, 0, 2]
    assert block_index({"layer": -1}, None, n_blocks=24) == 23
    with pytest.raises(ConfigError, match="does not exist in a model of 3 blocks"):
        block_index({"layer": -4}, md)


def test_push_command_uploads_each_sae_to_its_own_folder(runs, tmp_path, capsys):
    by_objective, _, _ = runs
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "actcache.cli", "export", *by_objective.values(), "--to", "saelens", str(out),
           "--n-blocks", str(N_BLOCKS), "--push", "me/vit-saes"]  # fmt: skip
    with HubStandIn() as hub:
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_standin", HF_HUB_OFFLINE="0")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert not [r for r in hub.unknown if not r.startswith("GET")]  # (GETs: the client's optional look-ups)
    assert hub.repos == {"me/vit-saes"} and len(hub.commits) == len(by_objective)
    for run_dir in by_objective.values():
        sae_id = os.path.basename(run_dir)
        for name in ("cfg.json", "sae_weights.safetensors", "README.md"):
            assert hub.files["me/vit-saes", f"{sae_id}/{name}"] == (out / sae_id / name).read_bytes()
    assert all(card["base_model"] == "test/tiny" for card in hub.cards)
    assert sum(f"{hub.endpoint}/me/vit-saes/commit/" in line for line in done.stdout.splitlines()) == len(by_objective)

    assert os.environ["HF_HUB_OFFLINE"] == "1"  # (set by fixtures_vit before huggingface_hub is imported)
    assert actcache_main(cmd[3:]) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "me/vit-saes" in err[0] and "hf auth login" in err[0] and "push again" in err[0], err


def test_eval_without_images_rewrites_the_heldout_statistics_of_a_saev_cache_run(runs, tmp_path, capsys):
    by_objective, _, _ = runs
    run_dir = shutil.copytree(by_objective["topk"], tmp_path / "run")
    before = read_json(run_dir, "eval.json")
    assert actcache_main(["eval", str(run_dir), "--device", "cpu"]) == 2  # a saev cache: no images, no ViT
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "--no-images" in err[0]
    assert actcache_main(["eval", str(run_dir), "--device", "cpu", "--no-images"]) == 0
    after = read_json(run_dir, "eval.json")
    assert "spliced" not in after and "held-out statistics only" in capsys.readouterr().out
    for key in ("nmse", "l0", "n_dead", "n_dense", "n_tokens", "mse"):
        assert after[key] == pytest.approx(before[key], abs=1e-6), key


def saev_checkpoint(path, sae: SAE, activation: dict) -> None:
    """A saev sae.pt from its documented layout: a JSON header line (schema, cfg with d_model, d_sae
    and the activation as a small dict), then torch.save of W_enc, b_enc, W_dec, b_dec, where
    saev's encoder is x @ W_enc + b_enc (no b_dec subtraction)."""
    import io

    with torch.no_grad():
        state = {"W_enc": sae.W_enc.clone(), "b_enc": sae.b_enc - sae.b_dec @ sae.W_enc,
                 "W_dec": sae.W_dec.clone(), "b_dec": sae.b_dec.clone()}  # fmt: skip
    header = {"schema": 5, "cfg": {"d_model": sae.cfg.d_vit, "d_sae": sae.cfg.width, "activation": activation}}
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(path, "wb") as fd:
        fd.write(json.dumps(header).encode() + b"\n" + buf.getvalue())


def read_json(*parts):
    with open(os.path.join(*parts), encoding="utf-8") as fd:
        return json.load(fd)


def error_lines(err: str) -> list[str]:
    """stderr's lines, without the ResourceWarnings a collected file object of another test prints."""
    return [ln for ln in err.strip().splitlines() if not ln.startswith("warning: unclosed file")]


EVAL_KEYS = ("nmse", "fvu", "mse", "l0", "l1", "n_dead", "n_dense", "n_tokens", "cos_x_xhat", "norm_ratio")


@pytest.mark.parametrize("source", ["saelens-relu", "saelens-topk", "saelens-jumprelu", "saev-relu", "saev-topk"])
def test_imported_sae_evaluates_as_the_same_weights_trained_here(runs, tmp_path, capsys, source):
    from actcache.rundir import check_weights, find_runs, load_run
    from actcache.visuals_pareto import pareto_points

    by_objective, outs, _ = runs
    fmt, objective = source.split("-")
    run_dir = by_objective[objective]
    trained, cache = read_json(run_dir, "eval.json"), read_json(run_dir, "run.json")["cache"]
    if fmt == "saelens":
        src = os.path.join(os.path.dirname(outs[0]), os.path.basename(run_dir))
    else:
        src = str(tmp_path / "sae.pt")
        act = {"key": "relu"} if objective == "relu" else {"key": "top-k", "top_k": 3}
        saev_checkpoint(src, SAE.load(run_dir), act)
    args = ["import", src, "--cache", cache, "--runs-to", str(tmp_path / "runs"), "--eval-frac", "0.2"]
    if fmt == "saelens":  # its hook is blocks.10; the saev cache records -2 of a model whose depth it does not say
        assert actcache_main(args) == 2
        err = error_lines(capsys.readouterr().err)
        assert len(err) == 1 and "layer 10" in err[0] and "--layer" in err[0]
    assert actcache_main([*args, "--layer", "-2"]) == 0
    out = capsys.readouterr().out.strip()
    got = read_json(out, "eval.json")
    for key in EVAL_KEYS:
        assert got[key] == pytest.approx(trained[key], abs=1e-6, rel=1e-6), key
    run = load_run(out)
    assert run.imported and run.info["imported"]["format"] == fmt and "(imported)" in run.label()
    assert not os.access(os.path.join(out, "sae.safetensors"), os.W_OK) or os.geteuid() == 0
    assert oct(os.stat(os.path.join(out, "sae.safetensors")).st_mode & 0o777) == "0o444"
    check_weights(out)  # done.json records the imported weights as train records its own
    assert set(read_json(out, "done.json")["files"]) == {"sae.safetensors", "config.json"}
    shutil.copytree(run_dir, os.path.join(os.path.dirname(out), "mine"))  # beside it, on the same cache
    points = pareto_points([load_run(d) for d in find_runs([str(tmp_path / "runs")])])
    assert sorted(p["imported"] for p in points) == [False, True]
    assert actcache_main([*args, "--layer", "-2"]) == 0 and capsys.readouterr().out.strip() == out  # idempotent


def test_pareto_plot_draws_imported_saes_apart(tmp_path):
    import numpy as np
    import PIL.Image

    from actcache.visuals_plots import plot_pareto

    pts = [
        {"l0": 1.0, "fvu": 0.5, "label": "a", "imported": False},
        {"l0": 2.0, "fvu": 0.3, "label": "b", "imported": False},
    ]
    paths = [str(tmp_path / "own.png"), str(tmp_path / "imported.png")]
    assert plot_pareto(pts, "fvu", "FVU", False, paths[0])
    assert plot_pareto([pts[0], {**pts[1], "imported": True}], "fvu", "FVU", False, paths[1])
    own, imp = (np.asarray(PIL.Image.open(p).convert("RGB")).astype(int) for p in paths)
    blue = np.array([0x2C, 0x7F, 0xB8])  # the imported marker's colour, in the plot and its legend
    assert (np.abs(imp - blue).sum(-1) < 30).sum() > 20 and (np.abs(own - blue).sum(-1) < 30).sum() == 0
