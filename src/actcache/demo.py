"""Offline demo assets: a small randomly initialised ViT of a real family, and an image folder.

`actcache demo-assets [--root data/demo] [--family F]` writes (idempotently, atomically per directory):
    <root>/models/tiny-<F>/    config.json, model.safetensors, preprocessor_config.json
                               (the family's transformers vision model, 4 blocks, d=64, 32x32 input,
                               8x8 patches; F is clip, siglip, dinov2, dinov3 or siglip2; default clip)
    <root>/images/<class>/*.png   240 images in 3 classes (coloured shapes on noise)
Nothing is downloaded; the same call always writes the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

CLASSES = ("circles", "squares", "stripes")
DEMO_FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "siglip2")
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _processor(name: str, **kw):
    """transformers' PIL image processor ``name`` (``<name>Pil`` in transformers 5)."""
    import transformers

    return (getattr(transformers, name + "Pil", None) or getattr(transformers, name))(**kw)


def _tiny_model_and_processor(family: str, n_layers: int, d: int, image: int, patch: int):
    """(model, processor or a preprocessor_config.json dict) of a tiny random ``family`` ViT."""
    import transformers

    vision = dict(hidden_size=d, num_hidden_layers=n_layers, num_attention_heads=4, intermediate_size=4 * d,
                  patch_size=patch)  # fmt: skip
    square = {"height": image, "width": image}
    if family == "clip":
        proc = _processor("CLIPImageProcessor", size={"shortest_edge": image}, crop_size=square)
        return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(image_size=image, **vision)), proc
    if family == "siglip":
        proc = _processor("SiglipImageProcessor", size=square)
        return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(image_size=image, **vision)), proc
    if family == "dinov2":
        proc = _processor("BitImageProcessor", size={"shortest_edge": image + image // 8}, crop_size=square,
                          image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)  # fmt: skip
        return transformers.Dinov2Model(transformers.Dinov2Config(image_size=image, **vision)), proc
    if family == "dinov3":
        # transformers' DINOv3 processor needs torchvision; its saved config is plain JSON.
        proc = {"image_processor_type": "DINOv3ViTImageProcessorFast", "do_resize": True, "size": square,
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}  # fmt: skip
        cfg = transformers.DINOv3ViTConfig(image_size=image, num_register_tokens=4, **vision)
        return transformers.DINOv3ViTModel(cfg), proc
    if family == "siglip2":
        n = (image // patch) ** 2
        proc = _processor("Siglip2ImageProcessor", patch_size=patch, max_num_patches=n)
        return transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(num_patches=n, **vision)), proc
    from actcache.errors import ConfigError

    raise ConfigError(f"demo-assets --family {family!r} is not supported; use one of {', '.join(DEMO_FAMILIES)}")


def make_tiny_vit(directory: str, family: str = "clip", n_layers: int = 4, d: int = 64, image: int = 32,
                  patch: int = 8) -> str:  # fmt: skip
    """A tiny randomly initialised ``family`` checkpoint (seeded, so always the same weights)."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    import torch

    torch.manual_seed(0)
    model, proc = _tiny_model_and_processor(family, n_layers, d, image, patch)
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".tiny-{family}-")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a file of a few MB
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if isinstance(proc, dict):
        with open(os.path.join(tmp, "preprocessor_config.json"), "w", encoding="utf-8") as fh:
            fh.write(json.dumps(proc, indent=2) + "\n")
    else:
        proc.save_pretrained(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # written meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def make_tiny_clip(directory: str, n_layers: int = 4, d: int = 64, image: int = 32, patch: int = 8) -> str:
    return make_tiny_vit(directory, "clip", n_layers, d, image, patch)


def _draw(cls: str, rng: np.random.Generator, size: int = 48) -> np.ndarray:
    img = rng.integers(0, 60, (size, size, 3)).astype(np.uint8)
    color = rng.integers(120, 256, 3).astype(np.uint8)
    yy, xx = np.mgrid[:size, :size]
    if cls == "circles":
        cy, cx, r = rng.integers(12, 36, 2).tolist() + [int(rng.integers(6, 14))]
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    elif cls == "squares":
        y0, x0 = rng.integers(4, 24, 2)
        w = int(rng.integers(10, 20))
        mask = (yy >= y0) & (yy < y0 + w) & (xx >= x0) & (xx < x0 + w)
    else:
        period = int(rng.integers(4, 10))
        mask = ((xx + yy * int(rng.integers(0, 2))) // period) % 2 == 0
    img[mask] = color
    return img


def make_image_folder(directory: str, n_per_class: int = 80, seed: int = 0) -> str:
    if (
        os.path.isdir(directory)
        and all(
            len(os.listdir(os.path.join(directory, c))) == n_per_class
            for c in CLASSES
            if os.path.isdir(os.path.join(directory, c))
        )
        and all(os.path.isdir(os.path.join(directory, c)) for c in CLASSES)
    ):
        return directory
    import PIL.Image

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".images-")
    for ci, cls in enumerate(CLASSES):
        os.makedirs(os.path.join(tmp, cls))
        for i in range(n_per_class):
            rng = np.random.default_rng([seed, ci, i])
            PIL.Image.fromarray(_draw(cls, rng)).save(os.path.join(tmp, cls, f"{cls}_{i:04d}.png"))
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.rename(tmp, directory)
    return directory


def make_demo_assets(root: str = "data/demo", family: str = "clip") -> dict:
    """The tiny ``family`` checkpoint at ``<root>/models/tiny-<family>`` and the image folder."""
    return {
        "model": make_tiny_vit(os.path.join(root, "models", f"tiny-{family}"), family),
        "images": make_image_folder(os.path.join(root, "images")),
    }
