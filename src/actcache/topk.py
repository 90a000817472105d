"""Streaming per-latent statistics of SAE activations over a cache, in one ordered pass.

    stats = LatentStats(width=S, tokens_per_img=T, k=16)
    for batch in OrderedLoader(cache, batch_size=T * 64, patches="image", layer=-2):
        stats.update(sae.encode(batch["act"]), batch["image_i"])
    res = stats.result()                    # LatentSummary (numpy arrays); res.save(path)

Batches must come in storage order (each image's ``T`` selected tokens contiguous, images in
order); an image split across two batches is carried over to the next one. A latent *fires* on
a token when its activation is > 0. For every latent ``s``:

- ``fire_count[s]`` tokens it fires on; ``freq[s] = fire_count[s] / n_tokens``.
- ``mean_act[s]``: its mean activation over the tokens it fires on (0 when it never fires).
- ``hist[s, h]``: its firing activations counted in fixed log10-spaced bins (:data:`HIST_EDGES`,
  ``BINS_PER_DECADE`` per decade from 10^HIST_LO to 10^HIST_HI, compared as float32; values
  outside go to the first / last bin).
- ``top_img[s, :k]``, ``top_score[s, :k]``: the ``k`` images with the largest *image score*
  (the max of the latent over the image's tokens), best first; ``-1`` / ``0`` fill the slots
  when fewer than ``k`` images make it fire.
- ``top_acts[s, :k, :T]``: the latent's activation on every token of those images (heatmaps).
- ``q_img[s, h, :R]``, ``q_act``, ``q_tok``: a uniform sample of up to ``R`` (QUANTILE_LANES) firing
  tokens per histogram bin ``h`` (their image, activation and token position in the image; -1 /
  0 / -1 fill empty slots), for examples below the top (:func:`quantile_examples`).
- For the *explorable images* given to LatentStats (``explore``): per token, its top
  ``PATCH_TOP`` non-zero latents (``ex_ids``, ``ex_acts``; -1 / 0 fill) and per image its top
  ``IMAGE_TOP`` latents by max over its tokens (``ex_top_ids``, ``ex_top_acts``).

Quantile examples, why per histogram bin: the examples wanted lie between the median and the max
of a latent's firing activations, both known only at the end. The log-spaced histogram bins are
fixed in advance and cover every value, so one reservoir per (latent, bin) holds a uniform sample
of the tokens of that bin whatever the median and max turn out to be; at the end each quantile
bin takes the samples that fall in it. Each of the ``R`` lanes is a priority sample (the entry
with the largest random key of its slot wins; keys are unique), so a lane is a uniform draw and
lanes are independent (duplicates are dropped at the end). Memory: 18 bytes per (latent, bin,
lane), 113 MiB at width 65,536; a quantile example names its token (no per-token heatmap).

Vectorised per batch: one ``amax`` over each image's tokens, one ``torch.topk`` merging the
running ``(S, k)`` top-k with the batch's ``(S, n_images)`` scores, one ``nonzero`` + ``bincount``
for counts, sums and histograms, and a copy of per-token activations only for the images that
enter a top-k (after the first batches, few do).
"""

from __future__ import annotations

import dataclasses
import io
import os

import numpy as np
import torch

from actcache.fsutil import atomic_write_bytes

HIST_LO, HIST_HI, BINS_PER_DECADE = -4, 4, 4
N_BINS = (HIST_HI - HIST_LO) * BINS_PER_DECADE
HIST_EDGES = 10.0 ** (HIST_LO + np.arange(N_BINS + 1) / BINS_PER_DECADE)
HIST_EDGES32 = HIST_EDGES.astype(np.float32)
STATS_VERSION = 2
QUANTILE_LANES = 3  # R: sampled tokens per (latent, histogram bin)
N_QUANTILES = 5  # quantile bins between the median and the max of the firing activations
PATCH_TOP = 16  # latents kept per token of an explorable image
IMAGE_TOP = 32  # latents kept per explorable image (by max over its tokens)
_OPTIONAL = ("q_img", "q_act", "q_tok", "ex_img", "ex_ids", "ex_acts", "ex_top_ids", "ex_top_acts")


def hist_bins(values: torch.Tensor) -> torch.Tensor:
    """Bin index (int64) of each positive value: bin ``h`` holds ``HIST_EDGES32[h] <= v < HIST_EDGES32[h + 1]``
    (edges as float32); values outside the edges go to the first / last bin."""
    return torch.bucketize(values.float(), _inner_edges(values.device), right=True)


_EDGES: dict = {}


