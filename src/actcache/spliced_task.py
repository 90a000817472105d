"""The task-level number of `actcache eval`: what splicing an SAE in does to a classifier that reads
the ViT's final embedding.

    task = task_metrics(labels_I, clean_ND, {"sae": e_ND, "zero": ..., "mean": ..., "noise": ...})

A multinomial logistic regression is fitted on the clean embeddings of one half of the held-out
images (the fit half) and read on the other half (the test half) with each variant's embeddings
in place of the clean ones. Labels come from the cache; without them, from k-means on the clean
fit-half embeddings (pseudo-labels, the clean model's own grouping). Per variant v, on the test half:
- ce_v: mean cross-entropy of the labels under the classifier's predictions;
- kl_v: mean KL(p_clean || p_v) between the clean and the variant's predictions;
- ce_recovered_<a> = (ce_a - ce_sae) / (ce_a - ce_clean) for ablation a (zero, mean, const): 1 as
  clean, 0 no better than the ablation, unbounded below (worse than the ablation), above 1 when
  the SAE's predictions fit the labels better than the clean ones;
- kl_recovered_<a> = (kl_a - kl_sae) / kl_a: the same formula with the clean predictions as the
  targets (the CE against p_clean is H(p_clean) + KL). The headline is kl_recovered_mean: its
  denominator is the ablation's effect on the predictions, never below 0, where the labels'
  (ce_mean - ce_clean) can be 0 or negative on a small held-out set (a classifier fitted on a few
  images is no better than an ablated one on the others).
"const" is the best constant prediction: the test half's own label frequencies (the lowest CE any
one fixed prediction reaches), and for KL the mean clean prediction (the lowest KL).
"""

from __future__ import annotations

import numpy as np

HEADLINE = "kl_recovered_mean"
SPLIT_SEED = 1
MIN_IMAGES = 4


