"""Held-out evaluation of a trained SAE -> its run's eval file (actcache.rundir.EVAL_FILE).

    stats = evaluate(sae, batches, dense_frac=0.1)       # batches: iterable of (B, D) tensors
    stats_list = evaluate_many([sae_a, sae_b], batches, dense_frac=[0.1, 0.1])   # one pass
    write_eval(run_dir, stats | {"split": ...})

This module is the one place the held-out statistics are computed; :func:`definitions` states
each one with its window, and eval.json carries that text beside the numbers, so the page, the
report and export read the same values by the same names. Over N held-out examples (eval mode,
so a batchtopk SAE uses its inference threshold), with x the input and x_hat the reconstruction:
- fvu (also ``nmse``): sum (x_hat - x)^2 / sum (x - mean_x)^2; explained_variance = 1 - fvu.
- cos_x_xhat: mean cosine between x and x_hat; norm_ratio: mean ||x_hat|| / ||x||.
- recon_bias: sum ||x_hat||^2 / sum <x_hat, x> (1: unbiased; below 1: x_hat shrunk toward 0).
- l0: mean number of non-zero latents per example; l1: mean sum_s |f_s| * ||W_dec[s]||.
- n_dead (dead_fraction): latents that never fire on the N examples; n_dense (dense_fraction):
  latents firing on more than ``dense_frac`` of them.
- freq_hist: histogram of log10(firing frequency) of the latents that fire at least once
  (``n_never`` counts the others), bins of 0.5 decades from 10^-8 to 10^0.
- max_decoder_cos: the largest cosine between two different decoder rows.
metrics.jsonl's n_dead and n_dense are the trainer's own, over a different window (see
:func:`definitions`).
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
        self.sums: list[torch.Tensor] | None = None  # sse, sum_x_D, sum_x2_D, l0, l1 (float64)
        self.prefix_sse: list[torch.Tensor] | None = None  # matryoshka: one per prefix
        self.n = 0

    @torch.no_grad()
    def update(self, x_BD: torch.Tensor, image_i_B: torch.Tensor | None = None) -> None:
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
        ]  # fmt: skip
        self.sums = parts if self.sums is None else [a + b for a, b in zip(self.sums, parts, strict=True)]
        self.fires_S += (torch.ones(len(f_BS), device=f_BS.device) @ fired_BS).round().long()  # exact: B < 2^24
        self.n += x_BD.shape[0]
        if self.probe is not None and image_i_B is not None:
            self.probe.update(f_BS, image_i_B)

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
        sse, sum_x, sum_x2, l1, cos, ratio, xh2, dot = self.sums
        l0 = self.fires_S.sum()
        total_var = float((sum_x2 - sum_x.pow(2) / n).sum())
        fvu = float(sse) / total_var if total_var > 0 else math.nan
        n_dead = int((self.fires_S == 0).sum())
        n_dense = int((self.fires_S.double() / n > self.dense_frac).sum())
        freq_S = (self.fires_S.double() / n).cpu()
        fired = freq_S[freq_S > 0]
        n_bins = int(round((HIST_HI - HIST_LO) / HIST_STEP))
        edges = [HIST_LO + i * HIST_STEP for i in range(n_bins + 1)]
        counts = torch.histc(fired.log10().clamp(HIST_LO, HIST_HI).float(), bins=n_bins, min=HIST_LO, max=HIST_HI)
        out = {
            "n_tokens": n,
            "width": S,
            "mse": float(sse) / (n * D),
            "nmse": fvu,
            "fvu": fvu,
            "explained_variance": 1.0 - fvu,
            "cos_x_xhat": float(cos) / n,
            "norm_ratio": float(ratio) / n,
            "recon_bias": float(xh2) / float(dot) if float(dot) != 0 else math.nan,
            "l0": float(l0) / n,
            "l1": float(l1) / n,
            "n_dead": n_dead,
            "n_dense": n_dense,
            "dead_fraction": n_dead / S,
            "dense_fraction": n_dense / S,
            "dense_frac": self.dense_frac,
            "max_decoder_cos": max_decoder_cos(self.sae.W_dec),
            "definitions": definitions(n, self.dense_frac),
            "freq_hist": {
                "log10_bin_edges": edges,
                "counts": [int(c) for c in counts.tolist()],
                "n_never": int((freq_S == 0).sum()),
            },
        }
        for m, sse_m in zip(self.sae.cfg.matryoshka_prefixes or (), self.prefix_sse or (), strict=False):
            out[f"nmse_prefix_{m}"] = float(sse_m) / total_var if total_var > 0 else math.nan
        if self.probe is not None:
            out["probes"] = self.probe.result(self.class_names)
        return out


def definitions(n_tokens: int | None, dense_frac: float) -> dict[str, str]:
    """Each statistic's one definition, with its window (eval.json, the page, the report)."""
    on = f"the {n_tokens:,} held-out tokens" if n_tokens is not None else "the held-out tokens"
    return {
        "fvu": f"fraction of variance unexplained, sum (x_hat - x)^2 / sum (x - mean x)^2 over {on} (= nmse)",
        "explained_variance": "1 - fvu",
        "cos_x_xhat": f"mean cosine between x and x_hat over {on}",
        "norm_ratio": f"mean ||x_hat|| / ||x|| over {on}",
        "recon_bias": f"sum ||x_hat||^2 / sum <x_hat, x> over {on}; 1 unbiased, below 1 shrunk",
        "l0": f"mean number of non-zero latents per token over {on}",
        "n_dead": f"latents that never fired on {on}",
        "n_dense": f"latents firing on more than {dense_frac:g} of {on}",
        "freq_hist": f"log10 firing frequency of the latents that fired, over {on}",
        "max_decoder_cos": "largest cosine between two different decoder rows",
        "nmse_prefix": f"matryoshka, nmse_prefix_<m>: fvu of the reconstruction from the first m latents only, over {on}",
        "metrics.jsonl n_dead": "training window: latents that did not fire in the last dead_tokens training tokens",
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
             labels=None) -> dict:  # fmt: skip
    """Metrics of ``sae`` over ``batches`` (tensors (B, D) or loader dicts with "act")."""
    return evaluate_many([sae], batches, dense_frac=[dense_frac], max_tokens=max_tokens, labels=labels)[0]


