"""`actcache eval`: spliced-in downstream metrics, what an SAE's reconstruction does to the ViT's final embedding.

    docs = spliced_eval(run_dirs, device="cpu")   # per run: the "spliced" section of eval.json

For each group of runs that share a cache, the ViT is loaded with the dump's own code
(actcache.models.load_vit) and run on the run's held-out images (run.json "split") four ways: clean;
with the recorded layer's output replaced by the SAE's reconstruction on the tokens it was trained
on (the other tokens untouched); and with those tokens zeroed, or set to their mean over the
held-out images (zero- and mean-ablation). Each run is carried to the model's final embedding
(``pooler_output``: CLS after the final norm, or the family's pooled head). The clean pass runs
once per batch of images and keeps the spliced block's output; the ablations and every SAE resume
from it, so each SAE costs only the blocks after its own (:func:`spliced_group`).
- cos_spliced_clean: mean cosine between the spliced and the clean final embedding.
- fraction_recovered_zero / _mean: (d_ablate - d_sae) / d_ablate, with d the mean L2 distance of
  the final embedding from the clean one (1: as clean; 0: no better than the ablation).
- probe_acc_clean / probe_acc_spliced (labelled caches): a linear probe fitted on the clean final
  embeddings of half the held-out images, scored on the other half clean and spliced.
A scale_norm SAE sees its activations scaled as in training; its reconstruction is scaled back.
"""

from __future__ import annotations

import logging

import numpy as np

from actcache.errors import ActCacheError

log = logging.getLogger(__name__)


class SplicedError(ActCacheError):
    """A run cannot be spliced in (no held-out split recorded, images missing)."""


def _output_tensor(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _with_tensor(output, h):
    return (h, *output[1:]) if isinstance(output, (tuple, list)) else h


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the blocks it needs have run."""


def _embedding(vit, pixels_B3HW):
    import torch

    with torch.inference_mode():
        out = vit.model(**vit._model_inputs(pixels_B3HW.to(vit.device, torch.float32)))
    pooled = getattr(out, "pooler_output", None)
    return (pooled if pooled is not None else out.last_hidden_state[:, 0]).float()


def final_embedding(vit, pixels_B3HW, block: int | None = None, edit=None):
    """The model's final embedding (B, D_out); ``edit(h_BTD) -> h_BTD`` replaces block ``block``'s output."""
    if edit is None:
        return _embedding(vit, pixels_B3HW)
    hook = vit.blocks[block].register_forward_hook(lambda m, a, out: _with_tensor(out, edit(_output_tensor(out))))
    try:
        return _embedding(vit, pixels_B3HW)
    finally:
        hook.remove()


def capture(vit, pixels_B3HW, blocks, full: bool = True):
    """Run the ViT once, keeping the output of each block in ``blocks``: returns ({block: (h_BTD,
    form)}, final embedding or None). ``full=False`` stops after the deepest of them. ``form`` is
    the block's output with its tensor left out, for :func:`resume_embedding`."""
    got: dict[int, tuple] = {}
    last = max(blocks)

    def hook_for(i):
        def hook(module, args, out):
            form = tuple(None for _ in out) if isinstance(out, (tuple, list)) else None
            got[i] = (_output_tensor(out).detach().clone(), form)
            if i == last and not full:
                raise _Stop

        return hook

    hooks = [vit.blocks[i].register_forward_hook(hook_for(i)) for i in set(blocks)]
    try:
        emb = _embedding(vit, pixels_B3HW)
    except _Stop:
        emb = None
    finally:
        for h in hooks:
            h.remove()
    return got, emb


def resume_embedding(vit, pixels_B3HW, block: int, h_BTD, form, edit=None):
    """The final embedding with block ``block``'s output set to ``edit(h_BTD)`` (its output as
    captured by :func:`capture`), without running blocks 0..block again: each is swapped for a
    pass-through for the call. The embedding layer still runs on the pixels (cheap)."""
    out = _with_tensor(form, edit(h_BTD) if edit is not None else h_BTD)

    def passthrough(*args, **kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        return _with_tensor(form, h)

    saved = []
    for i in range(block + 1):
        m = vit.blocks[i]
        saved.append((m, m.__dict__.get("forward")))
        m.forward = passthrough if i < block else (lambda *a, **k: out)
    try:
        return _embedding(vit, pixels_B3HW)
    finally:
        for m, fwd in saved:
            del m.forward
            if fwd is not None:
                m.forward = fwd


def model_tokens(md, patches: str, n_registers: int) -> np.ndarray:
    """Positions, in the model's token sequence, of the cache tokens ``patches`` selects."""
    from actcache.loaders.common import Selection

    sel = Selection(md, patches, md.layers[0])
    cache_tok = np.arange(sel.token_start, sel.token_start + sel.n_tokens)
    return np.where(cache_tok >= 1, cache_tok + n_registers, cache_tok) if md.cls_token else cache_tok


class _Splice:
    """The edits of one batch at one block: SAE reconstruction, zero or mean on the chosen tokens."""

    def __init__(self, tokens, scale: float = 1.0):
        self.tokens, self.scale = tokens, scale

    def sae(self, sae):
        def edit(h_BTD):
            h = h_BTD.clone()
            x = h[:, self.tokens].reshape(-1, h.shape[-1]) * self.scale
            x_hat, _, _ = sae(x.to(sae.W_dec.dtype))
            h[:, self.tokens] = (x_hat.float() / self.scale).reshape(h.shape[0], len(self.tokens), -1).to(h.dtype)
            return h

        return edit

    def const(self, value_D):
        def edit(h_BTD):
            h = h_BTD.clone()
            h[:, self.tokens] = value_D.to(h.dtype)
            return h

        return edit


def _fraction(d_ablate: float, d_sae: float) -> float:
    return (d_ablate - d_sae) / d_ablate if d_ablate > 0 else float("nan")


def linear_probe_acc(train_ND, train_y, tests: list, steps: int = 200) -> list[float]:
    """Multinomial logistic regression (standardised features, L2) fitted on ``train_ND``; its
    accuracy on each (x_ND, y) of ``tests``."""
    import torch

    x = torch.as_tensor(train_ND, dtype=torch.float32)
    y = torch.as_tensor(train_y, dtype=torch.int64)
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    C = int(max(int(y.max()), *(int(t[1].max()) for t in tests))) + 1
    lin = torch.nn.Linear(x.shape[1], C)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=steps, line_search_fn="strong_wolfe")
    xs = (x - mu) / sd

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(xs), y) + 1e-3 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    out = []
    with torch.no_grad():
        for tx, ty in tests:
            pred = lin((torch.as_tensor(tx, dtype=torch.float32) - mu) / sd).argmax(1)
            out.append(float((pred == torch.as_tensor(ty)).double().mean()))
    return out


