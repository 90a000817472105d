"""Optimizer pieces for SAE training: Adam, an LR schedule, the L1 warm-up, clipping, one step.

opt = make_optimizer(sae, lr=4e-4)
sched = LRSchedule(lr=4e-4, warmup_steps=500, total_steps=20_000, decay="linear")
for step, x_BD in enumerate(batches):
    sched.apply(opt, step)
    out = train_step(sae, obj, opt, x_BD, max_grad_norm=1.0,
                     sparsity_scale=sparsity_warmup(step, 1000))
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from actcache.errors import ConfigError
from actcache.sae.modeling import SAE
from actcache.sae.spec import DECAYS


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def make_optimizer(sae: SAE, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
    """Adam over all SAE parameters."""
    if not _num(lr) or lr <= 0:
        raise ConfigError(f"lr must be a positive number, got {lr!r}")
    if len(betas) != 2 or not all(_num(b) and 0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {betas!r}")
    return torch.optim.Adam(sae.parameters(), lr=lr, betas=tuple(betas), eps=eps)


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from lr/warmup_steps to lr over ``warmup_steps`` steps, then ``decay`` to
    ``final_frac * lr`` at ``total_steps`` (held there afterwards)."""

    lr: float
    warmup_steps: int = 0
    total_steps: int = 1
    decay: str = "linear"
    final_frac: float = 0.0

    def __post_init__(self) -> None:
        if not _num(self.lr) or self.lr <= 0:
            raise ConfigError(f"LRSchedule.lr must be a positive number, got {self.lr!r}")
        for name in ("warmup_steps", "total_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"LRSchedule.{name} must be an integer >= 0, got {v!r}")
        if self.total_steps < self.warmup_steps:
            raise ConfigError(f"LRSchedule.total_steps={self.total_steps} must be >= warmup_steps={self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ConfigError(f"LRSchedule.decay must be one of {list(DECAYS)}, got {self.decay!r}")
        if not _num(self.final_frac) or not 0.0 <= self.final_frac <= 1.0:
            raise ConfigError(f"LRSchedule.final_frac must be in [0, 1], got {self.final_frac!r}")

    def multiplier(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = self.total_steps - self.warmup_steps
        p = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        f = self.final_frac
        if self.decay == "linear":
            return 1.0 - (1.0 - f) * p
        return f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * p))

    def __call__(self, step: int) -> float:
        return self.lr * self.multiplier(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every param group's lr for ``step``; returns it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def sparsity_warmup(step: int, warmup_steps: int) -> float:
    """Multiplier for the ReLU L1 coefficient: rises linearly from 0 at step 0 to 1 at ``warmup_steps``."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, max(0.0, step / warmup_steps))


def clip_grad_norm(sae: SAE, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of the SAE's parameters; returns the norm before clipping."""
    if not _num(max_norm) or max_norm <= 0:
        raise ConfigError(f"max_grad_norm must be a positive number, got {max_norm!r}")
    return torch.nn.utils.clip_grad_norm_(sae.parameters(), max_norm)


@contextlib.contextmanager
def matmul_precision(precision: str):
    """``tf32``: CUDA float32 matmuls may use TF32 inside the block (CPU matmuls are unchanged);
    the previous setting is restored after. Other precisions leave the setting alone."""
    if precision != "tf32":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def train_step(
    sae: SAE,
    objective,
    optimizer,
    x_BD: torch.Tensor,
    *,
    max_grad_norm: float | None = None,
    sparsity_scale: float = 1.0,
):
    """One update in the order the decoder constraint needs: loss, backward, (remove parallel
    decoder grads), clip, Adam step, (renormalize decoder rows). Returns the objective's LossOut.
    The forward and backward run at ``sae.precision`` (see SAE.set_compute)."""
    optimizer.zero_grad(set_to_none=True)
    with matmul_precision(getattr(sae, "precision", "fp32")):
        out = objective(sae, x_BD, sparsity_scale=sparsity_scale)
        out.loss.backward()
    if sae.cfg.normalize_decoder:
        sae.remove_parallel_grads_()
    if max_grad_norm is not None:
        clip_grad_norm(sae, max_grad_norm)
    optimizer.step()
    if sae.cfg.normalize_decoder:
        sae.normalize_decoder_()
    return out
