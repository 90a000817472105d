"""`actcache dump`: compute a ViT's activations for shards A..B-1 and write them atomically.

One Slurm job runs one shard range; many jobs write the same ``<dump_to>/<HASH>/`` directory.

Pipeline (each stage overlaps the others)::

    DataLoader workers       decode + preprocess images (n_workers processes), in image order
          │  (B, 3, H, W) float32 batches; for CUDA: (B, H, W, 3) uint8, resized and cropped only
    main thread              forward pass on the device (stops after the last requested block);
                             for CUDA the batch is first rescaled and normalised on the GPU
          │  (B, L, T, D) float32, or 16-bit (cache.dtype) cast on the device; bounded queue
    writer thread            streams into the open shard's temporary file; fsync + rename when full

Guarantees:

- A shard file appears only complete (temporary sibling, fsync, rename: ``writer.open_shard_writer``);
  a killed job leaves a temporary name that the next dump removes. Complete shards are skipped, so
  re-running the same command resumes.
- Batches start at the shard's first image and every ``batch_size`` images after it (a batch never
  spans two shards), so the bytes of a shard do not depend on how the shard range is split into
  jobs (for the same batch size, device type and number of CPU threads; other settings change
  only the float rounding).
- By default (``cache.forward: fp32``) the forward pass runs in full float32: on CUDA TF32 (which
  PyTorch allows for convolutions by default, and which rounds inputs to 10 mantissa bits) is
  switched off while the dump runs, so the cache holds the model's float32 activations whatever
  the GPU (the patch embedding is a convolution). ``tf32`` / ``bf16`` trade that for speed; the
  choice is in metadata.json, so it changes the hash (``forward_precision``).
- A corrupt image, a write failure (disk full, file size limit) or a worker crash is a
  ``DumpError`` naming the file; the shard being written is discarded, finished shards are kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.utils.data

from actcache.checksums import record_dir
from actcache.errors import ConfigError, DumpError, ProtocolError, os_error_text
from actcache.protocol import Metadata, shard_name
from actcache.shardlock import ShardLocks
from actcache.sink import QUEUE_DEPTH, PinnedRing, ShardSink
from actcache.writer import ensure_metadata, shard_is_complete

log = logging.getLogger(__name__)

LOADER_TIMEOUT_S = 900  # a worker that delivers no batch for this long is stuck: fail, don't hang


# ---- arguments --------------------------------------------------------------------------------


def parse_shard_range(text: str | None) -> tuple[int | None, int | None] | None:
    """'A:B' -> (A, B); 'A:' / ':B' leave an end open (None); None -> None (all shards)."""
    if text is None or text.strip() in ("", ":"):
        return None
    a, sep, b = text.strip().partition(":")
    try:
        if not sep:
            raise ValueError
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None
    except ValueError:
        raise ConfigError(f"--shards {text!r}: expected A:B (shards A..B-1, e.g. 0:4)") from None
    return lo, hi


def check_shard_range(shards, n_shards: int) -> tuple[int, int]:
    """Resolve ``shards`` ((A, B), open ends allowed, or None for all) against ``n_shards``."""
    if shards is None:
        return 0, n_shards
    a, b = shards
    a = 0 if a is None else a
    b = n_shards if b is None else b
    if not (0 <= a < b <= n_shards):
        raise ConfigError(
            f"shard range {a}:{b} is not within this cache's {n_shards} shard(s): use A:B with "
            f"0 <= A < B <= {n_shards} (shards A..B-1)."
        )
    return a, b


SLURM_GPU_VARS = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS")


def resolve_device(device: str | None, env=None) -> torch.device:
    """None / 'auto' -> cuda when available, else cpu; anything else must exist. A Slurm job that
    was given GPUs never falls back to the CPU in silence: no usable CUDA there is an error."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        _check_no_gpu_job(os.environ if env is None else env)
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: no CUDA GPU is available here; use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    return dev


