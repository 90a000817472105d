"""The shuffled loader's plan: which examples go into which batch, and which bytes must be
resident when. Pure numpy, no I/O; a function of (seed, epoch, part) alone.

Epoch order. Each shard is cut into *runs*: contiguous example ranges of random length (0.5x to
1.5x ``run_imgs`` images, so that runs end at spread-out times), or of ``run_imgs`` images each
(``equal``: io="read", whose arena slots then fit every run). Read through 2 MiB mappings, runs
are cut where a 2 MiB boundary of the file falls between two vectors (:func:`cut_points`), so a
run maps no block holding a neighbour's data. The runs of all shards are put in a random order
from (seed, epoch) only (every rank computes the same), and :class:`~.partition.Partition` gives
each (rank, worker) one contiguous piece of the resulting example sequence.

Batches (:meth:`EpochPlan.batches`, per part). Runs are *admitted* in order while the bytes they
hold fit in the budget; a run admitted at batch t must be resident before batch t is copied.
Each batch takes from every held run a share proportional to the run's weight (water-filling:
a nearly empty run gives what it has); once no run is left to admit, shares are proportional to
what each run has left, so all end with the epoch. Weights are equal per run, except in the
*two-rate plan* (the data left out of the first fill is under LATE_MAX of it): the first part of
the first fill is drawn about FAST_RATE times as fast per image, making room mid-epoch for the
rest. *Ramp*: when the whole part fits in the budget, batches 0-2 draw from growing prefixes of
it (RAMP), so gathering starts before everything is read (io="read": FILL_RAMP of the first
fill). Within a run, examples come in a random order balanced over its images (every image's
k-th example before any image's (k+1)-th; kernels.balanced_order), so a batch takes the same
count (+-1) from each image of the run.

Strips (``n_strips`` > 1). Each image's selected tokens are split into strips (from a random
token, wrapping round); a run hands out strip 0 of all its images first, then strip 1, ..., and
releases each strip's bytes once used up, so the same budget holds more images. Releasing part of
a 2 MiB mapping drops all of it, so strips need 4 KiB mappings (maps.ShardMaps).

Invariants: every example of the part is yielded exactly once; the plan never holds more than
the budget (plus what one batch needs); on_admit hears of each admitted run once, before its batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import numpy.random  # noqa: F401 - imported now: numpy imports it on first use, which would delay the first batch

from actcache.loaders import kernels


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How the selected vectors of one image lie in its shard (protocol v1, spec section 4)."""

    L: int  # layers stored
    T: int  # tokens stored per image
    D: int
    layer_idx: tuple[int, ...]  # selected layer positions
    token_start: int  # first selected stored token
    n_tokens: int  # selected tokens per layer
    layers: tuple[int, ...]  # layer values (metadata.layers)
    cls: bool
    itemsize: int = 4  # bytes per stored value (2: a 16-bit cache)

    @classmethod
    def from_selection(cls, sel) -> Geometry:
        md = sel.metadata
        return cls(
            len(md.layers),
            md.n_tokens_per_img,
            md.d_vit,
            tuple(sel.layer_idx),
            sel.token_start,
            sel.n_tokens,
            tuple(md.layers),
            md.cls_token,
            md.itemsize,
        )

    @property
    def per_img(self) -> int:
        return len(self.layer_idx) * self.n_tokens

    @property
    def vec_bytes(self) -> int:
        return self.D * self.itemsize

    @property
    def img_bytes(self) -> int:
        """Bytes read per image (the selected layers' selected tokens)."""
        return self.per_img * self.vec_bytes

    def decode(self, shard_img: np.ndarray, e: np.ndarray):
        """(image in shard, example within image) -> (row in the shard's (n*L*T, D) view,
        layer value, patch index (-1 for CLS), position among the selected layers)."""
        lpos, tok = np.divmod(e, self.n_tokens)
        lidx = np.asarray(self.layer_idx, np.int64)[lpos]
        token = tok + self.token_start
        row = (shard_img * self.L + lidx) * self.T + token
        return row, np.asarray(self.layers, np.int64)[lidx], token - int(self.cls), lpos

    def token_extents(self, imgs: np.ndarray, tok_lo: np.ndarray, tok_hi: np.ndarray):
        """Byte ranges in the shard of selected tokens [tok_lo, tok_hi) of every selected layer of
        shard images ``imgs`` (arrays of equal length; selection-token indices)."""
        lidx = np.asarray(self.layer_idx, np.int64)
        base = (imgs[:, None] * self.L + lidx[None, :]) * self.T + self.token_start
        starts = (base + tok_lo[:, None]) * self.vec_bytes
        ends = (base + tok_hi[:, None]) * self.vec_bytes
        return starts.ravel(), ends.ravel()

    def example_extents(self, imgs: np.ndarray, a: np.ndarray, b: np.ndarray, with_lpos: bool = False):
        """Byte ranges in the shard of examples [a, b) (indices within the image, selected layers
        then tokens) of shard images ``imgs``; in storage order, empty ranges left out. With
        ``with_lpos``, also each range's position among the selected layers."""
        lidx = np.asarray(self.layer_idx, np.int64)
        off = np.arange(len(lidx), dtype=np.int64) * self.n_tokens
        t_lo = np.clip(a[:, None] - off[None, :], 0, self.n_tokens)
        t_hi = np.clip(b[:, None] - off[None, :], 0, self.n_tokens)
        base = (imgs[:, None] * self.L + lidx[None, :]) * self.T + self.token_start
        keep = t_hi > t_lo
        starts, ends = ((base + t_lo) * self.vec_bytes)[keep], ((base + t_hi) * self.vec_bytes)[keep]
        if not with_lpos:
            return starts, ends
        return starts, ends, np.broadcast_to(np.arange(len(lidx)), keep.shape)[keep]


