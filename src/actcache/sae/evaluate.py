"""Held-out evaluation of a trained SAE -> its run's eval file (actcache.rundir.EVAL_FILE).

    stats = evaluate(sae, batches, dense_frac=0.1)       # batches: iterable of (B, D) tensors
    stats_list = evaluate_many([sae_a, sae_b], batches, dense_frac=[0.1, 0.1])   # one pass
    stats_list = evaluate_many(saes, batches, dense_frac=fr, window={"training": more})  # wider dead count
    write_eval(run_dir, stats | {"split": ...})

This module is the one place the held-out statistics are computed; :func:`definitions` states
each one with its window, and eval.json carries that text beside the numbers, so the page, the
report and export read the same values by the same names. Over N held-out examples (eval mode,
so a batchtopk SAE uses its inference threshold), with x the input and x_hat the reconstruction:
- fvu (also ``nmse``): sum (x_hat - x)^2 / sum (x - mean_x)^2; explained_variance = 1 - fvu.
  nmse_sq_norm: sum (x_hat - x)^2 / sum ||x||^2, the other convention some papers call NMSE.
- mse: per element, sum (x_hat - x)^2 / (N D); mse_per_token (SAELens' "mse"): sum (x_hat - x)^2 / N.
- by_token_kind (when the tokens hold CLS and patches, ``patches: all``): n, mse_per_token, fvu
  (about the kind's own mean), mean ||x|| and mean ||x_hat|| for the CLS and the patch tokens apart.
- cos_x_xhat: mean cosine between x and x_hat; norm_ratio: mean ||x_hat|| / ||x||;
  mean_norm_x, mean_norm_x_hat: mean ||x||, mean ||x_hat||.
- recon_bias: sum ||x_hat||^2 / sum <x_hat, x> (1: unbiased; below 1: x_hat shrunk toward 0).
- l0: mean number of non-zero latents per example; l1: mean sum_s |f_s| * ||W_dec[s]||.
- the firing window: the N examples, every other held-out token (those past the ``eval_tokens``
  cap) and the tokens of ``window`` (training images, so that it holds at least
  DEAD_WINDOW_TOKENS), encoded only. Over it: n_dead (dead_fraction) latents that never fire,
  n_almost_dead latents that fire on fewer than ALMOST_DEAD of its tokens (dead ones excluded),
  n_dense (dense_fraction) latents firing on more than ``dense_frac`` of them, freq_hist the
  histogram of log10(firing frequency) of the latents that fire (``n_never`` = n_dead), bins of
  0.5 decades from 10^-8 to 10^0. ``dead_definition`` states the window in one string.
- max_decoder_cos: the largest cosine between two different decoder rows.
metrics.jsonl's n_dead and n_dense are the trainer's own (AuxK's inactive latents), over a
different window, and are shown as "inactive" (see :func:`definitions`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

import torch

from actcache.errors import TrainError
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import EVAL_FILE

HIST_LO, HIST_HI, HIST_STEP = -8.0, 0.0, 0.5
DEAD_WINDOW_TOKENS = 1_000_000
ALMOST_DEAD = 1e-6


class EvalAccumulator:
    """Streaming held-out metrics of one SAE: ``update(x_BD)`` per batch, then ``result()``."""

    def __init__(self, sae, dense_frac: float = 0.1, labels_I=None, class_names: list[str] | None = None):
        self.sae, self.dense_frac = sae, dense_frac
        self.probe, self.class_names = None, class_names or []
        if labels_I is not None:
            from actcache.sae.probes import ProbeAccumulator

            self.probe = ProbeAccumulator(sae.cfg.width, labels_I)
        dev = next(sae.parameters()).device
        self.fires_S = torch.zeros(sae.cfg.width, dtype=torch.int64, device=dev)
        self.window_fires_S = torch.zeros(sae.cfg.width, dtype=torch.int64, device=dev)  # past the evaluated ones
        self.window_n: dict[str, int] = {}  # firing-window tokens past the evaluated ones, by source
        self.sums: list[torch.Tensor] | None = None  # sse, sum_x_D, sum_x2_D, l0, l1 (float64)
        self.kinds: dict[str, list[torch.Tensor]] = {}  # token kind -> n, sse, sum_x_D, sum_x2_D, |x|, |x_hat|
        self.prefix_sse: list[torch.Tensor] | None = None  # matryoshka: one per prefix
        self.n = 0

    @torch.no_grad()
    def count_firings(self, x_BD: torch.Tensor, source: str) -> None:
        """Firings of tokens that widen the firing window only (encoded, not reconstructed)."""
        was_training = self.sae.training
        self.sae.eval()
        try:
            f_BS = self.sae.encode(x_BD)
        finally:
            self.sae.train(was_training)
        self.window_fires_S += (torch.ones(len(f_BS), device=f_BS.device) @ torch.sign(f_BS).float()).round().long()
        self.window_n[source] = self.window_n.get(source, 0) + x_BD.shape[0]

    @torch.no_grad()
    def update(self, x_BD: torch.Tensor, image_i_B: torch.Tensor | None = None, patch_i_B=None) -> None:
        sae = self.sae
        was_training = sae.training
        sae.eval()  # batchtopk: the inference threshold, per example
        try:
            x_hat_BD, f_BS, _ = sae(x_BD)
        finally:
            sae.train(was_training)
        # per-example sums in the input's precision (D terms each), totals over examples in float64
        x, xh = x_BD.float(), x_hat_BD.float()
        x2_BD = x * x
        x_norm_B, xh_norm_B = x2_BD.sum(1).sqrt(), xh.norm(dim=1)
        dot_B = (xh * x).sum(1)
        # every activation gives f >= 0 (ReLU, top-k of ReLU'd values, JumpReLU and BatchTopK with
        # thresholds > 0), so |f| = f and sign(f) marks the firings: each reduces over the batch as
        # one matrix-vector product (a column count_nonzero is several times slower)
        fired_BS = torch.sign(f_BS).float()
        self._prefix_update(x, f_BS)
        f_BS = f_BS.float()
        dec_norm_S = sae.W_dec.norm(dim=1).float()
        d64 = torch.float64
        parts = [
            (xh - x).pow(2).sum(1).sum(dtype=d64), x.sum(0, dtype=d64), x2_BD.sum(0, dtype=d64),
            (f_BS @ dec_norm_S).sum(dtype=d64),
            (dot_B / (x_norm_B * xh_norm_B).clamp_min(1e-30)).sum(dtype=d64),
            (xh_norm_B / x_norm_B.clamp_min(1e-30)).sum(dtype=d64), xh_norm_B.pow(2).sum(dtype=d64), dot_B.sum(dtype=d64),
            x_norm_B.sum(dtype=d64), xh_norm_B.sum(dtype=d64),
        ]  # fmt: skip
        self.sums = parts if self.sums is None else [a + b for a, b in zip(self.sums, parts, strict=True)]
        self.fires_S += (torch.ones(len(f_BS), device=f_BS.device) @ fired_BS).round().long()  # exact: B < 2^24
        self.n += x_BD.shape[0]
        if patch_i_B is not None:
            self._by_kind(x, xh, x_norm_B, xh_norm_B, patch_i_B.to(x.device))
        if self.probe is not None and image_i_B is not None:
            self.probe.update(f_BS, image_i_B)

    def _by_kind(self, x, xh, x_norm_B, xh_norm_B, patch_i_B) -> None:
        """Sums per token kind (CLS: patch_i < 0; patch: patch_i >= 0)."""
        d64 = torch.float64
        for kind, m in (("cls", patch_i_B < 0), ("patch", patch_i_B >= 0)):
            if not bool(m.any()):
                continue
            xk, xhk = x[m], xh[m]
            part = [m.sum().to(d64), (xhk - xk).pow(2).sum(dtype=d64), xk.sum(0, dtype=d64),
                    xk.pow(2).sum(0, dtype=d64), x_norm_B[m].sum(dtype=d64), xh_norm_B[m].sum(dtype=d64)]  # fmt: skip
            old = self.kinds.get(kind)
            self.kinds[kind] = part if old is None else [a + b for a, b in zip(old, part, strict=True)]

    def kind_stats(self) -> dict:
        """by_token_kind (module docstring); empty unless the tokens held both kinds."""
        if len(self.kinds) < 2:
            return {}
        out = {}
        for kind, (n, sse, sx, sx2, xn, xhn) in self.kinds.items():
            n = float(n)
            var = float((sx2 - sx.pow(2) / n).sum())
            out[kind] = {"n_tokens": int(n), "mse_per_token": float(sse) / n,
                         "fvu": float(sse) / var if var > 0 else math.nan,
                         "mean_norm_x": float(xn) / n, "mean_norm_x_hat": float(xhn) / n}  # fmt: skip
        return {"by_token_kind": out}

    def _prefix_update(self, x_BD: torch.Tensor, f_BS: torch.Tensor) -> None:
        """Matryoshka: the squared error of each prefix's reconstruction (its first m latents)."""
        prefixes = self.sae.cfg.matryoshka_prefixes if self.sae.cfg.activation == "matryoshka" else None
        if not prefixes:
            return
        sse = [(xm.float() - x_BD).pow(2).sum(dtype=torch.float64) for xm in self.sae.decode_prefixes(f_BS, prefixes)]
        self.prefix_sse = sse if self.prefix_sse is None else [a + b for a, b in zip(self.prefix_sse, sse, strict=True)]

    def result(self) -> dict:
        if self.n == 0 or self.sums is None:
            raise TrainError("evaluation got no held-out examples")
        n, D, S = self.n, self.sae.cfg.d_vit, self.sae.cfg.width
        sse, sum_x, sum_x2, l1, cos, ratio, xh2, dot, norm_x, norm_xh = self.sums
        l0 = self.fires_S.sum()
        total_var = float((sum_x2 - sum_x.pow(2) / n).sum())
        fvu = float(sse) / total_var if total_var > 0 else math.nan
        n_window = n + sum(self.window_n.values())
        freq_S = ((self.fires_S + self.window_fires_S).double() / n_window).cpu()
        n_dead = int((freq_S == 0).sum())
        n_almost_dead = int(((freq_S > 0) & (freq_S < ALMOST_DEAD)).sum())
        n_dense = int((freq_S > self.dense_frac).sum())
        fired = freq_S[freq_S > 0]
        n_bins = int(round((HIST_HI - HIST_LO) / HIST_STEP))
        edges = [HIST_LO + i * HIST_STEP for i in range(n_bins + 1)]
        counts = torch.histc(fired.log10().clamp(HIST_LO, HIST_HI).float(), bins=n_bins, min=HIST_LO, max=HIST_HI)
        out = {
            "n_tokens": n,
            "width": S,
            "mse": float(sse) / (n * D),
            "mse_per_token": float(sse) / n,
            "nmse": fvu,
            "nmse_sq_norm": float(sse) / float(sum_x2.sum()) if float(sum_x2.sum()) > 0 else math.nan,
            "fvu": fvu,
            "explained_variance": 1.0 - fvu,
            "cos_x_xhat": float(cos) / n,
            "norm_ratio": float(ratio) / n,
            "mean_norm_x": float(norm_x) / n,
            "mean_norm_x_hat": float(norm_xh) / n,
            "recon_bias": float(xh2) / float(dot) if float(dot) != 0 else math.nan,
            "l0": float(l0) / n,
            "l1": float(l1) / n,
            "n_dead": n_dead,
            "n_almost_dead": n_almost_dead,
            "dead_window_tokens": n_window,
            "dead_definition": dead_definition(n, self.window_n),
            "n_dense": n_dense,
            "dead_fraction": n_dead / S,
            "dense_fraction": n_dense / S,
            "dense_frac": self.dense_frac,
            "max_decoder_cos": max_decoder_cos(self.sae.W_dec),
            "definitions": definitions(n, self.dense_frac, self.window_n),
            "freq_hist": {
                "log10_bin_edges": edges,
                "counts": [int(c) for c in counts.tolist()],
                "n_never": int((freq_S == 0).sum()),
            },
        }
        out.update(self.kind_stats())
        for m, sse_m in zip(self.sae.cfg.matryoshka_prefixes or (), self.prefix_sse or (), strict=False):
            out[f"nmse_prefix_{m}"] = float(sse_m) / total_var if total_var > 0 else math.nan
        if self.probe is not None:
            out["probes"] = self.probe.result(self.class_names)
        return out