def halves(n: int, usable: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random split of the usable positions 0..n-1 into a fit half and a test half."""
    ok = np.arange(n) if usable is None else np.flatnonzero(usable)
    perm = ok[np.random.default_rng(SPLIT_SEED).permutation(len(ok))]
    return np.sort(perm[: len(perm) // 2]), np.sort(perm[len(perm) // 2 :])


def kmeans(x_ND: np.ndarray, k: int, iters: int = 50, seed: int = 0) -> np.ndarray:
    """Centroids (k, D) of k-means (k-means++ start, Lloyd steps) on standardised ``x_ND``."""
    rng = np.random.default_rng(seed)
    x = x_ND.astype(np.float64)
    c = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None] - np.asarray(c)[None]) ** 2).sum(-1), axis=1)
        c.append(x[rng.choice(len(x), p=d2 / d2.sum())] if d2.sum() > 0 else x[rng.integers(len(x))])
    c = np.asarray(c)
    for _ in range(iters):
        a = nearest(x, c)
        new = np.asarray([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)])
        if np.allclose(new, c):
            break
        c = new
    return c


def nearest(x_ND: np.ndarray, c_KD: np.ndarray) -> np.ndarray:
    return ((x_ND[:, None].astype(np.float64) - c_KD[None]) ** 2).sum(-1).argmin(1)


def task_labels(labels: np.ndarray | None, clean_ND: np.ndarray) -> tuple[np.ndarray | None, str]:
    """Per image a class (-1: unusable) and where it came from: the cache's labels when the fit
    half holds two classes, else k-means pseudo-labels of the clean embeddings (fitted on the fit
    half), else None and why there is no task metric."""
    n = len(clean_ND)
    if labels is not None:
        fit, _ = halves(n, labels >= 0)
        if len(np.unique(labels[fit])) >= 2:
            return labels.astype(np.int64), "the cache's labels"
    if n < MIN_IMAGES:
        return None, f"no task metric: {n} held-out images, fewer than {MIN_IMAGES} (raise --max-images or eval_frac)"
    fit, _ = halves(n)
    mu, sd = clean_ND[fit].mean(0), clean_ND[fit].std(0) + 1e-6
    k = int(min(8, max(2, len(fit) // 4)))
    z = (clean_ND - mu) / sd
    y = nearest(z, kmeans(z[fit], k)).astype(np.int64)
    if len(np.unique(y[fit])) < 2:
        return (
            None,
            "no task metric: the clean embeddings of the fit half form one k-means cluster (no labels in the cache)",
        )
    why = "the cache has no labels" if labels is None else "the cache's labels give the fit half one class"
    return y, f"k-means pseudo-labels (k={k}) of the clean embeddings: {why}"


def fit_classifier(x_ND: np.ndarray, y: np.ndarray, n_classes: int, l2: float = 1e-2, steps: int = 200):
    """Multinomial logistic regression (standardised features, L2 ``l2`` on the weights); returns
    logits(x_ND) -> torch (N, C) float64."""
    import torch

    x = torch.as_tensor(x_ND, dtype=torch.float64)
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6) if len(x) > 1 else torch.ones(x.shape[1], dtype=torch.float64)
    lin = torch.nn.Linear(x.shape[1], n_classes).double()
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=steps, line_search_fn="strong_wolfe")
    xs, yt = (x - mu) / sd, torch.as_tensor(y, dtype=torch.int64)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(xs), yt) + l2 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)

    def logits(z_ND):
        with torch.no_grad():
            return lin((torch.as_tensor(z_ND, dtype=torch.float64) - mu) / sd)

    return logits


def _recovered(ablate: float, sae: float, clean: float) -> float | None:
    """(ablate - sae) / (ablate - clean); None when the ablation does not raise the loss."""
    return (ablate - sae) / (ablate - clean) if ablate - clean > 1e-12 else None


class Task:
    """The classifier of one set of clean embeddings (fitted once, read for every SAE of a group):
    ``Task(labels, clean_ND).metrics(variants)``; ``note`` says why there is none."""

    def __init__(self, labels: np.ndarray | None, clean_ND: np.ndarray):
        import torch

        self.y, self.source = task_labels(labels, clean_ND)
        self.note = None if self.y is not None else self.source
        if self.note:
            return
        self.fit, self.test = halves(len(self.y), self.y >= 0)
        self.n_classes = int(self.y.max()) + 1
        self.logits = fit_classifier(clean_ND[self.fit], self.y[self.fit], self.n_classes)
        self.yt = torch.as_tensor(self.y[self.test])
        self.logp_clean = torch.log_softmax(self.logits(clean_ND[self.test]), 1)

    def metrics(self, variants: dict[str, np.ndarray]) -> dict:
        """The task section for one SAE: ``variants`` maps "sae", "zero", "mean", "noise" to the
        final embeddings (same images, same order as the clean ones) with that edit spliced in."""
        import torch

        if self.note:
            return {"task_labels": self.source, HEADLINE: None, "task_note": self.note}
        nll, logp_clean, yt = torch.nn.functional.nll_loss, self.logp_clean, self.yt
        p_clean = logp_clean.exp()
        out = {"task_labels": self.source, "task_n_fit": int(len(self.fit)), "task_n_test": int(len(self.test)),
               "task_n_classes": self.n_classes, "ce_clean": float(nll(logp_clean, yt)),
               "acc_clean": float((logp_clean.argmax(1) == yt).double().mean())}  # fmt: skip
        for name, e_ND in variants.items():
            logp = torch.log_softmax(self.logits(e_ND[self.test]), 1)
            out[f"ce_{name}"] = float(nll(logp, yt))
            out[f"kl_{name}"] = float((p_clean * (logp_clean - logp)).sum(1).mean())
            out[f"acc_{name}"] = float((logp.argmax(1) == yt).double().mean())
        freq = np.bincount(self.y[self.test], minlength=self.n_classes) / len(self.test)
        out["ce_const"] = float(-(freq[freq > 0] * np.log(freq[freq > 0])).sum())
        out["kl_const"] = float((p_clean * (logp_clean - p_clean.mean(0, keepdim=True).log())).sum(1).mean())
        return _fractions(out)


def _fractions(out: dict) -> dict:
    """The recovered fractions of a task section, and a note for each that is null."""
    for a in ("zero", "mean", "const"):
        if f"ce_{a}" in out:
            out[f"ce_recovered_{a}"] = _recovered(out[f"ce_{a}"], out["ce_sae"], out["ce_clean"])
            out[f"kl_recovered_{a}"] = _recovered(out[f"kl_{a}"], out["kl_sae"], 0.0)
    if "ce_noise" in out:
        out["ce_recovered_mean_noise"] = _recovered(out["ce_mean"], out["ce_noise"], out["ce_clean"])
        out["kl_recovered_mean_noise"] = _recovered(out["kl_mean"], out["kl_noise"], 0.0)
    notes = []
    if out.get("ce_recovered_mean") is None:
        notes.append(f"ce_recovered_mean: mean-ablation does not raise the test half's label CE ({out['ce_mean']:.4g} "
                     f"vs clean {out['ce_clean']:.4g}), so the labels cannot tell the SAE from the ablation")  # fmt: skip
    if out.get(HEADLINE) is None:
        notes.append("no headline: mean-ablating the tokens leaves the classifier's predictions unchanged")
    if notes:
        out["task_note"] = "; ".join(notes)
    return out


def task_metrics(labels: np.ndarray | None, clean_ND: np.ndarray, variants: dict[str, np.ndarray]) -> dict:
    """:meth:`Task.metrics` of a classifier fitted for this one call."""
    return Task(labels, clean_ND).metrics(variants)


WHAT = {"sae": "the SAE's reconstruction", "zero": "zeros", "mean": "each token's per-position held-out mean",
        "noise": "the noise control (x + isotropic Gaussian noise with the SAE's squared error, FVU noise_fvu)"}  # fmt: skip
AGAINST = {"zero": "zero-ablation", "mean": "mean-ablation (each token set to its position's held-out mean)",
           "const": "the best constant prediction"}  # fmt: skip


def definitions(n_test: int | None) -> dict[str, str]:
    """One definition per field :func:`task_metrics` writes."""
    on = f"the {n_test:,} test-half images" if n_test else "the test half of the held-out images"
    out = {
        "task_labels": "where the classifier's classes come from (the cache's labels, else k-means pseudo-labels "
        "of the clean embeddings of the fit half)",
        "task_n_fit": "images the classifier is fitted on: a seeded random half of the (labelled) held-out images",
        "task_n_test": "images every task number is read on: the other half",
        "task_n_classes": "classes of the task",
        "ce_clean": "cross-entropy of the labels under a logistic regression (standardised features, L2) fitted on "
        f"the clean final embeddings of the fit half, read on the clean embeddings of {on}",
        "ce_const": f"the best constant prediction's cross-entropy: the entropy of the label frequencies of {on}",
        "kl_const": f"mean KL(clean predictions || their mean) over {on}: the best constant prediction's KL",
        "acc_clean": f"the classifier's accuracy on the clean embeddings of {on}; chance: the largest class frequency",
    }
    for v, what in WHAT.items():
        out[f"ce_{v}"] = f"the classifier's cross-entropy on {on} with {what} spliced in"
        out[f"kl_{v}"] = f"mean KL(clean predictions || predictions with {what} spliced in) over {on}; 0 = as clean"
        out[f"acc_{v}"] = f"the classifier's accuracy on {on} with {what} spliced in"
    for a, against in AGAINST.items():
        out[f"kl_recovered_{a}"] = (
            f"CE-loss recovered against {against} with the clean predictions as the targets, (kl_{a} - kl_sae) / "
            f"kl_{a} (the CE against p_clean is H(p_clean) + KL): 1 = as clean, 0 = no better than the ablation, "
            "unbounded below (negative: worse than the ablation), not clipped"
        )
        out[f"ce_recovered_{a}"] = (
            f"CE-loss recovered with the labels against {against}, as SAELens and SAEBench for language models: "
            f"(ce_{a} - ce_sae) / (ce_{a} - ce_clean); 1 = as clean, 0 = as the ablation, unbounded below, above 1 "
            "when the spliced predictions fit the test labels better than the clean ones; null (task_note says why) "
            "when the ablation does not raise the CE. Noisier than the headline on small held-out sets"
        )
    out["kl_recovered_mean"] = (
        "HEADLINE. "
        + out["kl_recovered_mean"]
        + ("; its chance level is 0 (the ablation itself). Defined whenever the ablation moves the predictions")
    )
    for k in ("kl", "ce"):
        out[f"{k}_recovered_mean_noise"] = (
            f"the noise control on {k}_recovered_mean's scale: the SAE's reconstruction replaced by x + isotropic "
            "Gaussian noise of the same squared error (the SAE's own FVU, noise_fvu); an SAE below it does worse "
            "than random error of its size"
        )
    out["task_note"] = "why a task number is null, in one line"
    return out
