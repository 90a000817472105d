"""Spliced-in downstream metrics (actcache.spliced) on a real tiny ViT: known answers for an
identity SAE and a zero SAE, the token positions per family, and `actcache eval`."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
import yaml

from actcache import cli
from actcache.demo import CLASSES, make_image_folder
from actcache.images import ImageFolder, metadata_data, open_dataset
from actcache.models import load_vit
from actcache.protocol import Metadata
from actcache.rundir import load_run
from actcache.sae.modeling import SAE, SAEConfig
from actcache.sae.on_cache import train_on_cache
from actcache.spliced import (
    _CacheContext,
    capture,
    final_embedding,
    model_tokens,
    resume_embedding,
    spliced_eval,
    spliced_group,
)
from actcache.spliced_task import task_metrics
from actcache.visuals import spliced_row
from actcache.visuals_pareto import pareto_points
from actcache.writer import write_cache_from_array
from fixtures_vit import FAMILY, D, make_checkpoint


def jload(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_sae(run_dir, md, cache, held, W_dec, b_dec, sae_id, layer=-2, b_enc=None):
    """An SAE run directory with the given decoder (encoder = identity, ReLU)."""
    sae = SAE(SAEConfig(d_vit=D, width=D, activation="relu", normalize_decoder=False))
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(D))
        sae.W_dec.copy_(W_dec)
        sae.b_enc.copy_(torch.zeros(D) if b_enc is None else b_enc)
        sae.b_dec.copy_(b_dec)
    sae.save(run_dir)
    doc = {"sae_id": sae_id, "cache": cache, "cache_hash": md.hash, "layer": layer, "d_vit": D, "width": D,
           "run": {"patches": "image", "scale_norm": False, "activation": "relu"},
           "split": {"rule": "test", "heldout_images": [int(i) for i in held]}}  # fmt: skip
    with open(os.path.join(run_dir, "run.json"), "w") as fh:
        json.dump(doc, fh)
    with open(os.path.join(run_dir, "eval.json"), "w") as fh:
        json.dump({"nmse": 0.0, "l0": float(D)}, fh)
    return str(run_dir)


def affine_sae(run_dir, md, cache, held, A_DD, c_D, layer=-2):
    """A hand-built SAE with x_hat = x @ A_DD + c_D: the ReLU code is x + 50 (positive for any
    activation above -50), b_dec and b_enc chosen so the shifts cancel."""
    b_dec = c_D - 50.0 * A_DD.sum(0)
    return write_sae(run_dir, md, cache, held, A_DD, b_dec, os.path.basename(run_dir), layer, b_enc=b_dec + 50.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("spliced")
    ckpt = make_checkpoint(str(root / "ckpt"), "clip")
    cfg = ImageFolder(make_image_folder(str(root / "images"), n_per_class=4))
    ds = open_dataset(cfg)
    labels = np.array([ds[i][1] for i in range(len(ds))])
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2,), n_patches_per_img=16, cls_token=True, d_vit=D,
                  n_imgs=len(ds), max_patches_per_shard=8 * 17, data=metadata_data(cfg))  # fmt: skip
    acts = np.random.default_rng(0).standard_normal((md.n_imgs, 1, 17, D)).astype(np.float32)
    cache = write_cache_from_array(root / "cache", md, acts, labels=labels, class_names=["a", "b", "c"])
    held = np.arange(len(ds))  # every image: both probe halves hold every class
    runs = root / "runs" / md.hash
    # identity: b_dec = -50 makes every pre-activation x + 50 > 0, so ReLU passes it and x_hat = x
    ident = write_sae(runs / "identity0000", md, cache, held, torch.eye(D), torch.full((D,), -50.0), "identity0000")
    zero = write_sae(runs / "zero00000000", md, cache, held, torch.zeros(D, D), torch.zeros(D), "zero00000000")
    return {"identity": ident, "zero": zero, "runs": runs}


def test_identity_sae_recovers_everything_and_zero_sae_nothing(world):
    out = spliced_eval([world["identity"], world["zero"]], device="cpu", batch_images=5, report=lambda s: None)
    ident, zero = out[world["identity"]], out[world["zero"]]
    assert ident["fraction_recovered_zero"] == pytest.approx(1.0, abs=1e-5)
    assert ident["fraction_recovered_mean"] == pytest.approx(1.0, abs=1e-5)
    assert ident["cos_spliced_clean"] == pytest.approx(1.0, abs=1e-5)
    assert zero["fraction_recovered_zero"] == pytest.approx(0.0, abs=1e-6)
    assert zero["d_zero"] > 0 and zero["cos_spliced_clean"] < ident["cos_spliced_clean"]
    assert ident["ce_sae"] == pytest.approx(ident["ce_clean"]) and ident["kl_sae"] == pytest.approx(
        0.0, abs=1e-9
    )  # the same embeddings
    ev = jload(os.path.join(world["identity"], "eval.json"))
    assert ev["spliced"]["n_images"] == 12  # beside the held-out statistics, recomputed on the split
    assert ev["n_heldout_images"] == 12 and ev["fvu"] < 1e-6 and ev["n_dead"] == 0


def test_eval_command_writes_every_run_of_a_sweep(world, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="actcache.progress"):
        assert cli.main(["eval", str(world["runs"]), "--device", "cpu", "--max-images", "6"]) == 0
    for d in (world["identity"], world["zero"]):
        assert jload(os.path.join(d, "eval.json"))["spliced"]["n_images"] == 6
    assert "fraction recovered" in capsys.readouterr().out
    # a job log shows the progress: count, rate and time (a line every 10 s and one at the end)
    (line,) = [r.message for r in caplog.records if r.name == "actcache.progress"]
    assert line.startswith("spliced eval of 2 SAE(s), part 1 of 1: 6/6 img (100.0%)") and "img/s" in line, line
    # --missing (the workflow's): SAEs that have their spliced metrics keep them; nothing runs
    before = {d: os.stat(os.path.join(d, "eval.json")).st_mtime_ns for d in (world["identity"], world["zero"])}
    assert cli.main(["eval", "--missing", str(world["runs"]), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.count("spliced metrics already in its eval.json, kept") == 2
    assert before == {d: os.stat(os.path.join(d, "eval.json")).st_mtime_ns for d in before}


def run_without_split(world, d, **info_changes):
    """A copy of the zero SAE's run directory whose run.json records no held-out split."""
    os.makedirs(d)
    for name in ("config.json", "sae.safetensors", "eval.json"):
        with open(os.path.join(world["zero"], name), "rb") as src, open(d / name, "wb") as dst:
            dst.write(src.read())
    info = jload(os.path.join(world["zero"], "run.json"))
    info.pop("split")
    (d / "run.json").write_text(json.dumps({**info, **info_changes}))
    return d


