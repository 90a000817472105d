"""The sharded-activation file protocol (v1, and the opt-in 16-bit 2.0): the only module that
knows the byte layout.

Normative source: the protocol sheet (``shared/seeds/000_...``). In short::

    <dump_to>/<HASH>/metadata.json   the data-generating config (hash input)
    <dump_to>/<HASH>/shards.json     [{"name": "acts000000.bin", "n_imgs": N}, ...]
    <dump_to>/<HASH>/actsNNNNNN.bin  C-contiguous float32 (n_imgs_in_shard, L, T, D)

Protocol 2.0 is v1 with 16-bit values (``dtype`` float16 or bfloat16, little-endian): the same
fields, shapes and shard sizing in vectors, half the bytes. A dtype switch is a major change
(spec §5): float32 caches stay "1.0.0" byte for byte; 16-bit ones say "2.0.0", so every v1
reader refuses them by version, and this reader warns once per cache when it opens one.

    HASH = sha256(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode("utf-8"))

This module imports neither torch nor snakemake. Validation of a whole directory lives in
:mod:`actcache.validate`; atomic file writes in :mod:`actcache.fsutil`. Files beside a cache that
are not part of the protocol (not hashed, ignored by v1 readers) have modules of their own:
labels (:mod:`actcache.labels`) and per-shard checksums (:mod:`actcache.checksums`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from typing import ClassVar

from actcache.errors import ProtocolError, VersionError

PROTOCOL_VERSION = "1.0.0"
PROTOCOL_V2 = "2.0.0"  # 16-bit values
FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "siglip2")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per value
# how numpy holds each dtype's stored values (bfloat16: its raw bits, numpy has no bfloat16)
STORAGE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
_MAJOR_OF_DTYPE = {"float32": 1, "float16": 2, "bfloat16": 2}
# the dump's forward precision; "fp32" (the default) is left out of metadata.json, so the hash of
# every cache written in float32 stays as it was
FORWARDS = ("fp32", "tf32", "bf16")
DEFAULT_FORWARD = "fp32"
METADATA_FILE = "metadata.json"
SHARDS_FILE = "shards.json"
DEFAULT_MAX_PATCHES_PER_SHARD = 2_400_000
MAX_SHARDS = 100_000  # an implementation bound (1 PB at the default shard size): shards.json stays under 16 MiB


class ProtocolWarning(UserWarning):
    """A cache is readable but deviates from the protocol in a tolerated way."""


def shard_name(shard_idx: int) -> str:
    """File name of shard ``shard_idx`` (zero-padded width 6)."""
    if shard_idx < 0:
        raise ValueError(f"shard index must be >= 0, got {shard_idx}")
    return f"acts{shard_idx:06d}.bin"


def parse_version(version: str, where: str = METADATA_FILE) -> tuple[int, int, int]:
    """'1.2.3' -> (1, 2, 3); anything else is a ProtocolError."""
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ProtocolError(
            f"{where}: field 'protocol' is {version!r}, not a version like '1.0.0'. "
            "Was this cache written by a protocol-v1 writer?"
        )
    return int(parts[0]), int(parts[1]), int(parts[2])


def protocol_for(dtype: str) -> str:
    """The version a cache of ``dtype`` is written with: float32 -> v1, 16-bit -> 2.0."""
    return PROTOCOL_VERSION if _MAJOR_OF_DTYPE.get(dtype, 1) == 1 else PROTOCOL_V2


READ_VERSIONS = (PROTOCOL_VERSION, PROTOCOL_V2)  # the newest version of each major this reads


def check_version(version: str, where: str = METADATA_FILE, readable: tuple[str, ...] = READ_VERSIONS) -> None:
    """Refuse a major version not in ``readable``; warn about a newer minor version (spec §5).
    ``readable=(PROTOCOL_VERSION,)`` is a v1-only reader (what every reader before 2.0 does)."""
    major, minor, _ = parse_version(version, where)
    ours = {parse_version(v)[0]: v for v in readable}
    if major not in ours:
        known = ", ".join(f"{v} (major {parse_version(v)[0]})" for v in readable)
        raise VersionError(
            f"{where}: the cache uses protocol {version}, but this reader reads protocol {known} only. "
            f"Use a reader for protocol {major}.x, or re-dump the activations with this version."
        )
    if minor > parse_version(ours[major])[1]:
        warnings.warn(
            f"{where}: protocol {version} is newer than {ours[major]}; reading it as "
            f"{ours[major]} and ignoring fields this version does not know.",
            ProtocolWarning,
            stacklevel=3,
        )


_warned_major: set[str] = set()


def warn_breaking(md: Metadata, where: str) -> None:
    """The breaking warning spec §5 asks of loader code, once per cache and process, for a cache
    whose major version is not 1 (a 16-bit cache: v1 readers cannot open it). A saev cache (its
    own versions, the v1 layout) gets none."""
    if md.foreign or parse_version(md.protocol)[0] == 1 or where in _warned_major:
        return
    _warned_major.add(where)
    warnings.warn(
        f"{where}: protocol {md.protocol} cache ({md.dtype} values): readers of protocol 1.x (saev's "
        "included) cannot open it; `actcache convert DIR --dtype float32 --to ROOT` writes a v1 copy.",
        ProtocolWarning,
        stacklevel=3,
    )


def canonical_json(obj: object) -> bytes:
    """The hash input exactly as the spec defines it."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def content_hash(metadata_dict: dict) -> str:
    """sha256 hex digest (64 characters) of the canonical JSON of a metadata dict."""
    return hashlib.sha256(canonical_json(metadata_dict)).hexdigest()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field name -> (checker, description) for metadata.json; order is the spec's table order.