def _check_no_gpu_job(env) -> None:
    # GPU indices (SLURM_JOB_GPUS=0 is GPU 0) or counts (SLURM_GPUS_ON_NODE=0 is none)
    given = {k: env.get(k, "").strip() for k in SLURM_GPU_VARS}
    gpus = next((f"{k}={v}" for k, v in given.items() if v and not (k.endswith("GPUS_ON_NODE") and v == "0")), None)
    if not env.get("SLURM_JOB_ID") or gpus is None:
        return
    if torch.version.cuda is None:
        fix = (f"this torch {torch.__version__} is a CPU-only build. Install a CUDA one into the environment the "
               "jobs run (README: 'Install, with a CUDA torch'), e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128")  # fmt: skip
    else:
        fix = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check nvidia-smi and the driver on the node"
    raise ConfigError(
        f"cache.device: auto in Slurm job {env['SLURM_JOB_ID']}, which was given GPUs ({gpus}), but {fix}; "
        "or set cache.device: cpu to dump on the CPU on purpose."
    )


def plan_batches(md: Metadata, shard_ids, batch_size: int) -> list[tuple[int, int, int]]:
    """[(shard, start, end), ...]: batches aligned to each shard's first image, in image order."""
    out = []
    for s in shard_ids:
        lo, hi = md.shard_img_range(s)
        out.extend((s, b, min(b + batch_size, hi)) for b in range(lo, hi, batch_size))
    return out


# ---- data loading (worker processes) ------------------------------------------------------------


class _BatchError:
    """A batch whose loading failed (sent from a worker instead of raising: a clean message)."""

    def __init__(self, message: str):
        self.message = message


def _raw_pixels(dev: torch.device) -> bool:
    """Whether the workers send uint8 pixels, normalised on ``dev`` (see _Pixels)."""
    return dev.type == "cuda"


class _Pixels(torch.utils.data.Dataset):
    """Image i -> (pixels, None) or (None, error message). Pixels: the preprocessed (3, H, W)
    float32 image, or with ``raw`` the resized and cropped (H, W, 3) uint8 one, which
    ``ImageTransform.normalize`` turns into the same float32 numbers where the model runs. For a
    GPU that saves the workers CPU time and passes a quarter of the bytes (uint8 instead of
    float32) to the main process and the GPU. On the CPU the normalisation stays in the workers,
    in parallel: done in the main process it would be slower and serial."""

    def __init__(self, ds, transform, raw: bool = False):
        self.ds, self.transform, self.raw = ds, transform, raw

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        try:
            img, _ = self.ds[i]
            return (self.transform.geometry(img) if self.raw else self.transform(img)), None
        except DumpError as err:
            return None, str(err)
        except Exception as err:  # noqa: BLE001 - any failure on one image names that image
            try:
                what = self.ds.describe(i)
            except Exception:  # noqa: BLE001
                what = f"image {i}"
            return None, f"cannot read or preprocess image {i} ({what}): {type(err).__name__}: {err}"


def _collate(items):
    for _, err in items:
        if err is not None:
            return _BatchError(err)
    shape = (len(items), *items[0][0].shape)
    try:
        out = torch.from_numpy(np.empty(shape, dtype=items[0][0].dtype))
        if torch.utils.data.get_worker_info() is not None:
            # Allocate the shared memory here: a failure in the queue's feeder thread would be
            # printed and the batch silently lost (the main process would wait for ever).
            out = out.share_memory_()
        np.stack([x for x, _ in items], out=out.numpy())
    except (RuntimeError, OSError) as err:
        if torch.utils.data.get_worker_info() is not None:
            _remove_failed_segments()
        nbytes = int(np.prod(shape)) * items[0][0].itemsize
        return _BatchError(
            f"cannot pass a batch of {shape[0]} images ({nbytes:,} bytes) from an image-loading worker to the "
            f"main process ({err}): is /dev/shm full, or the file size limit (ulimit -f) too small? "
            "A smaller --batch-size (cache.batch_size) or --workers 0 needs less shared memory"
        )
    return out


