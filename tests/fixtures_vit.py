"""Tiny randomly initialised ViT checkpoints (saved with save_pretrained) for tests; no downloads.

``make_checkpoint(directory, kind)`` writes config.json, the weights and (unless
``preprocessor=False``) a preprocessor_config.json saved from transformers' own image processor.
Kinds: clip, clip_full (two-tower CLIPModel), siglip, dinov2, dinov2_reg (4 register tokens).
All are 3 blocks deep, d=32, 32x32 inputs with 8x8 patches (16 patches).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import PIL.Image
import torch
import transformers

KINDS = ("clip", "clip_full", "siglip", "dinov2", "dinov2_reg")
FAMILY = {"clip": "clip", "clip_full": "clip", "siglip": "siglip", "dinov2": "dinov2", "dinov2_reg": "dinov2"}
N_LAYERS, D, IMAGE, PATCH, N_REGISTERS = 3, 32, 32, 8, 4
VISION = dict(hidden_size=D, num_hidden_layers=N_LAYERS, num_attention_heads=2, intermediate_size=64, patch_size=PATCH)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def build_model(kind: str, image_size: int = IMAGE) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "clip":
        return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(image_size=image_size, **VISION))
    if kind == "clip_full":
        text = dict(hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
        cfg = transformers.CLIPConfig(vision_config=dict(image_size=image_size, **VISION), text_config=text,
                                      projection_dim=16)  # fmt: skip
        return transformers.CLIPModel(cfg)
    if kind == "siglip":
        return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(image_size=image_size, **VISION))
    if kind == "dinov2":
        return transformers.Dinov2Model(transformers.Dinov2Config(image_size=image_size, **VISION))
    if kind == "dinov2_reg":
        cfg = transformers.Dinov2WithRegistersConfig(image_size=image_size, num_register_tokens=N_REGISTERS, **VISION)
        return transformers.Dinov2WithRegistersModel(cfg)
    raise ValueError(kind)


def pil_processor_class(name: str):
    """transformers' PIL image processor ``name`` (e.g. "CLIPImageProcessor"): the reference our
    preprocessing follows. From transformers 5, the plain name is the torchvision-backed processor
    wherever torchvision is installed (its resize rounds differently) and the PIL one is ``<name>Pil``;
    before 5, and without torchvision, the plain name is the PIL one."""
    cls = getattr(transformers, name + "Pil", None) or getattr(transformers, name, None)
    assert cls is not None, f"transformers {transformers.__version__} has no {name} (needed as the reference)"
    return cls


def build_processor(kind: str, crop: int = IMAGE):
    if kind in ("clip", "clip_full"):
        return pil_processor_class("CLIPImageProcessor")(size={"shortest_edge": crop},
                                                         crop_size={"height": crop, "width": crop})  # fmt: skip
    if kind == "siglip":
        return pil_processor_class("SiglipImageProcessor")(size={"height": crop, "width": crop})
    return pil_processor_class("BitImageProcessor")(
        size={"shortest_edge": crop + crop // 8}, crop_size={"height": crop, "width": crop},
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
    )  # fmt: skip


def make_checkpoint(directory: str, kind: str, preprocessor: bool = True, image_size: int = IMAGE,
                    crop: int = IMAGE) -> str:  # fmt: skip
    model = build_model(kind, image_size)
    model.save_pretrained(directory)
    if preprocessor:
        build_processor(kind, crop).save_pretrained(directory)
    return str(directory)


def reference_hidden_states(ckpt: str, kind: str, pixels_B3HW: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' own hidden_states (output_hidden_states=True) from an independently loaded model."""
    if kind == "clip_full":
        model = transformers.CLIPModel.from_pretrained(ckpt).vision_model
    else:
        cls = {"clip": transformers.CLIPVisionModel, "siglip": transformers.SiglipVisionModel,
               "dinov2": transformers.Dinov2Model, "dinov2_reg": transformers.Dinov2WithRegistersModel}[kind]  # fmt: skip
        model = cls.from_pretrained(ckpt)
    with torch.inference_mode():
        return model.eval()(pixel_values=pixels_B3HW, output_hidden_states=True).hidden_states


def mixed_images(seed: int = 0) -> list[PIL.Image.Image]:
    """Random images of different sizes and modes (RGB, L, RGBA with transparency, P, tiny)."""
    rng = np.random.default_rng(seed)
    rgb = PIL.Image.fromarray(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8), "RGB")
    gray = PIL.Image.fromarray(rng.integers(0, 256, (70, 40), dtype=np.uint8), "L")
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (33, 50, 4), dtype=np.uint8), "RGBA")
    pal = PIL.Image.fromarray(rng.integers(0, 256, (52, 52, 3), dtype=np.uint8), "RGB").convert("P")
    tiny = PIL.Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8), "RGB")
    return [rgb, gray, rgba, pal, tiny]


def white_background(img: PIL.Image.Image) -> PIL.Image.Image:
    """``img`` with any transparency composited onto white, as RGB: actcache's rule for images
    with an alpha channel (images.to_rgb), written here independently. transformers applies the
    same rule in its recent releases (5.24 here); 5.17 drops the alpha channel instead
    (``convert("RGB")``, as 4.x did). The tests give transformers this image, so that its
    reference holds whichever version is installed, and check the rule itself separately."""
    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img
    rgba = np.asarray(img.convert("RGBA"), np.float64)
    alpha = rgba[..., 3:] / 255
    out = np.round(rgba[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8)
    return PIL.Image.fromarray(out, "RGB")