def dead_definition(n_eval: int, window_n: dict[str, int]) -> str:
    """The one definition of n_dead and n_almost_dead, naming their window."""
    held = n_eval + window_n.get("held-out", 0)
    parts = [f"{held:,} held-out tokens (all of them)"] + [f"{v:,} {k} tokens" for k, v in window_n.items()
                                                           if k != "held-out"]  # fmt: skip
    total = held + sum(v for k, v in window_n.items() if k != "held-out")
    return (
        f"over a firing window of {total:,} tokens ({' and '.join(parts)}; the window holds every held-out token "
        f"and at least {DEAD_WINDOW_TOKENS:,} tokens, or the whole cache when it has fewer): n_dead counts the "
        f"latents that never fired, n_almost_dead those that fired on fewer than {ALMOST_DEAD:g} of its tokens "
        "without being dead"
    )


def definitions(n_tokens: int | None, dense_frac: float, window_n: dict[str, int] | None = None) -> dict[str, str]:
    """Each statistic's one definition, with its window (eval.json, the page, the report)."""
    on = f"the {n_tokens:,} held-out tokens" if n_tokens is not None else "the held-out tokens"
    dead = dead_definition(n_tokens or 0, window_n or {})
    return {
        "fvu": f"fraction of variance unexplained, sum (x_hat - x)^2 / sum (x - mean x)^2 over {on}",
        "nmse": "= fvu (normalised by the variance about the mean); SAELens and some papers normalise by "
        "sum ||x||^2 instead: that is nmse_sq_norm",
        "nmse_sq_norm": f"sum (x_hat - x)^2 / sum ||x||^2 over {on}",
        "mse": f"mean squared error per element, sum (x_hat - x)^2 / (N d) over {on}",
        "mse_per_token": f"sum ||x_hat - x||^2 / N over {on} (SAELens' mse, d times mse)",
        "explained_variance": "1 - fvu",
        "by_token_kind": f"the same statistics for the CLS and the patch tokens apart, over {on} (registers are "
        "not cached); fvu about each kind's own mean; mean_norm_x, mean_norm_x_hat: mean ||x||, ||x_hat||",
        "cos_x_xhat": f"mean cosine between x and x_hat over {on}",
        "norm_ratio": f"mean ||x_hat|| / ||x|| over {on}",
        "mean_norm_x": f"mean ||x|| over {on} (mean_norm_x_hat: mean ||x_hat||)",
        "recon_bias": f"sum ||x_hat||^2 / sum <x_hat, x> over {on}; 1 unbiased, below 1 shrunk",
        "l0": f"mean number of non-zero latents per token over {on}",
        "n_dead": dead,
        "n_almost_dead": dead,
        "n_dense": f"latents firing on more than {dense_frac:g} of the firing window's tokens (see n_dead)",
        "freq_hist": "log10 firing frequency of the latents that fired, over the firing window (see n_dead)",
        "max_decoder_cos": "largest cosine between two different decoder rows",
        "nmse_prefix": f"matryoshka, nmse_prefix_<m>: fvu of the reconstruction from the first m latents only, over {on}",
        "metrics.jsonl n_inactive": "training: latents that did not fire in the last dead_tokens training tokens "
        "(AuxK's target; metrics.jsonl names it n_dead); not the dead count",
    }


