"""The loaders' kernels: copies of rows (or blocks) of memory-mapped shards into batch buffers,
and the index work around them.

``take_multi(sources, srcs, rows, out)`` copies ``sources[srcs[i]][rows[i]]`` into ``out[i]``
(optionally times a float32 factor, per row or for all; the shuffled loader), ``copy_blocks``
equal-size strided blocks (the ordered loader's io="mmap"), ``balanced_order`` and
``index_rows`` lay out a run's example order and a batch's rows (the shuffle plan and the
shuffled loader's index), ``touch`` faults fresh memory in, ``probe`` tells which byte ranges of
a file are in the page cache. Each uses the C kernel
``actcache._native`` when it was built (the normal install compiles it; see setup.py) and numpy
otherwise, with the same results; the C copies prefetch the next random rows and, for batches
larger than the CPU cache, write with non-temporal stores (a cached store first reads the line it
overwrites). Rows of a 16-bit cache (protocol 2.0) are widened to float32 during the copy
(the C kernel's gather_widen; numpy: dtypes.to_float32, the same bytes). Figures: BENCHMARKS.md
(loaders, half).

``ACTCACHE_NATIVE=0`` in the environment forces the numpy path (tests compare the two).
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np

from actcache.dtypes import to_float32

# gather_multi's ``prefetch`` is an index into PREFETCH_SCHEMES (defined with the other option values)
from actcache.loaders.options import PREFETCH_SCHEMES

try:
    from actcache import _native
except ImportError:  # not built (no C compiler at install time): numpy fallback
    _native = None
if os.environ.get("ACTCACHE_NATIVE", "1") == "0":
    _native = None

# Batches at least this large are written with non-temporal stores: they do not fit in the CPU
# cache anyway, and the consumer reads them later. Smaller ones stay cached for the consumer.
STREAM_MIN_BYTES = 16 * 2**20


def _median(values) -> float:
    """The median of a few floats (0.0 for none), without numpy's per-call cost."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        return 0.0
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


class PrefetchChooser:
    """Picks the copy kernel's prefetch scheme by timing both on the caller's own copies.

    ``pick()`` says which scheme the next copy uses, ``record(scheme, nbytes, cpu_s)`` what it
    cost (the copying thread's CPU time). The first copies alternate between the schemes; once
    each has had TRIAL_COPIES, the one with the higher median bytes per CPU-second is used, and
    every RECHECK_EVERY-th copy tries the other one again; the other takes over when the median
    of its last WINDOW copies beats the median of the one in use by SWITCH_BY. Medians, because
    single copies are noisy (page faults on a first touch, the other core's work: per-copy rates
    vary several-fold within one first epoch). ``fixed``: always that scheme (an index into
    PREFETCH_SCHEMES). Thread-safe; the copies' results do not depend on the scheme."""

    TRIAL_COPIES = 8
    RECHECK_EVERY = 16
    WINDOW = 8
    SWITCH_BY = 1.03

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed
        self._lock = threading.Lock()
        self._rates: list[collections.deque] = [collections.deque(maxlen=self.WINDOW) for _ in PREFETCH_SCHEMES]
        self._n = [0] * len(PREFETCH_SCHEMES)
        self._count = 0
        self.choice: int | None = fixed

    def pick(self) -> int:
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            self._count += 1
            if self.choice is None:  # still trying: the one with fewer copies
                return min(range(len(self._n)), key=lambda k: (self._n[k], k))
            if self._count % self.RECHECK_EVERY == 0:
                return 1 - self.choice
            return self.choice

    def record(self, scheme: int, nbytes: int, cpu_s: float) -> None:
        if self.fixed is not None or cpu_s <= 0:
            return
        with self._lock:
            self._rates[scheme].append(nbytes / cpu_s)
            self._n[scheme] += 1
            # decide when the trial ends and after each look at the other scheme, not after every
            # copy: this runs in the gather threads, holding the GIL (a median per copy took
            # enough CPU from the copies to undo what the choice gains)
            if min(self._n) < self.TRIAL_COPIES or (self.choice is not None and scheme == self.choice):
                return
            rate = self.rates()
            best = max(range(len(rate)), key=lambda i: rate[i])
            if self.choice is None or (best != self.choice and rate[best] > rate[self.choice] * self.SWITCH_BY):
                self.choice = best

    def rates(self) -> list[float]:
        """Median bytes per CPU-second of each scheme's last WINDOW copies (0 where none yet)."""
        return [_median(r) for r in self._rates]

    def describe(self) -> str | None:
        """The scheme in use, or None while still trying (or without the C kernel)."""
        return None if self.choice is None else PREFETCH_SCHEMES[self.choice]


