"""The dump at true size: a ViT-B/16-shaped model on photo-sized JPEGs, measured stage by stage.

    python scripts/bench_dump_true.py [--dir bench-out/dump-true] [--imgs N] [--batch B] [--rounds R]
                                      [--workers W] [--device cpu|cuda] [--quick] [--no-record]

Model: a randomly initialised CLIP vision model with ViT-B/16's configuration (d=768, 12 blocks,
12 heads, MLP 3072, 224x224 in 16x16 patches: 197 tokens, ~86M parameters), written with
save_pretrained: the same code path as a real checkpoint. Images: JPEGs of 500x375 at quality 90
with natural-image statistics (a 1/f amplitude spectrum in luminance, smooth low-frequency colour),
written once under ``--dir``; the checkpoint's processor resizes them to 298x224 and crops 224x224.

For each of 1 recorded layer ([-2]) and 4 ([-8, -6, -4, -2]; both forwards stop after block 10)
and ``cache.dtype`` float32 and bfloat16, every round measures, in alternating order:

- decode only: the dump's own image workers (``dump.pixel_loader``, ``--workers`` processes) and
  preprocessing over the same batches, no model;
- forward only: the model over the same batches of pixels already on the device, with the cast
  to the stored dtype, no writes;
- write only: the same bytes written sequentially, shard-sized files, 8 MiB writes, fsync per file;
- dump: ``dump_shards`` end to end (listing, model load, workers, forward, writer thread, fsync).

Rates are medians over the rounds; a ratio is taken within each round, its median shown. Target: the
dump's images/s >= 0.85 x the slowest stage's. Two more tables: the forward precision
(``cache.forward`` fp32 / tf32 / bf16: images/s and the activations' relative error against fp32,
4 layers) and the workers' decoding per core against a bare decode + preprocess loop in this
process, over the same files. Section ``dump-true-size`` (``dump-true-size-cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dump  # noqa: E402
import benchlib  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import PIL.Image  # noqa: E402
import torch  # noqa: E402

from actcache.config import experiment_from_dict  # noqa: E402
from actcache.dump import forward_precision, pixel_loader, plan_batches, stored_tensor  # noqa: E402
from actcache.plan import experiment_metadata  # noqa: E402

VITB16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=224, patch_size=16)  # fmt: skip
LAYER_SETS = {1: [-2], 4: [-8, -6, -4, -2]}
DTYPES = ("float32", "bfloat16")
PHOTO_WH, QUALITY = (500, 375), 90
DEV = benchlib.Device("cpu")


# ---- inputs ------------------------------------------------------------------------------------


def photo(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """An (h, w, 3) uint8 image with natural-image statistics: luminance with a 1/f amplitude
    spectrum (as photographs have), colour from two smoother (1/f^2) opponent channels."""
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0

    def field(power: float) -> np.ndarray:
        spec = (rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f**power
        spec[0, 0] = 0
        x = np.fft.irfft2(spec, s=(h, w))
        return x / x.std()

    lum, rg, yb = field(1.0), field(2.0), field(2.0)
    rgb = np.stack([lum + 0.5 * rg + 0.3 * yb, lum - 0.5 * rg + 0.3 * yb, lum - 0.6 * yb], axis=-1)
    return np.clip(128 + 40 * rgb, 0, 255).astype(np.uint8)


def _write_photo(args: tuple[str, int]) -> None:
    path, i = args
    arr = photo(np.random.default_rng([0, i]), *PHOTO_WH)  # image i is the same whatever the count
    PIL.Image.fromarray(arr, "RGB").save(path, quality=QUALITY)


def write_photos(root: str, n: int, name: str = "images") -> str:
    """n JPEGs (500x375, quality 90) in one class folder under root/name, written in parallel
    (one process per core); kept between runs."""
    import multiprocessing

    folder = os.path.join(root, name, "photos")
    os.makedirs(folder, exist_ok=True)
    have = set(os.listdir(folder))
    want = {f"img{i:06d}.jpg": i for i in range(n)}
    todo = [(os.path.join(folder, f), i) for f, i in want.items() if f not in have]
    if todo:
        with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
            pool.map(_write_photo, todo, chunksize=16)
    for f in have - set(want):
        os.unlink(os.path.join(folder, f))
    return os.path.dirname(folder)


def make_exp(ckpt: str, images: str, layers: list[int], dtype: str, imgs_per_shard: int, batch: int, workers: int,
             forward: str = "fp32"):  # fmt: skip
    doc = {
        "name": "true-size",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": layers},
        "data": {"kind": "image_folder", "root": images},
        "cache": {"max_patches_per_shard": imgs_per_shard * 197 * len(layers), "batch_size": batch,
                  "n_workers": workers, "device": DEV.name, "dtype": dtype, "forward": forward},
    }  # fmt: skip
    return experiment_from_dict(doc, source="<bench>")


# ---- stages ------------------------------------------------------------------------------------


def decode_only(exp, md, workers: int) -> float:
    """Seconds for the dump's image workers to deliver every batch (no model)."""
    from actcache.images import open_dataset
    from actcache.models import load_transform

    ds = open_dataset(exp.data)
    tf = load_transform(exp.vit.family, exp.vit.ckpt)
    t0 = time.perf_counter()
    n = 0
    for px in pixel_loader(ds, tf, plan_batches(md, range(md.n_shards), exp.cache.batch_size), _device(), workers):
        assert isinstance(px, torch.Tensor), px
        n += len(px)
    dt = time.perf_counter() - t0
    assert n == md.n_imgs
    return dt


