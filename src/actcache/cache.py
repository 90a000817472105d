"""ActivationCache: open and verify a hash directory, memory-map its shards lazily, index it.

    cache = ActivationCache.open("<dump_to>/<HASH>")
    cache[img]                  -> (L, T, D)
    cache[img, layer, token]    -> (D,)        layer is a recorded layer *value*
    cache[10:20]                -> (10, L, T, D), across shard boundaries
    cache[[3, 900, 7], -2]      -> (3, T, D)
    cache[ActIndex(...)]        -> see actcache.index
    cache[{"cat": 4}]           -> 4 random images of class "cat" (needs labels), (4, L, T, D)
    cache.query(sel, form="supervised") -> {"act": ..., "label": ...}

Arrays come back as numpy float32 copies (single-image reads read-only). A 16-bit cache
(protocol 2.0) gives float32, converted exactly, or with ``out_dtype="stored"`` its stored values
(float16, or bfloat16's raw bits as uint16: :mod:`actcache.dtypes`).

Every read goes through :class:`actcache.shardguard.ShardFiles`: plain reads (a shard cut
meanwhile is a short read, never SIGBUS), each shard checked after the read to be the file the
cache opened, unchanged (its identity, change time included), and, with ``verify_reads="first"``,
each checksum block checked against its record the first time the process reads it. A change is
a one-line ShardChangedError naming the shard, never wrong values.
"""

from __future__ import annotations

import os

import numpy as np

from actcache.dtypes import to_float32
from actcache.errors import ConfigError
from actcache.index import ALL, ActIndex
from actcache.labels import read_labels
from actcache.protocol import Metadata, ShardInfo, warn_breaking
from actcache.shardguard import DEFAULT_VERIFY_READS, ShardFiles
from actcache.validate import Report, validate_dir

FORMS = ("plain", "supervised", "unsupervised")
OUT_DTYPES = ("float32", "stored")


def check_out_dtype(out_dtype: str) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ConfigError(
            f"out_dtype={out_dtype!r}: use 'float32' (values converted exactly) or 'stored' (the cache's own "
            "16-bit values, for a GPU to convert)"
        )


