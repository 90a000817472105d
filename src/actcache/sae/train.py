"""Train a group of SAEs on one stream of batches from a cache (the library of `actcache train`).

    from actcache.sae.config import expand_train_section, groups
    runs = groups(expand_train_section(exp.train, "x.yaml"))["L-2-image-1a2b3c4d"]
    train_group("<dump_to>/<HASH>", runs, runs_to="data/runs", device="cpu")

Every SAE of the group takes an optimizer step on the same batch of ONE ShuffledLoader pass (the
held-out images of actcache.sae.split skipped). Per SAE, into its run directory (actcache.rundir): the run file at the
start, a metrics line every ``log_every`` steps, checkpoints every ``ckpt_every`` steps and at the
end (actcache.sae.checkpoint), then the final weights, the evaluation (actcache.sae.evaluate) and
last the done file. SAEs whose done file exists are skipped.

Resume: a restarted group continues from the newest checkpoint every unfinished SAE has, with the
loader started at the saved (epoch, batch); in deterministic loader mode on CPU the result is
bit-identical to an uninterrupted run. Unfinished SAEs without any checkpoint (added to the sweep
later) train in a second pass from step 0, so finished or running members are never restarted.

On CUDA a step never waits for the device: batches reach it through page-locked buffers
(:class:`PinnedFeed`), and the finiteness of the activations and AuxK's dead-latent count are read
back at log steps and checkpoints, or one step late (``GroupTrainer.sync_free``; CPU: off).

Stopping: ``stop`` (a callable polled once per step, e.g. set by a SIGTERM/SIGUSR2 handler) makes
the trainer write a checkpoint at the current step and raise :class:`Preempted`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from actcache.errors import EXIT_RETRY, ConfigError, LoaderError, TrainError, os_error_text
from actcache.feed import StagedFeed
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import DONE_FILE, EVAL_FILE, METRICS_FILE, RUN_FILE, done_path, is_done, run_dir, weights_records
from actcache.runlock import RunLock
from actcache.sae import checkpoint as ckpt
from actcache.sae import ddp
from actcache.sae.batched import BatchedSAEs, batch_key, choose_batching
from actcache.sae.config import RunConfig
from actcache.sae.evaluate import check_finite, evaluate_many, write_eval
from actcache.sae.modeling import SAE
from actcache.sae.objectives import make_objective
from actcache.sae.optim import (
    LRSchedule,
    clip_grad_norm,
    make_optimizer,
    matmul_precision,
    sparsity_warmup,
    train_step,
)

log = logging.getLogger(__name__)
_SCALARS = ("loss", "mse", "nmse", "l0", "l1", "aux")


def init_from_batch(sae: SAE, run: RunConfig, x_BD: torch.Tensor, ctx: ddp.DistContext | None = None) -> None:
    """Step 0's data-dependent init: b_dec (``b_dec_init``), then for topk variants some decoder
    rows from the batch (``dec_init_frac``; SAE.init_decoder_from_data_, encoder tied again) and
    the encoder's scale (``enc_init``; SAE.fit_encoder_scale_); both centre the batch on b_dec.
    Under DDP each result is rank 0's."""
    if run.b_dec_init != "zero":
        sae.init_b_dec(x_BD, method=run.b_dec_init)
    if ctx is not None:
        ddp.broadcast_(sae.b_dec.data, ctx)
    if run.decoder_data_frac > 0:
        sae.init_decoder_from_data_(x_BD, run.decoder_data_frac, run.seed)
    if run.encoder_init == "fit":
        sae.fit_encoder_scale_(x_BD)
    if ctx is not None and (run.decoder_data_frac > 0 or run.encoder_init == "fit"):
        ddp.broadcast_(sae.W_dec.data, ctx)
        ddp.broadcast_(sae.W_enc.data, ctx)


class Preempted(TrainError):
    """Training stopped on request after writing a checkpoint at ``step``."""

    exit_status = EXIT_RETRY  # the workflow retries it, and the retry resumes

    def __init__(self, step: int):
        super().__init__(f"training stopped on request at step {step}; a checkpoint was written, re-run to resume")
        self.step = step