def _device() -> torch.device:
    return torch.device(DEV.name)


def pixels_of(exp, n: int) -> torch.Tensor:
    """The preprocessed pixels of the first n images, on the device."""
    px = bench_dump.preprocessed(exp, n)
    return px.to(DEV.name)


def forward_only(vit, exp, md, pixels: torch.Tensor, forward: str = "fp32", keep: bool = False):
    """(seconds, activations or None): the forward over the dump's batches, cast to the stored dtype."""
    layers, out = list(exp.vit.layers), []
    DEV.sync()
    t0 = time.perf_counter()
    with forward_precision(_device(), forward):
        for _, lo, hi in plan_batches(md, range(md.n_shards), exp.cache.batch_size):
            acts = stored_tensor(vit.forward(pixels[lo:hi], layers), md.dtype)
            if keep:
                out.append(acts.float().cpu())
    DEV.sync()
    return time.perf_counter() - t0, (torch.cat(out).numpy() if keep else None)


def bare_decode(files: list[str], tf) -> float:
    """Seconds for this process alone to open, decode and preprocess the files (no workers)."""
    from actcache.images import to_rgb

    t0 = time.perf_counter()
    for f in files:
        with PIL.Image.open(f) as img:
            tf(to_rgb(img))
    return time.perf_counter() - t0


# ---- the run -----------------------------------------------------------------------------------


def stage_table(root, ckpt, images, vit, args) -> tuple[list[dict], list[float], list[str]]:
    configs = [(n_l, dt) for n_l in LAYER_SETS for dt in DTYPES]
    exps = {
        c: make_exp(ckpt, images, LAYER_SETS[c[0]], c[1], args.per_shard, args.batch, args.workers) for c in configs
    }
    mds = {c: experiment_metadata(e) for c, e in exps.items()}
    pixels = pixels_of(exps[configs[0]], args.imgs)
    res = {(c, s): [] for c in configs for s in ("decode", "forward", "write", "dump")}
    order = ["decode", "forward", "write", "dump"]
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            exp, md = exps[c], mds[c]
            for stage in order if r % 2 == 0 else order[::-1]:
                if stage == "decode":
                    dt = decode_only(exp, md, args.workers)
                elif stage == "forward":
                    dt = forward_only(vit, exp, md, pixels)[0]
                elif stage == "write":
                    dt = bench_dump.seq_write(os.path.join(root, "seq"), md.n_shards, md.shard_nbytes)
                else:
                    dt = bench_dump.dump(exp, os.path.join(root, "dump"))[0]
                res[c, stage].append(dt)
                print(
                    f"  round {r} {c[0]}L {c[1]:8s} {stage:7s} {dt:7.2f} s  {args.imgs / dt:8.2f} images/s", flush=True
                )
    rows, ratios, bounds = [], [], []
    for c in configs:
        rate = {s: args.imgs / statistics.median(res[c, s]) for s in order}
        slowest = min(("decode", "forward", "write"), key=lambda s: rate[s])
        # within each round: the dump against that round's slowest stage; the median over rounds
        per_round = [max(res[c, s][r] for s in ("decode", "forward", "write")) for r in range(args.rounds)]
        ratio = statistics.median(t / d for t, d in zip(per_round, res[c, "dump"], strict=True))
        ratios.append(ratio)
        bounds.append(slowest)
        md = mds[c]
        rows.append({
            "layers": c[0], "cache.dtype": c[1], "MB/image": md.bytes_per_img / 1e6,
            "decode img/s": rate["decode"], "forward img/s": rate["forward"], "write img/s": rate["write"],
            "dump img/s": rate["dump"], "bound by": slowest, "dump x bound": ratio,
        })  # fmt: skip
    return rows, ratios, bounds


