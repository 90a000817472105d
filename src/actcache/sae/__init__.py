"""Sparse autoencoders (ReLU, TopK, BatchTopK, JumpReLU, Matryoshka BatchTopK), their objectives and optimizer pieces."""

from actcache.sae.modeling import ACTIVATIONS, SAE, SAEConfig, geometric_median
from actcache.sae.objectives import (
    AuxKObjective,
    FiringStats,
    JumpReLUObjective,
    LossOut,
    MatryoshkaObjective,
    Objective,
    ReLUObjective,
    auxk_loss,
    make_objective,
)
from actcache.sae.optim import LRSchedule, clip_grad_norm, make_optimizer, sparsity_warmup, train_step

__all__ = [
    "ACTIVATIONS",
    "SAE",
    "AuxKObjective",
    "FiringStats",
    "JumpReLUObjective",
    "LRSchedule",
    "LossOut",
    "MatryoshkaObjective",
    "Objective",
    "ReLUObjective",
    "SAEConfig",
    "auxk_loss",
    "clip_grad_norm",
    "geometric_median",
    "make_objective",
    "make_optimizer",
    "sparsity_warmup",
    "train_step",
]