def heldout_of(run, max_images: int | None, n_imgs: int | None = None) -> np.ndarray:
    """The run's held-out images (run.json "split"), at most ``max_images`` (a seeded subset). A run
    trained before the split was recorded held out the images after its ``train_images`` range
    [0, t), up to ``n_imgs`` (the cache's count): that is its split."""
    held = (run.info.get("split") or {}).get("heldout_images")
    legacy = run.info.get("train_images")
    if not held and isinstance(legacy, list) and len(legacy) == 2 and legacy[0] == 0 and n_imgs:
        held = list(range(int(legacy[1]), int(n_imgs)))
    if not held:
        raise SplicedError(
            f"{run.dir}: run.json records no held-out images (trained with eval_cache or eval_frac 0, or "
            "before the split was recorded); spliced metrics need held-out images of the cache. Retrain with eval_frac > 0."
        )
    held = np.asarray(held, np.int64)
    if max_images is not None and len(held) > max_images:
        held = np.sort(held[np.random.default_rng(0).permutation(len(held))[:max_images]])
    return held


class _CacheContext:
    """What the runs of one cache share: the cache, its images and the ViT."""

    def __init__(self, run, device, batch_images: int):
        from actcache.models import load_vit
        from actcache.visuals import image_source, open_cache

        self.cache = open_cache(run)
        md = self.cache.metadata
        src = image_source(md, no_images=False)
        self.ds, self.batch_images = src.dataset, batch_images
        self.vit = load_vit(md.vit_family, md.vit_ckpt, device)

    def batches(self, held: np.ndarray):
        for s in range(0, len(held), self.batch_images):
            yield self.vit.preprocess([self.ds[int(i)][0] for i in held[s : s + self.batch_images]])


def _mean_vector(cache, held, patches, layer):
    import torch

    from actcache.sae.split import HeldoutBatches

    total, n = None, 0
    for b in HeldoutBatches(cache, held, patches, layer, False, batch_size=1 << 16):
        s = b["act"].double().sum(0)
        total, n = (s if total is None else total + s), n + b["act"].shape[0]
    return (total / n).float() if total is not None else torch.zeros(cache.metadata.d_vit)


