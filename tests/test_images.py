"""actcache.images: dataset configs, stable order and labels, listing cache, decoding errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import PIL.Image
import pytest

from actcache.errors import ConfigError, DumpError
from actcache.images import (
    HfDiskDataset,
    ImageFolder,
    SyntheticImages,
    count_images,
    data_config_from_dict,
    data_config_from_metadata,
    metadata_data,
    open_dataset,
)


def _save(path, mode="RGB", size=(10, 8), fmt=None, seed=0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(seed)
    img = PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    img.save(path, format=fmt)
    return img


def _age(root, t=1_700_000_000):
    """Set every folder's mtime to a fixed past time (a listing of a folder that just changed is not cached)."""
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (t, t))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "imgs"
    _save(str(root / "dog" / "b.png"), seed=1)
    _save(str(root / "cat" / "z.JPG"), fmt="JPEG", seed=2)
    _save(str(root / "cat" / "a.jpeg"), mode="L", fmt="JPEG", seed=3)
    _save(str(root / "dog" / "sub" / "c.webp"), mode="RGBA", seed=4)
    _save(str(root / "cat" / ".hidden.png"), seed=5)  # hidden: skipped
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_order_and_labels(folder):
    ds = open_dataset(ImageFolder(str(folder)))
    assert len(ds) == 4 == count_images(ImageFolder(str(folder)))
    assert [os.path.relpath(ds.describe(i), folder) for i in range(4)] == [
        "cat/a.jpeg", "cat/z.JPG", "dog/b.png", os.path.join("dog", "sub", "c.webp")
    ]  # fmt: skip
    assert ds.class_names == ["cat", "dog"]
    assert ds.labels().tolist() == [0, 0, 1, 1]
    for i in range(4):
        img, label = ds[i]
        assert img.mode == "RGB" and img.size == (10, 8) and label == ds.labels()[i]


def test_flat_folder_has_no_labels(tmp_path):
    for name in ["b.png", "a.png", "c.BMP"]:
        _save(str(tmp_path / name), fmt="BMP" if name.endswith("BMP") else None)
    ds = open_dataset(ImageFolder(str(tmp_path)))
    assert [os.path.basename(ds.describe(i)) for i in range(3)] == ["a.png", "b.png", "c.BMP"]
    assert ds.labels() is None and ds.class_names is None and ds[0][1] == -1


def test_missing_or_empty_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere.*does not exist"):
        count_images(ImageFolder(str(tmp_path / "nowhere")))
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "x.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"empty.*no image files"):
        open_dataset(ImageFolder(str(tmp_path / "empty")))


