"""What an SAE is (``SAEConfig``: shape and activation) and the choices of the SAE's config keys,
without torch: the workflow plans its jobs with these (``sae/config.py``), and Snakemake plans
again for every dry run and every cluster job, so planning must not pay for importing torch.
``modeling.py`` builds the SAE from an ``SAEConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING

from actcache.errors import ConfigError
from actcache.protocol import _is_int

if TYPE_CHECKING:
    import torch

ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu", "matryoshka")
NO_K = ("relu", "jumprelu")  # activations without a fixed number of latents
PRECISIONS = ("fp32", "tf32", "bf16")
DECODES = ("auto", "dense", "sparse", "hybrid")
PARAM_DTYPES = ("float32", "float64", "bfloat16")  # the SAE's parameters (torch's names; the cache's: protocol.DTYPES)
PARAM_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
BATCH_MODES = ("auto", "on", "off")  # batch_saes: train a group's SAEs as one stacked module (sae/batched.py)
DECAYS = ("linear", "cosine", "constant")  # the learning rate after warm-up (sae/optim.py)

# JumpReLU's threshold: "direct" trains theta = scale * theta_rel, initial threshold and bandwidth
# from the first batch unless given; "log" (SAEs saved before "direct" existed, and imported ones)
# trains log theta from the absolute JUMPRELU_INIT / JUMPRELU_BANDWIDTH unless given.
JUMPRELU_PARAMS = ("direct", "log")
JUMPRELU_BANDWIDTH = 1.0  # the "log" parameterisation's defaults of jumprelu_bandwidth / jumprelu_init_threshold
JUMPRELU_INIT = 1.0
ACTIVATION_ONLY = ("jumprelu_bandwidth", "jumprelu_init_threshold", "jumprelu_param", "matryoshka_prefixes")


@dataclasses.dataclass(frozen=True)
class SAEConfig:
    """Shape and activation of one SAE. Give ``width`` or ``exp_factor`` (width = d_vit * exp_factor).

    ``normalize_decoder`` (keep decoder rows at unit norm) defaults to True for every activation
    but relu: for the topk variants only MSE shapes the decoder, and a free row norm would let
    latents trade scale with the encoder (and make top-k selection compare pre-activations on
    unequal scales); jumprelu's L0 term does not see row norms either. It defaults to False for
    relu, whose L1 term is weighted by decoder row norms and so is already invariant to that trade.
    ``threshold_decay`` is the EMA decay of the batchtopk/matryoshka inference threshold.
    ``jumprelu_param`` ("direct", or "log" for SAEs saved before it existed: from_dict reads a
    jumprelu config.json without it so), ``jumprelu_bandwidth``/``jumprelu_init_threshold``
    (jumprelu; None with "direct": set from the first batch) and ``matryoshka_prefixes``
    (matryoshka: increasing sizes, the last equal to the width) exist only for their activation:
    None elsewhere, and left out of ``to_dict`` then, so other SAEs' config.json is unchanged.
    After construction ``width`` and ``normalize_decoder`` always hold their resolved values.
    """

    d_vit: int
    width: int | None = None
    exp_factor: float | None = None
    activation: str = "topk"
    k: int | None = None
    normalize_decoder: bool | None = None
    seed: int = 0
    dtype: str = "float32"
    threshold_decay: float = 0.99
    jumprelu_bandwidth: float | None = None
    jumprelu_init_threshold: float | None = None
    jumprelu_param: str | None = None
    matryoshka_prefixes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.d_vit) or self.d_vit < 1:
            raise ConfigError(f"SAEConfig.d_vit must be an integer >= 1, got {self.d_vit!r}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"SAEConfig.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        width = self._resolve_width()
        object.__setattr__(self, "width", width)
        if self.activation in NO_K:
            if self.k is not None:
                raise ConfigError(
                    f"SAEConfig.k={self.k!r} is only used by activation 'topk', 'batchtopk' or 'matryoshka'; "
                    f"remove it for activation {self.activation!r}"
                )
        else:
            if not _is_int(self.k):
                raise ConfigError(f"SAEConfig.k must be an integer for activation {self.activation!r}, got {self.k!r}")
            if not 1 <= self.k <= width:
                raise ConfigError(f"SAEConfig.k must satisfy 1 <= k <= width, got k={self.k} with width={width}")
        if self.normalize_decoder is None:
            object.__setattr__(self, "normalize_decoder", self.activation != "relu")
        elif not isinstance(self.normalize_decoder, bool):
            raise ConfigError(f"SAEConfig.normalize_decoder must be true or false, got {self.normalize_decoder!r}")
        if not _is_int(self.seed):
            raise ConfigError(f"SAEConfig.seed must be an integer, got {self.seed!r}")
        if self.dtype not in PARAM_DTYPES:
            raise ConfigError(f"SAEConfig.dtype must be one of {list(PARAM_DTYPES)}, got {self.dtype!r}")
        td = self.threshold_decay
        if isinstance(td, bool) or not isinstance(td, int | float) or not 0.0 <= td < 1.0:
            raise ConfigError(f"SAEConfig.threshold_decay must be a number in [0, 1), got {td!r}")
        self._check_jumprelu()
        self._check_matryoshka(width)

    def _check_jumprelu(self) -> None:
        param = self.jumprelu_param
        if self.activation == "jumprelu" and param is None:
            object.__setattr__(self, "jumprelu_param", param := "direct")
        elif self.activation == "jumprelu" and param not in JUMPRELU_PARAMS:
            raise ConfigError(f"SAEConfig.jumprelu_param must be one of {list(JUMPRELU_PARAMS)}, got {param!r}")
        elif self.activation != "jumprelu" and param is not None:
            raise ConfigError(f"SAEConfig.jumprelu_param={param!r} is only used by activation 'jumprelu'; remove it")
        for name, default in (("jumprelu_bandwidth", JUMPRELU_BANDWIDTH), ("jumprelu_init_threshold", JUMPRELU_INIT)):
            v = getattr(self, name)
            if self.activation != "jumprelu":
                if v is not None:
                    raise ConfigError(f"SAEConfig.{name}={v!r} is only used by activation 'jumprelu'; remove it")
                continue
            if v is None and param == "log":
                object.__setattr__(self, name, default)
            elif v is None:  # "direct": set from the first batch (SAE.init_jumprelu_)
                continue
            elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"SAEConfig.{name} must be a number > 0, got {v!r}")
            else:
                object.__setattr__(self, name, float(v))

    def _check_matryoshka(self, width: int) -> None:
        p = self.matryoshka_prefixes
        if self.activation != "matryoshka":
            if p is not None:
                raise ConfigError(f"SAEConfig.matryoshka_prefixes={p!r} is only used by activation 'matryoshka'")
            return
        if p is None:
            p = (width,)
        if not isinstance(p, list | tuple) or not p or not all(_is_int(m) for m in p):
            raise ConfigError(f"SAEConfig.matryoshka_prefixes must be a non-empty list of integers, got {p!r}")
        p = tuple(p)
        if any(b <= a for a, b in zip(p, p[1:], strict=False)) or p[0] < 1 or p[-1] != width:
            raise ConfigError(
                f"SAEConfig.matryoshka_prefixes must increase from >= 1 to the width {width}, got {list(p)}"
            )
        object.__setattr__(self, "matryoshka_prefixes", p)

    def _resolve_width(self) -> int:
        w, ef = self.width, self.exp_factor
        if w is None and ef is None:
            raise ConfigError("SAEConfig: give width (number of latents) or exp_factor (width = d_vit * exp_factor)")
        if w is not None and (not _is_int(w) or w < 1):
            raise ConfigError(f"SAEConfig.width must be an integer >= 1, got {w!r}")
        if ef is None:
            return w
        if isinstance(ef, bool) or not isinstance(ef, int | float) or not math.isfinite(ef) or ef <= 0:
            raise ConfigError(f"SAEConfig.exp_factor must be a positive number, got {ef!r}")
        from_ef = self.d_vit * ef
        if abs(from_ef - round(from_ef)) > 1e-9 or round(from_ef) < 1:
            raise ConfigError(
                f"SAEConfig.exp_factor={ef!r} with d_vit={self.d_vit} gives a non-integer width {from_ef!r}"
            )
        from_ef = int(round(from_ef))
        if w is not None and w != from_ef:
            raise ConfigError(
                f"SAEConfig: width={w} disagrees with exp_factor={ef!r} * d_vit={self.d_vit} = {from_ef}; give one"
            )
        return from_ef

    @property
    def n_params(self) -> int:
        """Parameters of the SAE: W_enc, W_dec, b_enc, b_dec (and jumprelu's per-latent threshold)."""
        return 2 * self.width * self.d_vit + self.width + self.d_vit + (self.width if self.activation == "jumprelu" else 0)

    @property
    def train_bytes(self) -> int:
        """Memory training holds for the SAE: weights, gradients and Adam's two moments (4 x parameters)
        in the parameter dtype; activations and the batch come on top."""
        return 4 * self.n_params * PARAM_BYTES[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        for name in ACTIVATION_ONLY:
            if doc[name] is None:
                del doc[name]
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, doc: object) -> SAEConfig:
        allowed = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(doc, dict):
            raise ConfigError(f"SAEConfig: expected an object with keys from {allowed}, got {doc!r}")
        unknown = sorted(set(doc) - set(allowed))
        if unknown:
            raise ConfigError(f"SAEConfig: unknown key(s) {unknown}; allowed: {allowed}")
        if "d_vit" not in doc:
            raise ConfigError("SAEConfig: missing required key 'd_vit'")
        if doc.get("activation") == "jumprelu" and "jumprelu_param" not in doc:
            doc = {**doc, "jumprelu_param": "log"}  # written before "direct" existed: its tensors are log theta
        return cls(**doc)

    @classmethod
    def from_json(cls, text: str) -> SAEConfig:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"SAEConfig: not JSON ({err.msg})") from None
        return cls.from_dict(doc)
