"""ViT families through Hugging Face transformers → one forward returning activations (B, L, T, D).

Families (``vit_family`` in the cache metadata):

- ``clip``: ``CLIPVisionModel`` (a full two-tower CLIP checkpoint works too); tokens [CLS, patches].
- ``siglip``: ``SiglipVisionModel`` (two-tower checkpoints too); tokens [patches], no CLS.
- ``dinov2``: ``Dinov2Model``, or ``Dinov2WithRegistersModel`` when the checkpoint's config is
  ``dinov2_with_registers``; tokens [CLS, patches]; register tokens are dropped (not stored).
- ``dinov3``: ``DINOv3ViTModel``; tokens [CLS, patches]; its register tokens are dropped too.
- ``siglip2``: ``Siglip2VisionModel`` (NaFlex); tokens [patches], no CLS. Every image is resized to
  the square grid its processor gives a square image (side = patch_size x isqrt(max_num_patches)),
  so each image has the same number of tokens; the processor would keep a non-square image's aspect.

The residual stream after block ``i`` (== ``hidden_states[i + 1]`` of transformers'
``output_hidden_states=True``) is read by forward hooks on the encoder's blocks, and the forward
pass stops after the last requested block, so later blocks are never computed.

Preprocessing follows the checkpoint's own ``preprocessor_config.json`` (see
``actcache.images.ImageTransform``), or the family's standard defaults when there is none.
``describe_checkpoint`` reads only the two JSON configs (no weights, no torch model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from typing import TYPE_CHECKING

import numpy as np
import PIL.Image

from actcache.errors import ConfigError, DumpError
from actcache.images import ImageTransform
from actcache.protocol import FAMILIES

if TYPE_CHECKING:  # annotations only: torch is imported where a model is built
    import torch

logger = logging.getLogger(__name__)

FAMILY_MODEL_TYPES = {
    "clip": ("clip", "clip_vision_model"),
    "siglip": ("siglip", "siglip_vision_model"),
    "dinov2": ("dinov2", "dinov2_with_registers"),
    "dinov3": ("dinov3_vit",),
    "siglip2": ("siglip2", "siglip2_vision_model"),
}
TWO_TOWER = ("clip", "siglip", "siglip2")  # model types whose vision settings sit in vision_config
PREPROCESSOR_FILE = "preprocessor_config.json"

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
BILINEAR, BICUBIC = int(PIL.Image.Resampling.BILINEAR), int(PIL.Image.Resampling.BICUBIC)

# Class defaults of transformers' image processors, used for keys a preprocessor_config.json omits.
_PROCESSOR_DEFAULTS = {
    "CLIPImageProcessor": dict(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, resample=BICUBIC, default_to_square=False,
    ),
    "BitImageProcessor": dict(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, resample=BICUBIC, default_to_square=False,
    ),
    "SiglipImageProcessor": dict(
        size={"height": 224, "width": 224}, crop_size=None, do_center_crop=False,
        image_mean=HALF, image_std=HALF, resample=BICUBIC, default_to_square=False,
    ),
    "ViTImageProcessor": dict(
        size={"height": 224, "width": 224}, crop_size=None, do_center_crop=False,
        image_mean=HALF, image_std=HALF, resample=BILINEAR, default_to_square=True,
    ),
    "DINOv3ViTImageProcessor": dict(
        size={"height": 224, "width": 224}, crop_size=None, do_center_crop=False,
        image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, resample=BILINEAR, default_to_square=True,
    ),
    "Siglip2ImageProcessor": dict(
        size=None, crop_size=None, do_center_crop=False, patch_size=16, max_num_patches=256,
        image_mean=HALF, image_std=HALF, resample=BILINEAR, default_to_square=True,
    ),
}  # fmt: skip
_FAMILY_PROCESSOR = {"clip": "CLIPImageProcessor", "siglip": "SiglipImageProcessor", "dinov2": "BitImageProcessor",
                     "dinov3": "DINOv3ViTImageProcessor", "siglip2": "Siglip2ImageProcessor"}  # fmt: skip
NO_CLS = ("siglip", "siglip2")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Shapes of one checkpoint's activations, as the cache metadata records them.

    ``image_size`` is the side of the preprocessed (square) input, which sets ``n_patches_per_img``
    (for DINOv2 it comes from the preprocessor, e.g. 224, not the config's 518).
    """

    n_layers: int
    d_vit: int
    n_patches_per_img: int
    cls_token: bool
    image_size: int
    patch_size: int
    n_registers: int = 0

    @property
    def n_tokens_per_img(self) -> int:
        return self.n_patches_per_img + int(self.cls_token)


