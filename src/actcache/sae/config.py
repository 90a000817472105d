"""The ``train:`` section of an experiment YAML -> a list of frozen :class:`RunConfig` (one per SAE).

    train:
      layer: -2              # every key at this level is a default for every SAE
      patches: image
      batch_size: 4096
      n_tokens: 100_000_000  # or steps: N (steps = ceil(n_tokens / batch_size))
      lr: 4.0e-4
      dead_tokens: 10_000_000
      sweep:                 # every list expands into a grid (product over keys) ...
        lr: [1.0e-4, 4.0e-4]
      saes:                  # ... crossed with each entry (optional; merged over the defaults)
        - {activation: topk, exp_factor: 16, sweep: {k: [16, 32, 64]}}
        - {activation: relu, width: 8192, sweep: {l1_coeff: [1.0e-4, 1.0e-3]}}
      # -> 2 x (3 + 2) = 10 SAEs, one group (same layer, patches, batch size, length): one data pass

An entry's own ``sweep:`` is crossed with the section's ``sweep:``; a key set by more than one of
(entry, entry sweep, section sweep) is an error. Without ``saes:`` the defaults are one SAE.
Every key and its default is in :data:`FIELDS`. Numbers written as ``3e-4`` (which YAML reads as
a string) are accepted for numeric keys. A list-valued key (``matryoshka_prefixes: [64, 256]``) is
one value; in ``sweep:`` give a list of such lists.

Identity
- ``RunConfig.sae_id``: 12 hex of the sha256 of every key that changes the trained weights or
  its eval (everything but :data:`LOGISTICS`; :data:`OBJECTIVE_KEYS` only when not at their default).
  A changed hyperparameter gives a new id and a new directory; other runs are never touched. Keys
  are hashed as written (``layer: null`` means the cache's only layer; ``exp_factor`` is not
  resolved into a width), so ids never need the cache.
- ``RunConfig.group_id``: SAEs with equal :data:`GROUP_KEYS` (layer, patches, batch size, length,
  loader settings and I/O, logging) train together on the batches of ONE loader pass; ``actcache train
  --group G`` trains one group. Ids look like ``L-2-image-1a2b3c4d`` (stable: a hash of the keys).

Each SAE trains into its own run directory ``<runs_to>/<HASH>/<sae-id>/``; actcache.rundir owns
its layout (run_dir, done_paths) and the names of its files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from typing import Any

from actcache.errors import ConfigError
from actcache.loaders.kernels import PREFETCH_SCHEMES
from actcache.loaders.maps import COLD_READS
from actcache.sae.modeling import (
    ACTIVATIONS,
    DECODES,
    DTYPES,
    JUMPRELU_BANDWIDTH,
    JUMPRELU_INIT,
    NO_K,
    PRECISIONS,
    SAEConfig,
)  # fmt: skip

ID_VERSION = 1
PATCHES = ("cls", "image", "all")
DECAYS = ("linear", "cosine", "constant")
B_DEC_INITS = ("geometric_median", "mean", "zero")

_NUM = (int, float)
# key -> (allowed types, default, help). Types: int, float (int accepted), bool, str, None.
FIELDS: dict[str, tuple[tuple, Any, str]] = {
    # data stream (shared by a group)
    "layer": ((int, None), None, "recorded layer value; null = the cache's only layer"),
    "patches": ((str,), "image", "cls | image | all"),
    "batch_size": ((int,), 4096, "examples per optimizer step (global, over all ranks)"),
    "steps": ((int, None), None, "optimizer steps (give steps or n_tokens)"),
    "n_tokens": ((int, None), None, "training examples; steps = ceil(n_tokens / batch_size)"),
    "data_seed": ((int,), 0, "shuffle seed of the loader"),
    "buffer_bytes": ((int,), 2**30, "shuffle buffer of the loader"),
    "scale_norm": ((bool,), False, "loader scales activations to mean norm sqrt(d)"),
    "deterministic": ((bool,), True, "loader yields batches in plan order (exact resume); false: as ready"),
    "eval_frac": ((float,), 0.05, "last fraction of images held out for eval (excluded from training)"),
    "eval_cache": ((str, None), None, "evaluate on this other cache directory instead (eval_frac ignored)"),
    "eval_tokens": ((int,), 1_000_000, "at most this many held-out examples are evaluated"),
    # model
    "activation": ((str,), "topk", "relu | topk | batchtopk | jumprelu | matryoshka"),
    "width": ((int, None), None, "number of latents"),
    "exp_factor": ((float, None), None, "width = d_vit * exp_factor (default 16 when width is not given)"),
    "k": ((int, None), None, "latents per example (topk, batchtopk, matryoshka; default 32)"),
    "normalize_decoder": ((bool, None), None, "unit-norm decoder rows (default: true for topk variants)"),
    "seed": ((int,), 0, "SAE init seed"),
    "dtype": ((str,), "float32", "float32 | float64 | bfloat16"),
    "threshold_decay": ((float,), 0.99, "batchtopk, matryoshka: inference threshold EMA decay"),
    "jumprelu_bandwidth": ((float,), JUMPRELU_BANDWIDTH, "jumprelu: straight-through kernel width"),
    "jumprelu_init_threshold": ((float,), JUMPRELU_INIT, "jumprelu: initial threshold of every latent"),
    "matryoshka_prefixes": ((list, None), None, "matryoshka: nested prefix sizes, last = width"),
    # objective
    "l1_coeff": ((float, None), None, "relu only: L1 coefficient (required for relu)"),
    "aux_coeff": ((float,), 1 / 32, "topk variants: AuxK coefficient"),
    "k_aux": ((int, None), None, "topk variants: AuxK latents (default d_vit // 2)"),
    "dead_tokens": ((int,), 10_000_000, "a latent is dead after this many tokens without firing"),
    "dense_frac": ((float,), 0.1, "a latent is dense when it fires on more than this fraction"),
    "l0_coeff": ((float, None), None, "jumprelu only: L0 coefficient, in fractions of variance per latent (required)"),
    "preact_coeff": ((float,), 0.0, "jumprelu: pre-activation penalty reviving latents that never fire (0: off)"),
    "matryoshka_weights": ((list, None), None, "matryoshka: relative weight of each prefix's MSE (default equal)"),
    # optimizer
    "lr": ((float,), 4e-4, "Adam learning rate"),
    "beta1": ((float,), 0.9, "Adam beta1"),
    "beta2": ((float,), 0.999, "Adam beta2"),
    "warmup_steps": ((int,), 0, "linear LR warm-up steps"),
    "lr_decay": ((str,), "constant", "linear | cosine | constant (after warm-up, to final_lr_frac)"),
    "final_lr_frac": ((float,), 0.0, "LR at the end as a fraction of lr (linear, cosine)"),
    "l1_warmup_steps": ((int,), 0, "relu: the L1 coefficient rises linearly from 0 over these steps"),
    "l0_warmup_steps": ((int,), 0, "jumprelu: the L0 coefficient rises linearly from 0 over these steps"),
    "max_grad_norm": ((float, None), 1.0, "clip the gradient norm (null: no clipping)"),
    "b_dec_init": ((str,), "geometric_median", "geometric_median | mean | zero (from the first batch)"),
    # compute recipe of a group: how the step is computed
    "precision": ((str,), "fp32", "fp32 | tf32 (CUDA TF32 matmuls) | bf16 (autocast matmuls, float32 weights)"),
    "decode": ((str,), "auto", "auto | dense | sparse | hybrid: topk variants decode from the k chosen latents"),
    # logistics: do not change the weights, so they are not part of sae_id
    "log_every": ((int,), 100, "metrics every N steps"),
    "ckpt_every": ((int,), 1000, "checkpoint every N steps (and at the end)"),
    "wandb_project": ((str, None), None, "also log to this Weights & Biases project (when installed)"),
    "wandb_entity": ((str, None), None, "Weights & Biases entity"),
    # loader I/O: how the batches are read, never which (the loaders' batches do not depend on them)
    "n_readers": (
        (int, None),
        None,
        "loader reader threads (null: the loader's default, 4)",
    ),
    "cold_read": ((str,), "read", "read | fault: how the shuffled loader reads shard bytes not in the page cache"),
    "prefetch": ((str,), "auto", "auto | whole | heads: the shuffled loader's copy prefetch (auto: it times both)"),
    "batch_timeout_s": (
        (float, None),
        30.0,
        "error when no batch comes and no read finishes for this long (null: wait)",
    ),
}
# Keys of the JumpReLU and Matryoshka objectives: in sae_id only when not at their default, so
# the ids of SAEs configured before these keys existed do not change.
OBJECTIVE_KEYS = (
    "jumprelu_bandwidth",
    "jumprelu_init_threshold",
    "matryoshka_prefixes",
    "l0_coeff",
    "preact_coeff",
    "matryoshka_weights",
    "l0_warmup_steps",
)
JUMPRELU_KEYS = ("jumprelu_bandwidth", "jumprelu_init_threshold", "l0_coeff", "preact_coeff", "l0_warmup_steps")
MATRYOSHKA_KEYS = ("matryoshka_prefixes", "matryoshka_weights")
LOADER_IO = ("n_readers", "cold_read", "batch_timeout_s", "prefetch")
LOGISTICS = ("log_every", "ckpt_every", "wandb_project", "wandb_entity", *LOADER_IO)
# Keys added after group ids were first issued: hashed into group_id only when set to something
# other than their default, so the groups of an existing experiment keep their ids (and the
# workflow does not see their finished training jobs as new).
LATE_GROUP_KEYS = (*LOADER_IO, "precision", "decode")
# Keys added after sae ids were first issued: hashed into sae_id only when not at their default.
# ``decode`` is never hashed: dense and sparse decoding compute the same sums (in another order).
LATE_SAE_KEYS = ("precision", *OBJECTIVE_KEYS)
NOT_IN_SAE_ID = (*LOGISTICS, "decode")
GROUP_KEYS = (
    "layer",
    "patches",
    "batch_size",
    "steps",
    "data_seed",
    "buffer_bytes",
    "scale_norm",
    "deterministic",
    "eval_frac",
    "eval_cache",
    "eval_tokens",
    *LOGISTICS,
    "precision",
    "decode",
)
SECTION_ONLY = ("sweep", "saes")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one SAE's training needs besides the cache (see FIELDS for meanings)."""

    layer: int | None = None
    patches: str = "image"
    batch_size: int = 4096
    steps: int = 1
    data_seed: int = 0
    buffer_bytes: int = 2**30
    scale_norm: bool = False
    deterministic: bool = True
    eval_frac: float = 0.05
    eval_cache: str | None = None
    eval_tokens: int = 1_000_000
    activation: str = "topk"
    width: int | None = None
    exp_factor: float | None = 16.0
    k: int | None = 32
    normalize_decoder: bool | None = None
    seed: int = 0
    dtype: str = "float32"
    threshold_decay: float = 0.99
    jumprelu_bandwidth: float = JUMPRELU_BANDWIDTH
    jumprelu_init_threshold: float = JUMPRELU_INIT
    matryoshka_prefixes: tuple[int, ...] | None = None
    l1_coeff: float | None = None
    aux_coeff: float = 1 / 32
    k_aux: int | None = None
    dead_tokens: int = 10_000_000
    dense_frac: float = 0.1
    l0_coeff: float | None = None
    preact_coeff: float = 0.0
    matryoshka_weights: tuple[float, ...] | None = None
    lr: float = 4e-4
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    lr_decay: str = "constant"
    final_lr_frac: float = 0.0
    l1_warmup_steps: int = 0
    l0_warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    b_dec_init: str = "geometric_median"
    log_every: int = 100
    ckpt_every: int = 1000
    wandb_project: str | None = None
    wandb_entity: str | None = None
    n_readers: int | None = None
    cold_read: str = "read"
    batch_timeout_s: float | None = 30.0
    prefetch: str = "auto"
    precision: str = "fp32"
    decode: str = "auto"

    # -- identity ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ConfigError(f"run config: unknown key(s) {unknown}")
        lists = {k: tuple(doc[k]) for k in MATRYOSHKA_KEYS if isinstance(doc.get(k), list)}  # JSON has no tuples
        return cls(**{**doc, **lists})

    @property
    def sae_id(self) -> str:
        doc = {k: v for k, v in self.to_dict().items()
               if k not in NOT_IN_SAE_ID and (k not in LATE_SAE_KEYS or v != FIELDS[k][1])}  # fmt: skip
        return _hash({"v": ID_VERSION, **doc})[:12]

    @property
    def group_key(self) -> dict:
        return {k: getattr(self, k) for k in GROUP_KEYS}

    @property
    def group_id(self) -> str:
        layer = "auto" if self.layer is None else str(self.layer)
        key = {k: v for k, v in self.group_key.items() if k not in LATE_GROUP_KEYS or v != FIELDS[k][1]}
        return f"L{layer}-{self.patches}-{_hash({'v': ID_VERSION, **key})[:8]}"

    # -- what the trainer builds from it ------------------------------------------------------------
    def sae_config(self, d_vit: int) -> SAEConfig:
        jump = self.activation == "jumprelu"
        return SAEConfig(
            d_vit=d_vit,
            width=self.width,
            exp_factor=self.exp_factor,
            activation=self.activation,
            k=self.k,
            normalize_decoder=self.normalize_decoder,
            seed=self.seed,
            dtype=self.dtype,
            threshold_decay=self.threshold_decay,
            jumprelu_bandwidth=self.jumprelu_bandwidth if jump else None,
            jumprelu_init_threshold=self.jumprelu_init_threshold if jump else None,
            matryoshka_prefixes=self.matryoshka_prefixes if self.activation == "matryoshka" else None,
        )

    @property
    def sparsity_warmup_steps(self) -> int:
        """Warm-up of the sparsity coefficient: l0_warmup_steps (jumprelu), else l1_warmup_steps."""
        return self.l0_warmup_steps if self.activation == "jumprelu" else self.l1_warmup_steps

    def objective_kwargs(self) -> dict:
        kw: dict = {"dead_tokens_threshold": self.dead_tokens, "dense_frac": self.dense_frac}
        if self.activation == "relu":
            kw["l1_coeff"] = self.l1_coeff
        elif self.activation == "jumprelu":
            kw.update(l0_coeff=self.l0_coeff, preact_coeff=self.preact_coeff)
        else:
            kw["aux_coeff"] = self.aux_coeff
            if self.k_aux is not None:
                kw["k_aux"] = self.k_aux
            if self.matryoshka_weights is not None:
                kw["prefix_weights"] = self.matryoshka_weights
        return kw

    def split_images(self, n_imgs: int) -> tuple[int, int]:
        """(n_train, n_eval): training uses images [0, n_train), eval [n_train, n_imgs)."""
        if self.eval_cache is not None or self.eval_frac <= 0:
            return n_imgs, 0
        n_eval = min(n_imgs - 1, max(1, int(math.floor(n_imgs * self.eval_frac))))
        return n_imgs - n_eval, n_eval