def test_corrupt_image_names_file_and_index(tmp_path):
    _save(str(tmp_path / "a.png"))
    (tmp_path / "b.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    good = _save(str(tmp_path / "c.png"), size=(64, 64))
    with open(tmp_path / "c.png", "rb") as f:
        data = f.read()
    (tmp_path / "d.png").write_bytes(data[: len(data) // 2])  # truncated: header fine, pixels missing
    ds = open_dataset(ImageFolder(str(tmp_path)))
    assert np.array_equal(np.asarray(ds[2][0]), np.asarray(good))
    with pytest.raises(DumpError, match=r"image 1 .*b\.jpg"):
        ds[1]
    with pytest.raises(DumpError, match=r"image 3 .*d\.png"):
        ds[3]


def test_listing_cache_hit_and_invalidation(folder, tmp_path):
    cache_dir = tmp_path / "listings"
    cfg = ImageFolder(str(folder))
    _age(folder)
    assert count_images(cfg, listing_cache=str(cache_dir)) == 4
    (cache_file,) = cache_dir.iterdir()
    assert "cat/a.jpeg" in json.loads(cache_file.read_text())["files"]
    stamp = cache_file.stat().st_mtime_ns
    _age(folder)
    assert count_images(cfg, listing_cache=str(cache_dir)) == 4
    assert cache_file.stat().st_mtime_ns == stamp  # unchanged folders: the stored listing is used

    # a new image in a class folder changes that folder's mtime: re-listed
    _save(str(folder / "cat" / "new.png"))
    assert count_images(cfg, listing_cache=str(cache_dir)) == 5
    # a new class folder changes the root's mtime
    _age(folder)
    _save(str(folder / "emu" / "e.png"))
    ds = open_dataset(cfg, listing_cache=str(cache_dir))
    assert len(ds) == 6 and ds.class_names == ["cat", "dog", "emu"]
    # a corrupt cache file is ignored
    _age(folder)
    count_images(cfg, listing_cache=str(cache_dir))
    for f in cache_dir.iterdir():
        f.write_text("{garbage")
    assert count_images(cfg, listing_cache=str(cache_dir)) == 6
    assert not [f for f in os.listdir(cache_dir) if ".tmp-" in f]


def test_nested_listing_sees_images_added_and_deleted_at_depth_3(tmp_path):
    root, cache_dir = tmp_path / "imgs", str(tmp_path / "listings")
    _save(str(root / "train" / "cat" / "x" / "a.png"))
    _save(str(root / "train" / "dog" / "x" / "b.png"))
    cfg = ImageFolder(str(root))
    _age(root)
    assert count_images(cfg, listing_cache=cache_dir) == 2
    _save(str(root / "train" / "cat" / "x" / "c.png"))  # three folders down: only that folder's mtime moves
    _age(root, t=1_700_000_100)  # every folder aged again, to a new time: mtimes differ from the stored ones
    ds = open_dataset(cfg, listing_cache=cache_dir)
    assert [os.path.relpath(ds.describe(i), root) for i in range(3)] == [
        "train/cat/x/a.png", "train/cat/x/c.png", "train/dog/x/b.png"
    ]  # fmt: skip
    os.unlink(root / "train" / "dog" / "x" / "b.png")
    os.utime(root / "train" / "dog" / "x", (1_700_000_100, 1_700_000_100))  # the same mtime as stored...
    os.utime(root / "train" / "dog" / "x", (1_700_000_200, 1_700_000_200))  # ...then a deletion's
    assert count_images(cfg, listing_cache=cache_dir) == 2
    # a change the mtimes cannot show (a folder's mtime set back by hand): --relist lists again
    _save(str(root / "train" / "dog" / "x" / "d.png"))
    os.utime(root / "train" / "dog" / "x", (1_700_000_200, 1_700_000_200))
    assert count_images(cfg, listing_cache=cache_dir) == 2
    assert count_images(cfg, listing_cache=cache_dir, relist=True) == 3
    assert count_images(cfg, listing_cache=cache_dir) == 3


def test_fifo_with_an_image_name_is_skipped_with_a_warning_never_opened(folder, tmp_path, caplog):
    os.mkfifo(folder / "dog" / "x.png")
    cfg = ImageFolder(str(folder))
    ds = open_dataset(cfg, listing_cache=str(tmp_path / "listings"))  # would block forever if opened
    assert len(ds) == 4 and "dog/x.png" not in [os.path.relpath(ds.describe(i), folder) for i in range(4)]
    assert "skipped 1 entry with an image name that is not a regular file" in caplog.text and "x.png" in caplog.text
    # a FIFO put in place of a listed image after listing: an error naming it, not a hang
    os.unlink(folder / "dog" / "b.png")
    os.mkfifo(folder / "dog" / "b.png")
    with pytest.raises(DumpError, match=r"b\.png.*not a regular file"):
        ds[2]


def test_synthetic_images_are_deterministic():
    a = open_dataset(SyntheticImages(n_imgs=10, seed=3, size=16, n_classes=4))
    b = open_dataset(SyntheticImages(n_imgs=50, seed=3, size=16, n_classes=4))
    c = open_dataset(SyntheticImages(n_imgs=10, seed=4, size=16))
    assert len(a) == 10 == count_images(SyntheticImages(n_imgs=10))
    for i in (0, 7):
        assert np.array_equal(np.asarray(a[i][0]), np.asarray(b[i][0]))  # image i depends on (seed, i) only
        assert not np.array_equal(np.asarray(a[i][0]), np.asarray(c[i][0]))
    assert not np.array_equal(np.asarray(a[0][0]), np.asarray(a[1][0]))
    assert a[0][0].size == (16, 16) and a[0][0].mode == "RGB"
    assert a.labels().tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1] and a[5][1] == 1
    assert c.labels() is None and c[0][1] == -1
    with pytest.raises(IndexError):
        a[10]


def test_data_config_from_dict_and_metadata(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = data_config_from_dict({"kind": "image_folder", "root": "x/../imgs/"}, "exp.yaml")
    assert cfg == ImageFolder(str(tmp_path / "imgs")) and cfg.root == str(tmp_path / "imgs")
    assert metadata_data(cfg) == {"root": str(tmp_path / "imgs"), "__class__": "ImageFolder"}
    assert data_config_from_metadata(metadata_data(cfg)) == cfg
    syn = data_config_from_dict({"kind": "synthetic", "n_imgs": 5, "n_classes": 2}, "exp.yaml")
    assert metadata_data(syn) == {"n_imgs": 5, "seed": 0, "size": 64, "n_classes": 2, "__class__": "SyntheticImages"}
    hf = data_config_from_dict({"kind": "hf_disk", "path": "ds", "split": "train", "label_key": None}, "e.yaml")
    assert hf == HfDiskDataset(str(tmp_path / "ds"), "train", "image", None)

    bad = [
        ({"kind": "image_folder", "root": "r", "shuffle": True}, r"exp\.yaml.*'shuffle'.*allowed: \['root'\]"),
        ({"kind": "synthetic"}, r"exp\.yaml.*missing required key.*'n_imgs'"),
        ({"kind": "synthetic", "n_imgs": "10"}, r"exp\.yaml.*n_imgs.*'10'"),
        ({"kind": "synthetic", "n_imgs": True}, r"exp\.yaml.*n_imgs.*True"),
        ({"kind": "synthetic", "n_imgs": 0}, r"exp\.yaml.*n_imgs must be an integer >= 1, got 0"),
        ({"kind": "imagenet", "root": "r"}, r"exp\.yaml.*data\.kind.*'imagenet'"),
        ({"root": "r"}, r"exp\.yaml.*data\.kind.*None"),
        ({"kind": "image_folder", "root": 3}, r"exp\.yaml.*ImageFolder\.root.*3"),
        (["kind", "synthetic"], r"exp\.yaml.*mapping"),
    ]
    for d, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            data_config_from_dict(d, "exp.yaml")


def test_hf_disk_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    images = [PIL.Image.fromarray(rng.integers(0, 256, (12, 9, 3), dtype=np.uint8)) for _ in range(5)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"img": images, "label": [0, 1, 1, 0, 1]}, features=features)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))

    cfg = HfDiskDataset(str(tmp_path / "dd"), split="train", image_key="img")
    assert count_images(cfg) == 5
    opened = open_dataset(cfg)
    assert opened.labels().tolist() == [0, 1, 1, 0, 1] and opened.class_names == ["a", "b"]
    img, label = opened[2]
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), np.asarray(images[2])) and label == 1
    assert "row 2" in opened.describe(2)
    assert count_images(HfDiskDataset(str(tmp_path / "dd"), split="test", image_key="img", label_key=None)) == 2

    with pytest.raises(ConfigError, match=r"image_key is 'image'.*\['img', 'label'\]"):
        count_images(HfDiskDataset(str(tmp_path / "dd"), split="train"))
    with pytest.raises(ConfigError, match=r"label_key is 'y'.*\['img', 'label'\]"):
        open_dataset(HfDiskDataset(str(tmp_path / "dd"), split="train", image_key="img", label_key="y"))
    with pytest.raises(ConfigError, match=r"split is None.*\['test', 'train'\]"):
        count_images(HfDiskDataset(str(tmp_path / "dd"), image_key="img"))
    with pytest.raises(ConfigError, match="does not exist"):
        count_images(HfDiskDataset(str(tmp_path / "missing")))


