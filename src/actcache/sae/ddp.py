"""Data-parallel SAE training over several processes (torchrun, srun, or mp.spawn).

Rank and world size come from the environment: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun)
or ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (srun). With one process nothing here does
anything. Each rank reads its own partition of the cache (the loader's rank/world_size) with
``batch_size / world_size`` examples per step; after every backward pass the gradients of each
SAE are averaged over ranks with one flat all-reduce, so every rank applies the same update and
the weights stay identical. The batchtopk threshold (a buffer) is averaged too. Dead/dense
counters stay per rank (rank 0's are logged and checkpointed). Only rank 0 writes the run
directory (:func:`on_main`), and an error there stops every rank at once. Backend: nccl on CUDA,
gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable

import torch
import torch.distributed as dist

from actcache.errors import TrainError


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_context(environ: dict | None = None) -> DistContext:
    """Rank, world size and local rank from torchrun's or Slurm's variables (defaults 0, 1, 0)."""
    env = os.environ if environ is None else environ

    def get(*names: str, default: int) -> int:
        for n in names:
            if env.get(n, "") != "":
                try:
                    return int(env[n])
                except ValueError:
                    raise TrainError(f"environment variable {n}={env[n]!r} is not an integer") from None
        return default

    world = get("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = get("RANK", "SLURM_PROCID", default=0)
    local = get("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if world < 1 or not 0 <= rank < world:
        raise TrainError(
            f"inconsistent rank {rank} for world size {world} (RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS)"
        )
    return DistContext(rank, world, local)


def _master_addr() -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodes and int(os.environ.get("SLURM_NNODES", "1")) > 1:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "127.0.0.1"


def init(ctx: DistContext, device: torch.device) -> bool:
    """Join the process group (when world_size > 1 and not joined yet); -> whether this call
    joined it (the caller then leaves it with :func:`shutdown`)."""
    if not ctx.enabled or dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", _master_addr())
    job = os.environ.get("SLURM_JOB_ID", "")
    os.environ.setdefault("MASTER_PORT", str(29500 + (int(job) % 1000 if job.isdigit() else 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=ctx.rank, world_size=ctx.world_size)
    return True


def shutdown(ctx: DistContext) -> None:
    """Leave the process group. A process that exits without this can abort at exit (SIGABRT,
    "terminate called without an active exception": gloo's threads may still hold work while
    the interpreter is torn down, a known PyTorch behaviour), and Slurm then reports a finished
    training job as failed. Seen once here, rank 1 of the two-rank test in a full CI run, before
    GroupTrainer.run left its group; not reproduced in 40 runs of that test alone."""
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def device_for(ctx: DistContext, requested: str | None) -> torch.device:
    """``requested`` (cpu, cuda, cuda:1) or cuda when present; on several ranks cuda -> cuda:local_rank."""
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"--device {requested}: CUDA is not available on this machine; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", ctx.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    return dev


def average_grads_(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Average the .grad of ``params`` over ranks with one flat all-reduce."""
    if not ctx.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= ctx.world_size
    off = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        chunk = flat[off : off + n].view_as(g)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        off += n


def average_(t: torch.Tensor, ctx: DistContext) -> None:
    """Average a tensor (e.g. the batchtopk threshold) over ranks in place."""
    if ctx.enabled:
        dist.all_reduce(t)
        t /= ctx.world_size


def any_true(flag: bool, ctx: DistContext, device: torch.device) -> bool:
    """True when ``flag`` is true on any rank (so that all ranks stop at the same step)."""
    if not ctx.enabled:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_(t: torch.Tensor, ctx: DistContext, src: int = 0) -> None:
    """Copy rank ``src``'s value of ``t`` to every rank (in place)."""
    if ctx.enabled:
        dist.broadcast(t, src)


def on_main(ctx: DistContext, device: torch.device, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` (writing the run directory: ``what``) on the main rank only, then wait for it on
    every rank. When it raises, every rank stops at once: the main rank with its error, the others
    with a TrainError naming it. Behind a plain barrier they waited for a rank that was gone: with
    gloo that failed with "Connection closed by peer", which does not say why; with nccl a
    collective whose peer is gone can wait for the process group's timeout (not measured here, no
    GPU), and srun by default lets the other tasks run on."""
    err = None
    if ctx.is_main:
        try:
            fn()
        except Exception as e:  # re-raised below, once the other ranks know
            err = e
    failed = any_true(err is not None, ctx, device)  # every rank waits here, as at a barrier
    if err is not None:
        raise err
    if failed:
        raise TrainError(
            f"rank 0 failed while writing {what}, so rank {ctx.rank} stops too: rank 0's output has the error "
            "and the fix; a new run resumes from the last complete checkpoint"
        )