def _remove_failed_segments(shm_dir: str = "/dev/shm") -> None:
    """Remove the shared-memory files torch left behind in this process. torch names a segment's
    file ``torch_<pid>_<random>_<n>``, sizes and allocates it, and with its default sharing
    strategy ("file_descriptor") unlinks it as soon as the segment is made. When sizing or
    allocating fails (a full /dev/shm: ENOSPC; a file size limit: EFBIG) the file stays, so any
    file of this process still there is a failed one."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return  # "file_system" keeps the names of live segments: leave them to torch
    prefix = f"torch_{os.getpid()}_"
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, name))


_SEGMENT = re.compile(r"torch_(\d+)_\d+_\d+$")


def remove_dead_segments(shm_dir: str = "/dev/shm", min_age_s: float = 1.0) -> list[str]:
    """Remove torch shared-memory files that a killed process left behind; returns their names.

    An image-loading worker makes each batch's segment as a file ``torch_<pid>_<random>_<n>`` and,
    with torch's default sharing strategy, unlinks it right after: a worker killed in between
    (SIGKILL of the job, e.g. Slurm's after a time limit) leaves the file, and its memory, in
    /dev/shm for good. Removed here: files of this user whose creating process no longer runs and
    that no process this user can see has mapped or open (so a live segment, e.g. one of torch's
    "file_system" strategy, stays), and that are at least ``min_age_s`` old (a process in another
    pid namespace sharing /dev/shm may be between making and unlinking one: microseconds)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    from actcache.fsutil import pid_alive

    dead = []
    for name in names:
        m = _SEGMENT.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except OSError:
            continue
        if st.st_uid == os.getuid() and time.time() - st.st_mtime >= min_age_s:
            dead.append(name)
    if not dead:
        return []
    used = _segments_in_use(shm_dir)
    removed = []
    for name in dead:
        if name in used:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


def _segments_in_use(shm_dir: str) -> set[str]:
    """Names of the files in shm_dir that a visible process has mapped or open."""
    used = set()
    prefix = shm_dir.rstrip("/") + "/"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as fd:
                for line in fd:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix) :].split()[0])
            fd_dir = f"/proc/{pid}/fd"
            for f in os.listdir(fd_dir):
                target = os.readlink(os.path.join(fd_dir, f))
                if target.startswith(prefix):
                    used.add(target[len(prefix) :].split()[0])
        except OSError:  # gone, or another user's
            continue
    return used


class _Batches(torch.utils.data.Sampler):
    def __init__(self, plan):
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self):
        for _, lo, hi in self.plan:
            yield list(range(lo, hi))


# ---- the dump -----------------------------------------------------------------------------------


@contextlib.contextmanager
def forward_precision(dev: torch.device, forward: str = "fp32"):
    """The dump's forward precision (``cache.forward``) while the block runs; flags restored after.

    fp32: no TF32 in matrix products or convolutions on CUDA (PyTorch allows it for convolutions
    by default). tf32: both allowed on CUDA; the CPU has no TF32, so there it is fp32. bf16:
    autocast to bfloat16 on the device (matrix products and convolutions in bfloat16).
    """
    if forward not in ("fp32", "tf32", "bf16"):
        raise ConfigError(f"cache.forward {forward!r}: use fp32, tf32 or bf16")
    if forward == "bf16":
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            yield
        return
    if dev.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = forward == "tf32"
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


@contextlib.contextmanager
def _ignore_sigxfsz():
    """Exceeding RLIMIT_FSIZE raises OSError(EFBIG) instead of killing the process (SIGXFSZ)."""
    if not hasattr(signal, "SIGXFSZ") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, old)


def _write_labels(path: str, ds) -> None:
    """labels.npy / labels.json beside the shards; every job may call it (atomic, same content)."""
    from actcache.labels import read_labels, write_labels

    labels = ds.labels()
    if labels is None:
        return
    labels = np.asarray(labels, dtype=np.int64)
    names = list(ds.class_names) if ds.class_names else None
    try:
        have = read_labels(path, len(labels))
    except ProtocolError:
        have = None
    if have is not None and np.array_equal(have[0], labels) and (names is None or have[1] == names):
        return
    write_labels(path, labels, names)


def _setup_error(err: OSError, what: str) -> DumpError:
    name = getattr(err, "filename", None)
    at = f" ({name})" if name and str(name) not in what else ""
    return DumpError(f"{what} failed{at}: {os_error_text(err)}. "
                     "Check that dump_to is writable and has free space.")  # fmt: skip