_FIELDS: dict[str, tuple] = {
    "vit_family": (lambda v: isinstance(v, str), "a string"),
    "vit_ckpt": (lambda v: isinstance(v, str), "a string"),
    "layers": (lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v), "a list of integers"),
    "n_patches_per_img": (_is_int, "an integer"),
    "cls_token": (lambda v: isinstance(v, bool), "true or false"),
    "d_vit": (_is_int, "an integer"),
    "n_imgs": (_is_int, "an integer"),
    "max_patches_per_shard": (_is_int, "an integer"),
    "data": (lambda v: isinstance(v, dict), "a JSON object"),
    "dtype": (lambda v: isinstance(v, str), "a string"),
    "protocol": (lambda v: isinstance(v, str), "a string"),
}


@dataclasses.dataclass(frozen=True, eq=True)
class Metadata:
    """metadata.json of protocol v1 (or 2.0: the same fields, a 16-bit dtype). Validated on construction.

    ``extra`` holds keys that this version does not know (from a newer minor version); they are
    written back and hashed unchanged, so the content hash of such a cache stays the same.
    """

    vit_family: str
    vit_ckpt: str
    layers: tuple[int, ...]
    n_patches_per_img: int
    cls_token: bool
    d_vit: int
    n_imgs: int
    max_patches_per_shard: int
    data: dict = dataclasses.field(hash=False)
    dtype: str = "float32"
    protocol: str | None = None  # None: protocol_for(dtype)
    forward: str = DEFAULT_FORWARD  # the forward's precision (a field only when not the default)
    extra: dict = dataclasses.field(default_factory=dict, hash=False, compare=True)
    foreign: ClassVar[bool] = False  # True for a cache another tool wrote: actcache never writes into it

    def __post_init__(self) -> None:
        where = METADATA_FILE
        if self.protocol is None:
            object.__setattr__(self, "protocol", protocol_for(self.dtype))
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        for name, (ok, what) in _FIELDS.items():
            value = getattr(self, name)
            if not ok(value):
                raise ProtocolError(f"{where}: field '{name}' must be {what}, got {value!r}.")
        if self.vit_family not in FAMILIES:
            raise ProtocolError(f"{where}: field 'vit_family' is {self.vit_family!r}; allowed: {', '.join(FAMILIES)}.")
        if not self.layers:
            raise ProtocolError(f"{where}: field 'layers' is empty; record at least one layer.")
        if len(set(self.layers)) != len(self.layers):
            raise ProtocolError(f"{where}: field 'layers' has repeated values: {list(self.layers)}.")
        for name in ("n_patches_per_img", "d_vit", "n_imgs", "max_patches_per_shard"):
            if getattr(self, name) < 1:
                raise ProtocolError(f"{where}: field '{name}' must be >= 1, got {getattr(self, name)}.")
        if self.dtype not in DTYPES:
            raise ProtocolError(
                f"{where}: field 'dtype' is {self.dtype!r}; allowed: {', '.join(DTYPES)} (float32 is "
                "protocol 1.x, the 16-bit ones 2.x)."
            )
        if self.forward not in FORWARDS:
            raise ProtocolError(
                f"{where}: field 'forward' is {self.forward!r}; allowed: {', '.join(FORWARDS)} (absent means fp32)."
            )
        if "__class__" not in self.data:
            warnings.warn(
                f"{where}: field 'data' has no '__class__' key (the spec asks for the dataset "
                "config's class name); the cache is still readable.",
                ProtocolWarning,
                stacklevel=3,
            )
        check_version(self.protocol, where)
        if parse_version(self.protocol, where)[0] != _MAJOR_OF_DTYPE[self.dtype]:
            raise VersionError(
                f"{where}: the cache uses protocol {self.protocol} with dtype {self.dtype!r}, but a "
                f"{self.dtype} cache is protocol {protocol_for(self.dtype)} (1.x allows only 'float32', 2.x "
                "only 16-bit dtypes). The file was edited; restore it, or re-dump the activations."
            )
        if self.n_imgs_per_shard < 1:
            raise ProtocolError(
                f"{where}: max_patches_per_shard={self.max_patches_per_shard} cannot hold one image "
                f"({self.n_tokens_per_img} tokens x {len(self.layers)} layers = "
                f"{self.n_tokens_per_img * len(self.layers)} vectors). Increase max_patches_per_shard "
                f"to at least {self.n_tokens_per_img * len(self.layers)}."
            )
        if self.n_shards > MAX_SHARDS:
            raise ProtocolError(
                f"{where}: n_imgs={self.n_imgs:,} makes {self.n_shards:,} shards of {self.n_imgs_per_shard:,} images, "
                f"more than the {MAX_SHARDS:,} actcache handles; check n_imgs or raise max_patches_per_shard."
            )

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON document (and hash input): the spec's fields plus unknown newer-minor keys."""
        out = {
            "vit_family": self.vit_family,
            "vit_ckpt": self.vit_ckpt,
            "layers": list(self.layers),
            "n_patches_per_img": self.n_patches_per_img,
            "cls_token": self.cls_token,
            "d_vit": self.d_vit,
            "n_imgs": self.n_imgs,
            "max_patches_per_shard": self.max_patches_per_shard,
            "data": self.data,
            "dtype": self.dtype,
            "protocol": self.protocol,
        }
        if self.forward != DEFAULT_FORWARD:
            out["forward"] = self.forward
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, doc: object, where: str = METADATA_FILE, readable: tuple[str, ...] = READ_VERSIONS) -> Metadata:
        if not isinstance(doc, dict):
            raise ProtocolError(f"{where}: expected a JSON object, got {type(doc).__name__}.")
        _refuse_other_format(doc, where)
        missing = [k for k in _FIELDS if k not in doc]
        if missing:
            raise ProtocolError(
                f"{where}: missing required field(s) {', '.join(missing)}. A protocol-v1 "
                f"metadata.json has: {', '.join(_FIELDS)}."
            )
        for name, (ok, what) in _FIELDS.items():
            if not ok(doc[name]):
                raise ProtocolError(f"{where}: field '{name}' must be {what}, got {doc[name]!r}.")
        check_version(doc["protocol"], where, readable)
        # an explicit "forward": "fp32" stays an extra key, so the file's hash is kept as written
        forward = doc.get("forward", DEFAULT_FORWARD)
        extra = {k: v for k, v in doc.items() if k not in _FIELDS and (k != "forward" or forward == DEFAULT_FORWARD)}
        if extra and parse_version(doc["protocol"], where)[1] == 0:
            warnings.warn(
                f"{where}: unknown field(s) {', '.join(sorted(extra))} for protocol "
                f"{doc['protocol']}; kept as they are (they are part of the hash).",
                ProtocolWarning,
                stacklevel=2,
            )
        try:
            return cls(**{k: doc[k] for k in _FIELDS}, forward=forward, extra=extra)
        except ProtocolError as err:
            raise type(err)(str(err).replace(METADATA_FILE, where, 1)) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Metadata:
        """Read metadata.json (a file path, or a cache directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, METADATA_FILE)
        return cls.from_dict(read_json(path), where=path)

    def dump(self, directory: str | os.PathLike) -> str:
        """Write metadata.json into ``directory`` atomically; returns the path."""
        from actcache.fsutil import atomic_write_bytes

        path = os.path.join(os.fspath(directory), METADATA_FILE)
        text = json.dumps(self.to_dict(), indent=4, sort_keys=True) + "\n"
        atomic_write_bytes(path, text.encode("utf-8"))
        return path

    @property
    def hash(self) -> str:
        return content_hash(self.to_dict())

    # ---- shard sizing (spec §3) ---------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_tokens_per_img(self) -> int:
        return self.n_patches_per_img + int(self.cls_token)

    @property
    def n_imgs_per_shard(self) -> int:
        return self.max_patches_per_shard // (self.n_tokens_per_img * len(self.layers))

    @property
    def n_shards(self) -> int:
        """Shards holding at least one image (an exact multiple makes no empty trailing shard)."""
        return math.ceil(self.n_imgs / self.n_imgs_per_shard)

    @property
    def shard_shape(self) -> tuple[int, int, int, int]:
        return (self.n_imgs_per_shard, len(self.layers), self.n_tokens_per_img, self.d_vit)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def storage(self) -> str:
        """The numpy dtype string of the stored values (bfloat16: '<u2', its raw bits)."""
        return STORAGE[self.dtype]

    @property
    def bytes_per_vector(self) -> int:
        return self.d_vit * self.itemsize

    @property
    def bytes_per_img(self) -> int:
        return len(self.layers) * self.n_tokens_per_img * self.bytes_per_vector

    @property
    def shard_nbytes(self) -> int:
        """Size of a full shard file (also of a padded last shard)."""
        return self.n_imgs_per_shard * self.bytes_per_img

    def shard_n_imgs(self, shard_idx: int) -> int:
        """How many images shard ``shard_idx`` holds in a complete cache."""
        if not 0 <= shard_idx < self.n_shards:
            raise IndexError(f"shard {shard_idx} out of range [0, {self.n_shards})")
        start = shard_idx * self.n_imgs_per_shard
        return min(self.n_imgs_per_shard, self.n_imgs - start)

    def shard_img_range(self, shard_idx: int) -> tuple[int, int]:
        """Global image range [start, end) of shard ``shard_idx``."""
        start = shard_idx * self.n_imgs_per_shard
        return start, start + self.shard_n_imgs(shard_idx)

    def expected_shards(self) -> list[ShardInfo]:
        """The shard table of a complete cache written by actcache."""
        return [ShardInfo(shard_name(i), self.shard_n_imgs(i)) for i in range(self.n_shards)]

    def layer_index(self, layer: int) -> int:
        """Position of a layer *value* in ``layers`` (spec §4.2); a clear error if not recorded."""
        if _is_int(layer) and layer in self.layers:
            return self.layers.index(layer)
        raise LayerNotRecordedError(
            f"layer {layer!r} is not recorded in this cache; recorded layers: {list(self.layers)}. "
            "Pick one of those values (layers are matched by value, so -2 and 10 differ)."
        )

    def locate(self, img: int, layer: int, token: int) -> Location:
        """Logical coordinate -> (shard file, byte offset) of its D-vector (spec §4.2)."""
        if not _is_int(img) or not 0 <= img < self.n_imgs:
            raise IndexError(f"image index {img!r} out of range [0, {self.n_imgs})")
        if not _is_int(token) or not 0 <= token < self.n_tokens_per_img:
            raise IndexError(
                f"token index {token!r} out of range [0, {self.n_tokens_per_img}) "
                f"({'CLS at 0, then ' if self.cls_token else ''}{self.n_patches_per_img} patches)"
            )
        layer_idx = self.layer_index(layer)
        shard_idx, img_in_shard = divmod(img, self.n_imgs_per_shard)
        L, T = len(self.layers), self.n_tokens_per_img
        offset_vectors = img_in_shard * L * T + layer_idx * T + token
        return Location(shard_idx, shard_name(shard_idx), img_in_shard, offset_vectors * self.bytes_per_vector)


def _refuse_other_format(doc: dict, where: str) -> None:
    """A document that is not v1 metadata (a saev 2.x cache's, say) gets an error saying what it has."""
    if "vit_family" not in doc:
        keys = ", ".join(list(doc)[:12]) + (" ..." if len(doc) > 12 else "")
        raise ProtocolError(
            f"{where}: not protocol-v1 metadata (found keys: {keys or 'none'}; protocol "
            f"{doc.get('protocol', 'missing')!r}). actcache writes v1 caches (16-bit ones: 2.0, same fields); a saev "
            "cache (its own protocol 2.x) is read-only: ActivationCache.open, the loaders, inspect, verify and train --cache read it."
        )


class LayerNotRecordedError(ProtocolError, KeyError):
    """A layer value that the cache does not record."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class Location:
    shard_idx: int
    shard: str
    img_in_shard: int
    offset_bytes: int


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One entry of shards.json."""

    name: str
    n_imgs: int

    def to_dict(self) -> dict:
        return {"name": self.name, "n_imgs": self.n_imgs}


def read_json(path: str) -> object:
    """Parse a small JSON file; a missing, unreadable, oversized, too deeply nested or invalid file
    is a ProtocolError naming the file (actcache.docfiles holds the bounds)."""
    from actcache.docfiles import load_json_file

    return load_json_file(path, ProtocolError, "file")


def parse_shards(doc: object, where: str = SHARDS_FILE, count: str = "n_imgs") -> list[ShardInfo]:
    """shards.json ([{name, <count>}, ...]) as ShardInfo rows. ``count`` names the images key:
    ``n_imgs`` in v1; saev 2.x's table is the same but for its ``n_examples``."""
    if not isinstance(doc, list):
        raise ProtocolError(f"{where}: expected a JSON array of {{name, {count}}} objects, got {type(doc).__name__}.")
    shards = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, dict) or "name" not in entry or count not in entry:
            raise ProtocolError(f"{where}: entry {i} must be an object with 'name' and '{count}', got {entry!r}.")
        if not isinstance(entry["name"], str) or not _is_int(entry[count]) or entry[count] < 0:
            raise ProtocolError(
                f"{where}: entry {i} needs a string 'name' and an integer '{count}' >= 0, got {entry!r}."
            )
        shards.append(ShardInfo(entry["name"], entry[count]))
    return shards


def read_shards(directory: str | os.PathLike, count: str = "n_imgs") -> list[ShardInfo]:
    path = os.path.join(os.fspath(directory), SHARDS_FILE)
    return parse_shards(read_json(path), where=path, count=count)


def write_shards(directory: str | os.PathLike, shards: list[ShardInfo]) -> str:
    """Write shards.json atomically; returns its path."""
    from actcache.fsutil import atomic_write_bytes

    path = os.path.join(os.fspath(directory), SHARDS_FILE)
    text = json.dumps([s.to_dict() for s in shards], indent=4) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
    return path
