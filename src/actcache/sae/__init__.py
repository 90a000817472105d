"""Sparse autoencoders (ReLU, TopK, BatchTopK, JumpReLU, Matryoshka BatchTopK), their objectives and optimizer pieces.

The public names are imported on first use (PEP 562), so that importing a light submodule
(``actcache.sae.config`` or ``actcache.sae.spec``, which the workflow plans with) loads no torch.
"""

from __future__ import annotations

import importlib

# public name -> the submodule that defines it
_LAZY = {
    "ACTIVATIONS": "actcache.sae.spec",
    "SAEConfig": "actcache.sae.spec",
    "SAE": "actcache.sae.modeling",
    "geometric_median": "actcache.sae.modeling",
    **dict.fromkeys(
        ("AuxKObjective", "FiringStats", "JumpReLUObjective", "LossOut", "MatryoshkaObjective", "Objective",
         "ReLUObjective", "auxk_loss", "make_objective"),
        "actcache.sae.objectives",
    ),  # fmt: skip
    **dict.fromkeys(
        ("LRSchedule", "clip_grad_norm", "make_optimizer", "sparsity_warmup", "train_step"), "actcache.sae.optim"
    ),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'actcache.sae' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