def _hash(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- validation ---------------------------------------------------------------------------------

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


# List-valued keys -> the type of their items.
LIST_ITEMS = {"matryoshka_prefixes": int, "matryoshka_weights": float}


def _coerce_list(key: str, v: Any, where: str) -> tuple:
    """A list-valued key (``matryoshka_prefixes: [64, 256]`` is ONE value) -> a tuple of its items."""
    item = LIST_ITEMS[key]
    if not isinstance(v, list | tuple) or not v:
        raise ConfigError(
            f"{where}: key '{key}' must be a non-empty list of {item.__name__} ({FIELDS[key][2]}), got {v!r}"
            + (" (in a sweep: a list of such lists)." if not isinstance(v, list | tuple) else ".")
        )
    out = []
    for x in v:
        if isinstance(x, str) and _FLOAT_RE.match(x.strip().replace("_", "")):
            x = float(x.replace("_", ""))
        if item is int and isinstance(x, float) and x.is_integer():
            x = int(x)
        ok = isinstance(x, int) if item is int else isinstance(x, int | float) and math.isfinite(x)
        if isinstance(x, bool) or not ok:
            raise ConfigError(f"{where}: key '{key}' must be a list of {item.__name__}, got {v!r}.")
        out.append(item(x))
    return tuple(out)


def _coerce(key: str, v: Any, where: str) -> Any:
    types, _, _ = FIELDS[key]
    if list in types and v is not None:
        return _coerce_list(key, v, where)
    if v is None:
        if None in types:
            return None
        raise ConfigError(f"{where}: key '{key}' may not be null ({FIELDS[key][2]}).")
    if (float in types or int in types) and isinstance(v, str) and _FLOAT_RE.match(v.strip().replace("_", "")):
        v = float(v.replace("_", ""))  # YAML 1.1 reads 3e-4 and 1e8 as strings
    if int in types and float not in types and isinstance(v, float) and v.is_integer():
        v = int(v)  # n_tokens: 1.0e8
    if isinstance(v, bool):
        if bool in types:
            return v
    elif isinstance(v, int) and int in types:
        return v
    elif isinstance(v, int | float) and float in types:
        if not math.isfinite(v):
            raise ConfigError(f"{where}: key '{key}' must be a finite number, got {v!r}.")
        return float(v)
    elif isinstance(v, str) and str in types:
        return v
    names = " or ".join("null" if t is None else t.__name__ for t in types)
    raise ConfigError(f"{where}: key '{key}' must be {names} ({FIELDS[key][2]}), got {v!r} ({type(v).__name__}).")


def _check_keys(d: dict, where: str, allowed: set[str]) -> None:
    unknown = [k for k in d if k not in allowed]
    if unknown:
        close = [k for k in FIELDS if k.replace("_", "") == str(unknown[0]).replace("_", "").lower()]
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{where}: unknown key '{unknown[0]}'.{hint} Allowed: {', '.join(sorted(allowed))} "
            "(actcache.sae.config.FIELDS documents each)."
        )