def cut_points(geom: Geometry, n_imgs: int, unit: int) -> np.ndarray:
    """Where a shard of ``n_imgs`` images can be cut on a ``unit`` boundary of its file.

    -> sorted shard-local example indices k (0 < k < n_imgs * per_img; examples image-major) such
    that some multiple X of ``unit`` lies between the bytes of examples < k and those of examples
    >= k: no selected vector straddles X. A run cut there maps whole ``unit`` blocks holding
    only its own examples (and unselected vectors, e.g. CLS), none of a neighbour's.
    """
    vb, LT, per = geom.vec_bytes, geom.L * geom.T, geom.per_img
    X = unit * np.arange(1, n_imgs * LT * vb // unit + 1, dtype=np.int64)
    r, rem = np.divmod(X, vb)
    w = r % LT
    tok = w % geom.T
    selected = np.isin(w // geom.T, geom.layer_idx) & (tok >= geom.token_start)
    selected &= tok < geom.token_start + geom.n_tokens
    ok = ~((rem != 0) & selected)
    R = r + (rem != 0)  # stored rows entirely before X
    first = np.asarray(geom.layer_idx, np.int64) * geom.T + geom.token_start
    within = np.clip((R % LT)[:, None] - first[None, :], 0, geom.n_tokens).sum(axis=1)
    k = (R // LT) * per + within
    k = k[ok & (k > 0) & (k < n_imgs * per)]
    # k rises with X: drop repeats without np.unique, whose first call imports numpy.ma (on a
    # fresh process's first batch)
    return k[np.r_[True, k[1:] != k[:-1]]] if len(k) else k


def cut_runs(
    shard_imgs: list[int],
    run_imgs: int,
    rng: np.random.Generator,
    per_img: int = 1,
    points: list[np.ndarray] | None = None,
    equal: bool = False,
) -> np.ndarray:
    """Cut every shard into runs of random length (0.5x to 1.5x ``run_imgs`` images), or with
    ``equal`` of ``run_imgs`` images each (a shard's last run: what is left).

    -> int64 (R, 5): shard, first image, images touched, [lo, hi) run-local example indices
    (counted from the first image's first example). Without ``points`` runs are whole images;
    with them (per shard, from :func:`cut_points`) each cut goes to the allowed point nearest
    its random target within the same length bounds, or to the image boundary if there is none.
    """
    lo, hi = (run_imgs, run_imgs) if equal else (max(1, run_imgs // 2), max(1, run_imgs + run_imgs // 2))
    per = per_img
    out = []
    for shard, n in enumerate(shard_imgs):
        if n <= 0:
            continue
        sizes = rng.integers(lo, hi + 1, size=n // lo + 2)
        N = n * per
        pts = None if points is None else points[shard]
        if pts is None or len(pts) == 0:
            ends = np.cumsum(sizes)
            k = int(np.searchsorted(ends, n)) + 1
            ends = np.minimum(ends[:k], n) * per
        else:
            cuts, pos = [], 0
            for size in sizes.tolist():
                target = pos + size * per
                if target >= N:
                    break
                a = int(np.searchsorted(pts, pos + lo * per, side="left"))
                b = int(np.searchsorted(pts, pos + hi * per, side="right"))
                if b > a:
                    c = pts[a:b]
                    target = int(c[np.argmin(np.abs(c - target))])
                cuts.append(target)
                pos = target
            ends = np.array(cuts + [N], np.int64)
        starts = np.r_[0, ends[:-1]]
        img0 = starts // per
        out.append(
            np.stack(
                [np.full(len(ends), shard), img0, -(-ends // per) - img0, starts - img0 * per, ends - img0 * per],
                axis=1,
            )
        )
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 5), np.int64)


def epoch_runs(
    shard_imgs: list[int],
    run_imgs: int,
    per_img: int,
    seed: int,
    epoch: int,
    points: list[np.ndarray] | None = None,
    equal: bool = False,
    skip: list[np.ndarray] | None = None,
) -> np.ndarray:
    """The epoch's runs in epoch order: (R, 5) as :func:`cut_runs`, less the ``skip`` images
    (:func:`drop_images`). Same on every rank."""
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    runs = cut_runs(shard_imgs, run_imgs, rng, per_img, points, equal)
    if skip is not None:
        runs = drop_images(runs, per_img, skip)
    return runs[rng.permutation(len(runs))]


def drop_images(runs: np.ndarray, per_img: int, skip: list[np.ndarray]) -> np.ndarray:
    """Runs with the examples of the skipped images taken out (``skip[shard]``: sorted
    shard-local image indices); a run holding skipped images is split around them. -> (R', 5)
    as :func:`cut_runs`, in the same order."""
    per, out = per_img, []
    for shard, img0, _, lo, hi in runs.tolist():
        sk = skip[shard] if shard < len(skip) else None
        a, b = img0 * per + lo, img0 * per + hi  # shard-local examples [a, b)
        inside = [] if sk is None else sk[(sk >= a // per) & (sk * per < b)].tolist()
        pieces, pos = [], a
        for im in inside:
            if im * per > pos:
                pieces.append((pos, im * per))
            pos = max(pos, (im + 1) * per)
        if pos < b:
            pieces.append((pos, b))
        for s, e in pieces:
            i0 = s // per
            out.append((shard, i0, -(-e // per) - i0, s - i0 * per, e - i0 * per))
    return np.asarray(out, np.int64).reshape(-1, 5)


def part_runs(runs: np.ndarray, per_img: int, start: int, end: int) -> np.ndarray:
    """Runs overlapping examples [start, end) of the epoch sequence, each narrowed to its part of
    them; -> (R, 5) as :func:`cut_runs`."""
    n_ex = runs[:, 4] - runs[:, 3]
    cum = np.r_[0, np.cumsum(n_ex)]
    if end <= start:
        return np.zeros((0, 5), np.int64)
    a = int(np.searchsorted(cum, start, side="right")) - 1
    b = int(np.searchsorted(cum, end, side="left"))
    sel = runs[a:b, :3]
    lo = runs[a:b, 3] + np.maximum(start - cum[a:b], 0)
    hi = runs[a:b, 3] + np.minimum(end - cum[a:b], n_ex[a:b])
    return np.concatenate([sel, lo[:, None], hi[:, None]], axis=1).astype(np.int64)


def _rank_within(group: np.ndarray, n_groups: int) -> np.ndarray:
    """For each element, how many elements of its group come before it in the sequence."""
    o = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=n_groups)
    first = np.r_[0, np.cumsum(counts)[:-1]]
    rank = np.empty(len(group), np.int64)
    rank[o] = np.arange(len(group), dtype=np.int64) - np.repeat(first, counts)
    return rank


class Run:
    """One admitted run: its static extent plus the plan's cursor in it."""

    __slots__ = (
        "key",
        "shard",
        "img0",
        "n_imgs",
        "lo",
        "hi",
        "order",
        "strip_end",
        "strip_bytes",
        "off",
        "done",
        "first_strip",
        "j0",
        "j1",
        "n_strips",
        "nT",
        "slot",
        "weight",
        "span",
        "pinned",
        "n_ex",
    )

    def __init__(self, key, row, n_strips: int, nT: int):
        self.key = key  # (epoch, index in the part's run order)
        self.shard, self.img0, self.n_imgs, self.lo, self.hi = (int(v) for v in row)
        self.n_ex = self.hi - self.lo  # examples it gives (its order, once drawn, lists each once)
        self.n_strips, self.nT = n_strips, nT
        self.done = 0  # strips used up
        self.first_strip = 0  # strips before this one need not be loaded (resume)
        self.slot = None  # io="read": the arena slot holding the run
        self.weight = 1.0  # share weight while runs are still admitted (EpochPlan.batches)
        self.span = None  # one strip: [first, last) byte in the shard of the run's selected vectors
        self.pinned = None  # 2 MiB mappings: the blocks of span it holds before it is read (ShardMaps.block_pin)

    def strip_tokens(self, g: int) -> tuple[int, int]:
        """[a, b): the rotated token positions of strip g (strip = position * n_strips // nT)."""
        a = -(-g * self.nT // self.n_strips)
        b = -(-(g + 1) * self.nT // self.n_strips)
        return a, b

    def extents(self, geom: Geometry, strips) -> tuple[np.ndarray, np.ndarray]:
        """Byte ranges in the shard of the given strips of every image this run touches (one
        strip: exactly the run's examples, in storage order, also where it cuts an image)."""
        imgs = np.arange(self.j0, self.j1, dtype=np.int64)
        if self.n_strips == 1:
            per = geom.per_img
            a, b = np.clip(self.lo - imgs * per, 0, per), np.clip(self.hi - imgs * per, 0, per)
            return geom.example_extents(imgs + self.img0, a, b)
        S, E = [], []
        for g in strips:
            a, b = self.strip_tokens(g)
            if b <= a:
                continue
            lo = (self.off[imgs - self.j0] + a) % self.nT
            n = b - a
            first = np.minimum(lo + n, self.nT)  # up to the wrap
            s, e = geom.token_extents(imgs + self.img0, lo, first)
            S.append(s), E.append(e)
            wrap = lo + n - self.nT
            w = wrap > 0
            if w.any():
                s, e = geom.token_extents(imgs[w] + self.img0, np.zeros(int(w.sum()), np.int64), wrap[w])
                S.append(s), E.append(e)
        if not S:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(S), np.concatenate(E)

    def held_bytes(self) -> int:
        return int(self.strip_bytes[self.done :].sum())


class _HeldRuns:
    """The runs a plan holds, in admission order, with per-run arrays so that a batch's shares
    and example ids need no Python per run: examples ``left``, share ``weight``, ``cursor`` in
    the run's order, the order's address (kernels.concat_ranges), first image and shard."""

    __slots__ = ("runs", "left", "weight", "cursor", "order_addr", "img0", "shard")

    def __init__(self):
        self.runs: list[Run] = []
        self.left, self.cursor, self.order_addr, self.img0, self.shard = (np.zeros(0, np.int64) for _ in range(5))
        self.weight = np.zeros(0, np.float64)

    def add(self, admitted: list[Run]) -> None:
        self.runs.extend(admitted)
        if not admitted:
            return
        cat = lambda a, vals, dt=np.int64: np.concatenate([a, np.array(vals, dt)])  # noqa: E731
        self.left = cat(self.left, [r.n_ex for r in admitted])
        self.cursor = cat(self.cursor, [0] * len(admitted))
        self.order_addr = cat(self.order_addr, [kernels.address(r.order) for r in admitted])
        self.img0 = cat(self.img0, [r.img0 for r in admitted])
        self.shard = cat(self.shard, [r.shard for r in admitted])
        self.weight = cat(self.weight, [r.weight for r in admitted], np.float64)

    def examples(self, shares: np.ndarray) -> tuple:
        """A batch's (runs, x, run_start, run_img0, run_shard) for BatchSpec: each run's next
        ``shares`` examples. img0 and shard are never changed in place, so the spec may keep them."""
        runs = list(self.runs)
        x = kernels.concat_ranges(lambda: [r.order for r in runs], self.order_addr, self.cursor, shares)
        run_start = np.zeros(len(shares) + 1, np.int64)
        np.cumsum(shares, out=run_start[1:])
        return runs, x, run_start, self.img0, self.shard

    def keep(self, mask: np.ndarray) -> None:
        """Drop the runs where ``mask`` is False (new arrays, not in place)."""
        self.runs = [r for r, k in zip(self.runs, mask.tolist(), strict=True) if k]
        self.left, self.cursor, self.order_addr = self.left[mask], self.cursor[mask], self.order_addr[mask]
        self.img0, self.shard, self.weight = self.img0[mask], self.shard[mask], self.weight[mask]


class _Walk:
    """Where EpochPlan.batches stands: the runs held, the next run to admit, the bytes held, the
    examples the held runs have left (``available``) and those left in the part, and the
    two-rate plan's per-image rates of the first fill (None: equal weights per run)."""

    __slots__ = ("active", "next_run", "held_bytes", "available", "examples_left", "rates")

    def __init__(self, n_examples: int):
        self.active = _HeldRuns()
        self.next_run = 0
        self.held_bytes = 0
        self.available = 0
        self.examples_left = n_examples
        self.rates: np.ndarray | None = None


@dataclasses.dataclass
class BatchSpec:
    """One batch of the plan. Its examples, run by run: run ``runs[i]`` gives the run-local ids
    ``x[run_start[i] : run_start[i + 1]]`` (possibly none); ``run_img0`` / ``run_shard`` hold
    each run's first image and shard (arrays, so that the loader's index needs no Python per
    run)."""

    epoch: int
    index: int  # batch index within the epoch
    n: int  # examples
    admit: list  # runs to make resident before this batch
    runs: list  # the runs the plan holds while this batch is gathered (all resident)
    x: np.ndarray  # int64 run-local example ids, run by run
    run_start: np.ndarray  # int64, len(runs) + 1
    run_img0: np.ndarray  # int64 per run
    run_shard: np.ndarray  # int64 per run
    releases: list  # (run, strip) strips used up after this batch; strip -1: the whole run
    plan_bytes: int  # bytes the plan holds while this batch is gathered (after its admissions)

    @property
    def takes(self) -> list:
        """(run, run-local example ids) for each run the batch takes examples from."""
        rs = self.run_start.tolist()
        return [(r, self.x[rs[i] : rs[i + 1]]) for i, r in enumerate(self.runs) if rs[i + 1] > rs[i]]


class EpochPlan:
    """Batches of one epoch for one part; ``batches(start)`` skips ``start`` batches without I/O."""

    def __init__(
        self,
        geom: Geometry,
        runs: np.ndarray,
        epoch: int,
        batch_size: int,
        n_examples: int,
        budget: int,
        n_strips: int,
        rng: np.random.Generator,
        fixed_run_bytes: int | None = None,
        map_unit: int = 0,
        ramp_fill: bool = False,
    ):
        self.geom, self.runs, self.epoch = geom, runs, epoch
        self.batch_size, self.n_examples, self.budget = batch_size, n_examples, budget
        self.n_tokens = geom.n_tokens
        self.n_strips = max(1, min(n_strips, self.n_tokens))  # at most one strip per token
        self.rng = rng
        self.fixed = fixed_run_bytes  # io="read": every run holds one arena slot
        self.ramp_fill = ramp_fill  # ramp over the first fill when the part does not fit (_ramp)
        # Huge-page mappings map whole map_unit blocks: a run also holds the parts of the blocks
        # at its ends that its neighbours' data fills (released with the run).
        self.map_unit = map_unit
        self._size_cache = None  # (spans, held bytes) of every run (_sizes)

    @property
    def n_batches(self) -> int:
        return -(-self.n_examples // self.batch_size)

    def _admit(self, i: int) -> Run:
        """Run ``i`` as admitted: where it lies and what it holds (all a reader needs); its
        example order is drawn by :meth:`_draw_order`, after the batch's admissions."""
        g, per = self.geom, self.geom.per_img
        r = Run((self.epoch, i), self.runs[i], self.n_strips, self.n_tokens)
        r.j0, r.j1 = r.lo // per, -(-r.hi // per)
        if self.fixed is not None:
            r.strip_bytes = np.full(self.n_strips, self.fixed // self.n_strips, np.int64)
        elif self.n_strips == 1:
            r.strip_bytes = np.array([self.run_bytes(i)], np.int64)
            r.span = self.run_span(i)
        else:
            tok = np.array([r.strip_tokens(k) for k in range(self.n_strips)])
            r.strip_bytes = (tok[:, 1] - tok[:, 0]) * (r.j1 - r.j0) * len(g.layer_idx) * g.vec_bytes
        return r

    def _draw_order(self, r: Run) -> None:
        """The run's random example order (and, with strips, each image's starting token), drawn
        from the plan's generator: runs are drawn in admission order, so the plan does not
        depend on when this happens."""
        rng, per = self.rng, self.geom.per_img
        if self.n_strips > 1:
            r.off = rng.integers(0, self.n_tokens, size=r.j1 - r.j0)
        else:  # one strip: no rotation (keeps each image's bytes one range)
            r.off = np.zeros(r.j1 - r.j0, np.int64)
        # Balanced: the k-th example of each image (in a random order) comes before the
        # (k+1)-th of any image, so a batch's share of the run takes the same count (+-1) from
        # every image of it rather than a multinomial draw (more images per batch, same
        # examples in expectation).
        if self.n_strips > 1:  # strip-major: strip 0's examples (balanced), then strip 1's, ...
            x = rng.permutation(np.arange(r.lo, r.hi, dtype=np.int64))
            img = x // per - r.j0
            strip = ((x % per) % self.n_tokens - r.off[img]) % self.n_tokens * self.n_strips // self.n_tokens
            rank = _rank_within(img * self.n_strips + strip, (r.j1 - r.j0) * self.n_strips)
            x = x[np.lexsort((rank, strip))]
            r.strip_end = np.cumsum(np.bincount(strip, minlength=self.n_strips))
        else:  # round by round over the run's images (kernels.balanced_order); a part's end may cut an image
            x = kernels.balanced_order(r.j1 - r.j0, per, r.j0, r.lo, r.hi, rng)
            r.strip_end = np.array([len(x)])
        assert len(x) == r.n_ex
        r.order = x

    def _sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every run's span and held bytes (see run_span, run_bytes), worked out once for all runs
        (vectorised: the first batch's plan asks for them once per run it may admit)."""
        if self._size_cache is None:
            g, per = self.geom, self.geom.per_img
            img0, lo, hi = (self.runs[:, j].astype(np.int64) for j in (1, 3, 4))
            first = g.decode(img0 + lo // per, lo % per)[0]
            last = g.decode(img0 + (hi - 1) // per, (hi - 1) % per)[0]
            spans = np.stack([first * g.vec_bytes, (last + 1) * g.vec_bytes], axis=1)
            if self.fixed is not None:
                held = np.full(len(self.runs), self.fixed // self.n_strips * self.n_strips, np.int64)
            elif self.n_strips > 1:
                held = (-(-hi // per) - lo // per) * g.img_bytes
            elif not self.map_unit:
                held = (hi - lo) * g.vec_bytes
            else:
                u = self.map_unit
                held = -(-spans[:, 1] // u) * u - spans[:, 0] // u * u
            self._size_cache = (spans, held.astype(np.int64))
        return self._size_cache

    def run_span(self, i: int) -> tuple[int, int]:
        """[first, last) byte in its shard of run ``i``'s selected vectors."""
        a, b = self._sizes()[0][i].tolist()
        return a, b

    def run_bytes(self, i: int) -> int:
        """Bytes run ``i`` holds while resident: its examples' bytes (whole images' strips with
        several strips); with ``map_unit``, every block its mapping spans (an image-aligned run
        also maps the parts of the edge blocks that its neighbours' data fills, ~1 block; one cut
        on block boundaries (:func:`cut_points`) maps only unselected vectors besides its own)."""
        return int(self._sizes()[1][i])

    def batches(self, start: int = 0, on_admit=None) -> Iterator[BatchSpec]:
        """Batch specs from batch ``start`` on (earlier batches are planned, not yielded).

        ``on_admit(run, t, held)``, if given, is called for each run that batch ``t >= start``
        admits (``held``: the bytes the plan holds with it) as soon as the run is admitted,
        before the plan draws its example order and works out the batch's shares (the loader's
        readers start on it meanwhile: the first batch admits the whole first fill); with
        strips the call comes after the draws (a reader needs each image's starting token),
        and the runs a resumed plan still holds at batch ``start`` are passed then too.
        Every run of a yielded spec's ``admit`` has been passed exactly once."""
        walk = _Walk(self.n_examples)
        caps, fill_ramp = self._ramp()
        early = on_admit is not None and self.n_strips == 1  # pass runs on before their draws
        for batch in range(self.n_batches):
            need = min(self.batch_size, walk.examples_left)
            cap = caps[batch] if batch < len(caps) else self.budget
            admitted = self._admit_within(walk, cap, need, on_admit if early and batch >= start else None, batch)
            for r in admitted:
                self._draw_order(r)
            held = walk.held_bytes  # what the plan holds while this batch is gathered
            if batch == 0:
                walk.rates = self._first_fill_rates(len(admitted), fill_ramp)
            if walk.rates is not None:
                self._weigh_per_image(admitted, walk.rates)
            walk.active.add(admitted)
            if batch == start:  # resuming: load what the held runs still hold (not used-up strips)
                admitted = self._resume(walk.active.runs, admitted if early else [], batch, held, on_admit)
            elif on_admit is not None and not early and batch > start:
                for r in admitted:
                    on_admit(r, batch, held)
            tail = walk.next_run >= len(self.runs)  # every run admitted
            shares = self._shares(walk.active.left, need, tail, walk.active.weight)
            if batch >= start:
                examples = walk.active.examples(shares)
            releases = self._take(walk, shares)
            walk.examples_left -= need
            if batch >= start:
                yield BatchSpec(self.epoch, batch, need, admitted, *examples, releases, held)

    def _admit_within(self, walk: _Walk, cap: float, need: int, on_admit, t: int) -> list[Run]:
        """Admit runs in epoch order while the bytes held stay within ``cap``, and always enough
        to fill a batch of ``need``; ``on_admit`` (if given) hears of each at once."""
        admitted = []
        while walk.next_run < len(self.runs) and (
            walk.held_bytes + self.run_bytes(walk.next_run) <= cap or walk.available < need
        ):
            r = self._admit(walk.next_run)
            walk.next_run += 1
            admitted.append(r)
            walk.held_bytes += r.held_bytes()
            walk.available += r.n_ex
            if on_admit is not None:
                on_admit(r, t, walk.held_bytes)
        return admitted

    def _first_fill_rates(self, n_admitted: int, fill_ramp: bool) -> np.ndarray | None:
        """Two-rate plan rates of the first fill: what batch 0 admits, or would without a ramp."""
        sizes = self._sizes()[1]
        n_fill = n_admitted
        if fill_ramp:
            n_fill = max(n_fill, int(np.searchsorted(np.cumsum(sizes), self.budget, side="right")))
        return self._fill_rates(sizes[:n_fill].astype(np.float64))

    @staticmethod
    def _weigh_per_image(admitted: list[Run], rates: np.ndarray) -> None:
        """Two-rate plan: the first fill's runs at their rates, later ones at 1, per image."""
        for r in admitted:
            i = r.key[1]
            r.weight = (float(rates[i]) if i < len(rates) else 1.0) * (r.j1 - r.j0)

    @staticmethod
    def _resume(held: list[Run], passed: list[Run], t: int, held_bytes: int, on_admit) -> list[Run]:
        """Batch ``start`` of a resumed plan: every held run is to be loaded from its first strip
        not used up; those not ``passed`` on yet go to ``on_admit``. -> the batch's admissions."""
        fresh = {id(r) for r in passed}
        for r in held:
            r.first_strip = r.done
            if on_admit is not None and id(r) not in fresh:
                on_admit(r, t, held_bytes)
        return list(held)

    def _take(self, walk: _Walk, shares: np.ndarray) -> list:
        """Advance every held run by its share; -> (run, strip) releases: strips used up (strip
        -1: the run's last), and runs used up leave the held set."""
        active, releases = walk.active, []
        if self.n_strips > 1:  # a run's order is strip-major: strips end as its cursor passes them
            for j in np.flatnonzero(shares).tolist():
                r, p = active.runs[j], int(active.cursor[j] + shares[j])
                while r.done < self.n_strips and p >= r.strip_end[r.done]:
                    walk.held_bytes -= int(r.strip_bytes[r.done])
                    releases.append((r, r.done if r.done < self.n_strips - 1 else -1))
                    r.done += 1
        active.cursor += shares
        active.left -= shares
        walk.available -= int(shares.sum())
        keep = active.left > 0
        if self.n_strips == 1:  # one strip: a run is released whole once used up
            for j in np.flatnonzero(~keep & (shares > 0)).tolist():
                r = active.runs[j]
                walk.held_bytes -= int(r.strip_bytes[0])
                releases.append((r, -1))
                r.done = 1
        if not keep.all():
            active.keep(keep)
        return releases

    RAMP = (1 / 8, 3 / 8, 5 / 8)  # a part that fits in the budget: admission caps (fractions of it)
    # ramp_fill, a part that does not fit: batch 0 draws from the first half of the first fill
    # (the first batch need not wait for the whole fill read into fresh memory; a shorter ramp
    # costs more mixing than it saves: BENCHMARKS.md)
    FILL_RAMP = (1 / 2,)

    def _ramp(self) -> tuple[list[float], bool]:
        """Byte caps on admission for the first batches: when the whole part fits in the budget,
        batch t < len(RAMP) draws only from the first RAMP[t] of it, so gathering starts once
        that much is read instead of all of it (module doc); else no ramp, or with ``ramp_fill``
        (io="read", whose first fill is read into fresh memory before batch 0 could start) the
        caps of FILL_RAMP as fractions of the budget. -> (caps, whether they ramp over the first
        fill)."""
        total = 0
        for i in range(len(self.runs)):
            total += self.run_bytes(i)
            if total > self.budget:
                return ([self.budget * f for f in self.FILL_RAMP], True) if self.ramp_fill else ([], False)
        return [total * f for f in self.RAMP], False

    # Two-rate plan (module doc): used while the data left out of the first fill is under
    # LATE_MAX of it; the first FAST_SPAN x that much of the fill is drawn FAST_RATE (+-
    # FAST_SPREAD) times as fast per image as the rest. Tuned on the plan alone (its mixing).
    LATE_MAX, FAST_SPAN, FAST_RATE, FAST_SPREAD = 0.5, 1.05, 2.0, 0.2

    def _fill_rates(self, held: np.ndarray) -> np.ndarray | None:
        """Per-image rates of the first fill's runs (runs 0..len(held)-1, holding ``held`` bytes)
        under the two-rate plan, or None when it does not apply (equal weights per run)."""
        if not len(held):
            return None
        late = 0  # bytes of the data left out of the first fill (counted up to LATE_MAX x it)
        for i in range(len(held), len(self.runs)):
            late += self.run_bytes(i)
            if late >= self.LATE_MAX * held.sum():
                return None
        if not late:
            return None
        span = min(0.5, self.FAST_SPAN * late / held.sum())
        u = (np.cumsum(held) - held / 2) / held.sum()  # position in the fill, 0..1
        fast = self.FAST_RATE * (1 + self.FAST_SPREAD * (1 - 2 * u / span))
        return np.where(u < span, fast, 1.0)

    def _shares(self, left: np.ndarray, need: int, tail: bool, weight: np.ndarray) -> np.ndarray:
        """Examples each held run gives to a batch of ``need`` (sums to ``need``), from what each
        has ``left``: proportional to ``weight`` while runs are still to be admitted, else
        (``tail``) to what is left."""
        n = len(left)
        total = int(left.sum())
        if need >= total:
            return left.copy()
        if tail:  # proportional to what is left: every run ends with the epoch
            exact = left * (need / total)
        else:  # shares proportional to weight, capped by what is left (water-filling)
            ratio = left / weight
            o = np.argsort(ratio, kind="stable")
            before = np.zeros(n, np.int64)
            np.cumsum(left[o][:-1], out=before[1:])
            weight_after = np.cumsum(weight[o][::-1])[::-1]
            fits = before + ratio[o] * weight_after >= need
            i = int(np.argmax(fits))
            level = (need - before[i]) / weight_after[i]
            exact = np.minimum(left, level * weight)
        shares = np.minimum(np.floor(exact).astype(np.int64), left)
        short = need - int(shares.sum())
        if short:  # the remainders go to the largest fractions (ties in random order)
            frac = exact - shares
            order = self.rng.permutation(n)
            order = order[np.argsort(-frac[order], kind="stable")]
            order = order[shares[order] < left[order]]
            shares[order[:short]] += 1
        return shares
