"""actcache.models on tiny random checkpoints saved with save_pretrained (offline, no mocks)."""

from __future__ import annotations

import json
import os

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from actcache.errors import ConfigError
from actcache.models import (
    ModelDims,
    describe_checkpoint,
    load_transform,
    load_vit,
    resolve_layers,
    transform_from_preprocessor_config,
)
from fixtures_vit import (
    FAMILY,
    IMAGE,
    N_LAYERS,
    N_REGISTERS,
    PATCH,
    build_processor,
    make_checkpoint,
    mixed_images,
    pil_processor_class,
    reference_hidden_states,
    white_background,
)

N_PATCHES = (IMAGE // PATCH) ** 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {kind: make_checkpoint(str(root / kind), kind) for kind in FAMILY}


@pytest.mark.parametrize("kind", ["clip", "clip_full", "siglip", "dinov2", "dinov2_reg"])
def test_forward_equals_transformers_hidden_states(ckpts, kind):
    vit = load_vit(FAMILY[kind], ckpts[kind])
    pixels = vit.preprocess(mixed_images())
    assert pixels.shape == (5, 3, IMAGE, IMAGE) and pixels.dtype == torch.float32

    ref = reference_hidden_states(ckpts[kind], kind, pixels)
    has_cls = FAMILY[kind] != "siglip"
    n_reg = N_REGISTERS if kind == "dinov2_reg" else 0
    keep = ([0] if has_cls else []) + list(range(int(has_cls) + n_reg, ref[0].shape[1]))  # drop registers
    for layers in ([0, -1], [1], [-1, 0]):
        acts = vit.forward(pixels, layers)
        assert acts.shape == (5, len(layers), N_PATCHES + int(has_cls), 32) and acts.dtype == torch.float32
        for li, layer in enumerate(layers):
            expected = ref[layer % N_LAYERS + 1][:, keep]
            torch.testing.assert_close(acts[:, li], expected, atol=1e-5, rtol=1e-5)


def test_registers_are_not_stored(ckpts):
    vit = load_vit("dinov2", ckpts["dinov2_reg"])
    assert vit.dims.n_registers == N_REGISTERS and vit.dims.n_tokens_per_img == N_PATCHES + 1
    pixels = vit.preprocess(mixed_images()[:2])
    ref = reference_hidden_states(ckpts["dinov2_reg"], "dinov2_reg", pixels)
    acts = vit(pixels, [2])
    assert ref[3].shape[1] == 1 + N_REGISTERS + N_PATCHES
    torch.testing.assert_close(acts[:, 0, 0], ref[3][:, 0])  # CLS first
    torch.testing.assert_close(acts[:, 0, 1:], ref[3][:, 1 + N_REGISTERS :])  # then the patches, in order


def test_two_tower_clip_uses_the_checkpoints_vision_weights(ckpts):
    vit = load_vit("clip", ckpts["clip_full"])
    full = transformers.CLIPModel.from_pretrained(ckpts["clip_full"])
    ours = {k.removeprefix("vision_model."): v for k, v in vit.model.named_parameters()}
    theirs = {k.removeprefix("vision_model."): v for k, v in full.vision_model.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2"])
def test_forward_stops_after_the_last_requested_block(ckpts, kind):
    vit = load_vit(FAMILY[kind], ckpts[kind])
    n_hooks = [len(block._forward_hooks) for block in vit.blocks]
    calls = [0] * N_LAYERS
    handles = [
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(vit.blocks)
    ]
    try:
        pixels = vit.preprocess(mixed_images()[:1])
        vit.forward(pixels, [0])
        assert calls == [1, 0, 0]
        vit.forward(pixels, [1, 0])
        assert calls == [2, 1, 0]
        vit.forward(pixels, [-1])
        assert calls == [3, 2, 1]
    finally:
        for h in handles:
            h.remove()
    # the recording hooks are removed after each call, so the model is left as it was
    assert [len(block._forward_hooks) for block in vit.blocks] == n_hooks


@pytest.mark.parametrize("kind", ["clip", "clip_full", "siglip", "dinov2", "dinov2_reg"])
def test_describe_checkpoint_matches_real_output(ckpts, kind):
    dims = describe_checkpoint(FAMILY[kind], ckpts[kind])
    assert dims == load_vit(FAMILY[kind], ckpts[kind]).dims
    assert dims.cls_token == (FAMILY[kind] != "siglip")
    assert (dims.n_layers, dims.d_vit, dims.n_patches_per_img, dims.image_size) == (N_LAYERS, 32, N_PATCHES, IMAGE)


def test_dinov2_patch_count_follows_the_preprocessor_crop(tmp_path):
    # like facebook/dinov2-*: config image_size 518 but the processor crops 224
    ckpt = make_checkpoint(str(tmp_path / "d"), "dinov2", image_size=64, crop=24)
    dims = describe_checkpoint("dinov2", ckpt)
    assert dims == ModelDims(n_layers=3, d_vit=32, n_patches_per_img=9, cls_token=True, image_size=24, patch_size=8)
    vit = load_vit("dinov2", ckpt)
    assert vit.forward(vit.preprocess(mixed_images()), [-2]).shape == (5, 1, 10, 32)


def test_missing_preprocessor_config_uses_family_defaults(tmp_path, caplog):
    ckpt = make_checkpoint(str(tmp_path / "c"), "clip", preprocessor=False)
    with caplog.at_level("WARNING", logger="actcache.models"):
        transform = load_transform("clip", ckpt)
    assert "preprocessor_config.json" in caplog.text
    # the standard CLIP preprocessing at the model's image size
    proc = build_processor("clip", IMAGE)
    for img in mixed_images():
        want = proc(white_background(img), return_tensors="np").pixel_values[0]
        np.testing.assert_allclose(transform(img), want, atol=1e-5)


def test_transparency_is_composited_onto_white():
    # recent transformers do the same; older ones drop the alpha channel (see white_background)
    transform = transform_from_preprocessor_config(build_processor("clip", IMAGE).to_dict(), "clip")

    def images():  # made anew for each use: PIL moves a palette's transparency into the palette on load()
        rng = np.random.default_rng(3)
        rgba = PIL.Image.fromarray(rng.integers(0, 256, (33, 50, 4), dtype=np.uint8), "RGBA")
        pal = PIL.Image.fromarray(rng.integers(0, 16, (30, 30), dtype=np.uint8), "P")
        pal.putpalette(rng.integers(0, 200, 16 * 3, dtype=np.uint8).tobytes())
        pal.info["transparency"] = 0  # palette entry 0 (not white) is transparent
        la = PIL.Image.fromarray(rng.integers(0, 256, (40, 36, 2), dtype=np.uint8), "LA")
        return [rgba, pal, la]

    for k in range(3):
        got = transform.geometry(images()[k])
        np.testing.assert_array_equal(got, transform.geometry(white_background(images()[k])))
        dropped = PIL.Image.fromarray(np.asarray(images()[k].convert("RGB")))  # alpha dropped (PIL keeps a
        assert not np.array_equal(got, transform.geometry(dropped))  # palette's transparent colour in .info)


PROCESSOR_CASES = [
    ("clip", "CLIPImageProcessor", dict(size={"shortest_edge": 40}, crop_size={"height": 36, "width": 36})),
    ("clip", "CLIPImageProcessor", dict(size=30, crop_size=30, resample=2, do_normalize=False)),
    ("siglip", "SiglipImageProcessor", dict(size={"height": 48, "width": 48})),
    ("siglip", "SiglipImageProcessor", dict(size={"height": 20, "width": 20}, do_rescale=False)),
    ("dinov2", "BitImageProcessor", dict(size={"shortest_edge": 37}, crop_size={"height": 32, "width": 32},
                                         image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])),
    ("dinov2", "BitImageProcessor", dict(do_resize=False, crop_size={"height": 64, "width": 64})),  # pads small images
]  # fmt: skip


@pytest.mark.parametrize("family,cls_name,kwargs", PROCESSOR_CASES)
def test_preprocessing_matches_transformers_slow_processors(tmp_path, family, cls_name, kwargs):
    proc = pil_processor_class(cls_name)(**kwargs)
    proc.save_pretrained(str(tmp_path))
    with open(tmp_path / "preprocessor_config.json") as f:
        doc = json.load(f)
    transform = transform_from_preprocessor_config(doc, family)
    rng = np.random.default_rng(1)
    images = mixed_images(2) + [PIL.Image.fromarray(rng.integers(0, 256, (97, 23, 3), dtype=np.uint8))]
    for img in images:
        expected = proc(white_background(img), return_tensors="np").pixel_values[0]
        ours = transform(img)
        assert ours.shape == expected.shape and ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        # The dump's split: uint8 geometry in the workers, normalize() where the model runs: same bits.
        u8 = transform.geometry(img)
        assert u8.dtype == np.uint8 and u8.shape == (*ours.shape[1:], 3)
        np.testing.assert_array_equal(np.asarray(transform.geometry_image(img)), u8)  # the pages' crops
        split = transform.normalize(torch.from_numpy(np.stack([u8, u8])))
        assert split.dtype == torch.float32 and split.is_contiguous()
        np.testing.assert_array_equal(split.numpy(), np.stack([ours, ours]))


def test_resolve_layers():
    assert resolve_layers([-2], 12) == (10,)
    assert resolve_layers([0, 11, -3], 12) == (0, 11, 9)
    with pytest.raises(ConfigError, match=r"layer 12 .* 12 blocks.*\[-12, 11\]"):
        resolve_layers([12], 12)
    with pytest.raises(ConfigError, match="layer -13"):
        resolve_layers([-13], 12)
    with pytest.raises(ConfigError, match="same block twice"):
        resolve_layers([11, -1], 12)
    with pytest.raises(ConfigError, match="empty"):
        resolve_layers([], 12)
    with pytest.raises(ConfigError, match="'a'"):
        resolve_layers(["a"], 12)


def test_layer_beyond_depth_in_forward(ckpts):
    vit = load_vit("clip", ckpts["clip"])
    with pytest.raises(ConfigError, match=r"layer 3 .* 3 blocks"):
        vit.forward(vit.preprocess(mixed_images()[:1]), [0, 3])


def test_bad_family_and_checkpoints(ckpts, tmp_path):
    with pytest.raises(ConfigError, match=r"'vit'.*\['clip', 'siglip', 'dinov2', 'dinov3', 'siglip2'\]"):
        load_vit("vit", ckpts["clip"])
    with pytest.raises(ConfigError, match=r"'clip_vision_model' model, not a 'dinov2'.*vit_family to 'clip'"):
        describe_checkpoint("dinov2", ckpts["clip"])
    with pytest.raises(ConfigError, match=r"'dinov2_with_registers' model, not a 'siglip'"):
        load_vit("siglip", ckpts["dinov2_reg"])
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"nope.*does not exist"):
        load_vit("clip", missing)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no config.json"):
        describe_checkpoint("clip", str(tmp_path / "empty"))
    # a relative folder that is not there reads as a Hub id (offline here): the error says how to write a local one
    with pytest.raises(ConfigError, match=r"(?s)as a Hub id .*write it as \./models/nope or an absolute path"):
        describe_checkpoint("clip", "models/nope")


def test_bad_pixels_shape(ckpts):
    from actcache.errors import DumpError

    vit = load_vit("siglip", ckpts["siglip"])
    with pytest.raises(DumpError, match=r"\(B, 3, 32, 32\)"):
        vit.forward(torch.zeros(2, 3, 16, 16), [0])