class _Member:
    """One run in a group's pass: where its SAE goes in (block, token positions, scale_norm factor)
    and the final embeddings with its reconstruction spliced in."""

    def __init__(self, ctx: _CacheContext, run):
        import torch

        from actcache.loaders.common import Selection
        from actcache.models import resolve_layers
        from actcache.visuals import open_cache

        open_cache(run)  # checks the hash, resolves run.layer
        md, vit = ctx.cache.metadata, ctx.vit
        self.run, self.key = run, (run.layer, run.patches)
        self.block = resolve_layers([run.layer], vit.dims.n_layers)[0]
        self.tokens = torch.as_tensor(model_tokens(md, run.patches, vit.dims.n_registers), device=vit.device)
        self.scale = 1.0
        if run.scale_norm:
            from actcache.stats import scale_factors

            self.scale = scale_factors(ctx.cache, Selection(md, run.patches, run.layer))[0]
        self.n_bytes = 4 * (2 * run.info.get("d_vit", md.d_vit) + 1) * run.info.get("width", 0)
        self.out: list = []


def _chunks(members: list[_Member], budget_bytes: int) -> list[list[_Member]]:
    """Consecutive members whose SAEs together fit ``budget_bytes`` (at least one per chunk)."""
    out, used = [[]], 0
    for m in members:
        if out[-1] and used + m.n_bytes > budget_bytes:
            out, used = [*out, []], 0
        out[-1].append(m)
        used += m.n_bytes
    return out


def spliced_group(ctx: _CacheContext, runs: list, held: np.ndarray, sae_budget_bytes: int = 4 << 30) -> dict:
    """The "spliced" section of eval.json for each of ``runs`` (one cache, one held-out split).

    Per batch of images, one clean pass keeps the output of every block an SAE reads; the
    ablations and each SAE's splice restart from there (:func:`resume_embedding`), so a sweep of
    n SAEs costs one forward plus n passes through the blocks after the spliced one. SAEs are
    loaded in chunks of at most ``sae_budget_bytes``; each further chunk reruns the prefix only."""
    import torch

    from actcache.labels import read_labels
    from actcache.progress import Progress
    from actcache.sae.modeling import SAE

    vit, md = ctx.vit, ctx.cache.metadata
    members = [_Member(ctx, r) for r in runs]
    sites = {m.key: m for m in members}  # one member per (layer, patches) stands for its ablations
    means = {(layer, patches): _mean_vector(ctx.cache, held, patches, layer).to(vit.device) for layer, patches in sites}
    blocks = sorted({m.block for m in members})
    clean, zero, mean = [], {k: [] for k in sites}, {k: [] for k in sites}
    chunks = _chunks(members, sae_budget_bytes)
    for ci, chunk in enumerate(chunks):
        saes = [SAE.load(m.run.dir).to(vit.device).eval() for m in chunk]
        desc = f"spliced eval of {len(chunk)} SAE(s), part {ci + 1} of {len(chunks)}"
        with torch.inference_mode(), Progress(len(held), desc=desc, unit="img") as bar:
            for px in ctx.batches(held):
                bar.update(len(px))
                got, emb = capture(vit, px, blocks, full=ci == 0)
                if ci == 0:
                    clean.append(emb.cpu())
                    for k, m in sites.items():
                        ablate = _Splice(m.tokens)
                        for value_D, into in ((torch.zeros_like(means[k]), zero[k]), (means[k], mean[k])):
                            into.append(resume_embedding(vit, px, m.block, *got[m.block], ablate.const(value_D)).cpu())
                for m, sae in zip(chunk, saes, strict=True):
                    edit = _Splice(m.tokens, m.scale).sae(sae)
                    m.out.append(resume_embedding(vit, px, m.block, *got[m.block], edit).cpu())
        del saes
    clean = torch.cat(clean)
    lab = read_labels(ctx.cache.path, md.n_imgs)
    docs = {}
    for m in members:
        e_sae, e_zero, e_mean = torch.cat(m.out), torch.cat(zero[m.key]), torch.cat(mean[m.key])
        d = {k: float((e - clean).norm(dim=1).mean()) for k, e in (("sae", e_sae), ("zero", e_zero), ("mean", e_mean))}
        doc = {
            "n_images": int(len(held)), "layer": m.run.layer, "patches": m.run.patches,
            "cos_spliced_clean": float(torch.nn.functional.cosine_similarity(e_sae, clean, dim=1).mean()),
            "fraction_recovered_zero": _fraction(d["zero"], d["sae"]),
            "fraction_recovered_mean": _fraction(d["mean"], d["sae"]),
            "d_sae": d["sae"], "d_zero": d["zero"], "d_mean": d["mean"],
        }  # fmt: skip
        if lab is not None:
            doc.update(_probe(lab[0][held], clean.numpy(), e_sae.numpy()))
        doc["definitions"] = _definitions(len(held))
        docs[m.run.dir] = doc
    return docs


