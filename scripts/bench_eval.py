"""Benchmark the held-out evaluation and the spliced-in pass against their floors.

    python scripts/bench_eval.py [--size-gib 4] [--width 6144] [--vit base] [--images 256] [--rounds 3]
                                 [--out bench-out/eval] [--device cpu]

1. eval: ``evaluate_many`` over the held-out split (a seeded random 5% of the images, read
   image by image: actcache.sae.split.HeldoutBatches) with the dead count's firing window (every
   held-out token and at least DEAD_WINDOW_TOKENS, filled with training images, encoded only:
   actcache.sae.split.window_batches) against its floor, one OrderedLoader pass over as many
   contiguous images as the window holds plus the SAE's own forward (encode + decode) on each
   batch. Target: eval <= 1.5x that floor. Cache: d=768, 197 tokens, 1 layer, synthetic.
   ``--heldout-only`` runs this part alone and records it as its own section (eval-window).
2. spliced: the ViT's final embeddings (pooled and mean patch token) with a layer's patch tokens
   replaced by an SAE's reconstruction and by its noise control, as `actcache eval` computes them
   (actcache.spliced.resume_embedding from the clean pass's block output), against a plain forward
   over the same preprocessed images, at the second-to-last and the middle block. Target: one
   SAE's passes (splice + noise control) <= 1.3x plain. The ViT is a random-init CLIP vision model
   of ``--vit`` size (base: 12 blocks, d=768, 224 px, 16 px patches).

``--only spliced`` skips part 1 (no cache is written) and records its own section,
"eval-downstream", leaving the summary table to the full run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import benchlib  # noqa: E402
import torch  # noqa: E402

from actcache.cache import ActivationCache  # noqa: E402
from actcache.loaders import OrderedLoader  # noqa: E402
from actcache.protocol import Metadata  # noqa: E402
from actcache.sae.evaluate import DEAD_WINDOW_TOKENS, evaluate_many  # noqa: E402
from actcache.sae.modeling import SAE, SAEConfig  # noqa: E402
from actcache.sae.split import HeldoutBatches, heldout_images, window_batches  # noqa: E402
from actcache.writer import write_cache  # noqa: E402

D, T, EVAL_FRAC, BATCH = 768, 197, 0.05, 16384
VITS = {"base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536)}  # fmt: skip


def build_cache(out: str, size_gib: float) -> str:
    n_imgs = int(size_gib * 2**30 // (T * D * 4))
    md = Metadata(vit_family="clip", vit_ckpt="bench/none", layers=(-2,), n_patches_per_img=T - 1, cls_token=True,
                  d_vit=D, n_imgs=n_imgs, max_patches_per_shard=2_400_000, data={"__class__": "Bench", "seed": 0})  # fmt: skip
    path = os.path.join(out, "cache", md.hash)
    if os.path.exists(os.path.join(path, "shards.json")):
        return path
    print(f"writing a {size_gib} GiB cache ({n_imgs} images) to {path} ...", flush=True)
    return write_cache(os.path.join(out, "cache"), md, lambda s, e: np.random.default_rng(s).standard_normal(
        (e - s, 1, T, D), dtype=np.float32))  # fmt: skip


def bench_eval(cache_dir: str, width: int, dev, rounds: int) -> dict:
    cache = ActivationCache.open(cache_dir)
    held = heldout_images(cache.n_imgs, EVAL_FRAC)
    sae = SAE(SAEConfig(d_vit=D, width=width, activation="topk", k=32, seed=0)).to(dev.name).eval()
    window = window_batches(cache, held, held, "image", -2, False, BATCH, DEAD_WINDOW_TOKENS)
    n_window_imgs = len(held) + sum(len(w.imgs) for w in window.values())
    a = int(cache.n_imgs - n_window_imgs)

    def floor():
        with OrderedLoader(cache, batch_size=BATCH, patches="image", layer=-2, start_img=a) as ld, torch.inference_mode():
            for b in ld:
                sae(b["act"].to(dev.name))

    def heldout_eval():
        evaluate_many([sae], HeldoutBatches(cache, held, "image", -2, False, BATCH), dense_frac=[0.1], window=window)

    t = [{"floor": _timed(dev, floor), "eval": _timed(dev, heldout_eval)} for _ in range(rounds)]
    return {"held-out images": len(held), "window images": n_window_imgs, "width": width, "rounds": rounds,
            "floor s": _median(t, "floor"),
            "eval s": _median(t, "eval"), "eval / floor": float(np.median([r["eval"] / r["floor"] for r in t]))}  # fmt: skip


def _median(rounds: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rounds]))


def _timed(dev, fn) -> float:
    t0 = time.perf_counter()
    fn()
    dev.sync()
    return time.perf_counter() - t0


def bench_spliced(vit_size: str, n_images: int, dev, rounds: int, sweep: int = 8) -> list[dict]:
    """Per spliced layer: a plain forward, the old full forward with the edit, and `actcache eval`'s
    passes (one clean capture, two ablations and one resumed pass per SAE), as ratios to plain
    (medians over ``rounds`` rounds, each timing every pass once, after one warm-up batch of each)."""
    import transformers

    from actcache.models import _find_blocks
    from actcache.spliced import _Splice

    cfg = transformers.CLIPVisionConfig(image_size=224, patch_size=16, **VITS[vit_size])
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(cfg).to(dev.name).eval()

    class _Vit:  # the attributes actcache.spliced uses
        device = torch.device(dev.name)
        dims = types.SimpleNamespace(n_registers=0, cls_token=True)
        blocks = _find_blocks(model, cfg.num_hidden_layers)

        @staticmethod
        def _model_inputs(px):
            return {"pixel_values": px}

    _Vit.model = model
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    sae = SAE(SAEConfig(d_vit=d, width=16 * d, activation="topk", k=32, seed=0)).to(dev.name).eval()
    splice = _Splice(torch.arange(1, 197, device=dev.name))
    mean_TD = torch.randn(196, d, device=dev.name)  # the per-position mean ablation's values
    batches = list(torch.randn(n_images, 3, 224, 224).split(32))
    rows = []
    for block in (n - 2, n // 2 - 1):
        t = _time_block(dev, _Vit, batches, block, splice, sae, mean_TD, rounds)

        def ratio(f, t=t):
            return float(np.median([f(r) / r["plain"] for r in t]))

        rows.append({"ViT": vit_size, "layer": f"block {block} of {n}", "images": n_images, "plain s": _median(t, "plain"),
                     "spliced / plain": ratio(lambda r: r["sae"]), "full-forward splice / plain": ratio(lambda r: r["full"]),
                     "eval of 1 SAE / plain": ratio(lambda r: r["clean"] + r["abl"] + r["sae"]),
                     f"per SAE of {sweep} / plain": ratio(lambda r: (r["clean"] + r["abl"]) / sweep + r["sae"])})  # fmt: skip
    return rows


def _time_block(dev, vit, batches, block, splice, sae, mean_TD, rounds) -> list[dict]:
    """Per round, the seconds of: a plain forward, the old full forward with the edit, the clean
    pass keeping the block's output, the two ablation tails and one SAE's tails (its splice and its
    noise control), every pass keeping both heads as `actcache eval` does (after one warm-up on a
    single batch)."""
    from actcache.spliced import _Tally, capture, final_embedding, resume_embedding

    got = []

    def plain():
        for px in batches:
            final_embedding(vit, px)

    def full_edit():
        for px in batches:
            final_embedding(vit, px, block, splice.sae(sae))

    def clean():
        got[:] = [capture(vit, px, [block], heads=True)[0][block] for px in batches]

    def ablations():
        for px, (h, form) in zip(batches, got, strict=True):
            for v in (torch.zeros_like(mean_TD), mean_TD):
                resume_embedding(vit, px, block, h, form, splice.const(v), heads=True)

    def per_sae():
        tally, gen = _Tally(mean_TD.mean(0)), torch.Generator(device=mean_TD.device).manual_seed(0)
        for px, (h, form) in zip(batches, got, strict=True):
            resume_embedding(vit, px, block, h, form, splice.sae(sae, tally), heads=True)
            resume_embedding(vit, px, block, h, form, splice.noise(lambda x: tally.batch, gen), heads=True)

    steps = (("plain", plain), ("full", full_edit), ("clean", clean), ("abl", ablations), ("sae", per_sae))
    warm, batches[:] = batches[:], batches[:1]
    with torch.inference_mode():  # as `actcache eval` runs its passes
        for _, fn in steps:
            fn()
        batches[:] = warm
        return [{name: _timed(dev, fn) for name, fn in steps} for _ in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--width", type=int, default=6144)
    ap.add_argument("--vit", choices=tuple(VITS), default="base")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "eval"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are medians")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--heldout-only", action="store_true", help="the held-out eval alone, as section eval-window")
    ap.add_argument("--only", choices=("spliced",), help="only the spliced part, into its own section")
    args = ap.parse_args()
    dev = benchlib.Device(args.device)
    ev = None
    if args.only is None:
        ev = bench_eval(build_cache(args.out, args.size_gib), args.width, dev, args.rounds)
        print(json.dumps(ev), flush=True)
        if args.heldout_only:
            return record_heldout(args, dev, ev)
    sp = bench_spliced(args.vit, args.images, dev, args.rounds)
    print(json.dumps(sp), flush=True)
    checks = [
        *([benchlib.check("held-out eval <= 1.5 x (ordered pass + SAE forward)", ev["eval / floor"], 1.5, "x floor",
                          at_least=False)] if ev else []),
        *(benchlib.check(f"spliced passes of one SAE (splice + noise control) <= 1.3 x plain ViT forward "
                         f"({r['layer']})", r["spliced / plain"], 1.3, "x plain", at_least=False) for r in sp),
    ]  # fmt: skip
    setup = [
        *([f"Cache: {args.size_gib} GiB synthetic (d={D}, {T} tokens, 1 layer); held-out split {EVAL_FRAC:.0%} of "
           f"the images; a random-init TopK SAE (k=32) of width {args.width:,}; on {dev.words}."] if ev else []),
        f"Spliced: random-init CLIP vision model ({args.vit}), {args.images} images of 224 px, {args.rounds} rounds "
        "(medians of per-round ratios); the SAE (16 x d, k=32) spliced in on the patch tokens after the "
        f"second-to-last block and after the middle one; on {dev.words}.",
        "spliced = one SAE's passes as `actcache eval` runs them: its splice and its noise control (isotropic "
        "noise of the SAE's squared error), each from the clean pass's output of the spliced block through the "
        "blocks after it, keeping the pooled and the mean patch embedding; full-forward splice = the whole ViT "
        "with the edit.",
        "eval of 1 SAE = clean pass + zero and per-position mean ablations + the SAE's passes; per SAE of 8 = "
        "the same for a sweep of 8 SAEs of one cache, divided by 8.",
        "Not timed: the task classifier (one logistic regression per cache and split, shared by every SAE) and "
        "its reads, which are on n_images x (2 d) features.",
    ]  # fmt: skip
    tables = [*([benchlib.table([ev])] if ev else []), benchlib.table(sp)]
    body = benchlib.section_body(setup, tables, [c.bullet() for c in checks])
    if not args.no_record:
        if args.only:  # its own section; the summary rows stay the full run's
            benchlib.record(*dev.section("eval-downstream", "the downstream pass per SAE vs a plain ViT forward"),
                            body)  # fmt: skip
        else:
            benchlib.record(*dev.section("eval", "held-out eval and the spliced-in pass vs their floors"), body,
                            checks=checks)  # fmt: skip
    print(body)


def record_heldout(args, dev, ev: dict) -> None:
    """The held-out eval alone as its own section (the summary table's rows are left to the lead)."""
    check = benchlib.check("held-out eval with the dead-count window <= 1.5 x (ordered pass + SAE forward)",
                           ev["eval / floor"], 1.5, "x floor", at_least=False)  # fmt: skip
    setup = [
        f"Cache: {args.size_gib} GiB synthetic (d={D}, {T} tokens, 1 layer); held-out split {EVAL_FRAC:.0%} of "
        f"the images; a random-init TopK SAE (k=32) of width {args.width:,}; on {dev.words}.",
        f"eval = evaluate_many over the held-out images plus the dead count's firing window (every held-out "
        f"token and at least {DEAD_WINDOW_TOKENS:,} tokens, or the whole cache when smaller: window images); "
        "floor = one OrderedLoader pass over as many contiguous images with the SAE's forward on each batch.",
    ]
    body = benchlib.section_body(setup, [benchlib.table([ev])], [check.bullet()])
    if not args.no_record:
        benchlib.record(*dev.section("eval-window", "held-out eval with the dead-count window vs its floor"), body)
    print(body)


if __name__ == "__main__":
    main()