def _prefix_metrics(line: dict) -> str:
    """A Matryoshka SAE's per-prefix NMSE (``nmse_prefix_<m>``) for its log line; '' for others."""
    names = sorted((k for k in line if k.startswith("nmse_prefix_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    return "".join(f", {k} {line[k]:.4f}" for k in names)


class _Member:
    """One SAE of a pass with its objective, optimizer, schedule and metric accumulators."""

    def __init__(self, run: RunConfig, directory: str, d_vit: int, device: torch.device, sync_free: bool = False):
        self.run, self.dir = run, directory
        self.sae = SAE(run.sae_config(d_vit)).to(device).set_compute(run.decode, run.precision)
        self.obj = make_objective(self.sae, **run.objective_kwargs())
        self.obj.stats.lag_host_reads = sync_free
        self.opt = make_optimizer(self.sae, lr=run.lr, betas=(run.beta1, run.beta2))
        self.sched = LRSchedule(lr=run.lr, warmup_steps=run.warmup_steps, total_steps=run.steps,
                                decay=run.lr_decay, final_frac=run.final_lr_frac)  # fmt: skip
        self.params = list(self.sae.parameters())
        self.metric_names = (*_SCALARS, *self.obj.extra_metrics)  # the objective's own metrics last
        # sums since the last log line
        self.acc_sum = torch.zeros(len(self.metric_names), dtype=torch.float64, device=device)
        self.acc_n = 0
        self.last = None  # the latest LossOut
        self.last_line: dict = {}

    def sparsity_scale(self, step: int) -> float:
        return sparsity_warmup(step, self.run.sparsity_warmup_steps)

    def step(self, x_BD: torch.Tensor, step: int, ctx: ddp.DistContext) -> None:
        run, sae = self.run, self.sae
        lr = self.sched.apply(self.opt, step)
        scale = self.sparsity_scale(step)
        if not ctx.enabled:
            out = train_step(sae, self.obj, self.opt, x_BD, max_grad_norm=run.max_grad_norm, sparsity_scale=scale)
        else:  # optim.train_step with the gradient average between backward and clipping
            self.opt.zero_grad(set_to_none=True)
            with matmul_precision(run.precision):
                out = self.obj(sae, x_BD, sparsity_scale=scale)
                out.loss.backward()
            ddp.average_grads_(self.params, ctx)
            if sae.cfg.normalize_decoder:
                sae.remove_parallel_grads_()
            if run.max_grad_norm is not None:
                clip_grad_norm(sae, run.max_grad_norm)
            self.opt.step()
            if sae.cfg.normalize_decoder:
                sae.normalize_decoder_()
            if sae.cfg.activation in ("batchtopk", "matryoshka"):
                ddp.average_(sae.threshold, ctx)
            if sae.cfg.activation == "jumprelu" and step == 0:  # each rank set it from its own batch
                for t in (sae.threshold_rel.data, sae.threshold_scale, sae.bandwidth):
                    ddp.broadcast_(t, ctx)
        self.record(out, lr)

    def record(self, out, lr: float) -> None:
        """Keep a step's LossOut and add its metrics to the window's sums."""
        self.lr = lr
        self.last = out
        values = [getattr(out, k) for k in _SCALARS] + [out.extras[k] for k in self.obj.extra_metrics]
        self.acc_sum += torch.stack([v.detach().double() for v in values])
        self.acc_n += 1


@contextlib.contextmanager
def _writing(what: str, directory: str):
    """An OSError while writing ``what`` under a run directory (a full disk, a quota, a read-only
    filesystem) -> a TrainError naming it and the fix. Checkpoints are written atomically and a
    resume drops metric lines cut short, so nothing already written is lost."""
    try:
        yield
    except OSError as err:
        try:
            done = ckpt.steps(directory)
        except OSError:
            done = []
        resume = (
            f"training resumes from its last complete checkpoint (step {done[-1]} here)"
            if done
            else "training starts again"
        )
        raise TrainError(
            f"could not write {what} in {directory}: {os_error_text(err)}. Nothing already written was lost; "
            f"free space there (or fix its permissions) and re-run the same command: {resume}."
        ) from err


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class PinnedFeed(StagedFeed):
    """A loader's activations as device tensors, staged through a ring of page-locked buffers.

    The feed's thread copies each batch's ``act`` into the next buffer of the ring, ``depth``
    batches ahead of the consumer, after waiting on the event recorded when that buffer's previous
    copy to the device was queued; ``next()`` queues the copy with ``non_blocking=True`` and
    records the event. ``wait_s`` adds up the time ``next()`` waited for the loader: its waits
    less the time the thread meanwhile waited on the device (a step ahead of the device waits
    for the device, not for data). On a CPU device (tests) the buffers are plain memory and the
    copy a clone.
    """

    def __init__(self, loader, device: torch.device, depth: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self.bufs: list = [None] * (depth + 2)  # in the queue, being filled, being consumed
        self.events: list = [None] * (depth + 2)
        self.n_filled = 0
        self.wait_s = 0.0
        self.device_wait_s = 0.0  # the thread's waits on events
        super().__init__(loader, self._stage, depth=depth, name="actcache-pinned-feed")

    @contextlib.contextmanager
    def _stage(self):
        yield self._copy_in

    def _copy_in(self, batch) -> int:
        """Copy ``batch["act"]`` into the ring's next buffer; returns its index."""
        i, act = self.n_filled % len(self.bufs), batch["act"]
        self.n_filled += 1
        if self.events[i] is not None:
            t0 = time.perf_counter()
            self.events[i].synchronize()  # its previous copy to the device is done
            self.device_wait_s += time.perf_counter() - t0
        buf = self.bufs[i]
        if buf is None or buf.shape != act.shape or buf.dtype != act.dtype:
            buf = self.bufs[i] = torch.empty(act.shape, dtype=act.dtype, pin_memory=self.cuda)
        buf.copy_(act)
        return i

    def __next__(self) -> torch.Tensor:
        t0, dev0 = time.perf_counter(), self.device_wait_s
        try:
            i = super().__next__()
        finally:
            self.wait_s += max(0.0, time.perf_counter() - t0 - (self.device_wait_s - dev0))
        if not self.cuda:
            return self.bufs[i].clone()
        x_BD = self.bufs[i].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[i] = event
        return x_BD


def _write_json(path: str, doc: dict) -> None:
    atomic_write_bytes(path, (json.dumps(doc, indent=2) + "\n").encode())


class _Unloadable(Exception):
    """Checkpoint ``step`` of ``dir`` passed its manifest but failed to load (``why``)."""

    def __init__(self, directory: str, step: int, why: str):
        super().__init__(why)
        self.dir, self.step, self.why = directory, step, why


class GroupTrainer:
    """Trains the SAEs of one group on a cache (see the module docstring)."""

    def __init__(self, cache_dir: str, runs: list[RunConfig], runs_to: str, device: str | None = None,
                 stop: Callable[[], bool] | None = None, ctx: ddp.DistContext | None = None,
                 wait_for_lock: bool = False):  # fmt: skip
        if not runs:
            raise ConfigError("train_group: no SAEs to train")
        keys = {json.dumps(r.group_key, sort_keys=True) for r in runs}
        if len(keys) != 1:
            raise ConfigError("train_group: the SAEs do not share a stream of batches (use config.groups)")
        self.cache_dir, self.runs, self.runs_to = os.fspath(cache_dir), list(runs), os.fspath(runs_to)
        self.stop = stop or (lambda: False)
        self.wait_for_lock = wait_for_lock  # another train owns a run: wait for it (else TrainError)
        self.ctx = ctx or ddp.env_context()
        self.device = ddp.device_for(self.ctx, device)
        self.group_id = runs[0].group_id
        self.sync_free = self.device.type == "cuda"  # see the module docstring; settable (tests)
        self.trained: dict[str, SAE] = {}  # sae_id -> the SAE trained in this process (tests, DDP checks)

    # -- set-up ------------------------------------------------------------------------------------
    def _open_cache(self):
        from actcache.cache import ActivationCache

        cache = ActivationCache.open(self.cache_dir)
        md, run = cache.metadata, self.runs[0]
        if run.layer is None:
            if len(md.layers) != 1:
                raise TrainError(
                    f"{self.cache_dir} records layers {list(md.layers)}; set 'layer' in the train section."
                )
            self.layer = md.layers[0]
        elif run.layer not in md.layers:
            raise TrainError(
                f"layer {run.layer} is not in the cache {self.cache_dir}; recorded layers: {list(md.layers)}. "
                "Set 'layer' in the train section to one of them."
            )
        else:
            self.layer = run.layer
        if run.batch_size % self.ctx.world_size:
            raise TrainError(f"batch_size {run.batch_size} is not divisible by the {self.ctx.world_size} ranks")
        for r in self.runs:
            try:
                r.sae_config(md.d_vit)
            except ConfigError as err:
                raise ConfigError(f"SAE {r.sae_id} on this cache (d_vit={md.d_vit}): {err}") from None
        self._check_memory(md.d_vit)
        self.md = md
        self.heldout = self._heldout(cache, run)
        self.n_eval = len(self.heldout)
        self.n_train = md.n_imgs - self.n_eval
        return cache

    def _check_memory(self, d_vit: int) -> None:
        """Refuse a group whose SAEs' training state (SAEConfig.train_bytes, together) exceeds the
        device's memory, before anything is allocated: one line with the figures."""
        if self.device.type == "cuda":
            limit = torch.cuda.get_device_properties(self.device).total_memory
        elif self.device.type == "cpu":
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        else:
            return
        cfgs = [r.sae_config(d_vit) for r in self.runs]
        need = sum(c.train_bytes for c in cfgs)
        if need > limit:
            widths = ", ".join(f"{c.width:,}" for c in cfgs)
            raise TrainError(
                f"group {self.group_id}: its {len(cfgs)} SAE(s) (width {widths}, d_vit {d_vit}) need "
                f"{need / 2**30:,.1f} GiB to train (weights, gradients, Adam's two moments), more than the "
                f"{limit / 2**30:,.1f} GiB of {self.device}; lower width or exp_factor, or split the group."
            )

    @staticmethod
    def _heldout(cache, run: RunConfig):
        """The images held out of training (actcache.sae.split); none with eval_cache."""
        from actcache.labels import read_labels
        from actcache.sae.split import heldout_images

        if run.eval_cache is not None:
            return heldout_images(cache.n_imgs, 0.0)
        lab = read_labels(cache.path, cache.n_imgs)
        return heldout_images(cache.n_imgs, run.eval_frac, None if lab is None else lab[0])

    def _write_run_json(self, run: RunConfig, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        sae_cfg = run.sae_config(self.md.d_vit)
        _write_json(os.path.join(directory, RUN_FILE), {
            "sae_id": run.sae_id, "group_id": self.group_id, "cache": os.path.abspath(self.cache_dir),
            "cache_hash": self.md.hash, "layer": self.layer, "d_vit": self.md.d_vit, "width": sae_cfg.width,
            "train_images": self.n_train, "split": self._split_doc(run), "world_size": self.ctx.world_size,
            "run": run.to_dict(),
        })  # fmt: skip

    def _split_doc(self, run: RunConfig) -> dict:
        from actcache.sae.split import RULE, SPLIT_SEED

        if run.eval_cache is not None:
            return {"rule": "eval_cache", "eval_cache": os.path.abspath(run.eval_cache)}
        return {"rule": RULE, "seed": SPLIT_SEED, "eval_frac": run.eval_frac, "n_heldout": self.n_eval,
                "heldout_images": [int(i) for i in self.heldout]}  # fmt: skip

    def _passes(self, pending: list[tuple[RunConfig, str]]) -> list[tuple[int, list[tuple[RunConfig, str]]]]:
        """(start step, members) of each data pass: SAEs with valid checkpoints resume from the
        newest step all of them have (damaged checkpoints skipped: checkpoint.valid_steps)."""
        valid = {d: ckpt.valid_steps(d, set_aside=self.ctx.is_main) for _, d in pending}
        with_ckpt = [p for p in pending if valid[p[1]]]
        fresh = [p for p in pending if not valid[p[1]]]
        out: dict[int, list] = {}
        both = set.intersection(*(set(valid[d]) for _, d in with_ckpt)) if with_ckpt else set()
        common = max(both) if both else None
        for p in with_ckpt:
            start = common if common is not None else valid[p[1]][-1]
            out.setdefault(start, []).append(p)
        if fresh:
            out.setdefault(0, []).extend(fresh)
        return sorted(out.items(), key=lambda kv: -kv[0])

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> list[str]:
        """Train every unfinished SAE of the group; returns their run directories."""
        cache = self._open_cache()
        joined = ddp.init(self.ctx, self.device)  # a group the caller joined stays theirs
        lock = RunLock()
        try:
            dirs = [(r, run_dir(self.runs_to, self.md.hash, r)) for r in self.runs]
            pending = self._own([(r, d) for r, d in dirs if not is_done(d)], lock)
            for r, d in dirs:
                if (r, d) not in pending:
                    log.info("SAE %s is done (%s); skipped", r.sae_id, done_path(d))

            def write_run_jsons():
                for r, d in pending:
                    with _writing(RUN_FILE, d):
                        self._write_run_json(r, d)
                        ckpt.clean_temps(d)

            ddp.on_main(self.ctx, self.device, RUN_FILE, write_run_jsons)
            todo = self._passes(pending)
            while todo:
                start, members = todo.pop(0)
                try:
                    self._train_pass(cache, start, members)
                except _Unloadable as bad:  # set aside like a checkpoint failing its manifest; plan again
                    self._set_aside(bad)
                    todo = self._passes(members) + todo
            return [d for _, d in dirs]
        finally:
            lock.close()
            if joined:
                ddp.shutdown(self.ctx)

    def _set_aside(self, bad: _Unloadable) -> None:
        """A checkpoint whose files match its manifest but do not load (say, a state.pt that is not a
        weights-only pickle): renamed aside, so the run resumes from the one before it, if any."""
        d = ckpt.step_dir(bad.dir, bad.step)
        log.warning("checkpoint %s passes its manifest but cannot be loaded (%s); setting it aside", d, bad.why)

        def move():
            if ckpt._set_aside(d) is None:
                raise TrainError(f"{bad.why}; and it cannot be renamed aside: move it away by hand.")

        ddp.on_main(self.ctx, self.device, f"the rename of {d}", move)
        if not ckpt.steps(bad.dir):
            raise TrainError(
                f"no valid checkpoint to resume {bad.dir} from: {bad.why}. Restore one from a backup, or delete "
                f"{os.path.join(bad.dir, ckpt.CKPT_DIR)} to train this SAE again from the start."
            )

    def _own(self, pending: list[tuple[RunConfig, str]], lock: RunLock) -> list[tuple[RunConfig, str]]:
        """Lock the run directories of ``pending`` (main rank; actcache.runlock) and return those still
        unfinished: a train waited for (wait_for_lock) may have finished them."""

        def take():
            for _, d in sorted(pending, key=lambda p: p[1]):  # one order: two waiting trains cannot deadlock
                lock.acquire(d, wait=self.wait_for_lock)

        ddp.on_main(self.ctx, self.device, "the run directories' locks", take)
        return [(r, d) for r, d in pending if not is_done(d)]

    def _loader(self, cache, start: int):
        from actcache.loaders import ShuffledLoader

        run = self.runs[0]
        loader = ShuffledLoader(
            cache, batch_size=run.batch_size // self.ctx.world_size, skip_imgs=self.heldout,
            patches=run.patches, layer=self.layer, buffer_bytes=run.buffer_bytes, seed=run.data_seed,
            n_epochs=None, end_at=("batch", run.steps), drop_last=True, deterministic=run.deterministic,
            scale_norm=run.scale_norm, rank=self.ctx.rank, world_size=self.ctx.world_size,
            n_readers=run.n_readers, cold_read=run.cold_read, batch_timeout_s=run.batch_timeout_s,
            prefetch=run.prefetch, verify_reads=run.verify_reads,
        )  # fmt: skip
        if self.ctx.is_main:
            _say_read_checks(loader, run.verify_reads)
        nb = len(loader)
        if nb == 0:
            raise TrainError(
                f"{self.cache_dir}: the {self.n_train} training images give fewer than batch_size="
                f"{run.batch_size} examples per epoch; lower batch_size or use a larger cache."
            )
        loader.start_at = (start // nb, start % nb)
        return loader

    def _train_pass(self, cache, start: int, pending: list[tuple[RunConfig, str]]) -> None:
        run = self.runs[0]
        members = [_Member(r, d, self.md.d_vit, self.device, self.sync_free) for r, d in pending]
        for m in members:
            if start > 0:
                try:
                    _, extra = ckpt.load(m.dir, start, m.sae, m.opt, m.obj)
                except ckpt.IncompatibleCheckpoint:
                    raise
                except TrainError as err:
                    raise _Unloadable(m.dir, start, str(err)) from None
                m.acc_sum.copy_(extra["metric_sum"])
                m.acc_n = extra["metric_n"]
            if self.ctx.is_main:
                ckpt.truncate_metrics(os.path.join(m.dir, METRICS_FILE), start)
        loader = self._loader(cache, start)
        self.loader = loader
        if start > 0:
            log.info("group %s: resuming %d SAE(s) at step %d (loader epoch %d, batch %d)", self.group_id,
                     len(members), start, *loader.start_at)  # fmt: skip
        self._stacks: list[tuple[BatchedSAEs, list[_Member]]] = []
        step = start
        t_log, wait_log, step_log = time.perf_counter(), 0.0, start
        feed = PinnedFeed(loader, self.device) if self.sync_free else None
        it = iter(loader) if feed is None else feed
        self._bad_step = torch.full((), -1, dtype=torch.int64, device=self.device)
        try:
            while step < run.steps:
                t0, fed0 = time.perf_counter(), feed.wait_s if feed else 0.0
                x_BD = self._next_batch(it, step, run.steps)
                wait_log += feed.wait_s - fed0 if feed else time.perf_counter() - t0
                if step == 0:
                    self._check_deferred()  # (b_dec's init reads the batch anyway)
                    self._init_from_batch(members, x_BD)
                if step == start:
                    self._stacks = self._stack(members)
                self._step_all(members, x_BD, step)
                step += 1
                if step == run.steps:  # before any checkpoint of the last step, so a resume has it
                    self._calibrate(members, x_BD)
                if step % run.log_every == 0 or step == run.steps:
                    self._check_deferred()
                    self._log(members, step, time.perf_counter() - t_log, wait_log, step - step_log)
                    t_log, wait_log, step_log = time.perf_counter(), 0.0, step
                periodic = step % run.ckpt_every == 0 and step < run.steps
                if periodic:
                    self._check_deferred()
                    self._save(members, step)
                if ddp.any_true(self.stop(), self.ctx, self.device):
                    if not periodic:
                        self._check_deferred()
                        self._save(members, step)
                    raise Preempted(step)
        except LoaderError:
            # a damaged shard: keep the steps done (one process only: with DDP the other ranks
            # would wait in the checkpoint's collectives for this one); a re-run resumes there
            if self.ctx.world_size == 1 and step > start and step % run.ckpt_every:
                self._check_deferred()
                self._save(members, step)
            raise
        finally:
            if feed is not None:
                feed.close()
            loader.close()
        self._check_deferred()
        self._save(members, run.steps)  # (copies the stacks back into the members)
        self.trained.update({m.run.sae_id: m.sae for m in members})
        ddp.on_main(self.ctx, self.device, "the final weights and evaluation", lambda: self._finish(cache, members))

    def _next_batch(self, it, step: int, steps: int) -> torch.Tensor:
        """The next batch on the device. Sync-free: its finiteness is kept on the device (the first
        bad step, read by _check_deferred); otherwise checked now, naming the image."""
        batch = next(it, None)
        if batch is None:
            raise TrainError(f"the loader ended at step {step} of {steps}")
        if self.sync_free:
            bad = ~torch.isfinite(batch).all()
            self._bad_step = torch.where(bad & (self._bad_step < 0), step, self._bad_step)
            return batch
        x_BD = batch["act"].to(self.device, non_blocking=True)
        check_finite(x_BD, batch, f"activations of {self.cache_dir}")
        return x_BD

    def _check_deferred(self) -> None:
        """Sync-free mode: raise for a batch with NaN/Inf since the last check (one device read),
        before any metric or checkpoint comes from it."""
        bad = int(self._bad_step) if self.sync_free else -1
        if bad >= 0:
            raise TrainError(
                f"activations of {self.cache_dir} contain NaN or Inf in the batch of step {bad}; not training "
                "through it. Check the cache with `actcache verify --deep DIR` and re-dump the shard holding it."
            )

    def _init_from_batch(self, members: list[_Member], x_BD: torch.Tensor) -> None:
        for m in members:
            init_from_batch(m.sae, m.run, x_BD, self.ctx)

    def _stack(self, members: list[_Member]) -> list[tuple[BatchedSAEs, list[_Member]]]:
        """Stacks of the members that step as one batched module (``batch_saes``): members of equal
        batch_key, two or more; not under DDP, whose gradient average is per SAE."""
        mode = self.runs[0].batch_saes
        if self.ctx.enabled or not choose_batching(mode, self.device.type, len(members)):
            return []
        by_key: dict[tuple, list[_Member]] = {}
        for m in members:
            by_key.setdefault(batch_key(m.sae, m.opt, (m.sched, m.run.max_grad_norm)), []).append(m)
        stacks = [(BatchedSAEs([m.sae for m in ms], [m.opt for m in ms]), ms) for ms in by_key.values() if len(ms) > 1]
        alone = len(members) - sum(len(ms) for _, ms in stacks)
        log.info("group %s: %d stack(s) of SAEs stepped as one batched module, %d SAE(s) alone (batch_saes=%s)",
                 self.group_id, len(stacks), alone, mode)  # fmt: skip
        return stacks

    def _step_all(self, members: list[_Member], x_BD: torch.Tensor, step: int) -> None:
        stacked = {id(m) for _, ms in self._stacks for m in ms}
        for st, ms in self._stacks:
            lr = ms[0].sched(step)
            outs = st.step([m.obj for m in ms], x_BD, lr=lr, max_grad_norm=ms[0].run.max_grad_norm,
                           sparsity_scales=[m.sparsity_scale(step) for m in ms])  # fmt: skip
            for m, out in zip(ms, outs, strict=True):
                m.record(out, lr)
        for m in members:
            if id(m) not in stacked:
                m.step(x_BD, step, self.ctx)

    def _calibrate(self, members: list[_Member], x_BD: torch.Tensor) -> None:
        """The batchtopk/matryoshka inference thresholds from the final weights on the last batch
        (SAE.calibrate_threshold_; under DDP the mean over ranks), in place of the training EMA."""
        for st, _ in getattr(self, "_stacks", []):
            st.scatter()
        for m in members:
            if m.sae.cfg.activation in ("batchtopk", "matryoshka"):
                m.sae.calibrate_threshold_(x_BD)
                ddp.average_(m.sae.threshold, self.ctx)

    def _save(self, members: list[_Member], step: int) -> None:
        for st, _ in getattr(self, "_stacks", []):
            st.scatter()  # the members' weights and Adam state, which the checkpoint holds

        def write():
            nb = len(self.loader)
            pos = {"loader": {"epoch": step // nb, "batch": step % nb}, "batches_per_epoch": nb,
                   "world_size": self.ctx.world_size, "time": _now()}  # fmt: skip
            for m in members:
                if step not in ckpt.steps(m.dir):  # (a resumed, already finished pass has it)
                    with _writing(f"the checkpoint of step {step}", m.dir):
                        extra = {"metric_sum": m.acc_sum, "metric_n": m.acc_n}
                        ckpt.save(m.dir, step, m.sae, m.opt, m.obj, pos, extra)
            for m in members:  # only now, when every member has `step`
                ckpt.prune(m.dir, keep_newest=m.run.keep_checkpoints)

        ddp.on_main(self.ctx, self.device, f"the checkpoint of step {step}", write)

    def _log(self, members: list[_Member], step: int, dt: float, wait_s: float, n_steps: int) -> None:
        run = self.runs[0]
        timing = {
            "step_s": dt / max(1, n_steps), "steps_per_s": n_steps / dt if dt > 0 else None,
            "examples_per_s": n_steps * run.batch_size / dt if dt > 0 else None,
            "wait_s": wait_s, "wait_frac": wait_s / dt if dt > 0 else None,
        }  # fmt: skip
        for m in members:
            means = (m.acc_sum / max(1, m.acc_n)).tolist()
            m.acc_sum.zero_()
            m.acc_n = 0
            line = {"step": step, "tokens": step * run.batch_size, "lr": m.lr, **dict(zip(m.metric_names, means, strict=True)),
                    "n_dead": int(m.last.n_dead), "n_dense": int(m.last.n_dense), **timing, "time": _now()}  # fmt: skip
            m.last_line = line

        def write():
            for m in members:
                with (
                    _writing(METRICS_FILE, m.dir),
                    open(os.path.join(m.dir, METRICS_FILE), "a", encoding="utf-8") as fh,
                ):
                    fh.write(json.dumps(m.last_line) + "\n")

        ddp.on_main(self.ctx, self.device, f"{METRICS_FILE} (step {step})", write)
        if self.ctx.is_main:
            _wandb_log(self, members, step)
            m0 = members[0].last_line
            log.info("group %s step %d/%d: %.1f steps/s, loader wait %.1f%%", self.group_id, step, run.steps,
                     m0["steps_per_s"] or 0, 100 * (m0["wait_frac"] or 0))  # fmt: skip
            for m in members:  # each SAE its own metrics, named by what it is
                line = m.last_line
                log.info("  %s %s: nmse %.4f l0 %.1f%s", m.run.sae_id, m.run.title(self.md.d_vit), line["nmse"],
                         line["l0"], _prefix_metrics(line))  # fmt: skip

    def _finish(self, cache, members: list[_Member]) -> None:
        run = self.runs[0]
        for m in members:
            with _writing("the final weights", m.dir):
                m.sae.save(m.dir)
        evals = self._evaluate(cache, members)
        for m, ev in zip(members, evals, strict=True):
            with _writing(EVAL_FILE, m.dir):
                write_eval(m.dir, ev)
            done = {"sae_id": m.run.sae_id, "group_id": self.group_id, "cache_hash": self.md.hash,
                    "steps": run.steps, "tokens": run.steps * run.batch_size, "final": m.last_line,
                    "eval": {k: ev.get(k) for k in ("n_tokens", "nmse", "l0", "n_dead", "n_dense")},
                    "finished": _now(), "files": weights_records(m.dir)}  # fmt: skip
            with _writing(DONE_FILE, m.dir):
                _write_json(done_path(m.dir), done)
            log.info("SAE %s done: %s", m.run.sae_id, done_path(m.dir))

    def _evaluate(self, cache, members: list[_Member]) -> list[dict]:
        run = self.runs[0]
        if run.eval_cache is None and self.n_eval == 0:
            return [{"skipped": "eval_frac is 0 and no eval_cache is set"} for _ in members]
        from actcache.loaders import OrderedLoader

        kw = {"batch_size": run.batch_size, "patches": run.patches, "layer": self.layer, "scale_norm": run.scale_norm,
              "n_readers": run.n_readers, "batch_timeout_s": run.batch_timeout_s}  # fmt: skip
        from actcache.sae.evaluate import DEAD_WINDOW_TOKENS
        from actcache.sae.probes import probe_labels
        from actcache.sae.split import window_batches

        wide = (run.patches, self.layer, run.scale_norm, run.batch_size)
        if run.eval_cache is not None:
            where = {"cache": os.path.abspath(run.eval_cache), "split": "eval_cache"}
            loader = OrderedLoader(run.eval_cache, **kw)  # read whole: its tokens past eval_tokens widen the window
            eval_on, held = loader.cache, np.arange(loader.cache.n_imgs)
            more = DEAD_WINDOW_TOKENS - loader.cache.n_imgs * loader.geom.per_img
            window = window_batches(cache, [], [], *wide, more)
        else:
            from actcache.sae.split import RULE, HeldoutBatches

            where = {"cache": os.path.abspath(self.cache_dir), "split": RULE, "n_heldout_images": self.n_eval}
            loader = HeldoutBatches(cache, self.heldout, run.patches, self.layer, run.scale_norm, run.batch_size,
                                    max_tokens=run.eval_tokens)  # fmt: skip
            window = window_batches(cache, self.heldout, loader.imgs, *wide, DEAD_WINDOW_TOKENS)
            eval_on, held = cache, self.heldout  # only the held-out images are probed
        found = probe_labels(eval_on, held)  # image labels, or a saev cache's per-patch labels
        labels = None if found is None else (*found, eval_on.metadata.n_patches_per_img)
        try:
            res = evaluate_many([m.sae for m in members], loader, dense_frac=[m.run.dense_frac for m in members],
                                max_tokens=run.eval_tokens, labels=labels, window=window)  # fmt: skip
        finally:
            loader.close()
        return [{**where, "layer": self.layer, "patches": run.patches, **r} for r in res]


def _wandb_log(trainer: GroupTrainer, members: list[_Member], step: int) -> None:
    """Weights & Biases, when installed and ``wandb_project`` is set; never fatal."""
    run = trainer.runs[0]
    if run.wandb_project is None or getattr(trainer, "_wandb", None) is False:
        return
    try:
        import wandb
    except ImportError:
        return
    try:
        if getattr(trainer, "_wandb", None) is None:
            trainer._wandb = wandb.init(
                project=run.wandb_project, entity=run.wandb_entity, id=f"{trainer.md.hash[:12]}-{trainer.group_id}",
                name=trainer.group_id, resume="allow", dir=members[0].dir,
                config={m.run.sae_id: m.run.to_dict() for m in members},
            )  # fmt: skip
        trainer._wandb.log({f"{m.run.sae_id}/{k}": v for m in members for k, v in m.last_line.items()
                            if isinstance(v, int | float)}, step=step)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - logging must never stop training
        log.warning("wandb logging failed (%s); continuing without it", err)
        trainer._wandb = False


def train_group(cache_dir: str, runs: list[RunConfig], runs_to: str, device: str | None = None,
                stop: Callable[[], bool] | None = None, wait_for_lock: bool = False) -> list[str]:  # fmt: skip
    """Train one group of SAEs (see the module docstring); returns the run directories."""
    return GroupTrainer(cache_dir, runs, runs_to, device=device, stop=stop, wait_for_lock=wait_for_lock).run()


_told: set[tuple[str, str]] = set()  # (cache, what): each notice once per process


def _say_read_checks(loader, mode: str) -> None:
    """One line each, once per cache: reads are unverified (verify_reads: off); shards have no
    checksum records to check reads against (and how to add them)."""
    path = loader.cache.path
    if mode == "off" and (path, "off") not in _told:
        _told.add((path, "off"))
        log.warning("reads of %s are unverified (verify_reads: off); set verify_reads: first to check each "
                    "checksum block the first time it is read", path)  # fmt: skip
    unsealed = loader.verifier.unsealed()
    if unsealed and (path, "seal") not in _told:
        _told.add((path, "seal"))
        log.warning("%d of %d shard(s) of %s have no checksum records: a flipped bit in them goes unnoticed; add "
                    "them with `actcache seal %s`", len(unsealed), len(loader.cache.shards), path, path)  # fmt: skip


def train_groups(cache_dir: str, by_group: dict[str, list[RunConfig]], runs_to: str, device: str | None = None,
                 stop: Callable[[], bool] | None = None, wait_for_lock: bool = False) -> list[str]:  # fmt: skip
    """Train each group of ``by_group`` (group id -> its SAEs) in turn; returns the run directories.
    SIGTERM or SIGUSR2 (a Slurm preemption) makes the current group write a checkpoint and raise
    :class:`Preempted`; so does ``stop()`` returning True."""
    stopping = {"flag": False}

    def _request_stop(signum, frame):
        stopping["flag"] = True
        log.warning("got %s: checkpointing at the end of this step", signal.Signals(signum).name)

    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, _request_stop) for sig in (signal.SIGTERM, signal.SIGUSR2)} if main else {}
    dirs: list[str] = []
    try:
        for gid, runs in by_group.items():
            log.info("training group %s (%d SAE(s)) on %s", gid, len(runs), cache_dir)
            dirs += train_group(cache_dir, runs, runs_to, device=device,
                                stop=lambda: stopping["flag"] or (stop is not None and stop()),
                                wait_for_lock=wait_for_lock)  # fmt: skip
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return dirs