def dump_shards(
    exp,
    shards: tuple[int | None, int | None] | None = None,
    dump_to: str | None = None,
    device: str | None = None,
    batch_size: int | None = None,
    n_workers: int | None = None,
    progress: bool = True,
    space_check: bool = True,
) -> str:
    """Compute and write shards A..B-1 (``shards=(A, B)``; None: all) of ``exp``'s cache.

    Returns the cache directory ``<dump_to>/<HASH>``. Complete shards are skipped, so re-running
    after a failure resumes. Raises ConfigError for a bad experiment/range/device (before any
    work) and DumpError for a failure while computing or writing, or (unless not ``space_check``)
    for a range that needs more than the free space.
    """
    from actcache.adopt import adopt
    from actcache.ckptid import record_source
    from actcache.images import open_dataset
    from actcache.models import load_transform, load_vit
    from actcache.plan import DUMP_MARKS, experiment_metadata
    from actcache.preflight import check_writable_dir, root_setting

    root = root_setting(exp, "dump_to", dump_to)
    dump_to = root.value
    if not dump_to:
        raise ConfigError(
            f"{exp.source}: no dump_to: pass --dump-to DIR, or set 'dump_to: DIR' in the experiment file "
            "(the workflow sets it from config/config.yaml)."
        )
    check_writable_dir(root)  # before the listing cache below writes under it
    batch_size = exp.cache.batch_size if batch_size is None else batch_size
    n_workers = exp.cache.n_workers if n_workers is None else n_workers
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    if n_workers < 0:
        raise ConfigError(f"workers must be >= 0, got {n_workers}")
    n_workers = usable_workers(n_workers)
    dev = resolve_device(device if device is not None else exp.cache.device)
    listing_cache = os.path.join(dump_to, ".listings")  # as actcache.plan.plan uses
    md = experiment_metadata(exp, listing_cache=listing_cache)  # unknown family, bad layer, no images: here
    a, b = check_shard_range(shards, md.n_shards)

    with _ignore_sigxfsz():
        try:
            adopt(dump_to, md, exp.vit.ckpt)  # a cache dumped when the checkpoint was named by its path
            path = ensure_metadata(dump_to, md)
            record_source(path, md.vit_ckpt, exp.vit.ckpt)  # where a local checkpoint lies (eval, visuals)
            from actcache.fsutil import remove_stale_temps

            stale = remove_stale_temps(path)
            if os.path.isdir(record_dir(path)):
                stale += remove_stale_temps(record_dir(path))
        except OSError as err:
            raise _setup_error(err, f"creating {os.path.join(dump_to, md.hash)}") from err
        if stale:
            log.info("removed %d temporary file(s) of killed writers: %s", len(stale), ", ".join(stale))
        shm = remove_dead_segments()
        if shm:
            log.info("removed %d shared-memory file(s) of killed image-loading workers from /dev/shm", len(shm))
        ds = open_dataset(exp.data, listing_cache=listing_cache)
        if len(ds) != md.n_imgs:
            raise DumpError(
                f"the dataset now holds {len(ds)} images but the cache metadata says {md.n_imgs}; "
                "did the image folder change during the dump?"
            )
        try:
            _write_labels(path, ds)
        except OSError as err:
            raise _setup_error(err, f"writing labels into {path}") from err

        todo = [i for i in range(a, b) if not shard_is_complete(path, md, i)]
        if len(todo) < b - a:
            log.info("shards %d..%d: %d already complete, skipped", a, b - 1, b - a - len(todo))
        if not todo:
            log.info("%s: shards %d..%d are complete; nothing to do", path, a, b - 1)
            return path
        if space_check:
            _check_fits(path, md, todo)
        from actcache.images import check_headers

        check_headers(ds, (i for sh in todo for i in range(*md.shard_img_range(sh))))  # before any model loads
        locks = ShardLocks(os.path.join(path, DUMP_MARKS))
        while todo:  # a second round only for shards whose other writer stopped before finishing them
            busy = _dump(exp, md, path, todo, dev, batch_size, n_workers, progress, ds, load_transform, load_vit, locks)
            for s in busy:
                log.info("waiting for the other dump writing %s", shard_name(s))
                locks.wait(shard_name(s))
            todo = [s for s in busy if not shard_is_complete(path, md, s)]
    return path


