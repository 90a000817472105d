"""Image datasets with a fixed size and a stable order, and the per-checkpoint image transform.

A dataset is described by a small frozen config (``ImageFolder``, ``HfDiskDataset``,
``SyntheticImages``); ``metadata_data(cfg)`` is what goes into a cache's ``metadata.json``
``data`` field, so the same config always gives the same dict (and the same cache hash).
``open_dataset(cfg)`` gives a map-style dataset (``len`` and ``[i]``, usable by a torch DataLoader)
of ``(PIL RGB image, label)``.

``ImageTransform`` is the preprocessing of Hugging Face's PIL ("slow") image processors
(resize, center crop, rescale, normalize) written with PIL and numpy only; ``actcache.models``
builds one from a checkpoint's ``preprocessor_config.json``.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import hashlib
import json
import logging
import os
import stat
import time

import numpy as np
import PIL.Image

from actcache.errors import ConfigError, DumpError
from actcache.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LISTING_VERSION = 3
# A folder modified less than this long ago may still change within the same mtime tick; its
# listing is not cached (the "racy git" problem).
_RACY_S = 2.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _abs(path: str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _check_str(cls: str, field: str, value: object, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        allowed = "a non-empty string" + (" or null" if optional else "")
        raise ConfigError(f"{cls}.{field} must be {allowed}, got {value!r}")


def _check_int(cls: str, field: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"{cls}.{field} must be an integer >= {minimum}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Configs


@dataclasses.dataclass(frozen=True)
class ImageFolder:
    """Every image file under ``root`` (sorted by relative path); ``root/<class>/...`` gives labels."""

    root: str

    def __post_init__(self) -> None:
        _check_str("ImageFolder", "root", self.root)
        object.__setattr__(self, "root", _abs(self.root))


@dataclasses.dataclass(frozen=True)
class HfDiskDataset:
    """A Hugging Face dataset written with ``save_to_disk`` (a ``DatasetDict`` needs ``split``)."""

    path: str
    split: str | None = None
    image_key: str = "image"
    label_key: str | None = "label"

    def __post_init__(self) -> None:
        _check_str("HfDiskDataset", "path", self.path)
        _check_str("HfDiskDataset", "split", self.split, optional=True)
        _check_str("HfDiskDataset", "image_key", self.image_key)
        _check_str("HfDiskDataset", "label_key", self.label_key, optional=True)
        object.__setattr__(self, "path", _abs(self.path))


@dataclasses.dataclass(frozen=True)
class SyntheticImages:
    """``n_imgs`` deterministic random RGB images; image ``i`` depends only on ``(seed, i)``."""

    n_imgs: int
    seed: int = 0
    size: int = 64
    n_classes: int = 0

    def __post_init__(self) -> None:
        _check_int("SyntheticImages", "n_imgs", self.n_imgs, 1)
        _check_int("SyntheticImages", "seed", self.seed, 0)
        _check_int("SyntheticImages", "size", self.size, 1)
        _check_int("SyntheticImages", "n_classes", self.n_classes, 0)


DataConfig = ImageFolder | HfDiskDataset | SyntheticImages
DATA_KINDS: dict[str, type] = {"image_folder": ImageFolder, "hf_disk": HfDiskDataset, "synthetic": SyntheticImages}


def data_config_from_dict(d: object, where: str) -> DataConfig:
    """The YAML ``data:`` mapping (``kind:`` plus the fields) → a config; errors name ``where``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: 'data' must be a mapping with a 'kind' key, got {d!r}")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in DATA_KINDS:
        raise ConfigError(f"{where}: data.kind must be one of {sorted(DATA_KINDS)}, got {kind!r}")
    return _build(DATA_KINDS[kind], {k: v for k, v in d.items() if k != "kind"}, where, f"data (kind {kind})")


