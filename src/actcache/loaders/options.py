"""What every loader is told, checked once: :class:`LoaderOptions`, and the allowed values of the
loaders' string options.

Light on purpose: it imports neither torch, numpy nor the C kernel, so that config validation
(sae/config.py, the workflow's parse) can check loader keys without loading the loaders.
OrderedLoader and ShuffledLoader keep their keyword constructors (the public API); each builds
one LoaderOptions from the keywords they share and hands it to BaseLoader by name. Options only
one loader has (buffer_bytes, seed, io, ...) stay on that loader.
"""

from __future__ import annotations

import dataclasses
import math

from actcache.errors import ConfigError
from actcache.shardguard import DEFAULT_VERIFY_READS, VERIFY_READS  # verify_reads (checksum blocks)

PATCHES = ("cls", "image", "all")
# How the shuffled loader reads runs that are not in the page cache yet (maps.ShardMaps).
COLD_READS = ("read", "fault")
# The C kernel's prefetch schemes (an index into this tuple): whole rows into L2, or only their
# first bytes into L3 (kernels.PrefetchChooser picks one with prefetch="auto").
PREFETCH_SCHEMES = ("whole", "heads")
# What a batch's act holds for a 16-bit cache: float32 (converted in the copy kernel) or the
# stored values (float16, bfloat16 as torch.bfloat16) for the GPU to convert.
OUT_DTYPES = ("float32", "stored")


def check_number(name: str, value, lo=None, integer=False, allow_none=False) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is a number (an int with ``integer``),
    not NaN, and >= ``lo``; None passes with ``allow_none``."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok = ok and isinstance(value, int)
    if not ok or (lo is not None and value < lo) or (isinstance(value, float) and math.isnan(value)):
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={value!r} must be {what}" + (f" >= {lo}" if lo is not None else ""))


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """The options OrderedLoader and ShuffledLoader share (see their docstrings). ``patches`` and
    ``layer`` are checked against the cache by BaseLoader (common.Selection); rank, world_size,
    worker_id and n_workers by partition.World."""

    batch_size: int = 16384
    patches: str = "image"
    layer: int | str = -2
    drop_last: bool = False
    batch_timeout_s: float | None = 30.0
    scale_norm: bool = False
    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    n_workers: int = 1
    n_threads: int = 2
    n_readers: int | None = None  # None: the loader's own default
    read_ahead: int = 2
    evict: bool = False
    out_dtype: str = "float32"
    token_labels: bool = False  # a saev cache's labels.bin: batch["token_label"] (-1 for CLS)
    verify_reads: str = DEFAULT_VERIFY_READS

    def __post_init__(self) -> None:
        if self.verify_reads not in VERIFY_READS:
            raise ConfigError(
                f"verify_reads={self.verify_reads!r} is not allowed; use one of {', '.join(VERIFY_READS)}"
            )
        if self.out_dtype not in OUT_DTYPES:
            raise ConfigError(f"out_dtype={self.out_dtype!r} is not allowed; use one of {', '.join(OUT_DTYPES)}")
        if self.out_dtype == "stored" and self.scale_norm:
            raise ConfigError(
                "scale_norm=True scales float32 values; with out_dtype='stored' scale on the GPU after "
                "converting, or use out_dtype='float32'"
            )
        check_number("batch_size", self.batch_size, 1, integer=True)
        check_number("batch_timeout_s", self.batch_timeout_s, allow_none=True)
        check_number("n_threads", self.n_threads, 1, integer=True)
        check_number("read_ahead", self.read_ahead, 1, integer=True)
        check_number("n_readers", self.n_readers, 1, integer=True, allow_none=True)
        for name in ("drop_last", "scale_norm", "evict", "token_labels"):
            check_bool(name, getattr(self, name))
