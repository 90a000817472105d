"""Sparse autoencoders (ReLU, TopK, BatchTopK, JumpReLU, Matryoshka BatchTopK), their objectives and optimizer pieces.

The public names are imported on first use (PEP 562), so that importing a light submodule
(``actcache.sae.config`` or ``actcache.sae.spec``, which the workflow plans with) loads no torch.
"""

from __future__ import annotations

from actcache.lazy import lazy_names

# public name -> the submodule that defines it
_LAZY = {
    "ACTIVATIONS": "actcache.sae.spec",
    "SAEConfig": "actcache.sae.spec",
    "SAE": "actcache.sae.modeling",
    "geometric_median": "actcache.sae.modeling",
    **dict.fromkeys(
        (
            "AuxKObjective",
            "FiringStats",
            "JumpReLUObjective",
            "LossOut",
            "MatryoshkaObjective",
            "Objective",
            "ReLUObjective",
            "auxk_loss",
            "make_objective",
        ),
        "actcache.sae.objectives",
    ),
    **dict.fromkeys(
        ("LRSchedule", "clip_grad_norm", "make_optimizer", "sparsity_warmup", "train_step"), "actcache.sae.optim"
    ),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