def data_config_from_metadata(d: object, where: str = "metadata.json") -> DataConfig:
    """Inverse of :func:`metadata_data`: a cache's ``data`` object → the config that made it."""
    classes = {cls.__name__: cls for cls in DATA_KINDS.values()}
    if isinstance(d, str):  # a saev cache: base64 of a pickle, which actcache never decodes
        raise ConfigError(f"{where}: data is an opaque string (saev's pickled dataset config), not an image dataset")
    if not isinstance(d, dict) or not isinstance(d.get("__class__"), str) or d["__class__"] not in classes:
        got = d.get("__class__") if isinstance(d, dict) else d
        raise ConfigError(f"{where}: data.__class__ must be one of {sorted(classes)}, got {got!r}")
    return _build(classes[d["__class__"]], {k: v for k, v in d.items() if k != "__class__"}, where, "data")


def _build(cls: type, fields: dict, where: str, what: str) -> DataConfig:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(fields) - set(known)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} in {what}; allowed: {sorted(known)}")
    required = [n for n, f in known.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in fields]
    if missing:
        raise ConfigError(f"{where}: {what} is missing required key(s) {missing}")
    try:
        return cls(**fields)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def metadata_data(cfg: DataConfig) -> dict:
    """The cache metadata's ``data`` object: ``asdict(cfg)`` plus ``__class__``."""
    return {**dataclasses.asdict(cfg), "__class__": type(cfg).__name__}


def count_images(cfg: DataConfig, listing_cache: str | None = None, relist: bool = False) -> int:
    """The dataset size, without decoding any image (``relist``: ignore a stored folder listing)."""
    if isinstance(cfg, SyntheticImages):
        return cfg.n_imgs
    if isinstance(cfg, ImageFolder):
        return len(list_image_folder(cfg.root, listing_cache, relist=relist).files)
    if isinstance(cfg, HfDiskDataset):
        return len(_load_hf(cfg))
    raise ConfigError(f"unknown data config {cfg!r}; use one of {sorted(c.__name__ for c in DATA_KINDS.values())}")


def open_dataset(cfg: DataConfig, listing_cache: str | None = None) -> ImageDataset:
    if isinstance(cfg, SyntheticImages):
        return SyntheticDataset(cfg)
    if isinstance(cfg, ImageFolder):
        return FolderDataset(cfg, list_image_folder(cfg.root, listing_cache))
    if isinstance(cfg, HfDiskDataset):
        return HfDataset(cfg, _load_hf(cfg))
    raise ConfigError(f"unknown data config {cfg!r}; use one of {sorted(c.__name__ for c in DATA_KINDS.values())}")


# ---------------------------------------------------------------------------------------------
# Image folder listing (optionally cached)


class _Strings:
    """Many strings in one bytes blob + offsets: compact and cheap to share with forked workers."""

    def __init__(self, strings: list[str]):
        encoded = [os.fsencode(s) for s in strings]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self.offsets[1:])
        self.blob = b"".join(encoded)

    @abc.abstractmethod
    def __len__(self) -> int:
        return len(self.offsets) - 1

    @abc.abstractmethod
    def __getitem__(self, i: int) -> str:
        return os.fsdecode(self.blob[self.offsets[i] : self.offsets[i + 1]])


@dataclasses.dataclass(frozen=True)
class FolderListing:
    root: str
    files: _Strings  # relative paths with "/" separators, sorted
    labels: np.ndarray  # int64, -1 for images directly in root
    classes: tuple[str, ...]


def _root_key(root: str) -> dict:
    st = os.stat(root)
    # The root's inode too: another folder moved or copied to the same path re-lists. Not the
    # device number, which differs between the nodes that mount one NFS export (each would re-list).
    return {"root": root, "ino": st.st_ino}


