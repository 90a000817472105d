"""The ``train:`` section of an experiment YAML -> a list of frozen :class:`RunConfig` (one per SAE).

    train:
      layer: -2              # every key at this level is a default for every SAE
      batch_size: 4096
      n_tokens: 100_000_000  # or steps: N (steps = ceil(n_tokens / batch_size))
      sweep:                 # every list expands into a grid (product over keys) ...
        lr: [1.0e-4, 4.0e-4]
      saes:                  # ... crossed with each entry (optional; merged over the defaults)
        - {activation: topk, exp_factor: 16, sweep: {k: [16, 32, 64]}}
        - {activation: relu, width: 8192, sweep: {l1_coeff: [1.0e-4, 1.0e-3]}}
      # -> 2 x (3 + 2) = 10 SAEs, one group (same layer, patches, batch size, length): one data pass

A key set by more than one of (entry, entry sweep, section sweep) is an error.
Each key is declared once, as a field of :class:`RunConfig` (or :class:`TrainSection`) with
:func:`actcache.keys.key`: type, default, scope (``group``: SAEs of a group agree on it; ``sae``;
``logging`` and ``loader``: group keys that never change the weights, so not hashed), help and
checks. To add a key, add one field; give it ``late=True`` so that it enters sae_id and group_id
only when set to something other than its default, and no existing id changes. ``compute`` keys
(precision, decode, batch_saes) set how a group's steps are computed. A list-valued key
(``matryoshka_prefixes: [64, 256]``) is one value; in ``sweep:`` give a list of such lists.

Identity
- ``RunConfig.sae_id``: 12 hex of the sha256 of every hashed key (all but :data:`LOGISTICS`), as
  written (``layer: null`` is not resolved), so ids never need the cache.
- ``RunConfig.group_id``: SAEs with equal :data:`GROUP_KEYS` train together on the batches of ONE
  loader pass (``actcache train --group G``); e.g. ``L-2-image-1a2b3c4d``. Its hash takes the
  :data:`JOB_ONLY_KEYS` (logging, loader) at their defaults, so editing ``log_every`` or
  ``n_readers`` reruns nothing.

Each SAE trains into ``<runs_to>/<HASH>/<sae-id>/``; actcache.rundir owns that layout and its file names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from typing import Any

from actcache.errors import ConfigError
from actcache.keys import Decl, ListOf, check_keys, coerce, declared, key
from actcache.loaders.options import COLD_READS, DEFAULT_VERIFY_READS, PATCHES, PREFETCH_SCHEMES, VERIFY_READS
from actcache.sae.spec import (
    ACTIVATIONS,
    BATCH_MODES,
    DECAYS,
    DECODES,
    NO_K,
    PARAM_DTYPES,
    PRECISIONS,
    SAEConfig,
)  # fmt: skip

ID_VERSION = 1
B_DEC_INITS = ("geometric_median", "mean", "zero")
ENC_INITS = ("fit", "tied")  # topk variants (SAE.fit_encoder_scale_); relu and jumprelu start tied
DEC_INIT_FRAC = 0.25  # dec_init_frac at null (SAE.init_decoder_from_data_)


def _group(default, help, **kw):  # the data stream: SAEs of one group share it
    return key(default, help, scope="group", **kw)


def _sae(default, help, **kw):  # one SAE's model, objective and optimizer
    return key(default, help, scope="sae", **kw)


def _logging(default, help, **kw):  # how a group reports: never the weights
    return key(default, help, scope="logging", hashed=False, **kw)


def _loader(default, help, **kw):  # how the batches are read, never which
    return key(default, help, scope="loader", hashed=False, late=True, **kw)


def _compute(default, help, **kw):  # how a group's steps are computed
    return key(default, help, scope="compute", late=True, **kw)


MAX_COEFF = 1e4  # loss coefficients and weights: sparsity penalties in use are below 100
MAX_TRAIN_BYTES = 192 * 2**30  # the stated cap at plan time: the memory of the largest accelerator in use (B200, MI300X)


def _objective(default, help, **kw):  # JumpReLU / Matryoshka keys, added after ids were issued
    return _sae(default, help, late=True, **kw)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one SAE's training needs besides the cache: every train key, declared once."""

    layer: int | None = _group(None, "recorded layer value; null = the cache's only layer")
    patches: str = _group("image", "which tokens are examples", choices=PATCHES)
    batch_size: int = _group(4096, "examples per optimizer step (global, over all ranks)", ge=1)
    steps: int = _group(1, "optimizer steps; a train section gives steps or n_tokens", ge=1, example=1000)
    data_seed: int = _group(0, "shuffle seed of the loader", ge=0)
    buffer_bytes: int = _group(2**30, "shuffle buffer of the loader", ge=1)
    scale_norm: bool = _group(False, "loader scales activations to mean norm sqrt(d)")
    deterministic: bool = _group(True, "loader yields batches in plan order (exact resume); false: as ready")
    eval_frac: float = _group(
        0.05, "fraction of images held out for eval: seeded random, stratified by label, never trained on", ge=0, lt=1
    )
    eval_cache: str | None = _group(None, "evaluate on this other cache directory instead (eval_frac ignored)")
    eval_tokens: int = _group(1_000_000, "at most this many held-out examples are evaluated", ge=1)
    activation: str = _sae("topk", "the SAE's activation", choices=ACTIVATIONS)
    width: int | None = _sae(None, "number of latents (null: from exp_factor)", ge=1, le=2**24, example=16384)
    exp_factor: float | None = _sae(16.0, "width = d_vit * exp_factor (null when width is given)", gt=0, le=4096)
    k: int | None = _sae(32, "latents per example (topk, batchtopk, matryoshka; null for relu, jumprelu)", ge=1)
    normalize_decoder: bool | None = _sae(None, "unit-norm decoder rows (null: true for every activation but relu)", example=True)
    seed: int = _sae(0, "SAE init seed", ge=0)
    dtype: str = _sae("float32", "parameter dtype", choices=PARAM_DTYPES)
    threshold_decay: float = _sae(0.99, "batchtopk, matryoshka: inference threshold EMA decay", ge=0, lt=1)
    jumprelu_bandwidth: float | None = _objective(
        None, "jumprelu: straight-through kernel width, absolute (null: 2.8 x the first batch's RMS pre-activation)",
        gt=0, example=0.5,
    )
    jumprelu_init_threshold: float | None = _objective(
        None, "jumprelu: initial threshold of every latent, absolute (null: 2.8 x the first batch's RMS "
        "pre-activation)", gt=0, example=0.5,
    )
    matryoshka_prefixes: tuple[int, ...] | None = _objective(
        None, "matryoshka: nested prefix sizes, increasing, the last = the width", ge=1, example=(64, 256, 1024)
    )
    l1_coeff: float | None = _sae(None, "relu only: L1 coefficient (required for relu)", ge=0, le=MAX_COEFF,
                                  example=0.001)  # fmt: skip
    aux_coeff: float = _sae(1 / 32, "topk variants: AuxK coefficient", ge=0, le=MAX_COEFF)
    k_aux: int | None = _sae(None, "topk variants: AuxK latents (null: d_vit // 2)", ge=1, example=512)
    dead_tokens: int = _sae(10_000_000, "a latent is dead after this many tokens without firing (metrics)", ge=1)
    aux_tokens: int | None = _sae(
        None, "topk variants, jumprelu: a latent joins the AuxK term after this many tokens without firing "
        "(null: batchtopk, matryoshka 80 x width; jumprelu 16 x width; topk dead_tokens)", ge=1, late=True, example=40960,
    )
    dense_frac: float = _sae(0.1, "a latent is dense when it fires on more than this fraction", gt=0, lt=1)
    l0_coeff: float | None = _objective(
        None, "jumprelu only (required): L0 coefficient, in fractions of variance per latent", ge=0, le=MAX_COEFF,
        example=0.01,
    )
    preact_coeff: float = _objective(0.0, "jumprelu: pre-activation penalty reviving latents that never fire", ge=0,
                                     le=MAX_COEFF)  # fmt: skip
    jumprelu_aux_coeff: float = _objective(
        1.0, "jumprelu: AuxK coefficient on the latents quiet for aux_tokens tokens, in fractions of "
        "variance (0: off)", ge=0, le=MAX_COEFF, example=1.0,
    )
    matryoshka_weights: tuple[float, ...] | None = _objective(
        None, "matryoshka: relative weight of each prefix's MSE (null: equal)", ge=0, le=MAX_COEFF, example=(1.0, 1.0, 1.0)
    )
    lr: float = _sae(4e-4, "Adam learning rate", gt=0, le=1)
    beta1: float = _sae(0.9, "Adam beta1", ge=0, lt=1)
    beta2: float = _sae(0.999, "Adam beta2", ge=0, lt=1)
    warmup_steps: int = _sae(0, "linear LR warm-up steps", ge=0)
    lr_decay: str = _sae("constant", "after warm-up, to final_lr_frac", choices=DECAYS)
    final_lr_frac: float = _sae(0.0, "LR at the end as a fraction of lr (linear, cosine)", ge=0, le=1)
    l1_warmup_steps: int = _sae(0, "relu: the L1 coefficient rises linearly from 0 over these steps", ge=0)
    l0_warmup_steps: int = _objective(0, "jumprelu: the L0 coefficient rises linearly from 0 over these steps", ge=0)
    max_grad_norm: float | None = _sae(1.0, "clip the gradient norm (null: no clipping)", gt=0)
    b_dec_init: str = _sae("geometric_median", "decoder bias from the first batch", choices=B_DEC_INITS)
    enc_init: str | None = _sae(
        None, "topk variants: encoder init, tied (W_enc = W_dec^T) or fit (tied, scaled to the first batch's "
        "least-squares factor); null: fit", choices=ENC_INITS, late=True,
    )
    dec_init_frac: float | None = _sae(
        None, "topk variants: fraction of decoder rows that start at centred examples of the first batch, the "
        "rest random (null: 0.25; 0: all random)", ge=0, le=1, late=True, example=0.25,
    )
    precision: str = _compute("fp32", "fp32 | tf32 (CUDA TF32 matmuls) | bf16 (autocast matmuls, float32 weights)",
                              choices=PRECISIONS)  # fmt: skip
    decode: str = _compute("auto", "topk variants: sparse (gather the k chosen latents), hybrid (sparse forward, matmul weight gradients), dense",
                           choices=DECODES, hashed=False)  # fmt: skip
    batch_saes: str = _compute("auto", "SAEs of equal shape step as one batched module (bmm): on | off | auto (where measured faster: nowhere yet)",
                               choices=BATCH_MODES, hashed=False)  # fmt: skip
    log_every: int = _logging(100, "metrics every N steps", ge=1)
    ckpt_every: int = _logging(1000, "checkpoint every N steps (and at the end)", ge=1)
    keep_checkpoints: int = _logging(
        2, "keep the newest N checkpoints (a damaged newest one falls back to the one before)", ge=1, late=True
    )
    wandb_project: str | None = _logging(None, "also log to this Weights & Biases project (when installed)")
    wandb_entity: str | None = _logging(None, "Weights & Biases entity")
    n_readers: int | None = _loader(None, "loader reader threads (null: the loader's default, 4)", ge=1, example=4)
    cold_read: str = _loader(
        "read", "how the shuffled loader reads shard bytes not in the page cache", choices=COLD_READS
    )
    batch_timeout_s: float | None = _loader(
        30.0, "error when no batch comes and no read finishes for this long (null: wait)", gt=0
    )
    prefetch: str = _loader(
        "auto", "the shuffled loader's copy prefetch (auto: it times both)", choices=("auto", *PREFETCH_SCHEMES)
    )
    verify_reads: str = _loader(
        DEFAULT_VERIFY_READS,
        "first: check each checksum block of the cache the first time a process reads it (a flipped bit is an "
        "error, not wrong rows); off: do not",
        choices=VERIFY_READS,
    )

    # -- identity ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise ConfigError(f"run config: unknown key(s) {unknown}")
        lists = {k: tuple(v) for k, v in doc.items() if isinstance(v, list)}  # JSON has no tuples
        return cls(**{**doc, **lists})

    @property
    def sae_id(self) -> str:
        doc = {k: v for k, v in self.to_dict().items() if RUN_KEYS[k].key.hashed and not _late_default(k, v)}
        return _hash({"v": ID_VERSION, **doc})[:12]

    @property
    def group_key(self) -> dict:
        return {k: getattr(self, k) for k in GROUP_KEYS}

    @property
    def group_id(self) -> str:
        # Logging and loader keys (never the weights nor the batches) are hashed at their defaults:
        # editing one keeps the group's id, so no job reruns; ids issued with the defaults stay.
        layer = "auto" if self.layer is None else str(self.layer)
        key = {k: RUN_KEYS[k].default if k in JOB_ONLY_KEYS else v for k, v in self.group_key.items()}
        key = {k: v for k, v in key.items() if not _late_default(k, v)}
        return f"L{layer}-{self.patches}-{_hash({'v': ID_VERSION, **key})[:8]}"

    # -- what people read beside the id ----------------------------------------------------------
    def sparsity(self) -> dict:
        """The objective's sparsity setting: k (TopK variants), else its penalty coefficient."""
        if self.activation == "jumprelu":
            return {"l0_coeff": self.l0_coeff}
        if self.activation == "relu":
            return {"l1_coeff": self.l1_coeff}
        return {"k": self.k}

    def resolved_width(self, d_vit: int | None = None) -> int | None:
        """Its number of latents; None when only exp_factor is given and d_vit is unknown."""
        if self.width is not None or self.exp_factor is None or d_vit is None:
            return self.width
        return round(d_vit * self.exp_factor)

    def describe(self, d_vit: int | None = None) -> dict:
        """What an SAE is, for plans, menus and logs: objective, k or coefficient, width, layer."""
        width = self.resolved_width(d_vit)
        doc = {"objective": self.activation, **self.sparsity(), "width": width, "layer": self.layer}
        if width is None:
            doc["exp_factor"] = self.exp_factor
        if self.activation == "matryoshka" and self.matryoshka_prefixes:
            doc["prefixes"] = list(self.matryoshka_prefixes)
        return doc

    def title(self, d_vit: int | None = None) -> str:
        """One line, e.g. ``topk k=32 width=16384 layer -2``."""
        doc = {k: v for k, v in self.describe(d_vit).items() if v is not None}
        layer = doc.pop("layer", "auto")
        words = [doc.pop("objective")]
        for name, v in doc.items():
            words.append(f"{name}={','.join(map(str, v)) if isinstance(v, list) else format(v, 'g')}")
        return " ".join([*words, f"layer {layer}"])

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
    def encoder_init(self) -> str:
        """How the trainer sets W_enc at step 0: "fit" (SAE.fit_encoder_scale_) or "tied" (as built)."""
        if self.activation in NO_K:
            return "tied"
        return self.enc_init or "fit"

    @property
    def decoder_data_frac(self) -> float:
        """The fraction of decoder rows the trainer starts at data (SAE.init_decoder_from_data_)."""
        if self.activation in NO_K:
            return 0.0
        return DEC_INIT_FRAC if self.dec_init_frac is None else self.dec_init_frac

    @property
    def sparsity_warmup_steps(self) -> int:
        """Warm-up of the sparsity coefficient: l0_warmup_steps (jumprelu), else l1_warmup_steps."""
        return self.l0_warmup_steps if self.activation == "jumprelu" else self.l1_warmup_steps

    def objective_kwargs(self) -> dict:
        kw: dict = {"dead_tokens_threshold": self.dead_tokens, "dense_frac": self.dense_frac}
        if self.activation == "relu":
            kw["l1_coeff"] = self.l1_coeff
        elif self.activation == "jumprelu":
            kw.update(l0_coeff=self.l0_coeff, preact_coeff=self.preact_coeff, aux_coeff=self.jumprelu_aux_coeff,
                      aux_tokens=self.aux_tokens)
        else:
            kw.update(aux_coeff=self.aux_coeff, aux_tokens=self.aux_tokens)
            if self.k_aux is not None:
                kw["k_aux"] = self.k_aux
            if self.matryoshka_weights is not None:
                kw["prefix_weights"] = self.matryoshka_weights
        return kw