@torch.no_grad()
def max_decoder_cos(W_dec_SD: torch.Tensor, chunk: int = 4096) -> float:
    """Largest cosine between two different rows of the decoder, in row chunks (memory chunk x S)."""
    W = W_dec_SD.detach().float()
    W = W / W.norm(dim=1, keepdim=True).clamp_min(1e-12)
    S, best = W.shape[0], -1.0
    if S < 2:
        return math.nan
    for a in range(0, S, chunk):
        c_CS = W[a : a + chunk] @ W.T
        rows = torch.arange(c_CS.shape[0], device=W.device)
        c_CS[rows, rows + a] = -2.0  # a row with itself
        best = max(best, float(c_CS.max()))
    return best


def check_finite(x_BD: torch.Tensor, batch: dict | None, what: str) -> None:
    """Raise TrainError naming the first example with NaN/Inf (image_i, patch_i when known)."""
    if bool(torch.isfinite(x_BD.sum())) or bool(torch.isfinite(x_BD).all()):
        return  # a NaN or Inf makes the sum NaN or Inf (one fast reduction); a large sum may overflow alone
    row = int((~torch.isfinite(x_BD)).any(1).nonzero()[0, 0])
    where = f"example {row} of the batch"
    if batch is not None and "image_i" in batch:
        where = f"image_i={int(batch['image_i'][row])}, patch_i={int(batch['patch_i'][row])}"
    raise TrainError(
        f"{what} contain NaN or Inf at {where}; not training through it. "
        "Check the cache with `actcache verify --deep DIR` and re-dump the shard holding that image."
    )