def evaluate_many(
    saes: list, batches: Iterable, *, dense_frac: list[float], max_tokens: int | None = None, labels=None
) -> list[dict]:
    """One pass over ``batches`` evaluating several SAEs (same d_vit and device). ``labels``:
    (labels_I, class_names), a class per image of the cache (-1: none), adds the label probes
    (actcache.sae.probes) of loader-dict batches."""
    lab, names = labels if labels is not None else (None, None)
    accs = [EvalAccumulator(s, f, lab, names) for s, f in zip(saes, dense_frac, strict=True)]
    device = next(saes[0].parameters()).device
    n = 0
    for batch in batches:
        x_BD = batch["act"] if isinstance(batch, dict) else batch
        if max_tokens is not None:
            x_BD = x_BD[: max_tokens - n]
        if x_BD.shape[0] == 0:
            break
        x_BD = x_BD.to(device, non_blocking=True)
        check_finite(x_BD, batch if isinstance(batch, dict) else None, "held-out activations")
        image_i = batch["image_i"][: x_BD.shape[0]] if isinstance(batch, dict) and "image_i" in batch else None
        for acc in accs:
            acc.update(x_BD, image_i)
        n += x_BD.shape[0]
        if max_tokens is not None and n >= max_tokens:
            break
    return [acc.result() for acc in accs]


def write_eval(run_dir: str, doc: dict) -> str:
    path = os.path.join(run_dir, EVAL_FILE)
    atomic_write_bytes(path, (json.dumps(doc, indent=2, allow_nan=True) + "\n").encode())
    return path