def test_eval_of_a_run_without_a_heldout_split_is_one_clear_line(world, tmp_path, capsys):
    d = run_without_split(world, tmp_path / "nosplit")
    assert cli.main(["eval", str(d), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "records no held-out images" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2", "dinov2_reg"])
def test_resuming_after_the_spliced_block_equals_a_full_forward_with_the_edit(tmp_path, kind):
    vit = load_vit(FAMILY[kind], make_checkpoint(str(tmp_path / kind), kind, preprocessor=False))
    px = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def edit(h_BTD):  # the patch tokens moved by a fixed random offset (not undone by a LayerNorm)
        noise = torch.randn(h_BTD[:, 1:].shape, generator=torch.Generator().manual_seed(1))
        return torch.cat([h_BTD[:, :1], h_BTD[:, 1:] + noise], dim=1)

    got, clean = capture(vit, px, [0, 1])
    assert torch.equal(clean, final_embedding(vit, px))
    for block in (0, 1):
        h, form = got[block]
        assert torch.equal(resume_embedding(vit, px, block, h, form), clean)
        full = final_embedding(vit, px, block, edit)
        torch.testing.assert_close(resume_embedding(vit, px, block, h, form, edit), full, rtol=1e-5, atol=1e-5)
        assert (full - clean).abs().max() > 1e-3  # the edit changes the embedding
    assert torch.equal(final_embedding(vit, px), clean)  # every block has its own forward back
    partial, none = capture(vit, px, [1], full=False)
    assert none is None and torch.equal(partial[1][0], got[1][0])


def test_model_tokens_skip_cls_and_registers():
    md = Metadata(vit_family="dinov2", vit_ckpt="x", layers=(-1,), n_patches_per_img=4, cls_token=True, d_vit=8,
                  n_imgs=1, max_patches_per_shard=5, data={"__class__": "T"})  # fmt: skip
    assert model_tokens(md, "image", 4).tolist() == [5, 6, 7, 8]
    assert model_tokens(md, "all", 4).tolist() == [0, 5, 6, 7, 8]
    assert model_tokens(md, "cls", 0).tolist() == [0]


def test_a_run_from_before_the_split_was_recorded_holds_out_the_images_after_its_training_range(world, tmp_path):
    # what run.json said before the split was recorded: the held-out images were the last ones
    d = run_without_split(world, tmp_path / "legacy", train_images=[0, 5])
    from actcache.rundir import load_run
    from actcache.spliced import heldout_of

    assert list(heldout_of(load_run(str(d)), None, n_imgs=8)) == [5, 6, 7]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A cache of the tiny CLIP's own activations at blocks -2 and -1 (48 labelled images), a TopK
    SAE trained on block -2 by train_on_cache (half the images held out), and the context
    `actcache eval` builds for that cache."""
    old, root = torch.get_num_threads(), tmp_path_factory.mktemp("real")
    torch.set_num_threads(1)  # tiny matrices: one thread is several times faster on a shared CPU
    ckpt = make_checkpoint(str(root / "ckpt"), "clip")
    cfg = ImageFolder(make_image_folder(str(root / "images"), n_per_class=16))
    ds = open_dataset(cfg)
    vit = load_vit("clip", ckpt)
    acts = vit(vit.preprocess([ds[i][0] for i in range(len(ds))]), [-2, -1]).numpy()
    md = Metadata(vit_family="clip", vit_ckpt=ckpt, layers=(-2, -1), n_patches_per_img=16, cls_token=True, d_vit=D,
                  n_imgs=len(ds), max_patches_per_shard=16 * 17, data=metadata_data(cfg))  # fmt: skip
    labels = np.array([ds[i][1] for i in range(len(ds))])
    cache = write_cache_from_array(root / "cache", md, acts, labels=labels, class_names=list(CLASSES))
    train = {"layer": -2, "batch_size": 64, "steps": 300, "lr": 5e-3, "eval_frac": 0.5, "b_dec_init": "mean",
             "log_every": 200, "ckpt_every": 1000, "buffer_bytes": 1 << 20,
             "saes": [{"activation": "topk", "width": 4 * D, "k": 16}]}  # fmt: skip
    (root / "train.yaml").write_text(yaml.safe_dump({"train": train}))
    try:
        (trained,) = train_on_cache(cache, root / "train.yaml", runs_to=str(root / "runs"))
    finally:
        torch.set_num_threads(old)
    held = np.asarray(jload(os.path.join(trained, "run.json"))["split"]["heldout_images"])
    mean_D = torch.as_tensor(acts[held, 0, 1:].reshape(-1, D).mean(0))
    return {"md": md, "cache": cache, "held": held, "trained": trained, "mean_D": mean_D, "root": root}


@pytest.mark.usefixtures("one_torch_thread")
def test_downstream_headline_ranks_a_trained_topk_sae_above_every_cheap_imitation(real):
    md, cache, held, root = real["md"], real["cache"], real["held"], real["root"] / "hand"
    eye, zero = torch.eye(D), torch.zeros(D)
    hand = {name: affine_sae(root / name, md, cache, held, A, c) for name, A, c in (
        ("identity", eye, zero), ("double", 2 * eye, zero), ("negated", -eye, zero),
        ("mean", torch.zeros(D, D), real["mean_D"]))}  # fmt: skip
    ctx = _CacheContext(load_run(real["trained"]), "cpu", batch_images=8)
    runs = [load_run(d) for d in (real["trained"], *hand.values())]
    docs = spliced_group(ctx, runs, held, noise_fvu=0.3)
    trained, got = docs[real["trained"]], {name: docs[d] for name, d in hand.items()}
    assert got["identity"]["kl_recovered_mean"] == pytest.approx(1.0, abs=1e-6)
    assert got["identity"]["ce_recovered_mean"] == pytest.approx(1.0, abs=1e-4)  # x + 50 - 50: float rounding
    assert trained["head"] == "pooled" and trained["fvu_spliced"] < 0.3  # a better fit than the noise control
    headline = trained[trained["headline"]]
    for name in ("double", "negated", "mean"):
        assert got[name][got[name]["headline"]] < headline, name
    assert trained["kl_recovered_mean_noise"] < headline  # isotropic noise at FVU 0.3
    assert trained["noise_fvu"] == 0.3 and got["mean"]["kl_recovered_mean"] < 0.1
    assert set(trained["definitions"]) >= {"kl_recovered_mean", "ce_recovered_mean", "kl_recovered_mean_noise", "head"}


@pytest.mark.usefixtures("one_torch_thread")
def test_a_block_whose_patch_tokens_cannot_reach_the_pooled_head_reads_the_patch_mean_with_a_note(real):
    md, cache, held, root = real["md"], real["cache"], real["held"], real["root"] / "last"
    eye, zero = torch.eye(D), torch.zeros(D)
    runs = {
        name: affine_sae(root / name, md, cache, held, A, zero, layer=-1)
        for name, A in (("identity", eye), ("negated", -eye))
    }
    lines = []
    out = spliced_eval(list(runs.values()), device="cpu", batch_images=8, report=lines.append)
    ident, neg = out[runs["identity"]], out[runs["negated"]]
    for doc in (ident, neg):
        assert doc["head"] == "patch_mean" and "cannot reach the pooled embedding" in doc["head_note"]
        assert "\n" not in doc["head_note"] and all(v == v for v in doc.values() if isinstance(v, float))
    assert ident["kl_recovered_mean"] == pytest.approx(1.0, abs=1e-6)
    assert ident["fraction_recovered_zero"] == pytest.approx(1.0, abs=1e-5)
    assert neg["d_sae"] > 0 and neg["kl_sae"] > 1e-3 and neg["kl_recovered_mean"] < 0
    assert neg["noise_fvu"] == neg["fvu_spliced"] > 1  # by default the noise control has the SAE's own FVU
    assert sum("note: layer -1" in line for line in lines) == 2


@pytest.mark.usefixtures("one_torch_thread")
def test_without_labels_the_task_uses_kmeans_pseudo_labels_and_says_so():
    rng = np.random.default_rng(0)
    clean = np.concatenate([rng.normal(c, 0.3, (8, 6)) for c in (-2.0, 0.0, 2.0)])  # three clear groups
    mean = np.repeat(clean.mean(0, keepdims=True), len(clean), 0)
    noisy = clean + rng.normal(0, 0.5, clean.shape)
    task = task_metrics(None, clean, {"sae": clean.copy(), "zero": 0 * clean, "mean": mean, "noise": noisy})
    assert task["task_labels"].startswith("k-means pseudo-labels") and task["task_n_classes"] >= 2
    assert task["kl_recovered_mean"] == pytest.approx(1.0) and task["kl_recovered_mean_noise"] < 1
    few = task_metrics(None, clean[:3], {"sae": clean[:3], "zero": 0 * clean[:3], "mean": mean[:3]})
    assert few["kl_recovered_mean"] is None and few["task_note"].startswith("no task metric: 3 held-out images")


def test_an_sae_without_a_headline_is_counted_on_the_pareto_view_not_dropped(world, tmp_path):
    d = tmp_path / "nohead"
    shutil.copytree(world["identity"], d)
    note = "no task metric: 3 held-out images, fewer than 4 (raise --max-images or eval_frac)"
    ev = {
        "nmse": 0.1,
        "l0": 4.0,
        "spliced": {"headline": "kl_recovered_mean", "kl_recovered_mean": None, "task_note": note},
    }
    (d / "eval.json").write_text(json.dumps(ev))
    (point,) = pareto_points([load_run(str(d))])
    assert point["spliced_recovered"] is None and point["spliced_recovered_why"] == note
    assert "Note: " + note in spliced_row(ev["spliced"])