def _check_family(family: object) -> str:
    if family not in FAMILIES:
        raise ConfigError(f"vit_family {family!r} is not supported; use one of {list(FAMILIES)}")
    return family


def resolve_layers(layers, n_layers: int) -> tuple[int, ...]:
    """Block indices, negative ones counted from the end (-1 is the last block)."""
    if isinstance(layers, (int, str)) or not hasattr(layers, "__iter__"):
        raise ConfigError(f"layers must be a list of block indices, got {layers!r}")
    layers = list(layers)
    if not layers:
        raise ConfigError("layers is empty; list at least one block index (e.g. [-2])")
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ConfigError(f"layer {layer!r} is not an integer block index")
        if not -n_layers <= layer < n_layers:
            raise ConfigError(
                f"layer {int(layer)} does not exist: the model has {n_layers} blocks, so layers must be in "
                f"[{-n_layers}, {n_layers - 1}] (negative counts from the end)"
            )
        out.append(int(layer) % n_layers)
    if len(set(out)) != len(out):
        raise ConfigError(f"layers {layers} name the same block twice (model depth {n_layers}); list each block once")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Reading checkpoints (configs only)


def is_local_checkpoint(ckpt: str) -> bool:
    """Whether ``ckpt`` names a local directory (absolute, ./ or ~, more than one slash) rather than a hub id."""
    return os.path.exists(ckpt) or os.path.isabs(ckpt) or ckpt.startswith((".", "~")) or ckpt.count("/") > 1


# Keys describe_checkpoint needs; when a local config.json has them all, it is read as plain JSON
# (no transformers import: the workflow parses many experiments at start-up).
_NEEDED = ("hidden_size", "num_hidden_layers", "image_size", "patch_size")


def _fast_vision_config(family: str, path: str):
    """(vision config namespace, model_type) from a local config.json, or None to ask transformers."""
    import types

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fd:
            doc = json.load(fd)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    model_type = doc.get("model_type")
    if model_type not in FAMILY_MODEL_TYPES[family]:
        return None  # transformers gives the precise error (or knows an alias)
    vision = doc.get("vision_config") if model_type in TWO_TOWER else doc
    needed = _NEEDED if family != "siglip2" else (*_NEEDED[:2], "num_patches", "patch_size")
    if not isinstance(vision, dict) or not all(isinstance(vision.get(k), int) for k in needed):
        return None
    if model_type in ("dinov2_with_registers", "dinov3_vit") and not isinstance(vision.get("num_register_tokens"), int):
        return None
    return types.SimpleNamespace(**vision), model_type


