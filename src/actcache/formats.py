"""Which on-disk format a cache directory holds, and its metadata in that format.

protocol.py owns actcache's own format (v1, read-write); saev.py owns saev's current format (2.x,
read-only). This module sits above both and is the one place that tells them apart.
"""

from __future__ import annotations

import os

from actcache.protocol import METADATA_FILE, Metadata, read_json
from actcache.saev import SaevMetadata, is_saev_doc


def describe_unknown(doc: dict) -> str:
    """One line naming what a metadata.json that is neither v1 nor saev 2.1 holds."""
    keys = ", ".join(list(doc)[:12]) + (" ..." if len(doc) > 12 else "")
    return (
        f"neither a protocol-v1 cache (needs 'vit_family', 'n_patches_per_img', ...) nor a saev 2.1 cache "
        f"(needs 'family', 'content_tokens_per_example', ...); found keys: {keys or 'none'}, "
        f"protocol {doc.get('protocol', 'missing')!r}."
    )


def describe_format(md: Metadata) -> tuple[str, str]:
    """(what the cache is, which readers can open it): the two lines `actcache inspect` prints."""
    to_saev = "For saev's current release: `actcache convert DIR --to-format saev --to ROOT`"
    if md.foreign:
        return (
            f"saev {md.protocol} cache ({md.dtype}; read-only here)",
            "saev's current release (Metadata.load; its ordered, shuffled and indexed loaders); actcache (cache, "
            "loaders, inspect, verify, train --cache, and `actcache convert DIR --dtype D --to ROOT` to protocol v1)",
        )
    if md.dtype == "float32":
        return (
            f"actcache protocol {md.protocol} ({md.dtype}, {md.itemsize} bytes per value)",
            "every protocol-1 reader: actcache (any version), saev releases that wrote protocol 1.0.0, the "
            f"protocol's reference code; not saev's current release (2.1 names its fields differently). {to_saev}",
        )
    return (
        f"actcache protocol {md.protocol} ({md.dtype}, {md.itemsize} bytes per value)",
        f"actcache with protocol {md.protocol.split('.')[0]} support only; protocol-1 readers refuse it by version "
        "and no saev release reads 16-bit values. For protocol-1 readers: `actcache convert DIR --dtype float32 "
        f"--to ROOT`. {to_saev} (widened to float32)",
    )


def describe_data(md: Metadata) -> str:
    """The cache's dataset for `inspect`: v1's JSON object, or saev's pickled config shown from its
    opcodes (class and simple fields; never unpickled), or "opaque" when it is anything else."""
    import base64
    import binascii
    import json

    from actcache.saev_pickle import describe_pickle

    raw = md.data if md.foreign else (md.data.get("data") if md.data.get("__class__") == "SaevDataset" else None)
    if not isinstance(raw, str):
        return json.dumps(md.data, sort_keys=True)
    try:
        shown = describe_pickle(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError):
        shown = None
    if shown is None:
        return f"opaque pickle ({len(raw)} base64 characters; not a plain object of simple values, never loaded)"
    fields = ", ".join(f"{k}={v!r}" for k, v in shown["fields"].items())
    return f"{shown['class'] or 'dict'}({fields}) (saev's pickled dataset config, read from its opcodes, not loaded)"


def load_metadata(path: str | os.PathLike) -> Metadata:
    """metadata.json (or the directory holding it) of a v1 cache (Metadata) or of a saev 2.x cache
    (SaevMetadata, read-only); anything else is a ProtocolError naming what it found."""
    from actcache.errors import ProtocolError

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METADATA_FILE)
    doc = read_json(path)
    if isinstance(doc, dict) and is_saev_doc(doc):
        return SaevMetadata.from_dict(doc, where=path)
    if isinstance(doc, dict) and "vit_family" not in doc:
        raise ProtocolError(f"{path}: {describe_unknown(doc)}")
    return Metadata.from_dict(doc, where=path)