def _check_fits(path: str, md: Metadata, todo: list[int]) -> None:
    """Refuse to start shards that cannot fit in the free space of the cache's filesystem."""
    from actcache.fsutil import fmt_bytes, free_bytes

    need, free = sum(md.shard_n_imgs(s) for s in todo) * md.bytes_per_img, free_bytes(path)
    if need > free:
        raise DumpError(
            f"{path}: the {len(todo)} shard(s) to write ({_ranges(todo)}) need {fmt_bytes(need)} ({need} bytes) but "
            f"only {fmt_bytes(free)} ({free} bytes) are free there; free space, dump to another dump_to, or dump "
            "fewer shards at a time (--shards A:B). No shard was written."
        )


def pixel_loader(ds, transform, batches, dev: torch.device, n_workers: int) -> torch.utils.data.DataLoader:
    """The dump's image pipeline: ``n_workers`` processes decode and preprocess the images of
    ``batches`` ([(shard, start, end), ...]) in order; each item is a batch of pixels or a _BatchError."""
    return torch.utils.data.DataLoader(
        _Pixels(ds, transform, raw=_raw_pixels(dev)),
        batch_sampler=_Batches(batches),
        num_workers=n_workers,
        collate_fn=_collate,
        pin_memory=dev.type == "cuda",
        timeout=LOADER_TIMEOUT_S if n_workers else 0,
    )


def usable_workers(n_workers: int, cpus: int | None = None) -> int:
    """At most one image worker per CPU this process may use: more only compete for the same
    cores (and PyTorch warns about them, once per iterator)."""
    cpus = cpus or len(os.sched_getaffinity(0))
    if n_workers > cpus:
        log.info("%d image worker(s) asked for, %d CPU(s) here: using %d", n_workers, cpus, cpus)
        return cpus
    return n_workers


def _start_workers(loader, n_workers: int):
    """iter(loader), with a clear error where the workers cannot start: their queues' semaphores
    live in /dev/shm, so a full /dev/shm fails here (OSError ENOSPC)."""
    hook = sys.unraisablehook
    try:
        return iter(loader)
    except OSError as err:
        error = os_error_text(err)
        # the half-built iterator is freed with this exception, at the end of this block, and its
        # __del__ fails as well: one clear message, not a second traceback
        sys.unraisablehook = lambda unraisable: None
    sys.unraisablehook = hook
    raise DumpError(
        f"cannot start {n_workers} image-loading worker(s): {error}. Is /dev/shm full? Free space there, "
        "or use --workers 0 (images decoded in the main process). No shard was written."
    )