@pytest.mark.parametrize(
    "plant",
    [
        lambda files: ["../../outside/evil.png", *files],  # a path leaving the folder
        lambda files: [*files, "emu/ghost.png"],  # one more image than the folder holds
        lambda files: sorted(files, reverse=True),
        lambda files: files[1:],  # an entry cut from the listing (and its digest)
        lambda files: ["/etc/passwd.png", *files],  # absolute
        lambda files: [*files[:-1], "dog/.sub/c.webp"],  # a hidden part
    ],
)
def test_planted_listing_is_rebuilt_from_the_folder(folder, tmp_path, caplog, plant):
    cache_dir = tmp_path / "listings"
    cfg = ImageFolder(str(folder))
    _age(folder)
    assert count_images(cfg, listing_cache=str(cache_dir)) == 4
    (cache_file,) = cache_dir.iterdir()
    doc = json.loads(cache_file.read_text())
    doc["files"] = plant(doc["files"])
    cache_file.write_text(json.dumps(doc))
    assert count_images(cfg, listing_cache=str(cache_dir)) == 4
    doc["digest"] = hashlib.sha256("\\n".join(doc["files"]).encode()).hexdigest()  # edited to match as well
    cache_file.write_text(json.dumps(doc))
    ds = open_dataset(cfg, listing_cache=str(cache_dir))
    assert len(ds) == 4 and all(os.path.realpath(ds.describe(i)).startswith(str(folder)) for i in range(4))
    assert json.loads(cache_file.read_text())["files"] == ["cat/a.jpeg", "cat/z.JPG", "dog/b.png", "dog/sub/c.webp"]
    assert "ignoring image listing cache" in caplog.text