class ActivationCache:
    def __init__(
        self,
        path: str,
        metadata: Metadata,
        shards: list[ShardInfo],
        report: Report | None = None,
        out_dtype: str = "float32",
        verify_reads: str = DEFAULT_VERIFY_READS,
    ):
        check_out_dtype(out_dtype)
        self.path = path
        self.metadata = metadata
        # reads convert stored 16-bit values to float32 unless the stored ones are asked for
        self.convert = out_dtype == "float32" and metadata.dtype != "float32"
        self.out_dtype = np.dtype(np.float32 if out_dtype == "float32" else metadata.storage)
        self.shards = [s for s in shards if s.n_imgs > 0]
        self.report = report
        S = metadata.n_imgs_per_shard
        self._starts = np.arange(len(self.shards), dtype=np.int64) * S
        # each shard's identity now; reads are checked against it (shardguard.py)
        need = [s.n_imgs * metadata.bytes_per_img for s in self.shards]
        self.files = ShardFiles(path, [s.name for s in self.shards], need, metadata.hash, verify_reads)
        self._labels: tuple[np.ndarray, list[str]] | None | bool = False

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | os.PathLike, check_hash: bool = True, out_dtype: str = "float32",
        verify_reads: str = DEFAULT_VERIFY_READS,
    ) -> ActivationCache:  # fmt: skip
        """Validate ``path`` (metadata, shard table, file sizes, hash) and open it; ``out_dtype``:
        "float32" (default) or "stored" (a 16-bit cache's own values, see the module doc);
        ``verify_reads``: "first" or "off" (see the module doc).

        Raises an ActCacheError subclass naming every problem. A cache of protocol 2.x gets the
        protocol's breaking warning (once).
        """
        check_out_dtype(out_dtype)
        path = os.fspath(path)
        rep = validate_dir(path, check_hash=check_hash)
        warn_breaking(rep.metadata, path)
        shards = [ShardInfo(s.name, s.n_imgs) for s in rep.shards]
        return cls(path, rep.metadata, shards, rep, out_dtype, verify_reads)

    def __repr__(self) -> str:
        md = self.metadata
        return (
            f"ActivationCache({self.path!r}, n_imgs={md.n_imgs}, layers={list(md.layers)}, "
            f"T={md.n_tokens_per_img}, D={md.d_vit}, shards={len(self.shards)})"
        )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def n_imgs(self) -> int:
        return self.metadata.n_imgs

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical 4-D tensor (n_imgs, L, T, D)."""
        md = self.metadata
        return (md.n_imgs, len(md.layers), md.n_tokens_per_img, md.d_vit)

    def __len__(self) -> int:
        return self.n_imgs

    # ---- shards ------------------------------------------------------------------------------
    def read_shard(self, shard_idx: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Images [start, stop) of one shard, stored values, (n, L, T, D): one guarded read."""
        s = self.shards[shard_idx]
        stop = s.n_imgs if stop is None else min(stop, s.n_imgs)
        md = self.metadata
        out = np.empty((max(0, stop - start), len(md.layers), md.n_tokens_per_img, md.d_vit), md.storage)
        if out.size:
            self.files.read_into(shard_idx, start * md.bytes_per_img, out)
        return out

    def _read_group(self, shard: int, local: np.ndarray, layer) -> np.ndarray:
        """Stored values of images ``local`` (indices in the shard) -> (n, L, T, D), or (n, T, D)
        when ``layer`` is one layer position (only that layer's bytes are read)."""
        md = self.metadata
        L, T, D = len(md.layers), md.n_tokens_per_img, md.d_vit
        uniq, inv = np.unique(local, return_inverse=True)
        if isinstance(layer, (int, np.integer)):
            slab = T * D * md.itemsize
            buf = np.empty((len(uniq), T, D), md.storage)
            for j, img in enumerate(uniq.tolist()):
                self.files.read_into(shard, img * md.bytes_per_img + int(layer) * slab, buf[j])
        else:
            buf = np.empty((len(uniq), L, T, D), md.storage)
            runs = np.flatnonzero(np.diff(uniq) != 1) + 1  # consecutive images: one read each stretch
            for lo, hi in zip(np.r_[0, runs].tolist(), np.r_[runs, len(uniq)].tolist(), strict=True):
                self.files.read_into(shard, int(uniq[lo]) * md.bytes_per_img, buf[lo:hi])
        return buf if np.array_equal(uniq, local) else buf[inv.reshape(-1)]

    def close(self) -> None:
        """Close the shard files (they are opened again on the next read)."""
        self.files.close()

    def __enter__(self) -> ActivationCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- indexing ----------------------------------------------------------------------------
    def _image_indices(self, sel) -> np.ndarray:
        n = self.n_imgs
        if isinstance(sel, slice):
            return np.arange(*sel.indices(n), dtype=np.int64)
        if isinstance(sel, str) and sel == ALL:
            return np.arange(n, dtype=np.int64)
        idx = np.asarray(sel)
        if idx.size == 0:
            return np.empty(0, np.int64)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean image mask has shape {idx.shape}, expected ({n},)")
            return np.flatnonzero(idx)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"image index must be an int, slice, list of ints or 'all', got {sel!r}")
        idx = idx.astype(np.int64).reshape(-1)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"image index {int(idx[bad][0])} out of range for a cache of {n} images")
        return np.where(idx < 0, idx + n, idx)

    def _layer_sel(self, layer):
        if isinstance(layer, slice) and layer == slice(None):
            return slice(None)
        if isinstance(layer, str) and layer == ALL:
            return slice(None)
        if isinstance(layer, (list, tuple)):
            return [self.metadata.layer_index(v) for v in layer]
        return self.metadata.layer_index(layer)

    def _token_sel(self, token):
        T = self.metadata.n_tokens_per_img
        if isinstance(token, str) and token == ALL:
            return slice(None)
        if isinstance(token, slice):
            return token
        if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
            if not -T <= token < T:
                raise IndexError(f"token index {token} out of range [0, {T}) for this cache")
            return int(token)
        idx = np.asarray(token)
        if idx.dtype.kind not in "iu" or ((idx < -T) | (idx >= T)).any():
            raise IndexError(f"token index {token!r} must be ints in [0, {T})")
        return idx

    @staticmethod
    def _sub(block_NLTD: np.ndarray, layer, token) -> np.ndarray:
        """Apply layer/token selections to a (N, L, T, D) block."""
        if not isinstance(layer, slice) or layer != slice(None):
            block_NLTD = block_NLTD[:, layer]
        if not isinstance(token, slice) or token != slice(None):
            block_NLTD = block_NLTD[:, :, token] if block_NLTD.ndim == 4 else block_NLTD[:, token]
        return block_NLTD

    def read_images(self, img_idx: np.ndarray, layer=slice(None), token=slice(None)) -> np.ndarray:
        """Gather images (any order, any shards) -> (N, ...) copy, grouped by shard for speed."""
        S = self.metadata.n_imgs_per_shard
        shard_of = img_idx // S
        out = None
        order = np.argsort(shard_of, kind="stable")
        bounds = np.flatnonzero(np.diff(shard_of[order])) + 1
        for group in np.split(order, bounds):
            if group.size == 0:
                continue
            sh = int(shard_of[group[0]])
            one = isinstance(layer, (int, np.integer))
            block = self._read_group(sh, img_idx[group] - sh * S, layer if one else None)
            if one:
                block = block if _every(token) else block[:, token]
            else:
                block = self._sub(block, layer, token)
            if out is None:
                out = np.empty((img_idx.size,) + block.shape[1:], self.out_dtype)
            out[group] = to_float32(block, self.metadata.dtype) if self.convert else block
        if out is None:  # no images selected: an empty array of the right trailing shape
            probe = self._sub(np.zeros((1,) + self.shape[1:], np.float32), layer, token)
            out = np.empty((0,) + probe.shape[1:], self.out_dtype)
        return out

    def __getitem__(self, key):
        if isinstance(key, ActIndex):
            return self.select(key)
        if isinstance(key, dict):
            return self.read_images(self.images_by_class(key))
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > 3:
            raise IndexError("index with at most (image, layer, token)")
        img = key[0]
        layer = self._layer_sel(key[1]) if len(key) > 1 else slice(None)
        token = self._token_sel(key[2]) if len(key) > 2 else slice(None)
        if isinstance(img, (int, np.integer)) and not isinstance(img, bool):
            i = int(self._image_indices([img])[0])
            sh, local = divmod(i, self.metadata.n_imgs_per_shard)
            one = isinstance(layer, (int, np.integer))
            view = self._read_group(sh, np.array([local]), layer if one else None)[0]
            if not one and not _every(layer):
                view = view[layer]
            if not _every(token):
                view = view[token] if view.ndim == 2 else view[:, token]
            out = to_float32(view, self.metadata.dtype) if self.convert else np.ascontiguousarray(view)
            out.flags.writeable = False  # (as the mapping's views were: a read never changes the cache)
            return out
        return self.read_images(self._image_indices(img), layer, token)

    def select(self, index: ActIndex) -> np.ndarray:
        """Read the array an ActIndex names (each 'all' axis kept, each number dropped)."""
        out = self[index.image, index.layer, index.token]
        if index.dim != ALL:
            D = self.metadata.d_vit
            if not 0 <= index.dim < D:
                raise IndexError(f"dim {index.dim} out of range [0, {D})")
            out = out[..., index.dim]
        return out

    # ---- labels (optional extra files; see actcache.labels) ----------------------------------
    def _load_labels(self):
        if self._labels is False:
            self._labels = read_labels(self.path, self.n_imgs)
        return self._labels

    @property
    def labels(self) -> np.ndarray | None:
        got = self._load_labels()
        return None if got is None else got[0]

    @property
    def class_names(self) -> list[str] | None:
        got = self._load_labels()
        return None if got is None else got[1]

    def _class_id(self, cls) -> int:
        names = self.class_names
        if names is None:
            raise ConfigError(
                f"{self.path} has no labels (labels.json/labels.npy); selection by class needs a "
                "dataset with labels, e.g. an image folder with one subfolder per class."
            )
        if isinstance(cls, str):
            if cls not in names:
                shown = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
                raise ConfigError(f"unknown class {cls!r}; classes: {shown}")
            return names.index(cls)
        if isinstance(cls, (int, np.integer)) and 0 <= cls < len(names):
            return int(cls)
        raise ConfigError(f"unknown class {cls!r}; use a class name or an id in [0, {len(names)})")

    def images_of_class(self, cls) -> np.ndarray:
        return np.flatnonzero(self.labels == self._class_id(cls))

    def images_by_class(self, spec: dict, seed: int | None = 0) -> np.ndarray:
        """{class: n} -> n random images of that class (seeded); {class: [i, ...]} -> the i-th ones."""
        rng = np.random.default_rng(seed)
        out = []
        for cls, want in spec.items():
            members = self.images_of_class(cls)
            if isinstance(want, (int, np.integer)) and not isinstance(want, bool):
                if not 0 <= want <= members.size:
                    raise ConfigError(f"class {cls!r} has {members.size} images; cannot draw {want}")
                out.append(rng.choice(members, size=int(want), replace=False))
            else:
                pos = np.asarray(want, dtype=np.int64)
                if pos.size and (pos.min() < 0 or pos.max() >= members.size):
                    raise ConfigError(f"class {cls!r} has {members.size} images; positions {want!r} out of range")
                out.append(members[pos])
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def query(self, sel, form: str = "plain") -> dict:
        """Read ``sel`` (anything ``cache[...]`` takes for images) in one of three output forms:

        plain -> {"act"}; supervised -> {"act", "label"}; unsupervised -> {"act", "target"}
        (target is the input itself, for autoencoders).
        """
        if form not in FORMS:
            raise ConfigError(f"unknown query form {form!r}; use one of {', '.join(FORMS)}")
        if isinstance(sel, dict):
            img = self.images_by_class(sel)
        elif isinstance(sel, (int, np.integer)):
            img = self._image_indices([sel])
        else:
            img = self._image_indices(sel)
        act = self.read_images(img)
        out = {"act": act, "image_i": img}
        if form == "supervised":
            if self.labels is None:
                raise ConfigError(f"{self.path} has no labels; the supervised form needs them")
            out["label"] = self.labels[img]
        elif form == "unsupervised":
            out["target"] = act
        return out


def _every(sel) -> bool:
    """Whether a layer/token selection keeps the whole axis."""
    return isinstance(sel, slice) and sel == slice(None)