def evaluate(sae, batches: Iterable, *, dense_frac: float = 0.1, max_tokens: int | None = None,
             labels=None, window: dict[str, Iterable] | None = None) -> dict:  # fmt: skip
    """Metrics of ``sae`` over ``batches`` (tensors (B, D) or loader dicts with "act")."""
    return evaluate_many([sae], batches, dense_frac=[dense_frac], max_tokens=max_tokens, labels=labels,
                         window=window)[0]  # fmt: skip


def evaluate_many(
    saes: list,
    batches: Iterable,
    *,
    dense_frac: list[float],
    max_tokens: int | None = None,
    labels=None,
    window: dict[str, Iterable] | None = None,
) -> list[dict]:
    """One pass over ``batches`` evaluating several SAEs (same d_vit and device). ``labels``:
    (labels_I, class_names), a class per image of the cache (-1: none), adds the label probes
    (actcache.sae.probes) of loader-dict batches. The examples of ``batches`` past ``max_tokens``
    and those of ``window`` (source name -> batches, e.g. "held-out", "training") only widen the
    firing window of the dead count (module docstring). ``labels`` as (labels, class_names, unit,
    n_patches) with unit "patch" labels each patch token instead (actcache.sae.probes.probe_labels)."""
    from actcache.sae.probes import probe_keys

    labels = tuple(labels) if labels is not None else (None, None)
    lab, names = labels[:2]
    unit, n_patches = labels[2:] if len(labels) == 4 else ("image", 0)
    accs = [EvalAccumulator(s, f, lab, names) for s, f in zip(saes, dense_frac, strict=True)]
    device = next(saes[0].parameters()).device
    n = 0
    for batch in batches:
        x_BD = (batch["act"] if isinstance(batch, dict) else batch).to(device, non_blocking=True)
        take = x_BD.shape[0] if max_tokens is None else max(0, min(x_BD.shape[0], max_tokens - n))
        check_finite(x_BD, batch if isinstance(batch, dict) else None, "held-out activations")
        if take:
            cut = {k: batch[k][:take] if k in batch else None for k in ("image_i", "patch_i")} if isinstance(batch, dict) else {}  # fmt: skip
            if unit == "patch" and cut.get("image_i") is not None and lab is not None:
                cut = {**cut, "image_i": probe_keys({"image_i": cut["image_i"], "patch_i": cut["patch_i"]}, unit, n_patches)}
            for acc in accs:
                acc.update(x_BD[:take], cut.get("image_i"), cut.get("patch_i"))
        if take < x_BD.shape[0]:
            for acc in accs:
                acc.count_firings(x_BD[take:], "held-out")
        n += take
    for source, more in (window or {}).items():
        for batch in more:
            x_BD = (batch["act"] if isinstance(batch, dict) else batch).to(device, non_blocking=True)
            for acc in accs:
                acc.count_firings(x_BD, source)
    out = [acc.result() for acc in accs]
    for r in out:
        if isinstance(r.get("probes"), dict) and "skipped" not in r["probes"]:
            r["probes"]["unit"] = unit  # "patch": every "image" count and row of the probes is a patch token
    return out


def write_eval(run_dir: str, doc: dict) -> str:
    path = os.path.join(run_dir, EVAL_FILE)
    atomic_write_bytes(path, (json.dumps(doc, indent=2, allow_nan=True) + "\n").encode())
    return path
