"""Per-latent label probes on the held-out split: do single latents, or a few, carry the classes?

    acc = ProbeAccumulator(width, labels_I)       # labels_I: class per image of the cache, -1 = not probed
    acc.update(f_BS, image_i_B)                   # per batch of the evaluation pass
    doc = acc.result(class_names)                 # eval.json "probes"

Each held-out image that the evaluation pass visited whole is summarised by the max of each latent
over its tokens (a seeded uniform sample of at most MAX_IMAGES of them, drawn as they arrive);
images the pass did not reach, or reached in part (a capped pass), are not probed. The images are
cut at random into a fit half and a test half. Definitions (one-vs-rest per class c):
- average precision (AP) is tie-aware: its expectation over the orders of tied scores, so a
  latent that is silent on most images scores what a random order of them would.
- best latent of c: the latent with the highest AP for c on the fit half, scored (AP) on the test
  half; chance level: c's prevalence among the test images.
- each latent's best class: the class with the highest mean image score of that latent
  (``latent_best_class``; -1 for a latent that never fired), shown on the latent cards.
- k-sparse probe balanced accuracy (k in K_SPARSE): the k latents whose class-c mean score exceeds
  the others' most on the fit half, then a logistic regression on them; its balanced accuracy
  (mean of the true positive and true negative rates) on the test half, averaged over classes (at
  most MAX_CLASSES, the most frequent); chance level 0.5.
Every figure carries its n (test images) and a bootstrap 95% interval (N_BOOT resamples of the
test images, the latent or the fitted probe held fixed).
"""

from __future__ import annotations

import numpy as np
import torch

K_SPARSE = (1, 2, 5, 20)
MAX_IMAGES = 4096
MAX_CLASSES = 100
N_BOOT = 1000
_COLS = 1024  # columns per chunk of the AP computation (memory ~ 8 x N x _COLS doubles)


def average_precision(score_NS: torch.Tensor, pos_NS: torch.Tensor) -> torch.Tensor:
    """Tie-aware AP of every column of ``score_NS`` for the boolean targets ``pos_NS`` (one column
    (N,) for all, or one per column) -> (S,) float64: the AP averaged over every order of tied
    scores. Within a tied group of n items holding p positives, after n0 items holding p0
    positives, each positive's expected precision is b + (a - b (1 + n0)) (H(n0 + n) - H(n0)) / n
    with a = p0 + 1, b = (p - 1) / (n - 1) and H the harmonic numbers. NaN where no target is true."""
    out = [_ap_chunk(score_NS[:, a : a + _COLS], pos_NS if pos_NS.dim() == 1 else pos_NS[:, a : a + _COLS])
           for a in range(0, score_NS.shape[1], _COLS)]  # fmt: skip
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _ap_chunk(score_NS: torch.Tensor, pos_NS: torch.Tensor) -> torch.Tensor:
    N, S = score_NS.shape
    s_NS, order = score_NS.double().sort(dim=0, descending=True)
    pos_NS = pos_NS.unsqueeze(1).expand(N, S) if pos_NS.dim() == 1 else pos_NS
    hit = pos_NS.gather(0, order).double()
    k = torch.arange(N).unsqueeze(1).expand(N, S)
    new = torch.ones(N, S, dtype=torch.bool)
    new[1:] = s_NS[1:] != s_NS[:-1]
    start = torch.where(new, k, 0).cummax(0).values  # first row of each row's tied group
    end_new = torch.ones(N, S, dtype=torch.bool)
    end_new[:-1] = new[1:]
    end = torch.where(end_new, k, N).flip(0).cummin(0).values.flip(0) + 1  # one past its last row
    cum = torch.cat([torch.zeros(1, S, dtype=torch.float64), hit.cumsum(0)])  # cum[j]: hits in rows < j
    p0, p = cum.gather(0, start), cum.gather(0, end) - cum.gather(0, start)
    n0, n = start.double(), (end - start).double()
    harm = torch.cat(
        [torch.zeros(1, dtype=torch.float64), (1.0 / torch.arange(1, N + 1, dtype=torch.float64)).cumsum(0)]
    )
    b = torch.where(n > 1, (p - 1) / (n - 1).clamp_min(1), 0.0)
    prec = b + (p0 + 1 - b * (1 + n0)) * (harm[end] - harm[start]) / n
    n_pos = hit.sum(0)
    return torch.where(n_pos > 0, (prec * hit).sum(0) / n_pos.clamp_min(1), torch.nan)