def _inner_edges(device: torch.device) -> torch.Tensor:
    if device not in _EDGES:
        _EDGES[device] = torch.from_numpy(HIST_EDGES32[1:-1].copy()).to(device)
    return _EDGES[device]


@dataclasses.dataclass
class LatentSummary:
    """The result of one pass (numpy arrays; shapes use S latents, K top images, T tokens per image)."""

    n_tokens: int
    n_imgs: int
    fire_count: np.ndarray  # (S,) int64
    act_sum: np.ndarray  # (S,) float64
    hist: np.ndarray  # (S, N_BINS) int64
    top_img: np.ndarray  # (S, K) int64, -1 = empty slot
    top_score: np.ndarray  # (S, K) float32, 0 = empty slot
    top_acts: np.ndarray  # (S, K, T) float32 (saved as float16)
    hist_edges: np.ndarray = dataclasses.field(default_factory=lambda: HIST_EDGES.copy())
    # Absent (None) in a summary saved before STATS_VERSION 2: the explorer needs them.
    q_img: np.ndarray | None = None  # (S, N_BINS, R) int64, -1 = empty slot
    q_act: np.ndarray | None = None  # (S, N_BINS, R) float32
    q_tok: np.ndarray | None = None  # (S, N_BINS, R) int64 token position in its image
    ex_img: np.ndarray | None = None  # (E,) int64 explorable images, sorted
    ex_ids: np.ndarray | None = None  # (E, T, PATCH_TOP) int64, -1 = none
    ex_acts: np.ndarray | None = None  # (E, T, PATCH_TOP) float32
    ex_top_ids: np.ndarray | None = None  # (E, IMAGE_TOP) int64, -1 = none
    ex_top_acts: np.ndarray | None = None  # (E, IMAGE_TOP) float32

    @property
    def has_explorer_stats(self) -> bool:
        return all(getattr(self, n) is not None for n in _OPTIONAL)

    @property
    def width(self) -> int:
        return int(self.fire_count.shape[0])

    @property
    def freq(self) -> np.ndarray:
        return self.fire_count / max(1, self.n_tokens)

    @property
    def mean_act(self) -> np.ndarray:
        return np.where(self.fire_count > 0, self.act_sum / np.maximum(self.fire_count, 1), 0.0)

    @property
    def max_act(self) -> np.ndarray:
        return np.where(self.top_img[:, 0] >= 0, self.top_score[:, 0], 0.0).astype(np.float32)

    def save(self, path: str) -> None:
        """Write an ``.npz`` atomically (per-token activations as float16, clipped to its range)."""
        f16 = np.finfo(np.float16).max
        buf = io.BytesIO()
        np.savez_compressed(
            buf, version=np.int64(STATS_VERSION), n_tokens=np.int64(self.n_tokens), n_imgs=np.int64(self.n_imgs),
            fire_count=self.fire_count, act_sum=self.act_sum, freq=self.freq, mean_act=self.mean_act,
            max_act=self.max_act, hist=self.hist, hist_edges=self.hist_edges, top_img=self.top_img,
            top_score=self.top_score, top_acts=np.clip(self.top_acts, -f16, f16).astype(np.float16),
            **{n: getattr(self, n) for n in _OPTIONAL if getattr(self, n) is not None},
        )  # fmt: skip
        atomic_write_bytes(os.fspath(path), buf.getvalue())

    @classmethod
    def load(cls, path: str) -> LatentSummary:
        with np.load(os.fspath(path)) as z:
            return cls(
                n_tokens=int(z["n_tokens"]), n_imgs=int(z["n_imgs"]), fire_count=z["fire_count"],
                act_sum=z["act_sum"], hist=z["hist"], top_img=z["top_img"], top_score=z["top_score"],
                top_acts=z["top_acts"].astype(np.float32), hist_edges=z["hist_edges"],
                **{n: z[n] for n in _OPTIONAL if n in z.files},
            )  # fmt: skip


