"""ViT families dinov3 and siglip2 from `demo-assets` checkpoints: preprocessing equal to transformers'
processors, activations equal to transformers' hidden states (registers dropped), a dump that reads
back value for value, an SAE trained on it and its visuals; and a demo checkpoint for every family."""

from __future__ import annotations

import json
import os

import numpy as np
import PIL.Image
import pytest
import torch
import transformers
import yaml

from actcache import cli
from actcache.cache import ActivationCache
from actcache.config import load_experiment
from actcache.demo import DEMO_FAMILIES, make_demo_assets, make_tiny_vit
from actcache.dump import dump_shards
from actcache.models import describe_checkpoint, load_vit, transform_from_preprocessor_config
from actcache.rundir import load_run
from actcache.sae.on_cache import train_on_cache
from actcache.spliced import _CacheContext, _Member, capture, heldout_of
from actcache.validate import validate_dir
from actcache.writer import gather
from fixtures_vit import mixed_images, pil_processor_class

N_LAYERS, D, N_PATCHES, N_REGISTERS = 4, 64, 16, 4


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return {f: make_tiny_vit(str(root / f"tiny-{f}"), f) for f in ("dinov3", "siglip2")}


def square_images(seed=0) -> list[PIL.Image.Image]:
    """Square images of several sizes and modes (siglip2's processor keeps a non-square aspect)."""
    rng = np.random.default_rng(seed)
    rgb = [PIL.Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8), "RGB") for s in (20, 32, 57, 90)]
    gray = PIL.Image.fromarray(rng.integers(0, 256, (45, 45), dtype=np.uint8), "L")
    return [*rgb, gray]