def _balanced_acc(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Balanced accuracy along the last dimension (rows: bootstrap resamples)."""
    y, pred = y.double(), pred.double()
    tpr = (pred * y).sum(-1) / y.sum(-1).clamp_min(1)
    tnr = ((1 - pred) * (1 - y)).sum(-1) / (1 - y).sum(-1).clamp_min(1)
    return 0.5 * (tpr + tnr)


def sparse_probe(x_NK: torch.Tensor, y_N: torch.Tensor, fit: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Test predictions (bool, rows ``test``) of a class-weighted logistic regression fitted on rows ``fit``."""
    x = x_NK.double()
    mu, sd = x[fit].mean(0), x[fit].std(0).clamp_min(1e-6)
    xs = (x - mu) / sd
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    yf = y_N[fit].double()
    pos_weight = (len(yf) - yf.sum()) / yf.sum().clamp_min(1)
    opt = torch.optim.LBFGS([w, b], max_iter=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = xs[fit] @ w + b
        loss = (
            torch.nn.functional.binary_cross_entropy_with_logits(z, yf, pos_weight=pos_weight) + 1e-4 * w.pow(2).sum()
        )
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return (xs[test] @ w + b) > 0


def interval(values_B: torch.Tensor) -> list[float] | None:
    """The bootstrap 95% interval [2.5th, 97.5th percentile] of the finite values, None without any."""
    v = values_B[torch.isfinite(values_B)].numpy()
    return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if len(v) else None


def resamples(n: int, seed: int = 3) -> torch.Tensor:
    """N_BOOT seeded bootstrap resamples of n rows: (N_BOOT, n) indices."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, n, size=(N_BOOT, n)))


def ap_with_interval(score_N: torch.Tensor, pos_N: torch.Tensor) -> dict:
    """One score's tie-aware AP for ``pos_N``, its n, chance level (prevalence) and bootstrap 95% interval."""
    idx = resamples(len(score_N))
    boot = average_precision(score_N[idx].T, pos_N[idx].T)
    return {"ap": float(average_precision(score_N.unsqueeze(1), pos_N)[0]), "n": len(score_N),
            "chance": float(pos_N.double().mean()), "ci95": interval(boot)}  # fmt: skip


def probe_labels(cache, held: np.ndarray):
    """The labels the probes of the held-out images ``held`` use: (labels, class names, unit).

    unit "image": the cache's image labels (labels.json/npy), one per image; unit "patch": a saev
    cache's per-patch labels (labels.bin), one per content token, keyed image * P + patch, used
    where there are no image labels. Only held-out images are labelled (-1 elsewhere); None: no labels.
    """
    import os

    from actcache.labels import read_labels
    from actcache.saev import LABELS_FILE, read_token_labels

    found = read_labels(cache.path, cache.n_imgs)
    if found is not None:
        lab_I = np.full(cache.n_imgs, -1, np.int64)
        lab_I[held] = found[0][held]
        return lab_I, found[1], "image"
    md = cache.metadata
    if md.foreign and os.path.isfile(os.path.join(cache.path, LABELS_FILE)):
        labels_NP = read_token_labels(cache.path, md)
        P = md.n_patches_per_img
        lab_K = np.full(cache.n_imgs * P, -1, np.int64)
        for img in held:
            lab_K[img * P : (img + 1) * P] = labels_NP[img]
        return lab_K, [str(c) for c in range(int(lab_K.max()) + 1)], "patch"
    return None


def probe_keys(batch: dict, unit: str, n_patches: int) -> torch.Tensor:
    """Each example's label key: its image, or (unit "patch") image * P + patch, -1 for CLS."""
    if unit == "image":
        return batch["image_i"]
    patch = batch["patch_i"]
    return torch.where(patch >= 0, batch["image_i"] * n_patches + patch, torch.full_like(patch, -1))


class ProbeAccumulator:
    """Per-image max of every latent over the labelled held-out images the pass visits whole."""

    def __init__(self, width: int, labels_I: np.ndarray):
        self.labels_I = torch.from_numpy(np.asarray(labels_I, np.int64))
        self.row_I = torch.full((len(labels_I),), -1, dtype=torch.int64)
        n = min(MAX_IMAGES, int((self.labels_I >= 0).sum()))
        self.image_N = torch.zeros(n, dtype=torch.int64)
        self.score_NS = torch.zeros(n, width)
        self.tokens_N = torch.zeros(n, dtype=torch.int64)
        self.seen, self.rng = 0, np.random.default_rng(0)

    def _rows(self, image_i_B: torch.Tensor) -> torch.Tensor:
        """Rows of the images of a batch; a new image takes a free row, or with probability
        MAX_IMAGES / seen replaces a random one (reservoir sampling: a uniform sample of the images)."""
        for i in torch.unique_consecutive(image_i_B).tolist():
            if i < 0 or self.row_I[i] >= 0 or self.row_I[i] == -2 or self.labels_I[i] < 0:
                continue
            self.seen += 1
            r = self.seen - 1 if self.seen <= MAX_IMAGES else int(self.rng.integers(0, self.seen))
            if r >= MAX_IMAGES:
                self.row_I[i] = -2  # seen, not sampled
                continue
            if self.seen > MAX_IMAGES:
                self.row_I[self.image_N[r]] = -2
                self.score_NS[r], self.tokens_N[r] = 0.0, 0
            self.row_I[i], self.image_N[r] = r, i
        return torch.where(image_i_B >= 0, self.row_I[image_i_B.clamp_min(0)], -1)

    @torch.no_grad()
    def update(self, f_BS: torch.Tensor, image_i_B: torch.Tensor) -> None:
        """``image_i_B``: the key of each example's label (an image; or a patch, -1 for none)."""
        rows = self._rows(image_i_B.cpu())
        ok = rows >= 0
        if not bool(ok.any()):
            return
        f = f_BS.detach().float().cpu()[ok]
        idx = rows[ok].unsqueeze(1).expand_as(f)
        self.score_NS.scatter_reduce_(0, idx, f, reduce="amax", include_self=True)
        self.tokens_N.scatter_add_(0, rows[ok], torch.ones(len(f), dtype=torch.int64))

    def whole_images(self) -> torch.Tensor:
        """Rows of the images the pass visited whole (as many tokens as the most visited one), in image order."""
        t_N = self.tokens_N[: min(self.seen, MAX_IMAGES)]
        rows = torch.arange(len(t_N))[t_N == t_N.max()] if len(t_N) else t_N
        return rows[self.image_N[rows].argsort()]

    @torch.no_grad()
    def result(self, class_names: list[str]) -> dict:
        rows = self.whole_images()
        s, y = self.score_NS[rows], self.labels_I[self.image_N[rows]]
        classes, counts = torch.unique(y, return_counts=True)
        if len(classes) < 2:
            return {"skipped": "fewer than two classes among the labelled held-out images the evaluation visited"}
        top = classes[counts.argsort(descending=True, stable=True)[:MAX_CLASSES]].tolist()
        perm = torch.from_numpy(np.random.default_rng(1).permutation(len(y)))
        fit, test = perm[: len(y) // 2].sort().values, perm[len(y) // 2 :].sort().values
        best = [_best_latent(s, y == c, fit, test, c, class_names) for c in top]
        mean_SC = torch.stack([s[y == c].mean(0) for c in classes.tolist()], dim=1)
        latent_best = torch.where(s.max(0).values > 0, classes[mean_SC.argmax(1)], torch.tensor(-1))
        return {
            "n_images": int(len(y)), "n_fit": int(len(fit)), "n_test": int(len(test)),
            "n_classes": int(len(classes)), "classes_probed": len(top),
            "best_latent_per_class": best,
            **_sparse_probes(s, y, top, fit, test),
            "latent_best_class": latent_best.tolist(),
            "class_names": list(class_names),
            "images": self.image_N[rows].tolist(),
        }  # fmt: skip


def _best_latent(s_NS, pos_N, fit, test, c: int, class_names: list[str]) -> dict:
    """Class c's best latent by AP on the fit half, with its AP on the test half."""
    j = int(torch.nan_to_num(average_precision(s_NS[fit], pos_N[fit]), nan=-1.0).argmax())
    scored = ap_with_interval(s_NS[test, j], pos_N[test])
    return {"class": int(c), "name": class_names[c] if c < len(class_names) else str(c), "latent": j,
            **scored, "n_images": int(pos_N[test].sum())}  # fmt: skip


def _sparse_probes(s_NS, y_N, top: list[int], fit, test) -> dict:
    """k-sparse probes per class; mean balanced accuracy over classes with its bootstrap interval."""
    preds = {k: [] for k in K_SPARSE}
    used = []
    for c in top:
        pos = y_N == c
        if not (int(pos[fit].sum()) and int(pos[test].sum())):
            continue
        used.append(pos[test])
        gap = s_NS[fit][pos[fit]].mean(0) - s_NS[fit][~pos[fit]].mean(0)
        for k in K_SPARSE:
            cols = gap.topk(min(k, s_NS.shape[1])).indices
            preds[k].append(sparse_probe(s_NS[:, cols], pos, fit, test))
    acc, ci = {}, {}
    idx = resamples(len(test))
    for k, p in preds.items():
        if not p:
            acc[str(k)], ci[str(k)] = None, None
            continue
        pred_CN, y_CN = torch.stack(p), torch.stack(used)
        acc[str(k)] = float(_balanced_acc(pred_CN, y_CN).mean())
        ci[str(k)] = interval(_balanced_acc(pred_CN[:, idx], y_CN[:, idx]).mean(0))
    return {"sparse_probe_acc": acc, "sparse_probe_ci95": ci, "sparse_probe_chance": 0.5,
            "sparse_probe_n": int(len(test))}  # fmt: skip
