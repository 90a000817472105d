"""Conversion between actcache's protocol v1 (or 2.0) and saev's current cache format (2.1).

    to_saev("dump/<HASH>", "out")            # -> out/saev/shards/<h>/, what saev HEAD's loaders read
    from_saev(".../saev/shards/<h>", "float32", "dump")   # -> dump/<HASH>/, a v1 cache (or 16-bit, 2.0)

Both copy values shard by shard (the two formats share the byte layout and examples-per-shard
formula, so shard i is shard i); the saev side is float32 only. Never unpickles saev's ``data``.

What each direction keeps and loses:
- to saev: values (16-bit caches widened exactly to float32), model, layers, tokens. ``data``
  becomes a pickle of saev's own ``saev.data.datasets.ImgFolder(root)`` for an image folder (what
  saev's tools unpickle); other datasets (Hugging Face on disk, synthetic) have no saev class, so
  ``data`` is a pickled plain dict of actcache's fields: saev's loaders never read it, its
  ``make_data_cfg()`` rejects it. Image class labels (labels.json/npy) have no saev place: lost.
  The family string is kept: saev's ``clip`` loads open_clip, actcache's transformers' CLIP.
- from saev: values, and saev's ``data``, ``dataset`` and ``pixel_agg`` kept verbatim in v1's
  ``data`` object (``__class__: SaevDataset``), so converting back gives saev's metadata and
  directory name unchanged; actcache cannot open that dataset (pages need ``--no-images``).
  labels.bin is not copied. Families outside actcache's (fake-clip, pe-*, bird-mae) are refused.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pathlib
import pickle
import shutil

import numpy as np

from actcache import saev
from actcache.errors import CacheIncompleteError, ConfigError
from actcache.protocol import DTYPES, FAMILIES, METADATA_FILE, SHARDS_FILE, Metadata, shard_name

log = logging.getLogger(__name__)
CHUNK_BYTES = 64 * 2**20  # values read, converted and written per step
SAEV_CLASS = "SaevDataset"  # v1 data.__class__ of a cache converted from saev
SAEV_DATASETS = "saev.data.datasets"


def _saev_data(md: Metadata) -> tuple[str, str, str, list[str]]:
    """(data, dataset, pixel_agg, what is lost) of saev's metadata for a v1 cache's ``data``."""
    data = md.data if isinstance(md.data, dict) else {}
    kind = data.get("__class__")
    if kind == SAEV_CLASS:
        return data["data"], data["dataset"], data["pixel_agg"], []
    fields = {k: v for k, v in data.items() if k != "__class__"}
    if kind == "ImageFolder":
        raw = _dataset_pickle("ImgFolder", {"root": pathlib.PurePosixPath(fields["root"])})
        return raw, fields["root"], "majority", []
    raw = base64.b64encode(pickle.dumps(dict(data), protocol=4)).decode()  # a dict of str/int: no classes
    where = fields.get("path") or ("synthetic" if kind == "SyntheticImages" else str(kind))
    return raw, where, "majority", [f"the {kind} dataset has no saev class: `data` is a plain dict saev's tools reject"]


def _dataset_pickle(cls: str, fields: dict) -> str:
    from actcache.saev_pickle import dataset_pickle

    return base64.b64encode(dataset_pickle(SAEV_DATASETS, cls, fields)).decode()


def saev_metadata(md: Metadata) -> tuple[saev.SaevMetadata, list[str]]:
    """The saev 2.1 metadata of a v1/2.0 cache, and notes on what the conversion loses or changes."""
    if md.foreign:
        raise ConfigError("the cache is already a saev cache; convert it to protocol v1 with --dtype")
    if md.vit_family not in saev.FAMILIES:
        raise ConfigError(f"family {md.vit_family!r} has no saev name; saev knows {', '.join(saev.FAMILIES)}")
    data, dataset, pixel_agg, lost = _saev_data(md)
    if md.dtype != "float32":
        lost.append(f"values: {md.dtype} widened exactly to float32 (saev stores float32 only); none lost")
    if md.vit_family == "clip":
        lost.append(
            "the family name 'clip' is kept, but saev's clip is open_clip's model and actcache's transformers' CLIP"
        )
    out = saev.SaevMetadata(
        vit_family=md.vit_family, vit_ckpt=md.vit_ckpt, layers=tuple(md.layers),
        n_patches_per_img=md.n_patches_per_img, cls_token=md.cls_token, d_vit=md.d_vit, n_imgs=md.n_imgs,
        max_patches_per_shard=md.max_patches_per_shard, data=data, dataset=dataset, pixel_agg=pixel_agg,
        dtype="float32", protocol="2.1",
    )  # fmt: skip
    return out, lost


def v1_metadata(md: saev.SaevMetadata, dtype: str) -> Metadata:
    """The protocol v1 (float32) or 2.0 (16-bit) metadata of a saev cache; saev's dataset fields kept."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not a cache dtype; use one of {', '.join(DTYPES)}")
    if md.vit_family not in FAMILIES:
        raise ConfigError(
            f"the saev cache's family {md.vit_family!r} is not one actcache runs ({', '.join(FAMILIES)}); "
            "train on it directly instead (`actcache train --cache DIR`)"
        )
    data = {"__class__": SAEV_CLASS, "data": md.data, "dataset": md.dataset, "pixel_agg": md.pixel_agg}
    return Metadata(
        vit_family=md.vit_family, vit_ckpt=md.vit_ckpt, layers=tuple(md.layers),
        n_patches_per_img=md.n_patches_per_img, cls_token=md.cls_token, d_vit=md.d_vit, n_imgs=md.n_imgs,
        max_patches_per_shard=md.max_patches_per_shard, data=data, dtype=dtype,
    )  # fmt: skip