def _hash(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """Keys of a ``train:`` section that are not RunConfig fields: they expand into RunConfigs."""

    n_tokens: int | None = _group(None, "training examples; steps = ceil(n_tokens / batch_size)", ge=1, example=10**8)
    sweep: dict | None = key(
        None, "grid: key -> list of values (section level, or in an entry of saes)", scope="section"
    )
    saes: list | None = key(None, "SAE variants, each merged over the section's defaults", scope="section")


RUN_KEYS: dict[str, Decl] = declared(RunConfig)
TRAIN_KEYS: dict[str, Decl] = {**RUN_KEYS, "n_tokens": declared(TrainSection)["n_tokens"]}
# key -> (allowed types, default, help): a view of the declarations.
FIELDS: dict[str, tuple[tuple, Any, str]] = {n: (d.types, d.default, d.key.help) for n, d in TRAIN_KEYS.items()}
LOADER_IO = tuple(n for n, d in RUN_KEYS.items() if d.key.scope == "loader")
LOGISTICS = tuple(n for n, d in RUN_KEYS.items() if not d.key.hashed)
GROUP_KEYS = tuple(n for n, d in RUN_KEYS.items() if d.key.scope != "sae")
JOB_ONLY_KEYS = tuple(n for n, d in RUN_KEYS.items() if d.key.scope in ("logging", "loader"))
LATE_GROUP_KEYS = tuple(n for n in GROUP_KEYS if RUN_KEYS[n].key.late)
SECTION_ONLY = ("sweep", "saes")


def _late_default(name: str, value: Any) -> bool:
    """A late key at its default is left out of ids, so ids issued before it existed still hold."""
    decl = RUN_KEYS[name]
    return decl.key.late and value == decl.default


# ---- validation ---------------------------------------------------------------------------------


def _sweep(doc: Any, where: str) -> dict[str, list]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: must be a mapping of key -> list of values, got {type(doc).__name__}.")
    check_keys(doc, TRAIN_KEYS, where, retired=RETIRED_KEYS)
    out = {}
    for name, vals in doc.items():
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{where}: key '{name}' must be a non-empty list of values, got {vals!r}.")
        if any(isinstance(t, ListOf) for t in TRAIN_KEYS[name].types) and not all(isinstance(v, list) for v in vals):
            raise ConfigError(
                f"{where}: key '{name}' takes a list as ONE value, so its sweep is a list of such lists, "
                f"got {vals!r}; e.g. `{name}: [[64, 256], [128, 256]]`."
            )
        out[name] = [coerce(TRAIN_KEYS[name], v, where) for v in vals]
    return out


def _length(d: dict, given: set, where: str) -> None:
    """``steps`` from ``steps`` or ``n_tokens`` (exactly one of them given)."""
    steps = d["steps"] if "steps" in given else None
    n_tokens = d.pop("n_tokens")
    if steps is not None and n_tokens is not None:
        raise ConfigError(f"{where}: give 'steps' or 'n_tokens', not both.")
    if steps is None and n_tokens is None:
        raise ConfigError(f"{where}: missing the training length: give 'steps' or 'n_tokens'.")
    d["steps"] = steps if steps is not None else -(-n_tokens // d["batch_size"])
    if d["warmup_steps"] > d["steps"]:
        raise ConfigError(f"{where}: key 'warmup_steps' = {d['warmup_steps']} exceeds the {d['steps']} training steps.")


def _model(d: dict, given: set, where: str) -> None:
    """Keys that do not apply become null: exp_factor beside a width, k for relu."""
    if "exp_factor" not in given and d["width"] is not None:
        d["exp_factor"] = None
    if d["width"] is None and d["exp_factor"] is None:
        d["exp_factor"] = RUN_KEYS["exp_factor"].default
    _objective_keys(d, where)
    if d["activation"] in NO_K:
        for name in ("enc_init", "dec_init_frac"):
            if d[name] is not None:
                raise ConfigError(
                    f"{where}: key '{name}' is only for activation topk/batchtopk/matryoshka, not {d['activation']}; "
                    "remove it."
                )
        if "k" in given and d["k"] is not None:
            raise ConfigError(
                f"{where}: key 'k' is only for activation topk/batchtopk/matryoshka, not {d['activation']}; remove it."
            )
        d["k"] = None
        if d["activation"] == "relu" and d["l1_coeff"] is None:
            raise ConfigError(f"{where}: activation relu needs 'l1_coeff' (the L1 sparsity coefficient).")
        if d["activation"] == "jumprelu" and d["l1_coeff"] is not None:
            raise ConfigError(f"{where}: key 'l1_coeff' is only for activation relu, not jumprelu.")
        return
    if d["l1_coeff"] is not None:
        raise ConfigError(f"{where}: key 'l1_coeff' is only for activation relu, not {d['activation']}.")
    if d["k"] is None:
        d["k"] = RUN_KEYS["k"].default
    if d["width"] is not None and d["k"] > d["width"]:
        raise ConfigError(f"{where}: key 'k' = {d['k']} is larger than the width {d['width']}; need k <= width.")


RETIRED_KEYS = {  # keys a release dropped: what to write instead
    "revive_coeff": "jumprelu's quiet latents now get an AuxK term, on by default (jumprelu_aux_coeff, "
    "aux_tokens); delete the key",
}
JUMPRELU_KEYS = ("jumprelu_bandwidth", "jumprelu_init_threshold", "l0_coeff", "preact_coeff", "jumprelu_aux_coeff",
                 "l0_warmup_steps")
MATRYOSHKA_KEYS = ("matryoshka_prefixes", "matryoshka_weights")


def _objective_keys(d: dict, where: str) -> None:
    """JumpReLU / Matryoshka keys: set only for their activation; the required ones given."""
    act = d["activation"]
    for keys, owner in ((JUMPRELU_KEYS, "jumprelu"), (MATRYOSHKA_KEYS, "matryoshka")):
        if act != owner:
            for name in keys:
                if d[name] != RUN_KEYS[name].default:
                    raise ConfigError(f"{where}: key '{name}' is only for activation {owner}, not {act}; remove it.")
    if act == "jumprelu" and d["l0_coeff"] is None:
        raise ConfigError(f"{where}: activation jumprelu needs 'l0_coeff' (the L0 sparsity coefficient).")
    if act == "relu" and d["aux_tokens"] is not None:
        raise ConfigError(f"{where}: key 'aux_tokens' is only for the activations with an AuxK term (topk, batchtopk, "
                          "matryoshka, jumprelu), not relu; remove it.")
    if act != "matryoshka":
        return
    p, w = d["matryoshka_prefixes"], d["matryoshka_weights"]
    if p is not None and any(b <= a for a, b in zip(p, p[1:], strict=False)):
        raise ConfigError(f"{where}: key 'matryoshka_prefixes' = {list(p)} must be increasing sizes >= 1.")
    if p is not None and d["width"] is not None and p[-1] != d["width"]:
        raise ConfigError(
            f"{where}: key 'matryoshka_prefixes' = {list(p)} must end with the width {d['width']}; append it."
        )
    n = 1 if p is None else len(p)
    if w is not None and len(w) != n:
        raise ConfigError(f"{where}: key 'matryoshka_weights' has {len(w)} values for {n} prefixes; give one each.")
    if w is not None and sum(w) <= 0:
        raise ConfigError(f"{where}: key 'matryoshka_weights' = {list(w)} must not be all 0.")


def _finish(given: dict, where: str, layers: tuple[int, ...] | None, d_vit: int | None) -> RunConfig:
    """Checked values as written (later layers win) -> defaults applied -> a checked RunConfig."""
    d = {name: decl.default for name, decl in TRAIN_KEYS.items()} | given
    _length(d, set(given), where)
    _model(d, set(given), where)
    if layers is not None and d["layer"] is not None and d["layer"] not in layers:
        raise ConfigError(f"{where}: key 'layer' = {d['layer']} is not one of the experiment's layers {list(layers)}.")
    if layers is not None and d["layer"] is None and len(layers) != 1:
        raise ConfigError(f"{where}: key 'layer' is required: the experiment records layers {list(layers)}.")
    run = RunConfig(**d)
    if d_vit is not None:
        try:  # the model's own checks (k <= width from exp_factor, integral width)
            cfg = run.sae_config(d_vit)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        check_fits(cfg, MAX_TRAIN_BYTES, "the largest device actcache plans for", where)
    return run


def check_fits(cfg, limit: int, device: str, where: str, error_cls: type[ConfigError] = ConfigError) -> None:
    """Refuse an SAE whose training memory (SAEConfig.train_bytes) exceeds ``limit`` bytes of ``device``."""
    need = cfg.train_bytes
    if need > limit:
        raise error_cls(
            f"{where}: an SAE of width {cfg.width:,} on d_vit {cfg.d_vit} needs {need / 2**30:,.1f} GiB to train "
            f"(weights, gradients and Adam's two moments: 4 x {cfg.n_params:,} {cfg.dtype} parameters), more than the "
            f"{limit / 2**30:,.0f} GiB of {device}; lower width or exp_factor."
        )


def _values(doc: dict, where: str, skip: tuple) -> dict:
    return {name: coerce(TRAIN_KEYS[name], v, where) for name, v in doc.items() if name not in skip}


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
    check_keys(train, {*TRAIN_KEYS, *SECTION_ONLY}, where, retired=RETIRED_KEYS)
    defaults = _values(train, where, SECTION_ONLY)
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
        check_keys(entry, {*TRAIN_KEYS, "sweep"}, ew, retired=RETIRED_KEYS)
        fixed = _values(entry, ew, ("sweep",))
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
            run = _finish({**defaults, **fixed, **point}, label, layers, d_vit)
            if run.sae_id in seen:
                raise ConfigError(f"{label}: the same SAE as {seen[run.sae_id]} (sae-id {run.sae_id}); remove one.")
            seen[run.sae_id] = label
            runs.append(run)
    return runs


def groups(runs: list[RunConfig]) -> dict[str, list[RunConfig]]:
    """group id -> the runs that share one loader pass, in first-appearance order."""
    out: dict[str, list[RunConfig]] = {}
    for run in runs:
        members = out.setdefault(run.group_id, [])
        if members:
            _check_same_logistics(members[0], run)
        members.append(run)
    return out


def _check_same_logistics(first: RunConfig, run: RunConfig) -> None:
    """SAEs of one group share one job: a logging or loader key (left out of group_id) has one value."""
    for name in JOB_ONLY_KEYS:
        if getattr(first, name) != getattr(run, name):
            raise ConfigError(
                f"train: SAEs {first.sae_id} and {run.sae_id} train in one group ({run.group_id}) but set "
                f"'{name}' to {getattr(first, name)!r} and {getattr(run, name)!r}; it is one value per group: "
                f"set it once at the train: level, not in sweep: or saes:."
            )