def _read_vision_config(family: str, ckpt: str):
    """(vision config, model_type of the checkpoint) from its config.json."""
    if not isinstance(ckpt, str) or not ckpt:
        raise ConfigError(f"vit_ckpt must be a Hugging Face model id or a local directory, got {ckpt!r}")
    if is_local_checkpoint(ckpt):
        path = os.path.expanduser(ckpt)
        if not os.path.isdir(path):
            hint = ""
            if os.path.normpath(path).endswith(os.path.join("demo", "models", "tiny-clip")):
                hint = " (the offline demo's model: `actcache demo-assets` writes it, as scripts/demo.sh does)"
            raise ConfigError(f"vit_ckpt {ckpt!r}: checkpoint directory does not exist; fix the path{hint}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"vit_ckpt {ckpt!r}: no config.json in that directory; point it at a folder written by "
                "save_pretrained (config.json + weights)"
            )
        ckpt = path
        fast = _fast_vision_config(family, path)
        if fast is not None:
            return fast
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(ckpt)
    except (OSError, ValueError, KeyError) as e:
        local = f" A local folder named {ckpt!r} was not found: write it as ./{ckpt} or an absolute path." if ckpt.count("/") == 1 else ""
        raise ConfigError(
            f"vit_ckpt {ckpt!r}: cannot read its config.json as a Hub id ({type(e).__name__}: {e}). Use a local checkpoint "
            f"directory or a Hugging Face Hub id (reachable, or already in the HF cache when HF_HUB_OFFLINE=1).{local}"
        ) from e
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY_MODEL_TYPES[family]:
        guess = [f for f, types in FAMILY_MODEL_TYPES.items() if model_type in types]
        hint = f"set vit_family to {guess[0]!r}" if guess else f"use a {family} checkpoint"
        raise ConfigError(
            f"vit_ckpt {ckpt!r} is a {model_type!r} model, not a {family!r} one "
            f"(expected model_type in {list(FAMILY_MODEL_TYPES[family])}); {hint}"
        )
    if model_type in TWO_TOWER:
        config = config.vision_config
    return config, model_type


def _read_preprocessor_config(ckpt: str) -> dict | None:
    path = os.path.expanduser(ckpt)
    if os.path.isdir(path):
        file = os.path.join(path, PREPROCESSOR_FILE)
        if not os.path.isfile(file):
            return None
    else:
        from transformers.utils import cached_file

        try:
            file = cached_file(ckpt, PREPROCESSOR_FILE, _raise_exceptions_for_missing_entries=False)
        except OSError:
            file = None
        if file is None:
            return None
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not readable JSON ({e}); fix or delete it") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{file}: must hold a JSON object, got {type(doc).__name__}")
    return doc


def _family_default_transform(family: str, image_size: int) -> ImageTransform:
    if family == "clip":
        return ImageTransform(("shortest_edge", image_size), BICUBIC, (image_size, image_size), 1 / 255,
                              OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)  # fmt: skip
    if family == "siglip":
        return ImageTransform(("hw", image_size, image_size), BICUBIC, None, 1 / 255, HALF, HALF)
    if family == "siglip2":
        return ImageTransform(("hw", image_size, image_size), BILINEAR, None, 1 / 255, HALF, HALF)
    if family == "dinov3":
        return ImageTransform(("hw", image_size, image_size), BILINEAR, None, 1 / 255, IMAGENET_MEAN, IMAGENET_STD)
    short = int(round(256 * image_size / 224))
    return ImageTransform(("shortest_edge", short), BICUBIC, (image_size, image_size), 1 / 255,
                          IMAGENET_MEAN, IMAGENET_STD)  # fmt: skip


def _size_dict(value, default_to_square: bool, where: str, key: str) -> dict:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{where}: {key} must be an int, [height, width] or a mapping, got {value!r}")