class LatentStats:
    """Accumulates :class:`LatentSummary` statistics batch by batch (see the module docstring)."""

    def __init__(self, width: int, tokens_per_img: int, k: int = 16, device: str | torch.device = "cpu",
                 explore=(), seed: int = 0, quantiles: bool = True):  # fmt: skip
        """``explore``: the explorable images (image indices) whose per-token latents are kept;
        ``seed``: of the quantile samples; ``quantiles=False``: none (the summary has no q_*)."""
        if width < 1 or tokens_per_img < 1 or k < 1:
            raise ValueError(f"width, tokens_per_img and k must be >= 1, got {width}, {tokens_per_img}, {k}")
        self.S, self.T, self.K = int(width), int(tokens_per_img), int(k)
        dev = torch.device(device)
        self.device = dev
        self.n_tokens = 0
        self.n_imgs = 0
        self.act_sum = torch.zeros(self.S, dtype=torch.float64, device=dev)
        self.hist = torch.zeros(self.S * N_BINS, dtype=torch.int64, device=dev)
        self.top_val = torch.full((self.S, self.K), -torch.inf, dtype=torch.float32, device=dev)
        self.top_img = torch.full((self.S, self.K), -1, dtype=torch.int64, device=dev)
        self.top_phys = torch.arange(self.K, device=dev).repeat(self.S, 1)
        self.acts = torch.zeros((self.S, self.K, self.T), dtype=torch.float32, device=dev)
        self._carry: tuple[torch.Tensor, torch.Tensor] | None = None
        self.quantiles = quantiles
        slots = (self.S * N_BINS, QUANTILE_LANES if quantiles else 0)
        self.q_key = torch.full(slots, -1, dtype=torch.int64, device=dev)
        self.q_img = torch.full(slots, -1, dtype=torch.int32, device=dev)
        self.q_act = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.q_tok = torch.full(slots, -1, dtype=torch.int16, device=dev)
        self.seed = int(seed)
        self.explore = torch.as_tensor(sorted({int(i) for i in explore}), dtype=torch.int64, device=dev)
        self.ex: dict[int, tuple] = {}

    @torch.no_grad()
    def update(self, f_BS: torch.Tensor, image_i: torch.Tensor) -> None:
        """Add a batch: ``f_BS`` (B, S) latent activations, ``image_i`` (B,) their image indices."""
        if f_BS.ndim != 2 or f_BS.shape[1] != self.S or image_i.shape != f_BS.shape[:1]:
            raise ValueError(
                f"expected f_BS (B, {self.S}) and image_i (B,), got {tuple(f_BS.shape)}, {tuple(image_i.shape)}"
            )
        if f_BS.shape[0] == 0:
            return
        f_BS = f_BS.to(self.device, torch.float32)
        image_i = image_i.to(self.device, torch.int64)
        self._count(f_BS, image_i)
        if self._carry is not None:
            f_BS = torch.cat([self._carry[0], f_BS])
            image_i = torch.cat([self._carry[1], image_i])
            self._carry = None
        n = f_BS.shape[0] // self.T
        if f_BS.shape[0] > n * self.T:  # an image continues in the next batch
            self._carry = (f_BS[n * self.T :].clone(), image_i[n * self.T :].clone())
        if n:
            img_NT = image_i[: n * self.T].view(n, self.T)
            if not bool((img_NT == img_NT[:, :1]).all()):
                raise ValueError(
                    f"batches are not in storage order: each run of {self.T} tokens must belong to one image"
                )
            self._merge(f_BS[: n * self.T].view(n, self.T, self.S), img_NT[:, 0])
            self.n_imgs += n

    def _count(self, f_BS: torch.Tensor, image_i: torch.Tensor) -> None:
        f = f_BS.reshape(-1)
        flat = f.nonzero().squeeze(1)
        vals = f[flat]
        if vals.numel() and float(vals.min()) <= 0:  # negative activations do not count as firing
            keep = vals > 0
            flat, vals = flat[keep], vals[keep]
        lat = flat.remainder(self.S)
        self.act_sum += torch.zeros(self.S, dtype=torch.float32, device=self.device).index_add_(0, lat, vals)
        slot = hist_bins(vals).add_(lat.mul_(N_BINS))
        self.hist += torch.bincount(slot, minlength=self.S * N_BINS)
        self._sample(slot, vals, flat, image_i)
        self.n_tokens += f_BS.shape[0]

    def _sample(self, slot: torch.Tensor, vals: torch.Tensor, flat: torch.Tensor, image_i: torch.Tensor) -> None:
        """Offer every firing (token, latent) of the batch to its (latent, bin) reservoir, one
        priority sample per lane: key = 31 pseudo-random bits (a hash of the entry's place in the
        stream, the lane and the seed) above the entry's number in the batch (unique in the batch;
        a tie with a stored key keeps either, both uniform)."""
        if not slot.numel():
            return
        row = flat.div(self.S, rounding_mode="floor")
        idx = torch.arange(slot.numel(), device=self.device)
        where = flat.add(self.n_tokens * self.S).mul_(4)
        for r in range(self.q_key.shape[1]):
            key = _mix64(where + (r + 4 * self.seed)).bitwise_right_shift_(32).bitwise_left_shift_(32)
            key.bitwise_or_(idx)
            best = self.q_key[:, r].clone().scatter_reduce_(0, slot, key, "amax")
            win = key == best[slot]  # one entry per slot at most (keys are unique)
            s, e = slot[win], row[win]
            self.q_key[s, r] = key[win]
            self.q_img[s, r] = image_i[e].to(torch.int32)
            self.q_act[s, r] = vals[win]
            self.q_tok[s, r] = (e + self.n_tokens).remainder(self.T).to(torch.int16)

    def _merge(self, f_NTS: torch.Tensor, img_N: torch.Tensor) -> None:
        """Merge a batch of whole images into the running top-k.

        Per-token activations live in physical slots ``self.acts[s, phys]`` that never move; rank
        ``r`` of latent ``s`` is at ``self.top_phys[s, r]``. An image entering the top-k takes the
        slot of the one it evicts, so only new entries are written.
        """
        S, K, n = self.S, self.K, f_NTS.shape[0]
        if self.explore.numel():
            self._explore(f_NTS, img_N)
        score_SN = f_NTS.amax(1).T
        score_SN = torch.where(score_SN > 0, score_SN, -torch.inf)  # an image that never fires is no candidate
        val_SK, pos_SK = torch.cat([self.top_val, score_SN], 1).topk(K, dim=1)
        img_SK = torch.cat([self.top_img, img_N.expand(S, n)], 1).gather(1, pos_SK)
        from_run = pos_SK < K
        kept = torch.zeros((S, K + 1), dtype=torch.bool, device=self.device)
        kept.scatter_(1, torch.where(from_run, pos_SK, K), True)
        phys_SK = self.top_phys.gather(1, pos_SK.clamp(max=K - 1))
        # Row-major nonzero lists of freed slots and new ranks align: each row has as many of both.
        fs, fj = (~kept[:, :K]).nonzero(as_tuple=True)
        ns, nr = (~from_run).nonzero(as_tuple=True)
        phys_SK[ns, nr] = self.top_phys[fs, fj]
        write = val_SK[ns, nr] > 0
        ns, nr = ns[write], nr[write]
        if ns.numel():
            self.acts[ns, phys_SK[ns, nr]] = f_NTS[pos_SK[ns, nr] - K, :, ns]
        self.top_val, self.top_phys = val_SK, phys_SK
        self.top_img = torch.where(val_SK > 0, img_SK, -1)

    def _explore(self, f_NTS: torch.Tensor, img_N: torch.Tensor) -> None:
        """Each explorable image of the batch: its tokens' top latents and its own (non-zero only)."""
        for n in torch.isin(img_N, self.explore).nonzero().squeeze(1).tolist():
            f_TS = f_NTS[n]
            v_TP, i_TP = f_TS.topk(min(PATCH_TOP, self.S), dim=1)
            v_I, i_I = f_TS.amax(0).topk(min(IMAGE_TOP, self.S))
            self.ex[int(img_N[n])] = tuple(_pad(x.cpu().numpy(), m) for x, m in (
                (torch.where(v_TP > 0, i_TP, -1), PATCH_TOP), (v_TP.clamp_min(0), PATCH_TOP),
                (torch.where(v_I > 0, i_I, -1), IMAGE_TOP), (v_I.clamp_min(0), IMAGE_TOP)))  # fmt: skip

    def _explored(self) -> dict:
        imgs = sorted(self.ex)
        T = self.T
        parts = [np.stack([self.ex[i][j] for i in imgs]) if imgs else np.zeros((0, *shape), dt)
                 for j, (shape, dt) in enumerate((((T, PATCH_TOP), np.int64), ((T, PATCH_TOP), np.float32),
                                                  ((IMAGE_TOP,), np.int64), ((IMAGE_TOP,), np.float32)))]  # fmt: skip
        return dict(ex_img=np.asarray(imgs, np.int64), ex_ids=parts[0].astype(np.int64),
                    ex_acts=parts[1].astype(np.float32), ex_top_ids=parts[2].astype(np.int64),
                    ex_top_acts=parts[3].astype(np.float32))  # fmt: skip

    def result(self) -> LatentSummary:
        """The statistics so far (numpy); an image still incomplete at the end is an error."""
        if self._carry is not None:
            raise ValueError(
                f"the last image is incomplete: {self._carry[0].shape[0]} of its {self.T} tokens were seen"
            )
        hist = self.hist.view(self.S, N_BINS).cpu().numpy()
        filled = self.top_img >= 0
        top_acts = self.acts.gather(1, self.top_phys.unsqueeze(-1).expand(-1, -1, self.T))
        return LatentSummary(
            n_tokens=self.n_tokens, n_imgs=self.n_imgs, fire_count=hist.sum(1), act_sum=self.act_sum.cpu().numpy(),
            hist=hist, top_img=self.top_img.cpu().numpy(),
            top_score=torch.where(filled, self.top_val, 0.0).cpu().numpy(),
            top_acts=torch.where(filled.unsqueeze(-1), top_acts, 0.0).cpu().numpy(),
            **self._quantile_samples(), **self._explored(),
        )  # fmt: skip

    def _quantile_samples(self) -> dict:
        if not self.quantiles:
            return {}
        shape = (self.S, N_BINS, -1)
        return dict(q_img=self.q_img.view(shape).cpu().numpy().astype(np.int64),
                    q_act=self.q_act.view(shape).cpu().numpy(),
                    q_tok=self.q_tok.view(shape).cpu().numpy().astype(np.int64))  # fmt: skip