def precision_table(ckpt, images, vit, args) -> list[dict]:
    exp = make_exp(ckpt, images, LAYER_SETS[4], "float32", args.per_shard, args.batch, args.workers)
    md = experiment_metadata(exp)
    pixels = pixels_of(exp, args.imgs)
    times: dict[str, list[float]] = {f: [] for f in ("fp32", "tf32", "bf16")}
    acts = {}
    for r in range(min(args.rounds, 2)):  # the precision's cost is far from the dump target: 2 rounds
        for f in times if r % 2 == 0 else list(times)[::-1]:
            dt, a = forward_only(vit, exp, md, pixels, f, keep=r == 0)
            times[f].append(dt)
            if a is not None:
                acts[f] = a
    ref = acts["fp32"]
    # what storing the fp32 forward as bfloat16 alone costs, for scale
    stored = torch.from_numpy(ref).to(torch.bfloat16).float().numpy()
    rows = []
    for f, a in [*acts.items(), ("fp32, stored as bfloat16", stored)]:
        err = [float(np.linalg.norm(a[:, i] - ref[:, i]) / np.linalg.norm(ref[:, i])) for i in range(ref.shape[1])]
        fwd = f.split(",")[0]
        rows.append({
            "cache.forward": f, "forward img/s": args.imgs / statistics.median(times[fwd]),
            "x fp32": statistics.median(x / y for x, y in zip(times["fp32"], times[fwd], strict=True)),
            "rel. error vs fp32 (max over 4 layers)": max(err), "rel. error at layer -2": err[-1],
        })  # fmt: skip
    return rows