def native_info() -> dict:
    """Which copy kernel the loaders use: {"native": bool, "isa": "avx512f" | "avx2" | "sse2" | ...}."""
    return {"native": _native is not None, "isa": getattr(_native, "isa", None)}


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def copy_blocks(
    src: np.ndarray,
    rows: np.ndarray,
    out: np.ndarray,
    *,
    stride: int,
    offset: int = 0,
    stream: bool = False,
    scale: float | None = None,
    scales: np.ndarray | None = None,
    widen: str | None = None,
) -> bool:
    """Equal-size blocks of ``src`` (a C-contiguous array, e.g. a shard's byte mapping) into
    ``out``: block i is bytes ``[offset + rows[i] * stride, + piece)`` of src, piece =
    ``out.nbytes // len(rows)``, and lands at bytes ``[i * piece, (i + 1) * piece)`` of out
    (optionally its float32 values times ``scale`` or ``scales[i]``). Blocks that would reach
    past src raise IndexError. ``widen`` ("float16" / "bfloat16"): src holds that 16-bit type,
    out float32 (a block is then piece / 2 bytes of src). Returns False, copying nothing, when the
    C kernel is not built: the caller then copies with numpy (strided views)."""
    if _native is None:
        return False
    k = len(rows)
    if k == 0:
        return True
    piece = out.nbytes // k // (2 if widen else 1)
    n_src = (src.nbytes - offset - piece) // stride + 1 if src.nbytes >= offset + piece else 0
    one = np.zeros(k, np.int64)  # every block from the one source
    _gather([address(src) + offset], [max(0, n_src)], one, rows, stride, piece, out, stream, scale, scales, 0, widen)
    return True


def _gather(
    addresses,
    counts,
    srcs,
    rows,
    stride: int,
    piece: int,
    out,
    stream: bool,
    scale,
    scales,
    prefetch: int = 0,
    widen: str | None = None,
) -> None:
    """The C kernel's gather_multi (gather_widen with ``widen``), arguments as it wants them."""
    head = (
        np.asarray(addresses, np.int64),
        np.asarray(counts, np.int64),
        np.ascontiguousarray(srcs, np.int64),
        np.ascontiguousarray(rows, np.int64),
        stride,
        piece,
        address(out),
    )
    tail = (
        stream,
        None if scales is None else np.ascontiguousarray(scales, np.float32),
        1.0 if scale is None else float(scale),
        prefetch,
    )
    if widen:
        _native.gather_widen(*head, WIDEN_KINDS.index(widen), *tail)
    else:
        _native.gather_multi(*head, *tail)


# gather_widen's kinds, and the numpy dtype a shard view of each has (protocol.STORAGE)
WIDEN_KINDS = ("float16", "bfloat16")
_KIND_OF_STORAGE = {np.dtype("<f2"): "float16", np.dtype("<u2"): "bfloat16"}


def widen_kind(src_dtype, out_dtype) -> str | None:
    """The 16-bit type to widen from when copying ``src_dtype`` rows into ``out_dtype`` (float32)
    ones, or None for a plain copy (same dtype)."""
    if np.dtype(src_dtype) == np.dtype(out_dtype):
        return None
    kind = _KIND_OF_STORAGE.get(np.dtype(src_dtype))
    if kind is None or np.dtype(out_dtype) != np.float32:
        raise TypeError(f"cannot copy {np.dtype(src_dtype)} rows into {np.dtype(out_dtype)} ones")
    return kind


def widen_rows(
    src: np.ndarray, out: np.ndarray, scale: float | None = None, scales: np.ndarray | None = None, stream: bool = False
) -> None:
    """``out[:] = src`` as float32 (src: rows of a 16-bit stored type, out: C-contiguous float32 of
    the same shape), times ``scale`` or ``scales[i]`` per row; the C kernel when built, else numpy,
    with the same bytes. ``stream``: non-temporal stores (see STREAM_MIN_BYTES)."""
    src2 = np.ascontiguousarray(src).reshape(len(out), -1)
    if widen_kind(src2.dtype, out.dtype) is None:
        raise TypeError(f"widen_rows: {src2.dtype} rows are not a 16-bit stored type")
    rows = np.arange(len(src2), dtype=np.int64)
    out2 = out.reshape(len(out), -1)
    take_multi([src2], np.zeros(len(rows), np.int64), rows, out2, scale=scale, scales=scales, stream=stream)