def _sweep(doc: Any, where: str) -> dict[str, list]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: must be a mapping of key -> list of values, got {type(doc).__name__}.")
    _check_keys(doc, where, set(FIELDS))
    out = {}
    for key, vals in doc.items():
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{where}: key '{key}' must be a non-empty list of values, got {vals!r}.")
        out[key] = [_coerce(key, v, f"{where}.{key}") for v in vals]
    return out


def _positive(d: dict, where: str) -> None:
    def bad(key, what):
        raise ConfigError(f"{where}: key '{key}' {what}, got {d[key]!r}.")

    for key in ("batch_size", "buffer_bytes", "eval_tokens", "dead_tokens", "log_every", "ckpt_every"):
        if d[key] < 1:
            bad(key, "must be >= 1")
    for key in ("steps", "n_tokens", "width", "k", "k_aux"):
        if d.get(key) is not None and d[key] < 1:
            bad(key, "must be >= 1")
    for key in ("data_seed", "seed", "warmup_steps", "l1_warmup_steps", "l0_warmup_steps"):
        if d[key] < 0:
            bad(key, "must be >= 0")
    if not 0.0 <= d["eval_frac"] < 1.0:
        bad("eval_frac", "must be in [0, 1)")
    if d["lr"] <= 0:
        bad("lr", "must be > 0")
    for key in ("beta1", "beta2", "threshold_decay"):
        if not 0.0 <= d[key] < 1.0:
            bad(key, "must be in [0, 1)")
    if not 0.0 < d["dense_frac"] < 1.0:
        bad("dense_frac", "must be in (0, 1)")
    if not 0.0 <= d["final_lr_frac"] <= 1.0:
        bad("final_lr_frac", "must be in [0, 1]")
    for key in ("aux_coeff", "l1_coeff", "l0_coeff", "preact_coeff"):
        if d.get(key) is not None and d[key] < 0:
            bad(key, "must be >= 0")
    for key in ("jumprelu_bandwidth", "jumprelu_init_threshold"):
        if d[key] <= 0:
            bad(key, "must be > 0")
    if d["matryoshka_weights"] is not None and (min(d["matryoshka_weights"]) < 0 or sum(d["matryoshka_weights"]) <= 0):
        bad("matryoshka_weights", "must be numbers >= 0, not all 0")
    if d["n_readers"] is not None and d["n_readers"] < 1:
        bad("n_readers", "must be >= 1 (or null for the loader's default)")
    if d["batch_timeout_s"] is not None and d["batch_timeout_s"] <= 0:
        bad("batch_timeout_s", "must be > 0 (or null to wait without limit)")
    if d["max_grad_norm"] is not None and d["max_grad_norm"] <= 0:
        bad("max_grad_norm", "must be > 0 (or null for no clipping)")
    if d["exp_factor"] is not None and d["exp_factor"] <= 0:
        bad("exp_factor", "must be > 0")
    for key, allowed in (
        ("patches", PATCHES),
        ("activation", ACTIVATIONS),
        ("dtype", tuple(DTYPES)),
        ("lr_decay", DECAYS),
        ("b_dec_init", B_DEC_INITS),
        ("cold_read", COLD_READS),
        ("prefetch", ("auto", *PREFETCH_SCHEMES)),
        ("precision", PRECISIONS),
        ("decode", DECODES),
    ):
        if d[key] not in allowed:
            bad(key, f"must be one of {', '.join(allowed)}")