def transform_from_preprocessor_config(doc: dict, family: str, where: str = PREPROCESSOR_FILE) -> ImageTransform:
    """The ImageTransform a transformers PIL image processor with this config would apply."""
    ptype = str(doc.get("image_processor_type") or "").removesuffix("Fast").removesuffix("Pil")
    defaults = _PROCESSOR_DEFAULTS.get(ptype) or _PROCESSOR_DEFAULTS[_FAMILY_PROCESSOR[family]]

    def get(key, default):
        value = doc.get(key)
        return default if value is None else value

    resize = None
    if "max_num_patches" in defaults:  # Siglip2: the side of the grid it gives a square image
        patch = int(get("patch_size", defaults["patch_size"]))
        budget = int(get("max_num_patches", defaults["max_num_patches"]))
        resize = ("hw", patch * math.isqrt(budget), patch * math.isqrt(budget))
    elif get("do_resize", True):
        size = _size_dict(get("size", defaults["size"]), defaults["default_to_square"], where, "size")
        if size.get("shortest_edge"):
            resize = ("shortest_edge", int(size["shortest_edge"]), size.get("longest_edge"))
        elif size.get("height") and size.get("width"):
            resize = ("hw", int(size["height"]), int(size["width"]))
        else:
            raise ConfigError(f"{where}: size {size!r} is not supported; use shortest_edge or height and width")
    crop = None
    if get("do_center_crop", defaults["do_center_crop"]):
        crop_size = _size_dict(get("crop_size", defaults["crop_size"]), True, where, "crop_size")
        if not (crop_size.get("height") and crop_size.get("width")):
            raise ConfigError(f"{where}: crop_size {crop_size!r} needs height and width")
        crop = (int(crop_size["height"]), int(crop_size["width"]))
    resample = get("resample", defaults["resample"])
    try:
        resample = int(PIL.Image.Resampling[resample.upper()] if isinstance(resample, str) else resample)
        PIL.Image.Resampling(resample)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{where}: resample {resample!r} is not a PIL resampling filter") from e
    rescale = float(get("rescale_factor", 1 / 255)) if get("do_rescale", True) else None
    mean = std = None
    if get("do_normalize", True):
        mean, std = get("image_mean", defaults["image_mean"]), get("image_std", defaults["image_std"])
        mean = tuple(float(m) for m in (mean if isinstance(mean, (list, tuple)) else [mean] * 3))
        std = tuple(float(s) for s in (std if isinstance(std, (list, tuple)) else [std] * 3))
        if len(mean) != 3 or len(std) != 3:
            raise ConfigError(f"{where}: image_mean/image_std need 3 values (RGB), got {mean} / {std}")
    return ImageTransform(resize, resample, crop, rescale, mean, std)