def hidden_states(family: str, ckpt: str, images) -> tuple[torch.Tensor, ...]:
    """transformers' own hidden_states for ``images``, fed by its own processor where it can run."""
    if family == "siglip2":
        proc = pil_processor_class("Siglip2ImageProcessor").from_pretrained(ckpt)
        rgb = [img.convert("RGB") for img in images]  # this processor does not convert modes
        inputs = {k: torch.as_tensor(np.asarray(v)) for k, v in proc(images=rgb, return_tensors="np").items()}
        model = transformers.Siglip2VisionModel.from_pretrained(ckpt)
    else:
        inputs = {"pixel_values": load_vit(family, ckpt).preprocess(images)}
        model = transformers.DINOv3ViTModel.from_pretrained(ckpt)
    with torch.inference_mode():
        return model.eval()(**inputs, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family", ["dinov3", "siglip2"])
def test_activations_equal_transformers_hidden_states_without_registers(demo, family):
    vit = load_vit(family, demo[family])
    images = square_images()
    ref = hidden_states(family, demo[family], images)
    has_cls = family == "dinov3"
    n_reg = N_REGISTERS if family == "dinov3" else 0
    assert ref[1].shape[1] == int(has_cls) + n_reg + N_PATCHES
    keep = ([0] if has_cls else []) + list(range(int(has_cls) + n_reg, ref[1].shape[1]))
    acts = vit(vit.preprocess(images), [0, -1])
    assert acts.shape == (len(images), 2, N_PATCHES + int(has_cls), D)
    for li, layer in enumerate([0, N_LAYERS - 1]):
        torch.testing.assert_close(acts[:, li], ref[layer + 1][:, keep], atol=1e-5, rtol=1e-5)


def test_siglip2_preprocessing_equals_its_processor(demo):
    proc = pil_processor_class("Siglip2ImageProcessor").from_pretrained(demo["siglip2"])
    transform = transform_from_preprocessor_config(proc.to_dict(), "siglip2")
    images = square_images(1)
    out = proc(images=[img.convert("RGB") for img in images], return_tensors="np")
    assert (np.asarray(out["spatial_shapes"]) == 4).all() and np.asarray(out["pixel_attention_mask"]).all()
    vit = load_vit("siglip2", demo["siglip2"])
    for img, want in zip(images, np.asarray(out["pixel_values"]), strict=True):
        x_3HW = torch.from_numpy(transform(img))[None]
        got = vit._model_inputs(x_3HW)["pixel_values"][0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_dinov3_preprocessing_equals_a_transformers_processor_with_its_settings(demo):
    # transformers' DINOv3ViTImageProcessor runs only on torchvision; its settings (224 -> 32 here,
    # bilinear, ImageNet statistics, no crop) are applied by transformers' PIL ViT processor.
    with open(os.path.join(demo["dinov3"], "preprocessor_config.json")) as fh:
        doc = json.load(fh)
    assert doc["image_processor_type"].startswith("DINOv3ViTImageProcessor")
    ref = pil_processor_class("ViTImageProcessor")(size=doc["size"], resample=doc["resample"],
                                                   image_mean=doc["image_mean"], image_std=doc["image_std"])  # fmt: skip
    transform = transform_from_preprocessor_config(doc, "dinov3")
    for img in mixed_images():
        want = np.asarray(ref(images=img.convert("RGB"), return_tensors="np")["pixel_values"])[0]
        np.testing.assert_allclose(transform(img.convert("RGB")), want, atol=1e-5, rtol=0)


def test_every_family_gets_a_demo_checkpoint(tmp_path):
    for family in DEMO_FAMILIES:
        out = make_demo_assets(str(tmp_path), family)
        assert os.path.basename(out["model"]) == f"tiny-{family}"
        dims = describe_checkpoint(family, out["model"])
        assert (dims.n_layers, dims.d_vit, dims.n_patches_per_img) == (N_LAYERS, D, N_PATCHES)
        assert dims.cls_token == (family not in ("siglip", "siglip2"))
    assert sorted(os.listdir(tmp_path / "models")) == sorted(f"tiny-{f}" for f in DEMO_FAMILIES)


@pytest.mark.parametrize("family", ["dinov3", "siglip2"])
def test_dump_gather_train_and_visuals(tmp_path, demo, family):
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    for i in range(6):
        os.makedirs(images / ("a" if i % 2 else "b"), exist_ok=True)
        arr = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
        PIL.Image.fromarray(arr).save(images / ("a" if i % 2 else "b") / f"{i}.png")
    T = N_PATCHES + int(family == "dinov3")
    doc = {"vit": {"family": family, "ckpt": demo[family], "layers": [1, -1]},
           "data": {"kind": "image_folder", "root": str(images)},
           "cache": {"max_patches_per_shard": 4 * T * 2, "batch_size": 3, "n_workers": 0}}  # fmt: skip
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    path = dump_shards(load_experiment(str(tmp_path / "exp.yaml")), None, str(tmp_path / "d"), progress=False)
    gather(path)
    validate_dir(path, deep=True)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(images) for f in fs)
    vit = load_vit(family, demo[family])
    want = vit(vit.preprocess([PIL.Image.open(f) for f in files]), [1, -1]).numpy()
    with ActivationCache.open(path) as cache:
        assert cache.metadata.vit_family == family and cache.shape == (6, 2, T, D)
        np.testing.assert_allclose(cache[0:6], want, atol=1e-5, rtol=1e-5)

    # ... then an SAE trains on it and its visuals page renders, with the images' patches.
    train = {"layer": 1, "batch_size": 16, "steps": 4, "eval_frac": 0.34, "activation": "topk", "width": 32, "k": 4}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"train": train}))
    (run_dir,) = train_on_cache(path, str(tmp_path / "train.yaml"), runs_to=str(tmp_path / "runs"))
    assert cli.main(["visuals", run_dir, "--latents", "4"]) == 0
    with open(os.path.join(run_dir, "visuals", "index.html"), encoding="utf-8") as fh:
        page = fh.read()
    assert family in page and ".jpg" in page

    # ... and `actcache eval` splices it in at the tokens the cache holds: the block output it
    # captures, at the SAE's positions (registers and CLS skipped), equals the cache's vectors.
    run = load_run(run_dir)
    ctx = _CacheContext(run, "cpu", batch_images=8)
    member, held = _Member(ctx, run), heldout_of(run, None, 6)
    got, _ = capture(ctx.vit, next(ctx.batches(held)), [member.block])
    with ActivationCache.open(path) as cache:
        stored = np.stack([cache[int(i)][0, T - N_PATCHES :] for i in held])  # layer 1's image patches
    np.testing.assert_allclose(got[member.block][0][:, member.tokens].numpy(), stored, atol=1e-5, rtol=1e-5)
    assert cli.main(["eval", run_dir, "--device", "cpu"]) == 0
    with open(os.path.join(run_dir, "eval.json"), encoding="utf-8") as fh:
        spliced = json.load(fh)["spliced"]
    assert spliced["n_images"] == len(held) and spliced["d_zero"] > 0


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("demo-assets"))  # its images are written once, by the first call


@pytest.mark.parametrize("family", sorted(set(DEMO_FAMILIES) - {"dinov3", "siglip2"}))  # those two: above
def test_demo_checkpoint_of_every_family_dumps_a_verified_shard(tmp_path, demo_root, family):
    out = make_demo_assets(demo_root, family)
    images = tmp_path / "few"
    os.makedirs(images / "a")
    for name in sorted(os.listdir(os.path.join(out["images"], "circles")))[:4]:
        os.link(os.path.join(out["images"], "circles", name), images / "a" / name)
    T = N_PATCHES + int(family != "siglip")
    doc = {"vit": {"family": family, "ckpt": out["model"], "layers": [-1]},
           "data": {"kind": "image_folder", "root": str(images)},
           "cache": {"max_patches_per_shard": 4 * T, "batch_size": 4, "n_workers": 0}}  # fmt: skip
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    path = dump_shards(load_experiment(str(tmp_path / "exp.yaml")), (0, 1), str(tmp_path / "d"), progress=False)
    gather(path)
    validate_dir(path, deep=True)
    with ActivationCache.open(path) as cache:
        assert cache.metadata.vit_family == family and cache.shape == (4, 1, T, D)
        assert np.isfinite(cache[0:4]).all() and cache[0:4].std() > 0
