"""Per-latent label probes on the held-out split: do single latents, or a few, carry the classes?

    acc = ProbeAccumulator(width, labels_I)       # labels_I: class per image of the cache, -1 = not probed
    acc.update(f_BS, image_i_B)                   # per batch of the evaluation pass
    # a saev cache with per-patch labels (labels.bin) and no image labels: one row per patch
    # token, keyed image * P + patch (probe_labels, probe_keys); "image" below then means "patch"
    doc = acc.result(class_names)                 # eval.json "probes"

Each held-out image is summarised by the max of each latent over its tokens (at most MAX_IMAGES
images). Definitions (one-vs-rest per class c, images of other classes as negatives):
- best latent of c: the latent with the highest average precision (AP) of its image score for c;
  ``best_latent_per_class`` lists it with its AP.
- each latent's best class: the class with the highest mean image score of that latent
  (``latent_best_class``; -1 for a latent that never fired), shown on the latent cards.
- k-sparse probe accuracy (k in K_SPARSE): the k latents whose class-c mean score exceeds the
  others' most, on a fit half of the images, then a logistic regression on them; its balanced
  accuracy (mean of the true positive and true negative rates) on the other half, averaged over
  classes (at most MAX_CLASSES, the most frequent).
"""

from __future__ import annotations

import numpy as np
import torch

K_SPARSE = (1, 2, 5, 20)
MAX_IMAGES = 4096
MAX_CLASSES = 100


def average_precision(score_NS: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
    """AP of every column of ``score_NS`` for the boolean targets ``pos_N`` -> (S,). Tied scores
    are ranked in a fixed random order (not by image index, which may follow the classes), and a
    column that is constant gets the AP of a random ranking: the positives' share."""
    shuffle = torch.from_numpy(np.random.default_rng(2).permutation(score_NS.shape[0]))
    score_NS, pos_N = score_NS[shuffle], pos_N[shuffle]
    order = score_NS.argsort(dim=0, descending=True, stable=True)
    hit = pos_N[order].double()
    prec = hit.cumsum(0) / torch.arange(1, hit.shape[0] + 1, dtype=torch.float64).unsqueeze(1)
    ap = (prec * hit).sum(0) / max(1, int(pos_N.sum()))
    constant = score_NS.max(0).values == score_NS.min(0).values
    return torch.where(constant, pos_N.double().mean(), ap)


def _balanced_acc(pred: torch.Tensor, y: torch.Tensor) -> float:
    tpr = float((pred & y).sum()) / max(1, int(y.sum()))
    tnr = float((~pred & ~y).sum()) / max(1, int((~y).sum()))
    return 0.5 * (tpr + tnr)


def sparse_probe(x_NK: torch.Tensor, y_N: torch.Tensor, fit: torch.Tensor, test: torch.Tensor) -> float:
    """Balanced test accuracy of a class-weighted logistic regression fitted on rows ``fit``."""
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
        return _balanced_acc((xs[test] @ w + b) > 0, y_N[test])


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
    """Per-image max of every latent over the held-out images that have a label."""

    def __init__(self, width: int, labels_I: np.ndarray):
        labels_I = np.asarray(labels_I, np.int64)
        imgs = np.flatnonzero(labels_I >= 0)
        if len(imgs) > MAX_IMAGES:
            imgs = np.sort(imgs[np.random.default_rng(0).permutation(len(imgs))[:MAX_IMAGES]])
        self.row_I = torch.full((len(labels_I),), -1, dtype=torch.int64)
        self.row_I[torch.from_numpy(imgs)] = torch.arange(len(imgs))
        self.y_N = torch.from_numpy(labels_I[imgs])
        self.score_NS = torch.zeros(len(imgs), width)

    @torch.no_grad()
    def update(self, f_BS: torch.Tensor, image_i_B: torch.Tensor) -> None:
        """``image_i_B``: the key of each example's label (an image; or a patch, -1 for none)."""
        key = image_i_B.cpu()
        rows = self.row_I[key.clamp_min(0)]
        ok = (rows >= 0) & (key >= 0)
        if not bool(ok.any()):
            return
        f = f_BS.detach().float().cpu()[ok]
        idx = rows[ok].unsqueeze(1).expand_as(f)
        self.score_NS.scatter_reduce_(0, idx, f, reduce="amax", include_self=True)

    @torch.no_grad()
    def result(self, class_names: list[str]) -> dict:
        s, y = self.score_NS, self.y_N
        classes, counts = torch.unique(y, return_counts=True)
        if len(classes) < 2:
            return {"skipped": "fewer than two classes among the labelled held-out images"}
        top = classes[counts.argsort(descending=True, stable=True)[:MAX_CLASSES]].tolist()
        perm = torch.from_numpy(np.random.default_rng(1).permutation(len(y)))
        fit, test = perm[: len(y) // 2], perm[len(y) // 2 :]
        best, accs = [], {k: [] for k in K_SPARSE}
        for c in top:
            pos = y == c
            ap = average_precision(s, pos)
            j = int(ap.argmax())
            best.append({"class": int(c), "name": class_names[c] if c < len(class_names) else str(c),
                         "latent": j, "ap": float(ap[j]), "n_images": int(pos.sum())})  # fmt: skip
            if int(pos[fit].sum()) and int(pos[test].sum()):
                gap = s[fit][pos[fit]].mean(0) - s[fit][~pos[fit]].mean(0)
                for k in K_SPARSE:
                    cols = gap.topk(min(k, s.shape[1])).indices
                    accs[k].append(sparse_probe(s[:, cols], pos, fit, test))
        mean_SC = torch.stack([s[y == c].mean(0) for c in classes.tolist()], dim=1)
        latent_best = torch.where(s.max(0).values > 0, classes[mean_SC.argmax(1)], torch.tensor(-1))
        return {
            "n_images": int(len(y)), "n_classes": int(len(classes)), "classes_probed": len(top),
            "best_latent_per_class": best,
            "sparse_probe_acc": {str(k): (float(np.mean(v)) if v else None) for k, v in accs.items()},
            "latent_best_class": latent_best.tolist(),
            "class_names": list(class_names),
        }  # fmt: skip