def _dump(exp, md, path, todo, dev, batch_size, n_workers, progress, ds, load_transform, load_vit, locks) -> list[int]:
    """Write the shards ``todo``; returns those skipped because another dump holds their lock."""
    from actcache.progress import Progress

    batches = plan_batches(md, todo, batch_size)
    n_imgs = sum(hi - lo for _, lo, hi in batches)
    log.info(
        "%s: computing %d shard(s) (%s), %d images, batch %d, %d worker(s), device %s",
        path, len(todo), _ranges(todo), n_imgs, batch_size, n_workers, dev,
    )  # fmt: skip
    transform = load_transform(exp.vit.family, exp.vit.ckpt)
    loader = pixel_loader(ds, transform, batches, dev, n_workers)
    batch_iter = _start_workers(loader, n_workers)  # workers start decoding while the model loads
    try:
        t0 = time.monotonic()
        vit = load_vit(exp.vit.family, exp.vit.ckpt, dev)
        log.info("loaded %s %s on %s in %.1f s", exp.vit.family, exp.vit.ckpt, dev, time.monotonic() - t0)
        sink = ShardSink(path, md, on_done=lambda s: _done(locks, s)).start()
        with (
            Progress(n_imgs, desc="dump", unit="img", bar=progress) as bar,
            forward_precision(dev, md.forward),
        ):
            skipped, busy = _run(
                md, path, batches, batch_iter, transform, vit, list(exp.vit.layers), dev, sink, bar, locks
            )
    finally:
        locks.release_all()
        # Stop the workers now (a traceback may keep the iterator alive for a while).
        shutdown = getattr(batch_iter, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del batch_iter
    dt = time.monotonic() - bar.t0
    nbytes = sum(md.shard_n_imgs(s) for s in sink.done) * md.bytes_per_img
    log.info(
        "wrote %d shard(s) in %.1f s: %.1f images/s, %.1f MB/s%s",
        len(sink.done), dt, n_imgs / dt if dt else 0.0, nbytes / dt / 1e6 if dt else 0.0,
        f" ({len(skipped)} written by another job)" if skipped else "",
    )  # fmt: skip
    return sorted(busy)


def _done(locks, shard: int) -> None:
    log.info("wrote %s", shard_name(shard))
    locks.release(shard_name(shard))


def _run(md, path, batches, batch_iter, transform, vit, layers, dev, sink: ShardSink, bar, locks):
    """The main loop: next batch of pixels -> forward -> writer thread.

    Returns (shards skipped, those of them another dump is still writing). A shard is locked at
    its first batch and unlocked by the writer thread once renamed into place.
    """
    pinned = PinnedRing(QUEUE_DEPTH + 2) if dev.type == "cuda" else None
    skipped: set[int] = set()
    busy: set[int] = set()
    try:
        for shard, lo, hi in batches:
            try:
                pixels = next(batch_iter)
            except RuntimeError as err:  # a worker died (killed, out of memory) or is stuck
                raise DumpError(
                    f"image loading failed while reading images {lo}..{hi - 1} (shard {shard_name(shard)}, "
                    f"not written): {err}"
                ) from err
            if isinstance(pixels, _BatchError):
                raise DumpError(f"{pixels.message.rstrip('. ')}. Shard {shard_name(shard)} was not written.")
            if lo == md.shard_img_range(shard)[0]:
                _claim(md, path, shard, locks, skipped, busy)
            if shard in skipped:
                bar.update(hi - lo)
                continue
            pixels = pixels.to(dev, non_blocking=True)
            if pixels.dtype == torch.uint8:  # resized and cropped only (CUDA): normalise here
                pixels = transform.normalize(pixels)
            acts = stored_tensor(vit.forward(pixels, layers), md.dtype)
            if pinned is None:
                sink.put(shard, acts.numpy())
            else:
                host, ready = pinned.copy(acts)
                sink.put(shard, host, ready)
            bar.update(hi - lo)
        sink.finish()
    except BaseException as err:
        sink.abort(drain=isinstance(err, DumpError) and sink.error is None)
        raise
    return skipped, busy


def _claim(md, path: str, shard: int, locks, skipped: set[int], busy: set[int]) -> None:
    """At a shard's first batch: skip it when complete or locked by another dump, else lock it."""
    if shard_is_complete(path, md, shard):
        log.info("%s was completed by another job meanwhile; skipping it", shard_name(shard))
        skipped.add(shard)
    elif not locks.try_acquire(shard_name(shard)):
        log.info("%s is being written by another dump; skipping it for now", shard_name(shard))
        skipped.add(shard)
        busy.add(shard)
    elif shard_is_complete(path, md, shard):  # finished between the check and the lock
        locks.release(shard_name(shard))
        skipped.add(shard)


def stored_tensor(acts: torch.Tensor, dtype: str) -> torch.Tensor:
    """The activations as the cache stores them, cast where they are (on the GPU, before the copy
    to the host, so that copy is halved too): float16 as it is, bfloat16 as its raw bits (int16,
    which numpy can hold). Rounding: torch's, to nearest even; non-finite values stay non-finite
    and ``actcache verify --deep`` counts them as for float32."""
    if dtype == "float32":
        return acts
    if dtype == "float16":
        return acts.to(torch.float16)
    return acts.to(torch.bfloat16).view(torch.int16)


def _ranges(ids: list[int]) -> str:
    groups: list[list[int]] = []
    for i in ids:
        if groups and groups[-1][1] == i - 1:
            groups[-1][1] = i
        else:
            groups.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in groups)