def test_listing_of_another_folder_once_at_the_same_path_is_not_used(folder, tmp_path):
    cache_dir = tmp_path / "listings"
    cfg = ImageFolder(str(folder))
    _age(folder)
    assert count_images(cfg, listing_cache=str(cache_dir)) == 4
    # another folder now at the same path, with the same subfolders and times but one image less
    os.rename(folder, tmp_path / "old")
    shutil.copytree(tmp_path / "old", folder)
    os.unlink(folder / "dog" / "b.png")
    _age(folder)
    assert count_images(cfg, listing_cache=str(cache_dir)) == 3


@pytest.mark.parametrize("kind", ["clip", "dinov2"])
def test_16_bit_palette_cmyk_and_alpha_images_equal_transformers_processor_output(tmp_path, kind, caplog):
    from actcache.images import check_headers
    from actcache.models import load_transform
    from fixtures_vit import FAMILY, build_processor, make_checkpoint

    rng = np.random.default_rng(0)
    rgb = PIL.Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    rgba = rgb.convert("RGBA")
    rgba.putalpha(PIL.Image.fromarray(rng.integers(0, 256, (40, 50), dtype=np.uint8)))
    root = tmp_path / "imgs"
    root.mkdir()
    PIL.Image.fromarray(rng.integers(0, 65536, (40, 50)).astype(np.uint16)).save(root / "a16.png")
    rgb.convert("P", palette=PIL.Image.Palette.ADAPTIVE).save(root / "b_palette.png", transparency=3)
    rgb.convert("CMYK").save(root / "c_cmyk.jpg")
    rgba.save(root / "d_rgba.png")
    rgba.convert("LA").save(root / "e_la.png")
    with PIL.Image.open(root / "a16.png") as img:
        assert img.mode == "I;16"

    ckpt = make_checkpoint(str(tmp_path / kind), kind)
    transform, proc = load_transform(FAMILY[kind], ckpt), build_processor(kind)
    ds = open_dataset(ImageFolder(str(root)))
    for i in range(len(ds)):
        with PIL.Image.open(ds.describe(i)) as img:  # the file as decoded, unconverted: the processor converts
            want = np.asarray(proc(images=[img], return_tensors="np")["pixel_values"])[0]
        np.testing.assert_array_equal(transform(ds[i][0]), want, err_msg=ds.describe(i))
    check_headers(ds, range(len(ds)))
    assert "1 of 5 images have 16 bits per channel" in caplog.text and "a16.png" in caplog.text