def _probe(y: np.ndarray, clean: np.ndarray, spliced: np.ndarray) -> dict:
    """Linear probe fitted on the clean embeddings of half the labelled images, scored on the rest."""
    ok = np.flatnonzero(y >= 0)
    perm = ok[np.random.default_rng(1).permutation(len(ok))]
    fit, test = perm[: len(perm) // 2], perm[len(perm) // 2 :]
    if len(test) == 0 or len(np.unique(y[fit])) < 2:
        return {"probe_skipped": "fewer than two classes among the labelled held-out images"}
    acc_clean, acc_spliced = linear_probe_acc(clean[fit], y[fit], [(clean[test], y[test]), (spliced[test], y[test])])
    return {"probe_acc_clean": acc_clean, "probe_acc_spliced": acc_spliced, "probe_n_test": int(len(test))}


def _definitions(n: int) -> dict[str, str]:
    on = f"the {n:,} held-out images"
    return {
        "cos_spliced_clean": f"mean cosine between the final embedding with the SAE spliced in and the clean one, over {on}",
        "fraction_recovered_zero": "(d_zero - d_sae) / d_zero, d = mean L2 distance of the final embedding from the "
        f"clean one over {on}; d_zero with the SAE's tokens zeroed",
        "fraction_recovered_mean": "as fraction_recovered_zero, the tokens set to their held-out mean instead",
        "probe_acc_clean": f"linear probe on clean final embeddings of half of {on}, accuracy on the other half",
        "probe_acc_spliced": "the same probe's accuracy on the spliced final embeddings of that half",
    }


def heldout_metrics(cache, run, device) -> dict:
    """The run's held-out statistics (actcache.sae.evaluate, with label probes), recomputed on the
    split in its run.json: the fields `actcache train` writes into eval.json."""
    import os

    from actcache.labels import read_labels
    from actcache.sae.evaluate import evaluate_many
    from actcache.sae.modeling import SAE
    from actcache.sae.split import RULE, HeldoutBatches

    held = heldout_of(run, None, cache.metadata.n_imgs)
    cfg = run.info.get("run", {})
    sae = SAE.load(run.dir).to(device).eval()
    tokens = cfg.get("eval_tokens")
    batches = HeldoutBatches(cache, held, run.patches, run.layer, run.scale_norm, 16384, max_tokens=tokens)
    labels, found = None, read_labels(cache.path, cache.n_imgs)
    if found is not None:
        lab_I = np.full(cache.n_imgs, -1, np.int64)
        lab_I[held] = found[0][held]
        labels = (lab_I, found[1])
    (res,) = evaluate_many([sae], batches, dense_frac=[cfg.get("dense_frac", 0.1)], max_tokens=tokens, labels=labels)
    where = {"cache": os.path.abspath(cache.path), "split": RULE, "n_heldout_images": int(len(held))}
    return {**where, "layer": run.layer, "patches": run.patches, **res}


def spliced_eval(run_dirs: list[str], device: str | None = None, batch_images: int = 32,
                 max_images: int | None = None, report=print, missing: bool = False) -> dict[str, dict]:  # fmt: skip
    """The spliced metrics of every run under ``run_dirs``, written into each eval.json under
    "spliced" beside its held-out statistics, recomputed (:func:`heldout_metrics`); returns
    {run dir: spliced section}. Runs sharing a cache share its ViT and clean pass. ``missing``:
    only runs whose eval.json has no spliced section yet (training writes eval.json without one,
    so a retrained SAE is evaluated again)."""
    import torch

    from actcache.rundir import find_runs, load_run
    from actcache.sae.evaluate import write_eval

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    runs = [load_run(p) for p in find_runs(run_dirs)]
    if missing:
        for r in [r for r in runs if "spliced" in r.eval()]:
            report(f"{r.dir}: spliced metrics already in its eval.json, kept")
        runs = [r for r in runs if "spliced" not in r.eval()]
    by_cache: dict[str, list] = {}
    for r in runs:
        by_cache.setdefault(r.cache or "", []).append(r)
    out = {}
    for members in by_cache.values():
        ctx = _CacheContext(members[0], device, batch_images)
        splits: dict[bytes, tuple] = {}  # every run of a cache shares one split, unless trained before it
        for r in members:
            held = heldout_of(r, max_images, ctx.cache.metadata.n_imgs)
            splits.setdefault(held.tobytes(), (held, []))[1].append(r)
        for held, group in splits.values():
            docs = spliced_group(ctx, group, held)
            for r in group:
                doc = docs[r.dir]
                write_eval(r.dir, {**r.eval(), **heldout_metrics(ctx.cache, r, device), "spliced": doc})
                out[r.dir] = doc
                report(f"{r.dir}: spliced cos {doc['cos_spliced_clean']:.4f}, fraction recovered "
                       f"{doc['fraction_recovered_zero']:.4f} (zero) {doc['fraction_recovered_mean']:.4f} (mean)")  # fmt: skip
    return out