def _check_objective_keys(d: dict, where: str) -> None:
    """JumpReLU / Matryoshka keys: set only for their activation; the required ones given."""
    act = d["activation"]
    for keys, owner in ((JUMPRELU_KEYS, "jumprelu"), (MATRYOSHKA_KEYS, "matryoshka")):
        if act != owner:
            for key in keys:
                if d[key] != FIELDS[key][1]:
                    raise ConfigError(f"{where}: key '{key}' is only for activation {owner}, not {act}; remove it.")
    if act == "jumprelu" and d["l0_coeff"] is None:
        raise ConfigError(f"{where}: activation jumprelu needs 'l0_coeff' (the L0 sparsity coefficient).")
    if act != "matryoshka":
        return
    p, w = d["matryoshka_prefixes"], d["matryoshka_weights"]
    if p is not None and (any(b <= a for a, b in zip(p, p[1:], strict=False)) or p[0] < 1):
        raise ConfigError(f"{where}: key 'matryoshka_prefixes' = {list(p)} must be increasing sizes >= 1.")
    if p is not None and d["width"] is not None and p[-1] != d["width"]:
        raise ConfigError(
            f"{where}: key 'matryoshka_prefixes' = {list(p)} must end with the width {d['width']}; append it."
        )
    if w is not None and len(w) != (1 if p is None else len(p)):
        n = 1 if p is None else len(p)
        raise ConfigError(f"{where}: key 'matryoshka_weights' has {len(w)} values for {n} prefixes; give one each.")