def balanced_order(n: int, per: int, j0: int, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """A run's examples in a random, balanced order (plan.EpochPlan): every image's k-th example
    comes before any image's (k+1)-th, so any stretch of the order takes the same count (+-1)
    from every image of the run.

    The run touches images j0 .. j0 + n - 1 (run-local ids: image * per + example) and owns ids
    [lo, hi). Round k lists the images in the order ``tau`` turned by ``shift[k]``; image i gives
    its example ``pi[(k + rot[i]) % per]``: a random order of the examples, shared by the run's
    images but started at a random place for each. Drawn with the plan's numpy generator
    (2 permutations of per and n, and per + n integers, instead of a shuffle of every image and
    every round), laid out by the C kernel or, identically, by numpy.
    """
    pi = rng.permutation(per).astype(np.int64)
    rot = rng.integers(0, per, n, dtype=np.int64)
    tau = rng.permutation(n).astype(np.int64)
    shift = rng.integers(0, n, per, dtype=np.int64)
    if _native is not None:
        out = np.empty(n * per, np.int64)
        m = _native.balanced_order(n, per, j0, lo, hi, pi, rot, tau, shift, out)
        return out[:m]
    img = tau[(np.arange(n, dtype=np.int64)[None, :] + shift[:, None]) % n]  # (rounds, n)
    ex = pi[(np.arange(per, dtype=np.int64)[:, None] + rot[img]) % per]
    x = ((j0 + img) * per + ex).ravel()
    return x[(x >= lo) & (x < hi)]


def touch(a: np.ndarray) -> bool:
    """Fault in the pages of a fresh, writable, C-contiguous array by writing a zero into each
    4 KiB page, without the GIL (buffers.prefault says why); False when the C kernel is missing."""
    if _native is None or a.nbytes == 0:
        return False
    _native.touch(address(a), a.nbytes, 4096)
    return True


def probe(fd: int, starts: np.ndarray, ends: np.ndarray, advise: bool) -> int | None:
    """How many of the byte ranges ``[starts[i], ends[i])`` of open file ``fd`` are not cached
    (their first or last byte is not in the page cache); with ``advise``, each of those is asked
    for (posix_fadvise WILLNEED). None where it cannot tell: no C kernel, or no RWF_NOWAIT here
    (the caller then probes from Python, or not at all). One call, without the GIL. A probe that
    misses starts the kernel's read-ahead of that page as well (Linux does so for a RWF_NOWAIT
    read), so a second probe soon after may find it cached."""
    if _native is None:
        return None
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    if starts.shape != ends.shape:
        raise ValueError(f"probe: {len(starts)} starts but {len(ends)} ends")
    got = _native.probe(fd, address(starts), address(ends), len(starts), advise)
    return None if got < 0 else got


_MASK = (1 << 64) - 1


def concat_ranges(arrays, addrs: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``arrays()[r][starts[r] : starts[r] + counts[r]]`` for each r, one after the other (int64): a
    batch's example ids out of its runs' orders (plan.EpochPlan.batches). ``addrs``: the arrays'
    addresses (C kernel: one call, no per-array Python); ``arrays``: a callable returning the
    arrays, called only without the C kernel. Ranges are not bounds-checked."""
    out = np.empty(int(counts.sum()), np.int64)
    if _native is not None:
        _native.concat_ranges(addrs, starts, counts, out)
        return out
    pos = 0
    for a, s, c in zip(arrays(), starts.tolist(), counts.tolist(), strict=True):
        out[pos : pos + c] = a[s : s + c]
        pos += c
    return out


def permutation_key(*words: int) -> int:
    """A 64-bit key for :func:`permutation` from non-negative integers (numpy's SeedSequence)."""
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0])


def permutation(n: int, key: int) -> np.ndarray:
    """A random order of ``range(n)`` (int64), a function of the 64-bit ``key`` alone: Fisher-Yates
    driven by splitmix64, in C (much cheaper than numpy's Generator.permutation) or, with the
    same result, in numpy and Python."""
    out = np.empty(n, np.int64)
    if _native is not None:
        _native.permutation(n, key & _MASK, out)
        return out
    out[:] = np.arange(n, dtype=np.int64)
    if n < 2:
        return out
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as in C
        i = np.arange(1, n, dtype=np.uint64)
        z = np.uint64(key & _MASK) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    tops = range(n - 1, 0, -1)  # draw k swaps position tops[k] with one in [0, tops[k]]
    p = out.tolist()
    for r, top in zip(z.tolist(), tops, strict=True):
        j = (r * (top + 1)) >> 64
        p[top], p[j] = p[j], p[top]
    out[:] = p
    return out


def index_rows(
    x: np.ndarray,
    run_start: np.ndarray,
    run_img0: np.ndarray,
    run_cimg0: np.ndarray,
    run_src: np.ndarray,
    run_sub: np.ndarray | None,
    perm: np.ndarray,
    geom,
    want_lpos: bool = False,
) -> dict:
    """A batch's rows in the order ``perm`` gives (the shuffled loader's index).

    ``x`` holds the batch's examples run by run: run r's run-local ids (image * per + example,
    counted from its first image ``run_img0[r]`` in the shard; ``run_cimg0[r]`` is that image's
    index in the cache) are ``x[run_start[r]:run_start[r + 1]]``. Output k describes
    ``x[perm[k]]``: ``src`` (``run_src`` of its run: the shard, or the run's arena slot), ``rows``
    (the vector's row in the shard's (n_imgs * L * T, D) view; with ``run_sub``, ``x - run_sub``:
    its row in the run's slot), ``image_i``, ``patch_i`` (-1 for CLS), ``layer`` (the layer value)
    and, if asked, ``lpos`` (position among the selected layers). Same integers with or without
    the C kernel.
    """
    i64 = lambda a: np.ascontiguousarray(a, np.int64)  # noqa: E731
    x, run_start, perm = i64(x), i64(run_start), i64(perm)
    run_img0, run_cimg0, run_src = i64(run_img0), i64(run_cimg0), i64(run_src)
    run_sub = None if run_sub is None else i64(run_sub)
    g = geom
    layer_idx, layers = i64(g.layer_idx), i64(g.layers)
    n = len(x)
    out = {k: np.empty(n, np.int64) for k in ("src", "rows", "image_i", "patch_i", "layer")}
    out["lpos"] = np.empty(n, np.int64) if want_lpos else None
    ts, cls = g.token_start, int(g.cls)
    if _native is not None:
        _native.index_rows(
            x, run_start, run_img0, run_cimg0, run_src, run_sub, perm,
            g.per_img, g.n_tokens, g.L, g.T, ts, cls, layer_idx, layers,
            out["src"], out["rows"], out["image_i"], out["patch_i"], out["layer"], out["lpos"],
        )  # fmt: skip
        return out
    run_of = np.repeat(np.arange(len(run_start) - 1, dtype=np.int64), np.diff(run_start))[perm]
    xi = x[perm]
    jimg, e = np.divmod(xi, g.per_img)
    lp, tok = np.divmod(e, g.n_tokens)
    li = layer_idx[lp]
    out["src"][:] = run_src[run_of]
    if run_sub is None:
        out["rows"][:] = ((run_img0[run_of] + jimg) * g.L + li) * g.T + ts + tok
    else:
        out["rows"][:] = xi - run_sub[run_of]
    out["image_i"][:] = run_cimg0[run_of] + jimg
    out["patch_i"][:] = tok + ts - cls
    out["layer"][:] = layers[li]
    if want_lpos:
        out["lpos"][:] = lp
    return out


def take_multi(
    sources: list[np.ndarray],
    srcs: np.ndarray,
    rows: np.ndarray,
    out: np.ndarray,
    *,
    stream: bool = False,
    scale: float | None = None,
    scales: np.ndarray | None = None,
    addresses: np.ndarray | None = None,
    counts: np.ndarray | None = None,
    prefetch: int = 0,
) -> None:
    """``out[i] = sources[srcs[i]][rows[i]]`` (times ``scale`` or ``scales[i]``) for C-contiguous
    2-D sources of one width and dtype (the shards' (rows, D) views, or arena slots); sources of a
    16-bit stored type (protocol 2.0) into a float32 ``out`` are widened (:func:`widen_kind`). Bad sources
    or rows raise IndexError. ``addresses`` / ``counts``: the sources' addresses and row counts
    (int64), if the caller keeps them. ``prefetch``: the C kernel's prefetch scheme, an index
    into PREFETCH_SCHEMES (the result is the same; only the speed differs)."""
    kind = widen_kind(sources[0].dtype, out.dtype)
    if _native is not None:
        if addresses is None:
            addresses = np.array([address(s) for s in sources], np.int64)
            counts = np.array([s.shape[0] for s in sources], np.int64)
        piece = sources[0].strides[0]
        _gather(addresses, counts, srcs, rows, piece, piece, out, stream, scale, scales, prefetch, kind)
        return
    if kind is not None:  # numpy: gather the 16-bit rows, then widen them (dtypes.to_float32)
        got = np.empty(out.shape, sources[0].dtype)
        take_multi(sources, srcs, rows, got)
        to_float32(got, kind, out=out)
    elif len(sources) == 1:
        np.take(sources[0], rows, axis=0, out=out, mode="clip")  # rows valid by construction
    else:
        for s in np.unique(srcs).tolist():
            sel = np.flatnonzero(srcs == s)
            out[sel] = np.take(sources[s], rows[sel], axis=0, mode="clip")
    if scales is not None:
        out *= scales.astype(out.dtype, copy=False)[:, None]
    elif scale is not None and scale != 1.0:
        out *= out.dtype.type(scale)
