"""protocol.py: metadata fields, content hash, shard sizing and coordinates (spec §2-§5)."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import make_metadata

from actcache.errors import ProtocolError, VersionError
from actcache.protocol import Metadata, ProtocolWarning, content_hash, read_shards, shard_name, write_shards

# Canonical JSON written out by hand (sorted keys, no spaces, ASCII escapes), hashed with hashlib
# directly: the expected digests do not go through protocol.py.
VECTORS = [
    (
        {
            "vit_family": "clip",
            "vit_ckpt": "openai/clip-vit-base-patch16",
            "layers": [-2],
            "n_patches_per_img": 196,
            "cls_token": True,
            "d_vit": 768,
            "n_imgs": 1281167,
            "max_patches_per_shard": 2400000,
            "data": {"__class__": "ImageFolder", "root": "/fs/scratch/imagenet/train"},
            "dtype": "float32",
            "protocol": "1.0.0",
        },
        '{"cls_token":true,"d_vit":768,"data":{"__class__":"ImageFolder","root":"/fs/scratch/imagenet/train"},'
        '"dtype":"float32","layers":[-2],"max_patches_per_shard":2400000,"n_imgs":1281167,'
        '"n_patches_per_img":196,"protocol":"1.0.0","vit_ckpt":"openai/clip-vit-base-patch16","vit_family":"clip"}',
    ),
    (
        {
            "vit_family": "siglip",
            "vit_ckpt": "google/siglip-base-patch16-224",
            "layers": [3, 7, 11],
            "n_patches_per_img": 196,
            "cls_token": False,
            "d_vit": 768,
            "n_imgs": 50000,
            "max_patches_per_shard": 2400000,
            "data": {"__class__": "HfDiskDataset", "path": "/data/in1k", "split": "validation", "label_key": None},
            "dtype": "float32",
            "protocol": "1.0.0",
        },
        '{"cls_token":false,"d_vit":768,"data":{"__class__":"HfDiskDataset","label_key":null,"path":"/data/in1k",'
        '"split":"validation"},"dtype":"float32","layers":[3,7,11],"max_patches_per_shard":2400000,"n_imgs":50000,'
        '"n_patches_per_img":196,"protocol":"1.0.0","vit_ckpt":"google/siglip-base-patch16-224","vit_family":"siglip"}',
    ),
    (
        {
            "vit_family": "dinov2",
            "vit_ckpt": "/models/dinov2-s\u00e9rie",
            "layers": [0, 5, 11, -1],
            "n_patches_per_img": 256,
            "cls_token": True,
            "d_vit": 384,
            "n_imgs": 7,
            "max_patches_per_shard": 2056,
            "data": {"__class__": "SyntheticImages", "n_imgs": 7, "seed": 3, "size": 64.5},
            "dtype": "float32",
            "protocol": "1.0.0",
        },
        '{"cls_token":true,"d_vit":384,"data":{"__class__":"SyntheticImages","n_imgs":7,"seed":3,"size":64.5},'
        '"dtype":"float32","layers":[0,5,11,-1],"max_patches_per_shard":2056,"n_imgs":7,"n_patches_per_img":256,'
        '"protocol":"1.0.0","vit_ckpt":"/models/dinov2-s\\u00e9rie","vit_family":"dinov2"}',
    ),
]


@pytest.mark.parametrize("doc,canonical", VECTORS)
def test_hash_vectors(doc, canonical, tmp_path):
    expected = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    md = Metadata.from_dict(doc)
    assert md.hash == expected
    assert len(md.hash) == 64
    # Also through the file and back: dump + load keeps the hash.
    md.dump(tmp_path)
    assert Metadata.load(tmp_path).hash == expected
    assert content_hash(json.loads((tmp_path / "metadata.json").read_text())) == expected


def test_hash_first_vector_is_stable():
    # Pinned digest: a change here means caches in the wild would no longer be found.
    assert Metadata.from_dict(VECTORS[0][0]).hash == hashlib.sha256(VECTORS[0][1].encode()).hexdigest()
    assert Metadata.from_dict(VECTORS[0][0]).hash.startswith(hashlib.sha256(VECTORS[0][1].encode()).hexdigest()[:8])


def test_hash_changes_with_any_field():
    base = Metadata.from_dict(VECTORS[0][0])
    changed = dict(VECTORS[0][0], layers=[-2, -1])
    assert Metadata.from_dict(changed).hash != base.hash
    changed = dict(VECTORS[0][0], data={**VECTORS[0][0]["data"], "root": "/other"})
    assert Metadata.from_dict(changed).hash != base.hash


def test_metadata_fields_and_types():
    doc = dict(VECTORS[0][0])
    md = Metadata.from_dict(doc)
    assert md.to_dict() == doc
    assert isinstance(md.layers, tuple)
    for field, bad in [("cls_token", 1), ("d_vit", "768"), ("layers", [1.5]), ("data", []), ("n_imgs", True)]:
        with pytest.raises(ProtocolError, match=field):
            Metadata.from_dict(dict(doc, **{field: bad}))
    missing = {k: v for k, v in doc.items() if k != "d_vit"}
    with pytest.raises(ProtocolError, match="missing required field.*d_vit"):
        Metadata.from_dict(missing)
    with pytest.raises(ProtocolError, match="vit_family"):
        Metadata.from_dict(dict(doc, vit_family="resnet"))
    with pytest.raises(ProtocolError, match="float32"):
        Metadata.from_dict(dict(doc, dtype="float16"))
    with pytest.raises(ProtocolError, match="cannot hold one image"):
        Metadata.from_dict(dict(doc, max_patches_per_shard=100))


def test_versions():
    doc = dict(VECTORS[0][0])
    with pytest.raises(VersionError, match=r"2\.0\.0.*1\.0\.0"):
        Metadata.from_dict(dict(doc, protocol="2.0.0"))
    with pytest.raises(VersionError, match=r"0\.9\.1"):
        Metadata.from_dict(dict(doc, protocol="0.9.1"))
    with pytest.warns(ProtocolWarning, match="newer"):
        md = Metadata.from_dict(dict(doc, protocol="1.3.0", new_optional_key={"x": 1}))
    # An unknown newer-minor key is kept, so the hash of the file is unchanged.
    assert md.extra == {"new_optional_key": {"x": 1}}
    assert md.hash == content_hash(dict(doc, protocol="1.3.0", new_optional_key={"x": 1}))
    with pytest.raises(ProtocolError, match="not a version"):
        Metadata.from_dict(dict(doc, protocol="v1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Metadata.from_dict(dict(doc, protocol="1.0.7"))  # patch versions: silent


def test_sizing_spec_section_3():
    md = make_metadata(n_imgs=10, layers=(3, 7), n_patches=4, cls=True, d=8, max_patches=45)
    assert md.n_tokens_per_img == 5
    assert md.n_imgs_per_shard == 45 // (5 * 2) == 4
    assert md.n_shards == 3
    assert md.shard_shape == (4, 2, 5, 8)
    assert [s.n_imgs for s in md.expected_shards()] == [4, 4, 2]
    assert md.shard_nbytes == 4 * 2 * 5 * 8 * 4
    exact = make_metadata(n_imgs=12, imgs_per_shard=4)
    assert exact.n_shards == 3 and [s.n_imgs for s in exact.expected_shards()] == [4, 4, 4]  # no empty trailing shard
    nocls = make_metadata(cls=False, n_patches=4)
    assert nocls.n_tokens_per_img == 4


def test_shards_json_roundtrip(tmp_path):
    md = make_metadata(n_imgs=9)
    write_shards(tmp_path, md.expected_shards())
    assert read_shards(tmp_path) == md.expected_shards()
    assert json.loads((tmp_path / "shards.json").read_text()) == [
        {"name": "acts000000.bin", "n_imgs": 4},
        {"name": "acts000001.bin", "n_imgs": 4},
        {"name": "acts000002.bin", "n_imgs": 1},
    ]
    assert shard_name(123) == "acts000123.bin"


def test_layer_errors_list_recorded_layers():
    md = make_metadata(layers=(3, 7))
    with pytest.raises(ProtocolError, match=r"layer 5 is not recorded.*\[3, 7\]"):
        md.locate(0, 5, 0)
    with pytest.raises(IndexError, match="out of range"):
        md.locate(md.n_imgs, 3, 0)
    with pytest.raises(IndexError, match="token index"):
        md.locate(0, 3, md.n_tokens_per_img)


shapes = st.fixed_dictionaries(
    {
        "n_imgs": st.integers(1, 23),
        "n_layers": st.integers(1, 4),
        "n_patches": st.integers(1, 6),
        "cls": st.booleans(),
        "d": st.integers(1, 5),
        "imgs_per_shard": st.integers(1, 7),
    }
)


@settings(max_examples=60, deadline=None)
@given(shapes, st.data())
def test_locate_matches_flat_reference(p, data):
    """Coordinates -> (shard, byte offset) agree with a C-order flat index into the logical tensor."""
    layers = tuple(range(10, 10 + 3 * p["n_layers"], 3))
    T = p["n_patches"] + int(p["cls"])
    slack = data.draw(st.integers(0, T * len(layers) - 1))  # spare budget below one more image
    md = make_metadata(
        n_imgs=p["n_imgs"],
        layers=layers,
        n_patches=p["n_patches"],
        cls=p["cls"],
        d=p["d"],
        max_patches=p["imgs_per_shard"] * T * len(layers) + slack,
    )
    img = data.draw(st.integers(0, md.n_imgs - 1))
    li = data.draw(st.integers(0, len(layers) - 1))
    tok = data.draw(st.integers(0, T - 1))
    loc = md.locate(img, layers[li], tok)
    S = md.n_imgs_per_shard
    assert S == p["imgs_per_shard"]
    # Naive reference: flat vector index in the whole logical tensor, then split by shard bytes.
    flat = np.ravel_multi_index((img, li, tok), (md.n_imgs, len(layers), T))
    per_shard_vectors = S * len(layers) * T
    assert loc.shard_idx == flat // per_shard_vectors
    assert loc.offset_bytes == (flat % per_shard_vectors) * md.d_vit * 4
    assert loc.shard == shard_name(loc.shard_idx)


def test_forward_field_only_when_not_fp32_and_round_trips():
    md = make_metadata()
    assert "forward" not in md.to_dict() and md.forward == "fp32"
    bf = Metadata.from_dict({**md.to_dict(), "forward": "bf16"})
    assert bf.forward == "bf16" and bf.to_dict()["forward"] == "bf16" and bf.hash != md.hash and not bf.extra
    with pytest.warns(ProtocolWarning, match="forward"):  # written out by hand: kept, so the hash stays
        explicit = Metadata.from_dict({**md.to_dict(), "forward": "fp32"})
    assert explicit.hash == content_hash({**md.to_dict(), "forward": "fp32"})
    with pytest.raises(ProtocolError, match="field 'forward' is 'fp16'; allowed: fp32, tf32, bf16"):
        Metadata.from_dict({**md.to_dict(), "forward": "fp16"})
