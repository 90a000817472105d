"""Offline demo assets: a small randomly initialised ViT of a real family, and an image folder.

`actcache demo-assets [--root data/demo]` writes (idempotently, atomically per directory):
    <root>/models/tiny-clip/   config.json, model.safetensors, preprocessor_config.json
                               (transformers CLIPVisionModel, 4 blocks, d=64, 32x32 input, 8x8 patches)
    <root>/images/<class>/*.png   240 images in 3 classes (coloured shapes on noise)
Nothing is downloaded; the same call always writes the same files.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

CLASSES = ("circles", "squares", "stripes")


def make_tiny_clip(directory: str, n_layers: int = 4, d: int = 64, image: int = 32, patch: int = 8) -> str:
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.CLIPVisionConfig(
        hidden_size=d,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        intermediate_size=4 * d,
        image_size=image,
        patch_size=patch,
    )
    model = transformers.CLIPVisionModel(cfg)
    proc = transformers.CLIPImageProcessor(size={"shortest_edge": image}, crop_size={"height": image, "width": image})
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tiny-clip-")
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # written meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


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


def make_demo_assets(root: str = "data/demo") -> dict:
    return {
        "model": make_tiny_clip(os.path.join(root, "models", "tiny-clip")),
        "images": make_image_folder(os.path.join(root, "images")),
    }