def _finish(d: dict, where: str, layers: tuple[int, ...] | None, d_vit: int | None) -> RunConfig:
    """Defaults applied, values coerced -> a checked RunConfig."""
    _positive(d, where)
    if d["steps"] is not None and d["n_tokens"] is not None:
        raise ConfigError(f"{where}: give 'steps' or 'n_tokens', not both.")
    if d["steps"] is None and d["n_tokens"] is None:
        raise ConfigError(f"{where}: missing the training length: give 'steps' or 'n_tokens'.")
    steps = d.pop("steps")
    n_tokens = d.pop("n_tokens")
    d["steps"] = steps if steps is not None else -(-n_tokens // d["batch_size"])
    if d["warmup_steps"] > d["steps"]:
        raise ConfigError(f"{where}: key 'warmup_steps' = {d['warmup_steps']} exceeds the {d['steps']} training steps.")
    if d["width"] is None and d["exp_factor"] is None:
        d["exp_factor"] = 16.0
    _check_objective_keys(d, where)
    if d["activation"] in NO_K:
        if d["k"] is not None:
            raise ConfigError(
                f"{where}: key 'k' is only for activation topk/batchtopk/matryoshka, not {d['activation']}; remove it."
            )
        if d["activation"] == "relu" and d["l1_coeff"] is None:
            raise ConfigError(f"{where}: activation relu needs 'l1_coeff' (the L1 sparsity coefficient).")
    else:
        if d["l1_coeff"] is not None:
            raise ConfigError(f"{where}: key 'l1_coeff' is only for activation relu, not {d['activation']}.")
        if d["k"] is None:
            d["k"] = 32
        if d["width"] is not None and d["k"] > d["width"]:
            raise ConfigError(f"{where}: key 'k' = {d['k']} is larger than the width {d['width']}; need k <= width.")
    if layers is not None and d["layer"] is not None and d["layer"] not in layers:
        raise ConfigError(f"{where}: key 'layer' = {d['layer']} is not one of the experiment's layers {list(layers)}.")
    if layers is not None and d["layer"] is None and len(layers) != 1:
        raise ConfigError(f"{where}: key 'layer' is required: the experiment records layers {list(layers)}.")
    run = RunConfig(**d)
    if d_vit is not None:
        try:  # the model's own checks (k <= width from exp_factor, integral width)
            run.sae_config(d_vit)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    return run


def expand_train_section(
    train: dict | None, where: str, *, layers: tuple[int, ...] | None = None, d_vit: int | None = None
) -> list[RunConfig]:
    """The experiment's ``train:`` mapping -> one RunConfig per SAE (order as written).

    ``where`` names the file in errors ("config/experiments/x.yaml", or "...yaml: train"). ``layers``/``d_vit``, when
    known, add checks (layer recorded, k <= width from exp_factor). An empty/missing section -> [].
    """
    if train is None:
        return []
    if not where.rstrip().endswith("train"):
        where = f"{where}: train"
    if not isinstance(train, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(train).__name__}.")
    _check_keys(train, where, set(FIELDS) | set(SECTION_ONLY))
    defaults = {k: _coerce(k, v, where) for k, v in train.items() if k not in SECTION_ONLY}
    section_sweep = _sweep(train.get("sweep"), f"{where}.sweep")
    entries = train.get("saes")
    if entries is None:
        entries = [{}]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}.saes: must be a non-empty list of mappings, got {entries!r}.")
    runs: list[RunConfig] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        ew = f"{where}.saes[{i}]" if "saes" in train else where
        if not isinstance(entry, dict):
            raise ConfigError(f"{ew}: must be a mapping of keys, got {entry!r}.")
        _check_keys(entry, ew, set(FIELDS) | {"sweep"})
        fixed = {k: _coerce(k, v, ew) for k, v in entry.items() if k != "sweep"}
        own_sweep = _sweep(entry.get("sweep"), f"{ew}.sweep")
        for a, b, name in (
            (fixed, own_sweep, "its own sweep"),
            (fixed, section_sweep, "train.sweep"),
            (own_sweep, section_sweep, "train.sweep"),
        ):
            both = sorted(set(a) & set(b))
            if both:
                raise ConfigError(f"{ew}: key '{both[0]}' is set both here and in {name}; set it in one place.")
        grid = {**section_sweep, **own_sweep}
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            point = dict(zip(keys, combo, strict=True))
            label = ew + (f" (sweep point {point})" if point else "")
            d = {k: spec[1] for k, spec in FIELDS.items()}
            d.update(defaults)
            d.update(fixed)
            d.update(point)
            run = _finish(d, label, layers, d_vit)
            if run.sae_id in seen:
                raise ConfigError(f"{label}: the same SAE as {seen[run.sae_id]} (sae-id {run.sae_id}); remove one.")
            seen[run.sae_id] = label
            runs.append(run)
    return runs


def groups(runs: list[RunConfig]) -> dict[str, list[RunConfig]]:
    """group id -> the runs that share one loader pass, in first-appearance order."""
    out: dict[str, list[RunConfig]] = {}
    for run in runs:
        out.setdefault(run.group_id, []).append(run)
    return out