def _signed(u: int) -> int:
    return u - 2**64 if u >= 2**63 else u


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 values (wrapping arithmetic; >> made logical by a mask): well-mixed
    pseudo-random bits, far cheaper than a generator call per entry; non-negative after >> 1."""

    def lsr(v: torch.Tensor, n: int) -> torch.Tensor:
        return v.bitwise_right_shift(n).bitwise_and_((1 << (64 - n)) - 1)

    x = x + _GOLDEN
    x = (x ^ lsr(x, 30)).mul_(_M1)
    x = (x ^ lsr(x, 27)).mul_(_M2)
    return lsr(x ^ lsr(x, 31), 1)


def _pad(x: np.ndarray, m: int) -> np.ndarray:
    """``x`` (..., n) padded to (..., m) with -1 (ids) or 0 (values), for a width below m."""
    if x.shape[-1] >= m:
        return x
    fill = -1 if x.dtype.kind == "i" else 0
    return np.concatenate([x, np.full((*x.shape[:-1], m - x.shape[-1]), fill, x.dtype)], -1)


def median_act(hist_SH: np.ndarray, edges: np.ndarray = HIST_EDGES) -> np.ndarray:
    """(S,) the median of each latent's firing activations, from its histogram: the bin where the
    count reaches half, interpolated geometrically inside it (exact to a bin's width, a factor
    10^(1/BINS_PER_DECADE)); 0 for a latent that never fires."""
    n = hist_SH.sum(1)
    cum = np.cumsum(hist_SH, 1)
    h = np.minimum((cum < (n / 2)[:, None]).sum(1), hist_SH.shape[1] - 1)
    below = np.take_along_axis(cum, h[:, None], 1)[:, 0] - np.take_along_axis(hist_SH, h[:, None], 1)[:, 0]
    inside = np.take_along_axis(hist_SH, h[:, None], 1)[:, 0]
    t = np.clip((n / 2 - below) / np.maximum(inside, 1), 0, 1)
    med = edges[h] * (edges[h + 1] / edges[h]) ** t
    return np.where(n > 0, med, 0.0)


def quantile_examples(res: LatentSummary, s: int, n_bins: int = N_QUANTILES, per_bin: int = 3,
                      median: float | None = None, max_act: float | None = None) -> list[dict]:  # fmt: skip
    """Latent ``s``'s examples below the top: ``n_bins`` equal-width bins of activation between
    the median of its firing activations (:func:`median_act`) and its max (``median``,
    ``max_act``: given, for many latents),
    each with up to ``per_bin`` sampled tokens ``{"img", "act", "tok"}`` in it, largest first
    (the last bin includes the max)."""
    mx = float(res.max_act[s]) if max_act is None else max_act
    if res.fire_count[s] == 0 or res.q_img is None:
        return []
    if median is None:
        median = float(median_act(res.hist[s : s + 1], res.hist_edges)[0])
    med = min(median, mx)
    edges = np.linspace(med, mx, n_bins + 1)
    img, act, tok = res.q_img[s].ravel(), res.q_act[s].ravel(), res.q_tok[s].ravel()
    ok = img >= 0
    seen = set()
    samples = []
    for i, a, t in sorted(zip(img[ok].tolist(), act[ok].tolist(), tok[ok].tolist(), strict=True), key=lambda x: -x[1]):
        if (i, t) not in seen:
            seen.add((i, t))
            samples.append((i, a, t))
    out = []
    for b in range(n_bins):
        lo, hi = float(edges[b]), float(edges[b + 1])
        last = b == n_bins - 1
        inside = [x for x in samples if lo <= x[1] and (x[1] < hi or (last and x[1] <= hi))]
        out.append({"lo": lo, "hi": hi, "examples": [{"img": i, "act": a, "tok": t} for i, a, t in inside[:per_bin]]})
    return out