def _walk_images(root: str) -> tuple[list[str], dict[str, int]]:
    """Relative paths (with "/") of the regular image files under root, and the mtime of every
    folder walked (relative path -> st_mtime_ns). Hidden files and folders are skipped; a FIFO,
    socket, device or dangling link with an image name is skipped with a warning, never opened
    (opening a FIFO would block forever)."""
    found: list[str] = []
    dirs: dict[str, int] = {}
    odd: list[str] = []
    seen: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel) if rel else root
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in seen:  # a symlink loop, or one folder linked twice
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs[rel] = st.st_mtime_ns  # before reading: a change while reading is seen next time
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise ConfigError(
                f"cannot list {e.filename or path!r} under image folder {root!r} ({e.strerror}); fix its permissions"
            ) from None
        prefix = rel + "/" if rel else ""
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if _is_dir(entry):
                stack.append(prefix + entry.name)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                (found if _is_file(entry) else odd).append(prefix + entry.name)
    if odd:
        shown = ", ".join(repr(f) for f in odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
        logger.warning(
            "image folder %s: skipped %d entr%s with an image name that %s not a regular file "
            "(a FIFO, socket, device or dangling link): %s; remove or replace them",
            root, len(odd), "y" if len(odd) == 1 else "ies", "is" if len(odd) == 1 else "are", shown,
        )  # fmt: skip
    found.sort()
    return found, dict(sorted(dirs.items()))


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def list_image_folder(root: str, listing_cache: str | None = None, relist: bool = False) -> FolderListing:
    """Sorted image files under ``root``, with labels from the first subfolder name.

    With ``listing_cache`` (a directory), the listing is stored there with the root's path and
    inode and the mtime of every folder of the tree (at any depth). It is used again only while
    each of those folders still has its mtime: adding, removing or renaming anything in a folder
    changes that folder's mtime, so a check costs one ``stat`` per folder, not a walk.
    ``relist`` ignores a stored listing (``actcache plan --relist``). A stored listing is not
    trusted blindly either: one with a path leaving the root, an entry that is not an image path,
    an unsorted or repeated entry, a digest that does not match its entries, a sampled file that
    does not exist or a sampled folder holding more images than listed is ignored with a warning,
    and the folder is listed again.
    """
    root = _abs(root)
    if not os.path.isdir(root):
        raise ConfigError(f"image folder {root!r} does not exist or is not a directory; fix data.root")
    try:
        key = _root_key(root)
    except OSError as e:
        raise ConfigError(f"image folder {root!r} cannot be read ({e}); fix data.root or its permissions") from e
    cache_path = None
    files = None
    if listing_cache is not None:
        name = "imagefolder-" + hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".json"
        cache_path = os.path.join(_abs(listing_cache), name)
        files = None if relist else _read_listing(cache_path, key, root)
    if files is None:
        t0 = time.perf_counter()
        files, dirs = _walk_images(root)
        took = time.perf_counter() - t0
        level = logging.INFO if took > 1 else logging.DEBUG  # said only when it kept someone waiting
        logger.log(level, "listed %d images in %d folders under %s in %.1f s", len(files), len(dirs), root, took)
        if not files:
            raise ConfigError(
                f"image folder {root!r} holds no image files (looked for {', '.join(IMAGE_EXTENSIONS)}, "
                "any case, at any depth); fix data.root"
            )
        if cache_path is not None and time.time() - max(dirs.values()) / 1e9 > _RACY_S:
            doc = {"version": LISTING_VERSION, "key": key, "dirs": dirs, "digest": _digest(files), "files": files}
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            atomic_write_bytes(cache_path, json.dumps(doc).encode("utf-8"))
    classes = sorted({f.split("/", 1)[0] for f in files if "/" in f})
    index = {c: i for i, c in enumerate(classes)}
    labels = np.array([index[f.split("/", 1)[0]] if "/" in f else -1 for f in files], dtype=np.int64)
    return FolderListing(root=root, files=_Strings(files), labels=labels, classes=tuple(classes))


def _digest(files: list[str]) -> str:
    return hashlib.sha256("\n".join(files).encode("utf-8", "surrogateescape")).hexdigest()


def _read_listing(path: str, key: dict, root: str) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable image listing cache %s (%s); listing again", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("version") != LISTING_VERSION or doc.get("key") != key:
        return None
    if not _dirs_unchanged(root, doc.get("dirs")):
        return None
    files = doc.get("files")
    problem = _listing_problem(root, files, doc.get("digest"))
    if problem is not None:
        logger.warning("ignoring image listing cache %s: %s; listing %s again", path, problem, root)
        return None
    return files


def _dirs_unchanged(root: str, dirs: object) -> bool:
    """Whether every folder the listing walked still has the mtime it had then."""
    if not isinstance(dirs, dict) or "" not in dirs:
        return False
    for rel, mtime_ns in dirs.items():
        if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/"):
            return False
        try:
            if os.stat(os.path.join(root, rel) if rel else root).st_mtime_ns != mtime_ns:
                return False
        except OSError:
            return False
    return True


_SAMPLED = 8  # listed files checked to exist, and folders counted, spread over the listing


# An entry that is empty, absolute, or has an empty, hidden or dot part, or a trailing "/".
_BAD_PARTS = ("\n\n", "\n/", "//", "/.", "\n.", "/\n")


def _listing_problem(root: str, files: object, digest: object = None) -> str | None:
    """Why a stored listing cannot be the listing of ``root`` (None: it can). The entries are
    checked in bulk (substring searches over all of them); only a failing listing is gone
    through entry by entry, to name the entry."""
    if not isinstance(files, list) or not files:
        return "it has no list of files"
    if not all(isinstance(f, str) for f in files):
        return _entry_problem(files)
    joined = "\n" + "\n".join(files) + "\n"  # each entry between two newlines: substring checks see every one
    if (
        "\0" in joined
        or joined.count("\n") != len(files) + 1
        or any(bad in joined for bad in _BAD_PARTS)
        or not all(f.lower().endswith(IMAGE_EXTENSIONS) for f in files)
        or not all(a < b for a, b in zip(files, files[1:]))  # noqa: B905 (one shorter by design)
    ):
        return _entry_problem(files)
    if digest != _digest(files):
        return "its entries do not match its digest (edited or cut)"
    step = max(1, len(files) // _SAMPLED)
    sampled = [*files[::step][:_SAMPLED], files[-1]]
    for f in sampled:
        if not os.path.isfile(os.path.join(root, f)):
            return f"listed file {f!r} does not exist"
    return _fewer_than_folder(root, files, sampled)


def _entry_problem(files: list) -> str:
    """The first entry of a listing that is not a sorted, plain image path inside the folder."""
    prev = None
    for f in files:
        if not isinstance(f, str) or not f or "\0" in f or "\n" in f:
            return f"entry {f!r} is not a file path"
        parts = f.split("/")
        if f.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return f"entry {f!r} is not a plain path inside the folder"
        if not f.lower().endswith(IMAGE_EXTENSIONS):
            return f"entry {f!r} is not an image file name"
        if prev is not None and f <= prev:
            return f"entry {f!r} is out of order or repeated"
        prev = f
    return "its entries are malformed"


def _fewer_than_folder(root: str, files: list[str], sampled: list[str]) -> str | None:
    """A sampled folder holding more image files than the listing names in it: the listing lost entries."""
    import bisect

    for d in dict.fromkeys(f.rsplit("/", 1)[0] if "/" in f else "" for f in sampled):
        prefix = d + "/" if d else ""
        lo = bisect.bisect_left(files, prefix)  # sorted: the folder's entries are one run from here
        hi = bisect.bisect_left(files, d + "0") if d else len(files)  # "0" follows "/"
        listed = sum(1 for f in files[lo:hi] if "/" not in f[len(prefix) :])
        try:
            with os.scandir(os.path.join(root, d) if d else root) as it:
                n = sum(
                    1
                    for e in it
                    if not e.name.startswith(".") and e.name.lower().endswith(IMAGE_EXTENSIONS) and _is_file(e)
                )
        except OSError:
            return f"folder {d or '.'!r} cannot be read"
        if n > listed:
            return f"folder {d or '.'!r} holds {n} images but the listing names {listed}"
    return None


# ---------------------------------------------------------------------------------------------
# Datasets


class ImageDataset(abc.ABC):
    """``ds[i] -> (PIL RGB image, label)``; label is -1 when the dataset has none."""

    class_names: list[str] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[PIL.Image.Image, int]:
        raise NotImplementedError

    @abc.abstractmethod
    def labels(self) -> np.ndarray | None:
        raise NotImplementedError

    @abc.abstractmethod
    def describe(self, i: int) -> str:
        raise NotImplementedError

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not _is_int(i) and not isinstance(i, np.integer):
            raise TypeError(f"image index must be an integer, got {i!r}")
        i = int(i)
        if not 0 <= i < n:
            raise IndexError(f"image index {i} out of range for a dataset of {n} images")
        return i


class FolderDataset(ImageDataset):
    def __init__(self, cfg: ImageFolder, listing: FolderListing):
        self.cfg = cfg
        self._listing = listing
        self.class_names = list(listing.classes) or None

    def __len__(self) -> int:
        return len(self._listing.files)

    def describe(self, i: int) -> str:
        return os.path.join(self._listing.root, self._listing.files[i])

    def labels(self) -> np.ndarray | None:
        return self._listing.labels.copy() if self.class_names else None

    def __getitem__(self, i: int) -> tuple[PIL.Image.Image, int]:
        i = self._check_index(i)
        path = self.describe(i)
        try:
            with open_regular(path) as f, PIL.Image.open(f) as img:
                rgb = to_rgb(img)
        except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
            raise DumpError(
                f"cannot decode image {i} of {self.cfg.root!r}: file {path!r} ({type(e).__name__}: {e}). "
                "Replace it with a valid image (deleting it changes the dataset, so the cache hash too)."
            ) from e
        return rgb, int(self._listing.labels[i])


def open_regular(path: str):
    """``path`` opened for binary reading, if it is a regular file. Opened without blocking and
    checked with fstat, so a FIFO put in place of an image after listing is an error, not a hang."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device)", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_SHOWN = 20  # unreadable images named in the one-line error (all of them go to the log)


def check_headers(ds: ImageDataset, indices, n_threads: int = 8) -> None:
    """Open every image ``indices`` of an image-folder dataset and read its header, in parallel,
    before any model loads: every unreadable one is named in one ConfigError. (Only the header:
    pixels cut short at the end of a file are found when the image is decoded.) Images of 16 bits
    per channel are converted as transformers' processors convert them (values above 255 become
    255): said once, in a warning. Other datasets are not checked here."""
    if not isinstance(ds, FolderDataset):
        return
    from concurrent.futures import ThreadPoolExecutor

    indices = list(indices)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(n_threads, len(indices)))) as pool:
        found = [(path, why) for path, why in pool.map(_header, map(ds.describe, indices)) if why is not None]
    took = time.perf_counter() - t0
    logger.log(logging.INFO if took > 1 else logging.DEBUG, "checked %d image headers in %.1f s", len(indices), took)
    bad = [(path, why) for path, why in found if not why.startswith("mode ")]
    wide = [path for path, why in found if why.startswith("mode ")]
    if wide:
        logger.warning(
            "%d of %d images have 16 bits per channel (e.g. %s); they are converted to 8 bits as transformers' "
            "image processors do, so values above 255 become 255: convert them to 8 bits first to keep their contrast",
            len(wide), len(indices), wide[0],
        )  # fmt: skip
    if bad:
        for path, why in bad:
            logger.error("unreadable image %s: %s", path, why)
        shown = "; ".join(f"{path!r} ({why})" for path, why in bad[:_SHOWN])
        more = f"; and {len(bad) - _SHOWN} more (all are in the log)" if len(bad) > _SHOWN else ""
        raise ConfigError(
            f"{len(bad)} of {len(indices)} images under {ds.cfg.root!r} cannot be read: {shown}{more}. "
            "Replace each with a valid image (deleting one changes the dataset, so the cache hash too); "
            "no model was loaded and no shard was written."
        )


_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _header(path: str) -> tuple[str, str | None]:
    """(path, None) for a readable image header, "mode M" for a 16-bit (or wider) one, else why it cannot be read."""
    try:
        with open_regular(path) as f, PIL.Image.open(f) as img:
            return path, f"mode {img.mode}" if img.mode in _WIDE_MODES else None
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
        return path, f"{type(e).__name__}: {e}"


def _load_hf(cfg: HfDiskDataset):
    import datasets

    if not os.path.isdir(cfg.path):
        raise ConfigError(f"HfDiskDataset.path {cfg.path!r} does not exist; it must be a save_to_disk directory")
    try:
        ds = datasets.load_from_disk(cfg.path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(f"HfDiskDataset.path {cfg.path!r} is not a dataset written by save_to_disk: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise ConfigError(
                f"HfDiskDataset.split is {cfg.split!r} but {cfg.path!r} holds splits {sorted(ds)}; set split to one"
            )
        ds = ds[cfg.split]
    elif cfg.split is not None:
        raise ConfigError(
            f"HfDiskDataset.split is {cfg.split!r} but {cfg.path!r} is a single Dataset, not a DatasetDict; "
            "set split: null"
        )
    for field in ("image_key", "label_key"):
        col = getattr(cfg, field)
        if col is not None and col not in ds.column_names:
            hint = " (or null if the dataset has no labels)" if field == "label_key" else ""
            raise ConfigError(
                f"HfDiskDataset.{field} is {col!r} but {cfg.path!r} has columns {ds.column_names}; "
                f"set {field} to one of them{hint}"
            )
    return ds


class HfDataset(ImageDataset):
    def __init__(self, cfg: HfDiskDataset, ds):
        import datasets

        self.cfg = cfg
        self._ds = ds.select_columns([cfg.image_key])
        self._labels = None
        self.class_names = None
        if cfg.label_key is not None:
            feature = ds.features[cfg.label_key]
            labels = np.asarray(ds.with_format("numpy", columns=[cfg.label_key])[cfg.label_key])
            if not np.issubdtype(labels.dtype, np.integer):
                raise ConfigError(
                    f"HfDiskDataset.label_key {cfg.label_key!r} in {cfg.path!r} holds {labels.dtype} values, "
                    "not integer class ids; use an integer/ClassLabel column or label_key: null"
                )
            self._labels = labels.astype(np.int64)
            if isinstance(feature, datasets.ClassLabel):
                self.class_names = list(feature.names)

    def __len__(self) -> int:
        return len(self._ds)

    def describe(self, i: int) -> str:
        split = f" split {self.cfg.split!r}" if self.cfg.split else ""
        return f"{self.cfg.path}{split} row {i}"

    def labels(self) -> np.ndarray | None:
        return None if self._labels is None else self._labels.copy()

    def __getitem__(self, i: int) -> tuple[PIL.Image.Image, int]:
        i = self._check_index(i)
        try:
            value = self._ds[i][self.cfg.image_key]
            if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
                import io

                value = PIL.Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
            if not isinstance(value, PIL.Image.Image):
                raise DumpError(
                    f"{self.describe(i)}: column {self.cfg.image_key!r} holds {type(value).__name__}, not an image; "
                    "set image_key to the image column"
                )
            rgb = to_rgb(value)
        except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
            raise DumpError(f"cannot decode image {i}: {self.describe(i)} ({type(e).__name__}: {e})") from e
        return rgb, -1 if self._labels is None else int(self._labels[i])


class SyntheticDataset(ImageDataset):
    def __init__(self, cfg: SyntheticImages):
        self.cfg = cfg
        self.class_names = [f"class{k}" for k in range(cfg.n_classes)] or None

    def __len__(self) -> int:
        return self.cfg.n_imgs

    def describe(self, i: int) -> str:
        return f"synthetic image {i} (seed {self.cfg.seed}, size {self.cfg.size})"

    def labels(self) -> np.ndarray | None:
        if not self.cfg.n_classes:
            return None
        return np.arange(self.cfg.n_imgs, dtype=np.int64) % self.cfg.n_classes

    def __getitem__(self, i: int) -> tuple[PIL.Image.Image, int]:
        i = self._check_index(i)
        rng = np.random.default_rng([self.cfg.seed, i])
        pixels = rng.integers(0, 256, size=(self.cfg.size, self.cfg.size, 3), dtype=np.uint8)
        label = i % self.cfg.n_classes if self.cfg.n_classes else -1
        return PIL.Image.fromarray(pixels), label


# ---------------------------------------------------------------------------------------------
# Image transform (matches transformers' PIL image processors)


def to_rgb(img: PIL.Image.Image) -> PIL.Image.Image:
    """A decoded RGB copy; transparency (an alpha channel, or a palette's or RGB image's transparent
    colour) is composited onto white, as transformers' PIL processors do in recent releases (5.24;
    5.17 and 4.x dropped the alpha channel, which changes only transparent pixels)."""
    img.load()
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """Resize → center crop → rescale → normalize; ``__call__(PIL image) -> (3, H, W) float32``.

    ``resize`` is ``None`` (no resize), ``("shortest_edge", s)``, ``("shortest_edge", s, longest)``
    or ``("hw", height, width)``; ``crop`` is ``(height, width)`` or ``None``.
    """

    resize: tuple | None
    resample: int
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, or None when it depends on the input image."""
        if self.crop is not None:
            return self.crop
        if self.resize is not None and self.resize[0] == "hw":
            return self.resize[1], self.resize[2]
        return None

    def _resize_hw(self, height: int, width: int) -> tuple[int, int]:
        if self.resize[0] == "hw":
            return self.resize[1], self.resize[2]
        size = self.resize[1]
        if len(self.resize) == 3 and self.resize[2]:
            return _size_with_aspect_ratio(height, width, size, self.resize[2])
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size, int(size * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, img: PIL.Image.Image) -> np.ndarray:
        x_HWC = self.geometry(img)
        if self.rescale_factor is not None:
            x_HWC = (x_HWC.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            x_HWC = x_HWC.astype(np.float32)
        if self.mean is not None:
            x_HWC = (x_HWC - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(x_HWC.transpose(2, 0, 1), dtype=np.float32)

    def _resized(self, img: PIL.Image.Image) -> PIL.Image.Image:
        img = to_rgb(img)
        if self.resize is not None:
            h, w = self._resize_hw(img.height, img.width)
            img = img.resize((w, h), resample=self.resample)
        return img

    def geometry(self, img: PIL.Image.Image) -> np.ndarray:
        """The PIL part: RGB, resize, center crop → uint8 (H, W, 3). ``normalize`` does the rest."""
        x_HWC = np.asarray(self._resized(img))
        if self.crop is not None:
            x_HWC = _center_crop(x_HWC, *self.crop)
        return x_HWC

    def geometry_image(self, img: PIL.Image.Image) -> PIL.Image.Image:
        """``geometry`` as a PIL image, cropped by PIL where the crop lies inside the resized image
        (the same pixels, without two copies through numpy: for pages that show the crops)."""
        img = self._resized(img)
        if self.crop is None:
            return img
        top, left = (img.height - self.crop[0]) // 2, (img.width - self.crop[1]) // 2
        if top >= 0 and left >= 0:
            return img.crop((left, top, left + self.crop[1], top + self.crop[0]))
        return PIL.Image.fromarray(_center_crop(np.asarray(img), *self.crop))

    def normalize(self, x_BHWC):
        """uint8 (B, H, W, 3) torch tensor, on any device → float32 (B, 3, H, W) on that device.

        The numbers equal ``__call__``'s bit for bit: the same IEEE operations in the same order
        (rescale in float64, round to float32, subtract the mean, divide by the std in float32).
        A CUDA dump's image workers only decode, resize and crop, and the GPU does this.
        """
        import torch

        if self.rescale_factor is not None:
            x = (x_BHWC.to(torch.float64) * self.rescale_factor).to(torch.float32)
        else:
            x = x_BHWC.to(torch.float32)
        if self.mean is not None:
            mean, std = _mean_std(self.mean, self.std, x.device)
            x = (x - mean) / std
        return x.permute(0, 3, 1, 2).contiguous()


_MEAN_STD: dict = {}


def _mean_std(mean: tuple, std: tuple, device) -> tuple:
    """The (3,) float32 mean and std tensors on ``device``, made once: creating them from Python
    lists for every batch would copy from pageable memory and make the host wait for the GPU."""
    import torch

    key = (tuple(mean), tuple(std), str(device))
    got = _MEAN_STD.get(key)
    if got is None:
        got = _MEAN_STD[key] = (torch.tensor(mean, dtype=torch.float32, device=device),
                                torch.tensor(std, dtype=torch.float32, device=device))  # fmt: skip
    return got


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    raw_size = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw_size = max_size * lo / hi
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw_size * height / width) if raw_size is not None else int(size * height / width)), size
    return size, (int(raw_size * width / height) if raw_size is not None else int(size * width / height))


def _center_crop(x_HWC: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """Center crop; an image smaller than the crop is zero-padded (as transformers does)."""
    h, w = x_HWC.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return x_HWC[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w, x_HWC.shape[2]), dtype=x_HWC.dtype)
    top_pad, left_pad = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
    padded[top_pad : top_pad + h, left_pad : left_pad + w] = x_HWC
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]
