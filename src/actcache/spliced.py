"""`actcache eval`: spliced-in downstream metrics, what an SAE's reconstruction does to the ViT's final embedding.

    docs = spliced_eval(run_dirs, device="cpu")   # per run: the "spliced" section of eval.json

For each group of runs that share a cache, the ViT is loaded with the dump's own code
(actcache.models.load_vit) and run on the run's held-out images (run.json "split"): clean; with the
recorded layer's output replaced by the SAE's reconstruction on the tokens it was trained on (the
other tokens untouched); with those tokens zeroed, or each set to its position's mean over the
held-out images (zero- and mean-ablation); and, per SAE, with isotropic Gaussian noise of the SAE's
own squared error added to them (the noise control). Each pass is carried to two final embeddings:
the pooled one (``pooler_output``: CLS after the final norm, or the family's pooled head) and the
mean of the last hidden state's patch tokens. The clean pass runs once per batch of images and
keeps the spliced block's output; the ablations and every SAE resume from it, so each SAE costs
only the blocks after its own (:func:`spliced_group`).
- the task metric (actcache.spliced_task): a logistic regression fitted on the clean [pooled ;
  patch mean] embeddings of half the held-out images (labels, else k-means pseudo-labels), read on
  the other half: KL and CE against the clean predictions and labels; the headline
  kl_recovered_mean = (KL_mean - KL_sae) / KL_mean, unbounded below, with the noise control beside it;
- the embedding distances: fraction_recovered_<a> = (d_a - d_sae) / d_a, d the mean L2 distance
  from the clean embedding, against zero, per-position mean and the best constant (the mean clean
  embedding); cos_spliced_clean.
Where ablating the tokens leaves the pooled embedding unchanged (patch tokens at the last block of
a CLS-pooled model), one line (head_note) says so and every number reads the patch mean instead.
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


def _embedding(vit, pixels_B3HW, heads: bool = False):
    """The pooled final embedding (B, D_out); with ``heads``, (pooled, mean-pooled patch tokens of the
    last hidden state) for a block whose patch tokens cannot reach the pooled head."""
    import torch

    with torch.inference_mode():
        out = vit.model(**vit._model_inputs(pixels_B3HW.to(vit.device, torch.float32)))
    pooled = getattr(out, "pooler_output", None)
    pooled = (pooled if pooled is not None else out.last_hidden_state[:, 0]).float()
    if not heads:
        return pooled
    first = vit.dims.n_registers + int(vit.dims.cls_token)
    return pooled, out.last_hidden_state[:, first:].float().mean(1)


def final_embedding(vit, pixels_B3HW, block: int | None = None, edit=None):
    """The model's final embedding (B, D_out); ``edit(h_BTD) -> h_BTD`` replaces block ``block``'s output."""
    if edit is None:
        return _embedding(vit, pixels_B3HW)
    hook = vit.blocks[block].register_forward_hook(lambda m, a, out: _with_tensor(out, edit(_output_tensor(out))))
    try:
        return _embedding(vit, pixels_B3HW)
    finally:
        hook.remove()


def capture(vit, pixels_B3HW, blocks, full: bool = True, heads: bool = False):
    """Run the ViT once, keeping the output of each block in ``blocks``: returns ({block: (h_BTD,
    form)}, final embedding or None). ``full=False`` stops after the deepest of them. ``form`` is
    the block's output with its tensor left out, for :func:`resume_embedding`; ``heads`` as in
    :func:`_embedding`."""
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
        emb = _embedding(vit, pixels_B3HW, heads)
    except _Stop:
        emb = None
    finally:
        for h in hooks:
            h.remove()
    return got, emb


def resume_embedding(vit, pixels_B3HW, block: int, h_BTD, form, edit=None, heads: bool = False):
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
        return _embedding(vit, pixels_B3HW, heads)
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
    """The edits of one batch at one block, on the chosen tokens: the SAE's reconstruction, a
    constant per position (zero- or mean-ablation) or the noise control."""

    def __init__(self, tokens, scale: float = 1.0):
        self.tokens, self.scale = tokens, scale

    def sae(self, sae, tally: _Tally | None = None):
        def edit(h_BTD):
            h = h_BTD.clone()
            x_BTD = h[:, self.tokens]
            x_hat, _, _ = sae((x_BTD.reshape(-1, h.shape[-1]) * self.scale).to(sae.W_dec.dtype))
            x_hat_BTD = (x_hat.float() / self.scale).reshape(x_BTD.shape).to(h.dtype)
            if tally is not None:
                tally.add(x_BTD, x_hat_BTD)
            h[:, self.tokens] = x_hat_BTD
            return h

        return edit

    def const(self, value):
        """``value``: one vector (D,) or one per chosen token (T, D)."""

        def edit(h_BTD):
            h = h_BTD.clone()
            h[:, self.tokens] = value.to(h.dtype)
            return h

        return edit

    def noise(self, sse_of, generator):
        """x + isotropic Gaussian noise whose squared error on the batch is ``sse_of(x_BTD)``."""
        import torch

        def edit(h_BTD):
            h = h_BTD.clone()
            x_BTD = h[:, self.tokens].float()
            sd = (sse_of(x_BTD) / x_BTD.numel()) ** 0.5
            eps = torch.randn(x_BTD.shape, generator=generator, device=h.device)
            h[:, self.tokens] = (x_BTD + sd * eps).to(h.dtype)
            return h

        return edit


class _Tally:
    """One SAE's squared error on the tokens it is spliced into: the last batch's (its noise
    control's size) and the totals, for its FVU against the held-out mean ``mu_D``."""

    def __init__(self, mu_D):
        self.mu_D, self.batch, self.sse, self.var = mu_D, 0.0, 0.0, 0.0

    def add(self, x_BTD, x_hat_BTD) -> None:
        self.batch = float((x_hat_BTD.double() - x_BTD.double()).pow(2).sum())
        self.sse += self.batch
        self.var += self.dev(x_BTD)

    def dev(self, x_BTD) -> float:
        return float((x_BTD.double() - self.mu_D.double()).pow(2).sum())

    def fvu(self) -> float | None:
        return self.sse / self.var if self.var > 0 else None


def _fraction(d_ablate: float, d_sae: float) -> float | None:
    return (d_ablate - d_sae) / d_ablate if d_ablate > 0 else None


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
        from actcache.ckptid import checkpoint_source
        from actcache.models import load_vit
        from actcache.visuals import image_source, open_cache

        self.cache = open_cache(run)
        md = self.cache.metadata
        src = image_source(md, no_images=False, cache_dir=self.cache.path)
        self.ds, self.batch_images = src.dataset, batch_images
        self.vit = load_vit(md.vit_family, checkpoint_source(md.vit_ckpt, self.cache.path), device)

    def batches(self, held: np.ndarray):
        for s in range(0, len(held), self.batch_images):
            yield self.vit.preprocess([self.ds[int(i)][0] for i in held[s : s + self.batch_images]])


def _position_means(cache, held, patches, layer):
    """The held-out mean of each chosen token position, (T, D) float32: the mean-ablation's values."""
    import torch

    from actcache.sae.split import HeldoutBatches

    batches = HeldoutBatches(cache, held, patches, layer, False, batch_size=1 << 16)
    total, n = None, 0
    for b in batches:
        s = b["act"].double().reshape(-1, batches.sel.per_img, b["act"].shape[-1]).sum(0)
        total, n = (s if total is None else total + s), n + b["act"].shape[0] // batches.sel.per_img
    return (total / n).float() if total is not None else torch.zeros(batches.sel.per_img, cache.metadata.d_vit)


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
        self.out: list = []  # per batch, (pooled, patch-mean) final embeddings with the SAE spliced in
        self.noise: list = []  # the same with the noise control spliced in
        self.tally: _Tally | None = None
        self.generator = torch.Generator(device=vit.device).manual_seed(0)  # the noise control's, per SAE


def _chunks(members: list[_Member], budget_bytes: int) -> list[list[_Member]]:
    """Consecutive members whose SAEs together fit ``budget_bytes`` (at least one per chunk)."""
    out, used = [[]], 0
    for m in members:
        if out[-1] and used + m.n_bytes > budget_bytes:
            out, used = [*out, []], 0
        out[-1].append(m)
        used += m.n_bytes
    return out


def spliced_group(ctx: _CacheContext, runs: list, held: np.ndarray, sae_budget_bytes: int = 4 << 30,
                  noise_fvu: float | None = None) -> dict:  # fmt: skip
    """The "spliced" section of eval.json for each of ``runs`` (one cache, one held-out split).

    Per batch of images, one clean pass keeps the output of every block an SAE reads; the
    ablations, each SAE's splice and its noise control restart from there (:func:`resume_embedding`),
    so a sweep of n SAEs costs one forward plus 2n passes through the blocks after the spliced one.
    SAEs are loaded in chunks of at most ``sae_budget_bytes``; each further chunk reruns the prefix
    only. ``noise_fvu`` sets the noise control's FVU (default: each SAE's own, batch by batch)."""
    from actcache.labels import read_labels

    members = [_Member(ctx, r) for r in runs]
    sites = {m.key: m for m in members}  # one member per (layer, patches) stands for its ablations
    means = {
        (layer, patches): _position_means(ctx.cache, held, patches, layer).to(ctx.vit.device)
        for layer, patches in sites
    }
    for m in members:
        m.tally = _Tally(means[m.key].mean(0))
    clean, ablated = _passes(ctx, members, sites, means, held, sae_budget_bytes, noise_fvu)
    lab = read_labels(ctx.cache.path, ctx.cache.metadata.n_imgs)
    labels = lab[0][held] if lab is not None else None
    tasks: dict = {}  # one classifier per set of clean features (pooled+patch_mean, or patch_mean)
    return {m.run.dir: _member_doc(m, clean, ablated[m.key], labels, tasks, noise_fvu) for m in members}


def _passes(ctx, members, sites, means, held, budget, noise_fvu):
    """Every pass of a group: the clean final embeddings (both heads), per site the zero- and
    mean-ablated ones, and (into each member) its spliced and noise-control ones."""
    import torch

    from actcache.progress import Progress
    from actcache.sae.modeling import SAE

    vit = ctx.vit
    blocks = sorted({m.block for m in members})
    clean, ablated = [], {k: {"zero": [], "mean": []} for k in sites}
    chunks = _chunks(members, budget)
    for ci, chunk in enumerate(chunks):
        saes = [SAE.load(m.run.dir).to(vit.device).eval() for m in chunk]
        desc = f"spliced eval of {len(chunk)} SAE(s), part {ci + 1} of {len(chunks)}"
        with torch.inference_mode(), Progress(len(held), desc=desc, unit="img") as bar:
            for px in ctx.batches(held):
                bar.update(len(px))
                got, emb = capture(vit, px, blocks, full=ci == 0, heads=True)
                if ci == 0:
                    clean.append(_cpu(emb))
                    for k, m in sites.items():
                        splice = _Splice(m.tokens)
                        for name, value in (("zero", torch.zeros_like(means[k])), ("mean", means[k])):
                            e = resume_embedding(vit, px, m.block, *got[m.block], splice.const(value), heads=True)
                            ablated[k][name].append(_cpu(e))
                for m, sae in zip(chunk, saes, strict=True):
                    splice, tally = _Splice(m.tokens, m.scale), m.tally
                    e = resume_embedding(vit, px, m.block, *got[m.block], splice.sae(sae, tally), heads=True)
                    m.out.append(_cpu(e))
                    sse = (
                        (lambda x, t=tally: noise_fvu * t.dev(x))
                        if noise_fvu is not None
                        else (lambda x, t=tally: t.batch)
                    )
                    e = resume_embedding(vit, px, m.block, *got[m.block], splice.noise(sse, m.generator), heads=True)
                    m.noise.append(_cpu(e))
        del saes
    return clean, ablated


def _cpu(heads: tuple) -> tuple:
    return tuple(e.cpu() for e in heads)


def _cat(batches: list[tuple], head: int):
    import torch

    return torch.cat([b[head] for b in batches])


def _blind(clean_ND, *ablated_ND) -> bool:
    """Whether ablating the tokens leaves the embedding unchanged on every image (they cannot reach it)."""
    scale = float(clean_ND.abs().max()) or 1.0
    return all(float((e - clean_ND).abs().max()) <= 1e-6 * scale for e in ablated_ND)


def _views(batches: list[tuple], blind: bool) -> tuple:
    """(the embedding distances read, the task classifier's features): the pooled embedding and
    [pooled ; patch mean] (the CLS + mean-patch head of DINOv2's linear evaluation), or the patch
    mean for both where the tokens cannot reach the pooled embedding."""
    import torch

    pooled, patch = _cat(batches, 0), _cat(batches, 1)
    return (patch, patch) if blind else (pooled, torch.cat([pooled, patch], dim=1))


def _member_doc(m: _Member, clean: list, ablated: dict, labels, tasks: dict, noise_fvu) -> dict:
    """One SAE's "spliced" section: distances and the task metric on the heads its tokens reach."""
    import torch

    from actcache.spliced_task import HEADLINE, Task

    blind = _blind(_cat(clean, 0), _cat(ablated["zero"], 0), _cat(ablated["mean"], 0))
    doc = {"n_images": len(_cat(clean, 0)), "layer": m.run.layer, "patches": m.run.patches,
           "head": "patch_mean" if blind else "pooled", "task_head": "patch_mean" if blind else "pooled+patch_mean"}  # fmt: skip
    if blind:
        doc["head_note"] = (f"layer {m.run.layer}: the '{m.run.patches}' tokens cannot reach the pooled embedding "
                            "(ablating them leaves it unchanged on every image); every number here reads the "
                            "mean-pooled patch tokens of the last hidden state instead")  # fmt: skip
    c, c_task = _views(clean, blind)
    views = {"sae": _views(m.out, blind), "zero": _views(ablated["zero"], blind),
             "mean": _views(ablated["mean"], blind), "noise": _views(m.noise, blind)}  # fmt: skip
    d = {k: float((v[0] - c).norm(dim=1).mean()) for k, v in views.items()}
    d["const"] = float((c - c.mean(0)).norm(dim=1).mean())
    fvu = m.tally.fvu()
    doc.update({
        "cos_spliced_clean": float(torch.nn.functional.cosine_similarity(views["sae"][0], c, dim=1).mean()),
        **{f"fraction_recovered_{a}": _fraction(d[a], d["sae"]) for a in ("zero", "mean", "const")},
        **{f"d_{k}": v for k, v in d.items()},
        "fvu_spliced": fvu, "noise_fvu": noise_fvu if noise_fvu is not None else fvu,
    })  # fmt: skip
    if blind not in tasks:
        tasks[blind] = Task(labels, c_task.numpy())
    doc.update(tasks[blind].metrics({k: v[1].numpy() for k, v in views.items()}))
    doc["headline"] = HEADLINE
    doc["definitions"] = _definitions(doc["n_images"], doc.get("task_n_test"))
    return doc


def _definitions(n: int, n_test: int | None) -> dict[str, str]:
    from actcache.spliced_task import definitions

    on = f"the {n:,} held-out images"
    return {
        "head": "the final embedding the distances read: pooled (the model's pooler_output: CLS after the final "
        "norm, or the family's pooled head) or patch_mean (the mean of the last hidden state's patch tokens, used "
        "when the SAE's tokens cannot reach the pooled one)",
        "task_head": "the task classifier's features: [pooled ; patch_mean] (the CLS + mean-patch head of DINOv2's "
        "linear evaluation, which a per-token rescale cannot slip past), or patch_mean where head is patch_mean",
        "cos_spliced_clean": f"mean cosine between the final embedding with the SAE spliced in and the clean one, over {on}",
        "fraction_recovered_zero": "(d_zero - d_sae) / d_zero, d = mean L2 distance of the final embedding from the "
        f"clean one over {on}; d_zero with the SAE's tokens zeroed; unbounded below, not clipped",
        "fraction_recovered_mean": "as fraction_recovered_zero, each token set to its position's held-out mean instead",
        "fraction_recovered_const": "as fraction_recovered_zero against the best constant embedding, the mean clean "
        "embedding (d_const: the clean embeddings' mean distance from it)",
        "fvu_spliced": f"the SAE's FVU on the tokens it is spliced into, over {on} (as fvu, in the model's units)",
        "d_sae": f"mean L2 distance of the final embedding (head) with the SAE spliced in from the clean one over {on}",
        "d_zero": "the same with the SAE's tokens zeroed",
        "d_mean": "the same with each of the SAE's tokens set to its position's held-out mean",
        "d_const": "the clean embeddings' mean distance from their mean (the best constant embedding)",
        "d_noise": "the same with the noise control spliced in",
        "noise_fvu": "the noise control's FVU: the tokens plus isotropic Gaussian noise with the same squared error as "
        "the SAE's reconstruction on each batch (so fvu_spliced), unless a fixed FVU was asked for",
        "head_note": "why head is patch_mean, in one line",
        "headline": "the field pages and Pareto views rank by",
        **definitions(n_test),
    }


def heldout_metrics(cache, run, device) -> dict:
    """The run's held-out statistics (actcache.sae.evaluate, with label probes), recomputed on the
    split in its run.json: the fields `actcache train` writes into eval.json."""
    import os

    from actcache.sae.evaluate import DEAD_WINDOW_TOKENS, evaluate_many
    from actcache.sae.modeling import SAE
    from actcache.sae.probes import probe_labels
    from actcache.sae.split import RULE, HeldoutBatches, window_batches

    held = heldout_of(run, None, cache.metadata.n_imgs)
    cfg = run.info.get("run", {})
    sae = SAE.load(run.dir).to(device).eval()
    tokens = cfg.get("eval_tokens")
    batches = HeldoutBatches(cache, held, run.patches, run.layer, run.scale_norm, 16384, max_tokens=tokens)
    found = probe_labels(cache, held)  # image labels, or a saev cache's per-patch labels
    labels = None if found is None else (*found, cache.metadata.n_patches_per_img)
    wide = (run.patches, run.layer, run.scale_norm, 16384)
    window = window_batches(cache, held, batches.imgs, *wide, DEAD_WINDOW_TOKENS)
    (res,) = evaluate_many([sae], batches, dense_frac=[cfg.get("dense_frac", 0.1)], max_tokens=tokens, labels=labels,
                           window=window)  # fmt: skip
    where = {"cache": os.path.abspath(cache.path), "split": RULE, "n_heldout_images": int(len(held))}
    return {**where, "layer": run.layer, "patches": run.patches, **res}


def spliced_eval(run_dirs: list[str], device: str | None = None, batch_images: int = 32,
                 max_images: int | None = None, report=print, no_images: bool = False,
                 missing: bool = False) -> dict[str, dict]:  # fmt: skip
    """The spliced metrics of every run under ``run_dirs``, written into each eval.json under
    "spliced" beside its held-out statistics, recomputed (:func:`heldout_metrics`); returns
    {run dir: spliced section}. Runs sharing a cache share its ViT and clean pass. ``no_images``
    (a cache whose images are gone, or a saev cache): only the held-out statistics, which need the
    cache alone; eval.json then has no "spliced" section. ``missing``: only runs whose eval.json
    has no spliced section yet (training writes eval.json without one, so a retrained SAE is
    evaluated again)."""
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
    if no_images:
        from actcache.visuals import open_cache

        for members in by_cache.values():
            cache = open_cache(members[0])
            for r in members:
                doc = {k: v for k, v in r.eval().items() if k != "spliced"}  # a stale section would mislead
                write_eval(r.dir, {**doc, **heldout_metrics(cache, r, device)})
                report(f"{r.dir}: held-out statistics only (--no-images: spliced metrics need the images and the ViT)")
        return out
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
                report(_summary(r.dir, doc))
    return out


def _summary(run_dir: str, doc: dict) -> str:
    """One line per SAE: the headline with its noise control, the head it reads and any note."""

    def f(v):
        return "n/a" if v is None else f"{v:.4f}"

    line = (f"{run_dir}: CE recovered vs mean-ablation {f(doc.get('ce_recovered_mean'))} (noise control at FVU "
            f"{f(doc.get('noise_fvu'))}: {f(doc.get('ce_recovered_mean_noise'))}), KL {f(doc.get('kl_sae'))}, "
            f"embedding fraction recovered {f(doc.get('fraction_recovered_mean'))} (mean), "
            f"cos {f(doc.get('cos_spliced_clean'))} [{doc['head']} head]")  # fmt: skip
    notes = [doc[k] for k in ("head_note", "task_note") if doc.get(k)]
    return "\n".join([line, *(f"  note: {n}" for n in notes)])