def saev_dir(to_root: str | os.PathLike, md: saev.SaevMetadata) -> str:
    """``<root>/saev/shards/<h>`` (saev's loaders require those two parents); a root that already
    ends in saev/shards gets ``<root>/<h>``."""
    root = os.path.abspath(os.fspath(to_root))
    if pathlib.Path(root).parts[-2:] != ("saev", "shards"):
        root = os.path.join(root, "saev", "shards")
    return os.path.join(root, md.hash)


def _chunks(src, shard: int):
    """float32 blocks of one source shard, in order, each one guarded read (ActivationCache.read_shard)."""
    from actcache.dtypes import to_float32

    n = src.shards[shard].n_imgs
    step = max(1, CHUNK_BYTES // max(1, src.metadata.bytes_per_img))
    for a in range(0, n, step):
        yield to_float32(src.read_shard(shard, a, a + step), src.metadata.dtype)


def to_saev(src_dir: str | os.PathLike, to_root: str | os.PathLike) -> tuple[str, list[str]]:
    """Write the v1/2.0 cache ``src_dir`` as a saev 2.1 cache under ``to_root``; (its directory, notes on what was lost)."""
    from actcache.cache import ActivationCache

    src = ActivationCache.open(src_dir, out_dtype="stored")
    md, lost = saev_metadata(src.metadata)
    if src.labels is not None:
        lost.append("the image class labels (labels.json/npy): saev has per-patch labels only")
    dest = saev_dir(to_root, md)
    _not_inside(dest, src.path)
    if not os.path.isdir(dest):
        tmp = f"{dest}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        _write_saev(src, md, tmp)
        os.rename(tmp, dest)  # the directory appears complete or not at all (saev has no completion marker)
    _verify(dest)
    return dest, lost


def _write_saev(src, md: saev.SaevMetadata, path: str) -> None:
    full = md.n_imgs_per_shard * md.bytes_per_img
    n_files = md.n_imgs // md.n_imgs_per_shard + 1  # saev's writer adds an empty shard on an exact multiple
    table = []
    for i in range(n_files):
        name = shard_name(i)
        with open(os.path.join(path, name), "wb") as fd:
            n = 0
            if i < md.n_shards:
                for block in _chunks(src, i):
                    fd.write(np.ascontiguousarray(block, dtype="<f4").tobytes())
                    n += len(block)
            fd.truncate(full)  # zero padding, as saev writes every shard at full size
            os.fsync(fd.fileno())
        table.append({"name": name, "n_examples": n})
    with open(os.path.join(path, SHARDS_FILE), "w", encoding="utf-8") as fd:
        fd.write(json.dumps(table, indent=2))
    with open(os.path.join(path, METADATA_FILE), "w", encoding="utf-8") as fd:
        fd.write(json.dumps(md.to_dict(), indent=2, ensure_ascii=False))  # as orjson's 2-space indent


def from_saev(src_dir: str | os.PathLike, dtype: str, to_root: str | os.PathLike) -> str:
    """Write the saev cache ``src_dir`` as a protocol v1 (float32) or 2.0 (16-bit) cache under ``to_root``."""
    from actcache.cache import ActivationCache
    from actcache.dtypes import to_stored
    from actcache.writer import ensure_metadata, gather, open_shard_writer, shard_is_complete

    src = ActivationCache.open(src_dir, out_dtype="stored")
    if not src.metadata.foreign:
        raise ConfigError(f"{src.path}: not a saev cache; `actcache convert DIR --dtype D --to ROOT` converts it")
    md = v1_metadata(src.metadata, dtype)
    dest = os.path.join(os.path.abspath(os.fspath(to_root)), md.hash)
    _not_inside(dest, src.path)
    if not os.path.exists(os.path.join(dest, SHARDS_FILE)):
        ensure_metadata(to_root, md)
        for i in range(md.n_shards):
            if not shard_is_complete(dest, md, i):
                with open_shard_writer(dest, md, i) as w:
                    for block in _chunks(src, i):
                        w.write(to_stored(block, dtype))
        gather(dest)
    _verify(dest)
    return dest


def _not_inside(dest: str, src: str) -> None:
    """A converted cache is written outside its source (a saev cache is never written into)."""
    src = os.path.realpath(src)
    real = os.path.realpath(dest)
    if os.path.commonpath([real, src]) == src:
        raise ConfigError(
            f"--to: the converted cache {dest} would be written inside its source {src}; pick another root"
        )


def _verify(dest: str) -> None:
    from actcache.validate import check_dir

    rep = check_dir(dest, deep=True)
    bad = [p for p in rep.problems if "NaN/Inf" not in p]  # non-finite values are the source's own
    if bad:
        raise CacheIncompleteError(f"{dest}: the converted cache does not verify:\n  - " + "\n  - ".join(bad))