def decode_table(ckpt, args) -> list[dict]:
    """The workers against a bare loop over their own image set (decoding is cheap: more images,
    so that the workers' start-up does not dominate)."""
    from actcache.models import load_transform

    name = "images" if args.decode_imgs == args.imgs else "images-decode"  # on a GPU: the same set
    images = write_photos(args.dir, args.decode_imgs, name)
    exp = make_exp(ckpt, images, LAYER_SETS[1], "float32", args.decode_imgs, args.batch, args.workers)
    md = experiment_metadata(exp)
    files = [os.path.join(images, "photos", f"img{i:06d}.jpg") for i in range(md.n_imgs)]
    tf = load_transform(exp.vit.family, exp.vit.ckpt)
    if DEV.cuda:  # the workers send uint8 pixels, resized and cropped only: the bare loop does the same
        tf_bare = type("Geometry", (), {"__call__": lambda self, img: tf.geometry(img)})()
    else:
        tf_bare = tf
    res: dict[str, list[float]] = {"workers": [], "bare": []}
    for r in range(args.rounds):
        for which in ("workers", "bare") if r % 2 == 0 else ("bare", "workers"):
            dt = decode_only(exp, md, args.workers) if which == "workers" else bare_decode(files, tf_bare)
            res[which].append(dt)
    w, b = md.n_imgs / statistics.median(res["workers"]), md.n_imgs / statistics.median(res["bare"])
    n = max(args.workers, 1)
    return [
        {"decoding": f"the dump's {args.workers} worker(s), {md.n_imgs} images", "images/s": w, "per core": w / n, "x bare": w / n / b},
        {"decoding": "bare loop in this process: PIL open, decode, preprocess", "images/s": b, "per core": b,
         "x bare": 1.0},
    ]  # fmt: skip


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(benchlib.ROOT, "bench-out", "dump-true"))
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--imgs", type=int, default=None, help="images (default 12 on cpu, 2048 on cuda)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 4 on cpu, 256 on cuda)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--decode-imgs",
        type=int,
        default=None,
        help="images of the decoding table (default 256 cpu; on cuda --imgs, the same files)",
    )
    ap.add_argument("--workers", type=int, default=None, help="image workers (default 1 on cpu, cores - 2 on cuda)")
    ap.add_argument("--quick", action="store_true", help="4 images, 1 round, no record (a smoke test)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    DEV = benchlib.Device(args.device)
    bench_dump.DEV = DEV
    cuda = DEV.cuda
    args.imgs = args.imgs or (2048 if cuda else 12)
    args.batch = args.batch or (256 if cuda else 4)
    args.workers = args.workers if args.workers is not None else (max(1, (os.cpu_count() or 2) - 2) if cuda else 1)
    args.decode_imgs = args.decode_imgs or (args.imgs if cuda else 256)
    if args.quick:
        args.imgs, args.batch, args.rounds, args.decode_imgs, args.no_record = 4, 2, 1, 16, True
    args.per_shard = max(args.batch, args.imgs // 4)  # four shards
    if args.imgs % args.per_shard:
        sys.exit(f"--imgs {args.imgs} must be a multiple of {args.per_shard} (four equal shards)")
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(args.dir, exist_ok=True)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    ckpt = bench_dump.make_ckpt(args.dir, "vitb16", **VITB16)
    images = write_photos(args.dir, args.imgs)
    root = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    from actcache.models import load_vit

    vit = load_vit("clip", ckpt, DEV.name)
    try:
        warm = make_exp(ckpt, images, [-2], "float32", args.per_shard, args.batch, args.workers)
        bench_dump.dump(warm, os.path.join(root, "warm"))  # imports, page cache, listing
        print("stages", flush=True)
        stages, ratios, bounds = stage_table(root, ckpt, images, vit, args)
        print("forward precision", flush=True)
        precision = precision_table(ckpt, images, vit, args)
        print("decoding", flush=True)
        decoding = decode_table(ckpt, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worst = min(ratios)
    check = benchlib.check("true-size dump >= 0.85 x its slowest stage (ViT-B/16, 1 and 4 layers, float32 and "
                           "bfloat16)", worst, 0.85, "x slowest stage (lowest of 4)")  # fmt: skip
    setup = [
        f"On {bench_dump.where()}: random-init CLIP ViT-B/16 (d=768, 12 blocks, 197 tokens, layers [-2] or "
        f"[-8, -6, -4, -2], forward up to block 10), {args.imgs} JPEGs of {PHOTO_WH[0]}x{PHOTO_WH[1]} at quality "
        f"{QUALITY} (1/f luminance, smooth colour), batch {args.batch}, {args.per_shard} images per shard, "
        f"{args.workers} image worker(s).",
        "Stages (images/s, medians over the rounds, alternating order; dump x bound = the median of each "
        "round's ratio): decode = the dump's workers and preprocessing, "
        "no model; forward = pixels already on the device, cast to the stored dtype; write = the same bytes, "
        "sequential, fsync per shard; dump = dump_shards end to end incl. model load. Decoding table: "
        f"{args.decode_imgs} other JPEGs of the same kind.",
        f"{args.rounds} round(s); whole run {time.perf_counter() - t_start:.0f} s; 1-minute load average at the "
        f"start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ]
    notes = [
        check.bullet(),
        f"bounding stage: {', '.join(sorted(set(bounds)))}; per configuration dump / slowest stage "
        f"{', '.join(f'{x:.3f}' for x in ratios)}",
    ]
    if not cuda:
        notes.append("the CPU has no TF32: cache.forward tf32 runs the fp32 forward there (same values)")
    body = benchlib.section_body(setup, [benchlib.table(t) for t in (stages, precision, decoding)], notes)
    print(body)
    if not args.no_record:
        benchlib.record(*DEV.section("dump-true-size", "dump at true size: ViT-B/16, photo-sized JPEGs, by stage"),
                        body)  # fmt: skip


if __name__ == "__main__":
    main()