def _inspect(family: str, ckpt: str):
    """(vision config, model_type, ModelDims, ImageTransform), from JSON configs only."""
    _check_family(family)
    config, model_type = _read_vision_config(family, ckpt)
    patch_size = config.patch_size
    # Siglip2 has no fixed input size: its config gives the patch budget of the position grid.
    image_size = config.image_size if family != "siglip2" else patch_size * math.isqrt(config.num_patches)
    doc = _read_preprocessor_config(ckpt)
    where = os.path.join(ckpt, PREPROCESSOR_FILE)
    if doc is None:
        logger.warning(
            "%s has no %s; using the standard %s preprocessing for image_size %d", ckpt, PREPROCESSOR_FILE,
            family, image_size,
        )  # fmt: skip
        transform = _family_default_transform(family, image_size)
    else:
        transform = transform_from_preprocessor_config(doc, family, where)
    out = transform.output_size()
    if out is None:
        raise ConfigError(
            f"{where}: the preprocessing gives images of varying size (resize by shortest_edge without a "
            "center crop); enable do_center_crop with a crop_size, or resize to height and width"
        )
    if out[0] != out[1]:
        raise ConfigError(f"{where}: only square model inputs are supported, the preprocessing gives {out[0]}x{out[1]}")
    if family in ("clip", "siglip") and out[0] != image_size:
        raise ConfigError(
            f"{where}: the preprocessing gives {out[0]}x{out[1]} images but the {family} model takes "
            f"{image_size}x{image_size}; fix size/crop_size"
        )
    with_registers = ("dinov2_with_registers", "dinov3_vit")
    n_registers = int(getattr(config, "num_register_tokens", 0) or 0) if model_type in with_registers else 0
    dims = ModelDims(
        n_layers=int(config.num_hidden_layers),
        d_vit=int(config.hidden_size),
        n_patches_per_img=(out[0] // patch_size) * (out[1] // patch_size),
        cls_token=family not in NO_CLS,
        image_size=int(out[0]),
        patch_size=int(patch_size),
        n_registers=n_registers,
    )
    return config, model_type, dims, transform


def describe_checkpoint(family: str, ckpt: str) -> ModelDims:
    """Activation shapes of ``ckpt`` from its config.json and preprocessor_config.json (no weights)."""
    return _inspect(family, ckpt)[2]


def load_transform(family: str, ckpt: str) -> ImageTransform:
    """The checkpoint's preprocessing (picklable: use it in DataLoader workers)."""
    return _inspect(family, ckpt)[3]


# ---------------------------------------------------------------------------------------------
# Loading and running


class _StopForward(Exception):
    """Raised by the hook on the last requested block to skip the rest of the model."""


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _model_class(model_type: str):
    import transformers

    name = {
        "clip": "CLIPVisionModel", "clip_vision_model": "CLIPVisionModel",
        "siglip": "SiglipVisionModel", "siglip_vision_model": "SiglipVisionModel",
        "dinov2": "Dinov2Model", "dinov2_with_registers": "Dinov2WithRegistersModel",
        "dinov3_vit": "DINOv3ViTModel", "siglip2": "Siglip2VisionModel", "siglip2_vision_model": "Siglip2VisionModel",
    }[model_type]  # fmt: skip
    try:
        return getattr(transformers, name)
    except AttributeError as e:
        raise ConfigError(
            f"transformers {transformers.__version__} has no {name}; upgrade transformers to load this checkpoint"
        ) from e


def _find_blocks(model: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList:
    import torch

    for path in ("encoder.layers", "encoder.layer", "vision_model.encoder.layers", "vision_model.encoder.layer",
                 "model.layer"):  # fmt: skip
        with contextlib.suppress(AttributeError):
            blocks = model.get_submodule(path)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) == n_layers:
                return blocks
    raise DumpError(f"cannot find the {n_layers} encoder blocks in {type(model).__name__}; unsupported model layout")


# Parts after the last block that actcache never runs; a checkpoint may lack their weights.
_UNUSED_TOP = {"head", "post_layernorm", "layernorm", "pooler", "norm"}


def load_vit(family: str, ckpt: str, device: str | torch.device = "cpu") -> Vit:
    import torch

    """Load a ViT (float32, eval mode) from a Hugging Face Hub id or a local directory."""
    import transformers

    config, model_type, dims, transform = _inspect(family, ckpt)
    path = os.path.expanduser(ckpt) if os.path.isdir(os.path.expanduser(ckpt)) else ckpt
    cls = _model_class(model_type)
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = {"dtype": torch.float32} if major_minor >= (4, 56) else {"torch_dtype": torch.float32}
    try:
        with _quiet_transformers():
            model, info = cls.from_pretrained(path, output_loading_info=True, **dtype_kw)
    except Exception as e:  # transformers and huggingface_hub raise many types for a bad checkpoint
        raise DumpError(
            f"vit_ckpt {ckpt!r}: cannot load {cls.__name__} weights ({type(e).__name__}: {e}); fix its "
            "config.json and weights, or point vit.ckpt at a directory written by save_pretrained"
        ) from e
    missing = [
        k for k in info.get("missing_keys", ()) if k.removeprefix("vision_model.").split(".")[0] not in _UNUSED_TOP
    ]
    if missing:
        raise DumpError(
            f"vit_ckpt {ckpt!r}: the weights lack {len(missing)} tensors the {family} model needs "
            f"(e.g. {sorted(missing)[:5]}); the checkpoint is incomplete or not a {family} vision model"
        )
    model = model.to(device).eval().requires_grad_(False)
    return Vit(family=family, ckpt=ckpt, dims=dims, transform=transform, model=model, device=torch.device(device))


class Vit:
    """A loaded ViT: ``preprocess(images) -> (B, 3, H, W)``; ``forward(pixels, layers) -> (B, L, T, D)``."""

    def __init__(self, family, ckpt, dims: ModelDims, transform: ImageTransform, model, device):
        self.family = family
        self.ckpt = ckpt
        self.dims = dims
        self.transform = transform
        self.model = model
        self.device = device
        self._blocks = _find_blocks(model, dims.n_layers)

    @property
    def blocks(self) -> torch.nn.ModuleList:
        """The encoder's residual blocks; block i's output is layer i."""
        return self._blocks

    def __repr__(self) -> str:
        return f"Vit(family={self.family!r}, ckpt={self.ckpt!r}, dims={self.dims})"

    def preprocess(self, images: list[PIL.Image.Image]) -> torch.Tensor:
        import torch

        """PIL images (any size or mode) → float32 (B, 3, H, W) on the CPU."""
        s = self.dims.image_size
        if not images:
            return torch.zeros((0, 3, s, s), dtype=torch.float32)
        return torch.from_numpy(np.stack([self.transform(img) for img in images]))

    def forward(self, pixels_B3HW: torch.Tensor, layers) -> torch.Tensor:
        """Residual stream after each block in ``layers`` (in that order) → float32 (B, L, T, D).

        T is ``n_patches_per_img`` plus the CLS token (first) when the family has one; DINOv2
        register tokens are dropped. The result is on the model's device.
        """
        import torch

        idx = resolve_layers(layers, self.dims.n_layers)
        s = self.dims.image_size
        if pixels_B3HW.ndim != 4 or tuple(pixels_B3HW.shape[1:]) != (3, s, s):
            raise DumpError(
                f"{self.family} {self.ckpt!r} takes pixels shaped (B, 3, {s}, {s}), got {tuple(pixels_B3HW.shape)}; "
                "use Vit.preprocess"
            )
        last = max(idx)
        captured: dict[int, torch.Tensor] = {}

        def hook_for(i: int):
            def hook(module, args, output):
                captured[i] = output[0] if isinstance(output, (tuple, list)) else output
                if i == last:
                    raise _StopForward

            return hook

        handles = [self._blocks[i].register_forward_hook(hook_for(i)) for i in set(idx)]
        try:
            with torch.inference_mode():
                try:
                    self.model(**self._model_inputs(pixels_B3HW.to(self.device, torch.float32)))
                except _StopForward:
                    pass
                acts_BLTD = torch.stack([captured[i] for i in idx], dim=1)
                if self.dims.n_registers:
                    r = self.dims.n_registers
                    acts_BLTD = torch.cat([acts_BLTD[:, :, :1], acts_BLTD[:, :, 1 + r :]], dim=2)
        finally:
            for h in handles:
                h.remove()
        want = (pixels_B3HW.shape[0], len(idx), self.dims.n_tokens_per_img, self.dims.d_vit)
        if tuple(acts_BLTD.shape) != want:
            raise DumpError(f"{self.family} {self.ckpt!r} gave activations {tuple(acts_BLTD.shape)}, expected {want}")
        return acts_BLTD.float()

    def _model_inputs(self, pixels_B3HW: torch.Tensor) -> dict:
        """The model's keyword inputs: pixels, or for siglip2 the flattened patches of its processor
        ((B, N, p*p*3), rows then columns, each patch in (row, column, channel) order) with a mask."""
        if self.family != "siglip2":
            return {"pixel_values": pixels_B3HW}
        import torch

        p, (B, C, H, W) = self.dims.patch_size, pixels_B3HW.shape
        nh, nw = H // p, W // p
        patches = pixels_B3HW.reshape(B, C, nh, p, nw, p).permute(0, 2, 4, 3, 5, 1).reshape(B, nh * nw, p * p * C)
        mask = torch.ones((B, nh * nw), dtype=torch.int32, device=pixels_B3HW.device)
        shapes = torch.tensor([[nh, nw]] * B, dtype=torch.long, device=pixels_B3HW.device)
        return {"pixel_values": patches, "pixel_attention_mask": mask, "spatial_shapes": shapes}

    __call__ = forward
