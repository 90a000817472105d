"""Sparse autoencoders on ViT activations: a frozen config and a plain ``nn.Module``.

    cfg = SAEConfig(d_vit=768, exp_factor=16, activation="topk", k=32)
    sae = SAE(cfg)
    sae.init_b_dec(sample_ND)                 # geometric median of a data sample
    x_hat_BD, f_BS, aux = sae(x_BD)           # aux["pre_BS"]: pre-activations (for AuxK)
    sae.save("runs/HASH/sae-0"); SAE.load("runs/HASH/sae-0")

Shapes: B batch, D = d_vit, S = width (number of latents), N a data sample.
The encoder is ``pre_BS = (x_BD - b_dec) @ W_enc + b_enc``; the decoder ``f_BS @ W_dec + b_dec``.

Activations
- ``relu``: ``f = relu(pre)``.
- ``topk``: per example, keep the k largest pre-activations (relu'd), zero the rest.
- ``batchtopk``: in train mode keep the B*k largest (relu'd) pre-activations of the whole batch,
  so examples share a budget of k on average; every train-mode forward also updates ``threshold``,
  an EMA of the smallest kept value. In eval mode ``f = pre * (pre > threshold)``, which needs no
  batch and so gives each example its own number of latents.
- ``jumprelu`` (Rajamanoharan et al. 2024): ``f = pre * (pre > theta)`` with a learned threshold
  per latent, trained directly: ``theta = threshold_scale * threshold_rel`` (parameter), the scale
  (10 x the RMS pre-activation) and, unless configured, the initial theta and the kernel's width
  (buffer ``bandwidth``) set by the first train-mode batch (:meth:`SAE.init_jumprelu_`). SAEs saved
  before that (``jumprelu_param: log``) keep the parameter ``log_threshold`` and an absolute
  ``jumprelu_bandwidth``. Its gradient wrt theta is the straight-through pseudo-derivative with
  a rectangle kernel of that width.
- ``matryoshka`` (Bussmann et al. 2025): BatchTopK selection and threshold over the whole width;
  the latents are ordered, ``matryoshka_prefixes`` naming nested prefixes that the objective
  asks to reconstruct on their own (:meth:`SAE.decode_prefixes`).

Compute (set by the trainer, not part of the saved config): ``sae.set_compute(decode, precision)``.
``decode="sparse"`` (topk variants) decodes from the chosen latents only and back-propagates into
the encoder only through them (:class:`SparseDecode`, :class:`SparseEncode`); ``decode="hybrid"``
does the same but forms the two weight gradients by dense matmuls of the zero-filled codes, which
tensor cores do faster than the scatter kernels; ``precision="bf16"`` runs the forward's matmuls
under autocast while weights stay float32.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat

import torch
from torch import nn

from actcache.errors import ConfigError, TrainError, os_error_text
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import CONFIG_FILE, WEIGHTS_FILE
from actcache.sae.spec import DECODES, PRECISIONS, SAEConfig

SPARSE_ACTIVATIONS = ("topk", "batchtopk")
# JumpReLU ("direct"), in units of the RMS pre-activation of the first batch: the initial threshold
# and the bandwidth (a start where few latents fire: scripts/bench_jumprelu.py), and the threshold's
# parameter unit (Adam moves a parameter by about lr a step: theta by up to about 10 lr RMS). The
# decoder rows' initial norm when they are not kept at unit norm (the encoder is tied).
JUMPRELU_INIT_REL = 2.8
JUMPRELU_BANDWIDTH_REL = 2.8
JUMPRELU_THRESHOLD_UNIT = 10.0
JUMPRELU_DECODER_NORM = 0.1
# decode "auto" picks sparse (or hybrid) when width >= SPARSE_MIN_RATIO * k (see choose_decode).
SPARSE_MIN_RATIO = 16


def geometric_median(x_ND: torch.Tensor, max_iter: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """Weiszfeld iterations from the mean; stops after ``max_iter`` or when the point moves less
    than ``tol`` times the data's RMS spread. Computed in float64; returns x's dtype."""
    if x_ND.ndim != 2 or x_ND.shape[0] < 1:
        raise TrainError(f"geometric_median: expected a non-empty (N, D) sample, got shape {tuple(x_ND.shape)}")
    x = x_ND.detach().to(torch.float64)
    y = x.mean(0)
    scale = float((x - y).pow(2).sum(1).mean().sqrt())
    if scale == 0.0:
        return y.to(x_ND.dtype)
    eps = 1e-12 * scale
    for _ in range(max_iter):
        w_N = 1.0 / (x - y).norm(dim=1).clamp_min(eps)
        y_next = (w_N[:, None] * x).sum(0) / w_N.sum()
        moved = float((y_next - y).norm())
        y = y_next
        if moved <= tol * scale:
            break
    return y.to(x_ND.dtype)


def _rectangle(pre_BS: torch.Tensor, theta_S: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """K((pre - theta) / bandwidth) / bandwidth with K the rectangle of width 1 around 0."""
    return ((pre_BS - theta_S).abs() < bandwidth / 2).to(pre_BS.dtype) / bandwidth


class JumpReLU(torch.autograd.Function):
    """``pre * (pre > theta)``; backward: the gate for pre, and for theta the straight-through
    pseudo-derivative ``-theta * K((pre - theta) / eps) / eps`` (Rajamanoharan et al. 2024)."""

    @staticmethod
    def forward(ctx, pre_BS, theta_S, bandwidth):
        ctx.save_for_backward(pre_BS, theta_S)
        ctx.bandwidth = bandwidth
        return pre_BS * (pre_BS > theta_S)

    @staticmethod
    def backward(ctx, g_BS):
        pre_BS, theta_S = ctx.saved_tensors
        g_pre = g_BS * (pre_BS > theta_S)
        g_theta = -(theta_S * _rectangle(pre_BS, theta_S, ctx.bandwidth) * g_BS).sum(0)
        return g_pre, g_theta, None


class HeavisideStep(torch.autograd.Function):
    """``(pre > theta)`` as a number (the L0 of JumpReLU); backward: nothing for pre, for theta
    ``-K((pre - theta) / eps) / eps``, the same straight-through estimator."""

    @staticmethod
    def forward(ctx, pre_BS, theta_S, bandwidth):
        ctx.save_for_backward(pre_BS, theta_S)
        ctx.bandwidth = bandwidth
        return (pre_BS > theta_S).to(pre_BS.dtype)

    @staticmethod
    def backward(ctx, g_BS):
        pre_BS, theta_S = ctx.saved_tensors
        g_theta = -(_rectangle(pre_BS, theta_S, ctx.bandwidth) * g_BS).sum(0)
        return None, g_theta, None


# -- sparse codes -------------------------------------------------------------------------------
# N chosen (example, latent) pairs, sorted by example: example ``row_N``, latent ``col_N``; the
# codes of example b are the bag_size_B[b] entries from offsets_B[b] (embedding_bag's layout).


@dataclasses.dataclass(frozen=True)
class Codes:
    row_N: torch.Tensor
    col_N: torch.Tensor
    offsets_B: torch.Tensor
    bag_size_B: torch.Tensor

    @classmethod
    def per_row(cls, idx_BK: torch.Tensor) -> Codes:
        """k latents per example (topk): ``idx_BK`` the chosen latent indices."""
        b, k = idx_BK.shape
        dev = idx_BK.device
        row_N = torch.arange(b, device=dev).repeat_interleave(k)
        bag_size_B = torch.full((b,), k, dtype=torch.int64, device=dev)
        return cls(row_N, idx_BK.reshape(-1), torch.arange(0, b * k, k, device=dev), bag_size_B)

    @classmethod
    def from_flat(cls, flat_N: torch.Tensor, width: int, batch: int) -> Codes:
        """Indices into a flattened (B, S) matrix (batchtopk), in any order."""
        flat_N = flat_N.sort().values
        row_N = torch.div(flat_N, width, rounding_mode="floor")
        counts_B = torch.bincount(row_N, minlength=batch)
        return cls(row_N, flat_N - row_N * width, torch.cumsum(counts_B, 0) - counts_B, counts_B)


def _scatter_rows(codes: Codes, w_N: torch.Tensor, src_BD: torch.Tensor, n_rows: int) -> torch.Tensor:
    """out[s] = sum over codes n with col_N[n] = s of w_N[n] * src_BD[row_N[n]]  -> (n_rows, D).
    (embedding_bag's weight gradient, with row_N as its offset2bag.)"""
    return torch.ops.aten._embedding_bag_dense_backward(
        src_BD.contiguous(), codes.col_N, codes.row_N, codes.bag_size_B, codes.row_N.new_zeros(0), n_rows, False, 0,
        w_N, -1,
    )  # fmt: skip


def _row_dots(codes: Codes, a_BD: torch.Tensor, w_SD: torch.Tensor) -> torch.Tensor:
    """out[n] = <a_BD[row_N[n]], w_SD[col_N[n]]>  -> (N,) (embedding_bag's per-sample-weight gradient)."""
    return torch.ops.aten._embedding_bag_per_sample_weights_backward(
        a_BD.contiguous(), w_SD, codes.col_N, codes.offsets_B, codes.row_N, 0, -1
    )


def _bag_sum(codes: Codes, w_N: torch.Tensor, w_SD: torch.Tensor) -> torch.Tensor:
    """out[b] = sum over the codes of example b of w_N[n] * w_SD[col_N[n]]  -> (B, D)."""
    return nn.functional.embedding_bag(
        codes.col_N, w_SD, codes.offsets_B, mode="sum", per_sample_weights=w_N.to(w_SD.dtype)
    )


def _dense_outer(codes: Codes, w_N: torch.Tensor, src_BD: torch.Tensor, n_rows: int, dtype, rows_first: bool):
    """:func:`_scatter_rows` as one matmul in ``dtype``, F_BS^T @ src_BD with F_BS holding w_N at the
    codes and zeros elsewhere: (n_rows, D) if ``rows_first``, else its transpose (D, n_rows), each
    computed in that layout (contiguous, as the parameter's gradient)."""
    f_BS = torch.zeros(src_BD.shape[0], n_rows, dtype=dtype, device=src_BD.device)
    f_BS.index_put_((codes.row_N, codes.col_N), w_N.to(dtype))
    src_BD = src_BD.to(dtype)
    with torch.autocast(src_BD.device.type, enabled=False):
        return f_BS.t() @ src_BD if rows_first else src_BD.t() @ f_BS


class SparseDecode(torch.autograd.Function):
    """x_BD = sum over each example's codes of val * W_dec[latent] (the decoder without b_dec).

    Equals ``f_BS @ W_dec`` for the f_BS holding ``val_N`` at the codes and zeros elsewhere, with
    O(N * D) work instead of O(B * S * D); backward scatters into W_dec's gradient."""

    @staticmethod
    def forward(ctx, val_N, W_SD, codes: Codes, mm_dtype=None):
        ctx.codes, ctx.mm_dtype = codes, mm_dtype
        ctx.save_for_backward(val_N, W_SD)
        with torch.autocast(W_SD.device.type, enabled=False):
            return _bag_sum(codes, val_N, W_SD)

    @staticmethod
    def backward(ctx, g_BD):
        val_N, W_SD = ctx.saved_tensors
        codes, g_BD = ctx.codes, g_BD.to(W_SD.dtype)
        g_val = _row_dots(codes, g_BD, W_SD).to(val_N.dtype) if ctx.needs_input_grad[0] else None
        g_W = None
        if ctx.needs_input_grad[1] and ctx.mm_dtype is not None:
            g_W = _dense_outer(codes, val_N, g_BD, W_SD.shape[0], ctx.mm_dtype, rows_first=True)
        elif ctx.needs_input_grad[1]:
            g_W = _scatter_rows(codes, val_N.to(W_SD.dtype), g_BD, W_SD.shape[0])
        return g_val, g_W.to(W_SD.dtype) if g_W is not None else None, None, None


class SparseEncode(torch.autograd.Function):
    """The pre-activations at the codes, pre[b, s] = (x_BD[b] - b_dec) . W_enc[:, s] + b_enc[s], taken
    from ``pre_BS`` (computed without a graph), with a backward through the codes only. b_dec's
    gradient is -W_enc @ (b_enc's gradient): no per-example gradient is formed unless x needs one."""

    @staticmethod
    def forward(ctx, x_BD, b_dec_D, W_DS, b_S, pre_BS, codes: Codes, mm_dtype=None):
        ctx.codes, ctx.mm_dtype = codes, mm_dtype
        ctx.save_for_backward(x_BD, b_dec_D, W_DS)
        return pre_BS.reshape(-1).take(codes.row_N * pre_BS.shape[1] + codes.col_N).to(W_DS.dtype)

    @staticmethod
    def backward(ctx, g_N):
        x_BD, b_dec_D, W_DS = ctx.saved_tensors
        codes, need = ctx.codes, ctx.needs_input_grad
        g_N = g_N.to(W_DS.dtype)
        g_x = g_bd = g_W = g_b = None
        g_S = torch.zeros(W_DS.shape[1], dtype=W_DS.dtype, device=W_DS.device).index_add_(0, codes.col_N, g_N)
        if need[0]:
            g_x = _bag_sum(codes, g_N, W_DS.t().contiguous()).to(x_BD.dtype)
        if need[1]:
            g_bd = -(W_DS @ g_S)
        if need[2] and ctx.mm_dtype is not None:
            src_BD = x_BD.to(W_DS.dtype) - b_dec_D
            g_W = _dense_outer(codes, g_N, src_BD, W_DS.shape[1], ctx.mm_dtype, rows_first=False).to(W_DS.dtype)
        elif need[2]:
            g_W = _scatter_rows(codes, g_N, x_BD.to(W_DS.dtype) - b_dec_D, W_DS.shape[1]).t()
        if need[3]:
            g_b = g_S
        return g_x, g_bd, g_W, g_b, None, None, None


def choose_decode(
    decode: str, activation: str, k: int | None, width: int, device: str = "cpu", precision: str = "fp32"
) -> str:
    """Returns "dense", "sparse" or "hybrid". Sparse and hybrid need a topk variant; "auto" takes
    one when width >= 16 k, where the gathers of N * D elements cost less than the dense matmuls'
    B * S * D: hybrid on CUDA in tf32/bf16, where tensor-core matmuls of the zero-filled codes form
    the weight gradients faster than the scatter kernels' sorts and atomics; sparse elsewhere."""
    if decode not in DECODES:
        raise ConfigError(f"decode must be one of {list(DECODES)}, got {decode!r}")
    if activation not in SPARSE_ACTIVATIONS:
        if decode in ("sparse", "hybrid"):
            raise ConfigError(f"decode {decode!r} needs activation topk or batchtopk, not {activation!r}")
        return "dense"
    if decode == "auto":
        if width < SPARSE_MIN_RATIO * k:
            return "dense"
        return "hybrid" if device == "cuda" and precision in ("tf32", "bf16") else "sparse"
    return decode


def _read_config(cfg_path: str, w_path: str) -> SAEConfig:
    """The SAEConfig of config.json, one ConfigError line naming it when unreadable or when the
    weights it implies are larger than the weights file beside it (checked before allocating)."""
    from actcache.docfiles import load_json_file

    doc = load_json_file(cfg_path, ConfigError, "SAE config")
    try:
        cfg = SAEConfig.from_dict(doc)
    except (ConfigError, TypeError, ValueError, OverflowError, AttributeError) as err:
        raise ConfigError(f"{cfg_path}: {err}; restore it or re-run actcache train for this SAE.") from None
    need = 2 * cfg.width * cfg.d_vit * torch.empty((), dtype=cfg.torch_dtype).element_size()
    if need > os.path.getsize(w_path):
        raise ConfigError(f"{cfg_path}: width {cfg.width} x d_vit {cfg.d_vit} needs {need:,} bytes of weights, more "
                          f"than {w_path} holds; the two files are not one SAE's: restore them.")  # fmt: skip
    return cfg


def _read_tensors(path: str, load_file, error_cls) -> dict:
    """The tensors of a safetensors file (a regular file); a damaged header or body is one
    ``error_cls`` line naming the file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error_cls(f"{path}: not a regular file; restore the SAE's weights.")
        return load_file(path)
    except error_cls:
        raise
    except OSError as err:
        raise error_cls(f"{path}: cannot read it: {os_error_text(err)}; restore the SAE's weights.") from None
    except Exception as err:  # noqa: BLE001 - SafetensorError and friends: a damaged file, one line
        text = " ".join(str(err).split())[:200]
        raise error_cls(f"{path}: not a readable safetensors file ({type(err).__name__}: {text}); restore it from "
                        "a backup or delete done.json and re-run actcache train for this SAE.") from None


class SAE(nn.Module):
    """W_enc (D, S), b_enc (S,), W_dec (S, D), b_dec (D,); buffer ``threshold`` (batchtopk,
    matryoshka); jumprelu: parameter ``threshold_rel`` (S,), buffers ``threshold_scale`` and
    ``bandwidth`` (0-d), or for ``jumprelu_param: log`` the parameter ``log_threshold`` (S,)."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        if not isinstance(cfg, SAEConfig):
            raise ConfigError(f"SAE needs an SAEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        d, s, dtype = cfg.d_vit, cfg.width, cfg.torch_dtype
        gen = torch.Generator().manual_seed(cfg.seed)
        W_dec = torch.randn(s, d, generator=gen, dtype=torch.float64)
        W_dec /= W_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(W_dec.to(dtype))
        self.W_enc = nn.Parameter(W_dec.T.contiguous().to(dtype))  # tied init
        self.b_enc = nn.Parameter(torch.zeros(s, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(d, dtype=dtype))
        # NaN until the first train-mode batchtopk forward estimates it.
        self.register_buffer("threshold", torch.tensor(float("nan"), dtype=torch.float32))
        if cfg.activation == "jumprelu":  # only then: other SAEs keep their tensor names
            self._init_jumprelu_params(cfg, s, dtype)
        self.decode_mode, self.precision = "dense", "fp32"

    def _init_jumprelu_params(self, cfg: SAEConfig, s: int, dtype: torch.dtype) -> None:
        if cfg.jumprelu_param == "log":
            log_th = torch.full((s,), math.log(cfg.jumprelu_init_threshold), dtype=torch.float64)
            self.log_threshold = nn.Parameter(log_th.to(dtype))
            return
        # "direct": theta = threshold_scale * threshold_rel; NaN until init_jumprelu_ reads a batch
        with torch.no_grad():
            if not cfg.normalize_decoder:
                self.W_dec.mul_(JUMPRELU_DECODER_NORM)
                self.W_enc.copy_(self.W_dec.T)
        self.threshold_rel = nn.Parameter(torch.full((s,), float("nan"), dtype=dtype))
        self.register_buffer("threshold_scale", torch.tensor(float("nan"), dtype=torch.float32))
        self.register_buffer("bandwidth", torch.tensor(float("nan"), dtype=torch.float32))

    # -- encoder / decoder ------------------------------------------------------------------------

    def _check_x(self, x_BD: torch.Tensor) -> None:
        if not isinstance(x_BD, torch.Tensor) or x_BD.ndim != 2 or x_BD.shape[1] != self.cfg.d_vit:
            shape = tuple(x_BD.shape) if isinstance(x_BD, torch.Tensor) else type(x_BD).__name__
            raise TrainError(f"SAE expects activations shaped (B, d_vit={self.cfg.d_vit}), got {shape}")

    def pre_acts(self, x_BD: torch.Tensor) -> torch.Tensor:
        self._check_x(x_BD)
        x_BD = x_BD.to(self.W_enc.dtype)
        return (x_BD - self.b_dec) @ self.W_enc + self.b_enc

    def activate(self, pre_BS: torch.Tensor) -> torch.Tensor:
        act = self.cfg.activation
        if act == "relu":
            return torch.relu(pre_BS)
        if act == "topk":
            vals_BK, idx_BK = pre_BS.topk(self.cfg.k, dim=-1, sorted=False)
            return torch.zeros_like(pre_BS).scatter(-1, idx_BK, torch.relu(vals_BK))
        if act == "jumprelu":
            if self.training and not self._jumprelu_ready():
                self._init_jumprelu_from(pre_BS)  # the first train-mode batch sets the scale
            return JumpReLU.apply(pre_BS, self.jumprelu_threshold(), self.jumprelu_bandwidth())
        # batchtopk, matryoshka
        if self.training:
            return self._batch_topk(pre_BS)
        if torch.isnan(self.threshold):
            raise TrainError(
                "BatchTopK SAE has no inference threshold yet: run training steps in train mode "
                "(sae.train()) first, or set sae.threshold"
            )
        return pre_BS * (pre_BS > self.threshold.to(pre_BS.dtype))

    def _batch_topk(self, pre_BS: torch.Tensor) -> torch.Tensor:
        flat = pre_BS.reshape(-1)
        n_keep = min(pre_BS.shape[0] * self.cfg.k, flat.numel())
        vals, idx = flat.topk(n_keep, sorted=False)
        vals = torch.relu(vals)
        f_BS = torch.zeros_like(flat).scatter(0, idx, vals).reshape(pre_BS.shape)
        self._update_threshold(vals)
        return f_BS

    def jumprelu_threshold(self) -> torch.Tensor:
        """theta (S,) of a jumprelu SAE (differentiable): threshold_scale * threshold_rel, or
        exp(log_threshold) for the "log" parameterisation."""
        if self.cfg.jumprelu_param == "log":
            return self.log_threshold.exp()
        if not self._jumprelu_ready():
            raise TrainError("JumpReLU SAE has no threshold yet: call sae.init_jumprelu_(x_BD) with a batch of "
                             "activations first (the trainer does at step 0)")  # fmt: skip
        return self.threshold_scale.to(self.threshold_rel.dtype) * self.threshold_rel

    def _jumprelu_ready(self) -> bool:
        """Whether the threshold is set ("log": always); reads the device once, until it is."""
        if not getattr(self, "_jr_ready", False):
            self._jr_ready = self.cfg.jumprelu_param == "log" or not bool(torch.isnan(self.threshold_scale))
        return self._jr_ready

    def jumprelu_bandwidth(self) -> float | torch.Tensor:
        """The straight-through kernel's width, in pre-activation units (a 0-d tensor for "direct")."""
        if self.cfg.jumprelu_param == "log":
            return self.cfg.jumprelu_bandwidth
        return self.bandwidth

    @torch.no_grad()
    def init_jumprelu_(self, x_BD: torch.Tensor) -> None:
        """Set a "direct" JumpReLU SAE's threshold scale, initial threshold and bandwidth from a batch
        (after b_dec): the scale is the RMS of the batch's pre-activations; the threshold and the
        bandwidth are the configured absolute values, or JUMPRELU_INIT_REL / JUMPRELU_BANDWIDTH_REL
        times that scale when not configured. No-op for other SAEs and the "log" parameterisation."""
        cfg = self.cfg
        if cfg.activation != "jumprelu" or cfg.jumprelu_param == "log":
            return
        self._init_jumprelu_from(self.pre_acts(x_BD))

    @torch.no_grad()
    def _init_jumprelu_from(self, pre_BS: torch.Tensor) -> None:
        cfg = self.cfg
        rms = float(pre_BS.detach().float().pow(2).mean().sqrt())
        if not math.isfinite(rms) or rms <= 0:
            raise TrainError(f"init_jumprelu_: the batch's pre-activations have RMS {rms}; need a finite, non-zero batch")
        theta = cfg.jumprelu_init_threshold if cfg.jumprelu_init_threshold is not None else JUMPRELU_INIT_REL * rms
        bw = cfg.jumprelu_bandwidth if cfg.jumprelu_bandwidth is not None else JUMPRELU_BANDWIDTH_REL * rms
        scale = JUMPRELU_THRESHOLD_UNIT * rms
        self.threshold_scale.fill_(scale)
        self.threshold_rel.fill_(theta / scale)
        self.bandwidth.fill_(bw)
        self._jr_ready = True

    @torch.no_grad()
    def _update_threshold(self, vals: torch.Tensor) -> None:
        """EMA of the smallest kept positive value of a train-mode batchtopk forward."""
        pos = vals.detach().float()
        pos = torch.where(pos > 0, pos, torch.full_like(pos, float("inf")))
        m = pos.min()  # smallest kept positive value; inf when none is positive
        decay = self.cfg.threshold_decay
        th = self.threshold
        new = torch.where(torch.isnan(th), m, decay * th + (1.0 - decay) * m)
        self.threshold.copy_(torch.where(torch.isfinite(m), new, th))

    @torch.no_grad()
    def calibrate_threshold_(self, x_BD: torch.Tensor) -> float:
        """Set the batchtopk/matryoshka inference threshold to the smallest value train mode keeps
        on this batch with the current weights (no EMA), so that in eval mode the batch's mean L0
        is k; returns it. The EMA of the training steps lags the weights (its horizon is
        1 / (1 - threshold_decay) steps), which leaves the held-out L0 off k; the trainer calls this
        on its last batch after the last step."""
        if self.cfg.activation not in ("batchtopk", "matryoshka"):
            raise ConfigError(f"calibrate_threshold_ is for batchtopk and matryoshka, not {self.cfg.activation!r}")
        flat = self.pre_acts(x_BD).reshape(-1)
        vals = torch.relu(flat.topk(min(x_BD.shape[0] * self.cfg.k, flat.numel()), sorted=False).values)
        pos = vals[vals > 0]
        if pos.numel():
            self.threshold.fill_(float(pos.min()))
        return float(self.threshold)

    def encode(self, x_BD: torch.Tensor) -> torch.Tensor:
        return self.activate(self.pre_acts(x_BD))

    def decode(self, f_BS: torch.Tensor) -> torch.Tensor:
        return f_BS @ self.W_dec + self.b_dec

    def decode_prefixes(self, f_BS: torch.Tensor, prefixes: tuple[int, ...]) -> list[torch.Tensor]:
        """Reconstructions from the first m latents only, for each m of ``prefixes`` (increasing):
        ``decode`` of f with latents m.. zeroed, built as running sums of one decode per slice."""
        out, x_hat_BD, start = [], self.b_dec, 0
        for m in prefixes:
            x_hat_BD = x_hat_BD + f_BS[:, start:m] @ self.W_dec[start:m]
            out.append(x_hat_BD)
            start = m
        return out

    def forward(self, x_BD: torch.Tensor, dense_f: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """Returns (x_hat_BD, f_BS, aux). ``dense_f=False`` lets a sparse forward skip building
        f_BS (returned as None): aux then holds the codes and their values "val_N" instead."""
        mode = self.decode_mode
        with self.autocast():
            if mode in ("sparse", "hybrid") and (self.training or self.cfg.activation == "topk"):
                return self._forward_sparse(x_BD, dense_f)
            return self._forward_dense(x_BD)

    def _forward_dense(self, x_BD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        pre_BS = self.pre_acts(x_BD)
        f_BS = self.activate(pre_BS)
        return self.decode(f_BS), f_BS, {"pre_BS": pre_BS}

    # -- compute recipe: sparse decoding, mixed precision ------------------------------------------

    def set_compute(self, decode: str = "dense", precision: str = "fp32") -> SAE:
        """Choose the decoder path (auto | dense | sparse | hybrid) and the precision (fp32 | tf32 |
        bf16). "auto" depends on the device: call this after moving the SAE to it."""
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        device = self.W_enc.device.type
        self.decode_mode = choose_decode(decode, self.cfg.activation, self.cfg.k, self.cfg.width, device, precision)
        self.precision = precision
        return self

    def _mm_dtype(self):
        """The dtype of the hybrid path's weight-gradient matmuls (None: sparse scatter kernels)."""
        if self.decode_mode != "hybrid":
            return None
        return torch.bfloat16 if self.precision == "bf16" else self.W_enc.dtype

    def autocast(self):
        """bf16: autocast (matmuls in bfloat16, parameters and everything else float32)."""
        device = self.W_enc.device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def _forward_sparse(
        self, x_BD: torch.Tensor, dense_f: bool = True, pre_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``pre_BS``: the pre-activations for choosing the codes when already computed (detached;
        the batched step of several SAEs computes them in one matmul)."""
        self._check_x(x_BD)
        x_BD = x_BD.to(self.W_enc.dtype)
        if pre_BS is None:
            with torch.no_grad():
                pre_BS = self._sparse_pre_acts(x_BD)
        if self.cfg.activation == "topk":
            codes = self.topk_codes(pre_BS, self.cfg.k)
        else:
            codes = self._batch_topk_codes(pre_BS)
        val_N = torch.relu(self.encode_codes(x_BD, pre_BS, codes))
        x_hat_BD = self.decode_codes(codes, val_N) + self.b_dec
        aux = {"pre_BS": pre_BS, "x_BD": x_BD, "codes": codes, "val_N": val_N.detach()}
        if not dense_f:
            return x_hat_BD, None, aux
        f_BS = torch.zeros(pre_BS.shape, dtype=val_N.dtype, device=val_N.device)
        return x_hat_BD, f_BS.index_put_((codes.row_N, codes.col_N), val_N.detach()), aux

    def _sparse_pre_acts(self, x_BD: torch.Tensor) -> torch.Tensor:
        """Pre-activations for choosing the codes: one matmul with the bias added in its epilogue,
        in the weights' dtype, or under bf16 in bfloat16 (half the memory traffic for top-k; the
        chosen values are taken back to float32 by SparseEncode)."""
        pre_BS = torch.addmm(self.b_enc, x_BD - self.b_dec, self.W_enc)  # bfloat16 under autocast
        return pre_BS if self.precision == "bf16" else pre_BS.to(self.W_enc.dtype)

    def topk_codes(self, pre_BS: torch.Tensor, k: int) -> Codes:
        return Codes.per_row(pre_BS.topk(k, dim=-1, sorted=False).indices)

    def _batch_topk_codes(self, pre_BS: torch.Tensor) -> Codes:
        flat = pre_BS.reshape(-1)
        vals, idx = flat.topk(min(pre_BS.shape[0] * self.cfg.k, flat.numel()), sorted=False)
        self._update_threshold(torch.relu(vals))
        return Codes.from_flat(idx, pre_BS.shape[1], pre_BS.shape[0])

    def encode_codes(self, x_BD: torch.Tensor, pre_BS: torch.Tensor, codes: Codes) -> torch.Tensor:
        """Pre-activations at ``codes`` with gradients into the encoder and b_dec (see SparseEncode)."""
        return SparseEncode.apply(x_BD, self.b_dec, self.W_enc, self.b_enc, pre_BS, codes, self._mm_dtype())

    def decode_codes(self, codes: Codes, val_N: torch.Tensor) -> torch.Tensor:
        """``f_BS @ W_dec`` for f_BS holding ``val_N`` at ``codes`` (no b_dec; see SparseDecode)."""
        return SparseDecode.apply(val_N, self.W_dec, codes, self._mm_dtype())

    # -- data-dependent init and decoder constraint ------------------------------------------------

    @torch.no_grad()
    def init_b_dec(
        self, x_ND: torch.Tensor, method: str = "geometric_median", max_iter: int = 100, tol: float = 1e-6
    ) -> torch.Tensor:
        """Set b_dec to the geometric median (default) or mean of a data sample; returns it."""
        self._check_x(x_ND)
        if x_ND.shape[0] < 1:
            raise TrainError("init_b_dec: the data sample is empty")
        if not bool(torch.isfinite(x_ND).all()):
            raise TrainError("init_b_dec: the data sample contains NaN or inf")
        if method == "geometric_median":
            center = geometric_median(x_ND, max_iter=max_iter, tol=tol)
        elif method == "mean":
            center = x_ND.detach().to(torch.float64).mean(0)
        else:
            raise ConfigError(f"init_b_dec: method must be 'geometric_median' or 'mean', got {method!r}")
        self.b_dec.copy_(center.to(self.b_dec))
        return self.b_dec.detach().clone()

    @torch.no_grad()
    def init_decoder_from_data_(self, x_ND: torch.Tensor, frac: float, seed: int) -> int:
        """Start round(frac * width) decoder rows, chosen at random (``seed``), at distinct examples
        of a data sample centred on b_dec, scaled to unit norm, and tie the encoder to the decoder
        again (W_enc = W_dec^T); the other rows keep their random directions. Returns the number
        of rows set (at most one per example; examples at b_dec are skipped).

        The examples are drawn one at a time with probability proportional to 1 - their largest
        squared cosine with the examples drawn before (k-means++ seeding on directions), so that
        the frequent directions, which most examples contain, do not take many rows. An example
        sums a few of the data's directions, so a row started there is near several of them; a
        random row starts near none (scripts/bench_quality.py measures the mix)."""
        self._check_x(x_ND)
        if not 0.0 <= frac <= 1.0:
            raise ConfigError(f"init_decoder_from_data_: frac must be in [0, 1], got {frac!r}")
        xc_ND = x_ND.detach().float() - self.b_dec.detach().float()
        norm_N = xc_ND.norm(dim=1)
        unit_ND = xc_ND / norm_N.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        n = min(round(frac * self.cfg.width), int((norm_N > 0).sum()))
        gen = torch.Generator().manual_seed(seed)  # the draws on the CPU: the same on every device
        free_N = norm_N > 0  # usable and not drawn yet
        weight_N = free_N.float()  # 1 - largest squared cosine with the drawn examples
        picked = []
        if n == int(free_N.sum()):  # every usable example takes a row: nothing to choose
            picked = free_N.nonzero().squeeze(1).cpu()[torch.randperm(n, generator=gen)].tolist()
        for _ in range(n - len(picked)):
            w_N = (weight_N * free_N).cpu()
            i = int(torch.multinomial(w_N if bool(w_N.sum() > 0) else free_N.float().cpu(), 1, generator=gen))
            picked.append(i)
            free_N[i] = False
            weight_N = torch.minimum(weight_N, 1.0 - (unit_ND @ unit_ND[i]).pow(2))
        rows = torch.randperm(self.cfg.width, generator=gen)[:n].to(self.W_dec.device)
        self.W_dec[rows] = unit_ND[picked].to(self.W_dec)
        self.W_enc.copy_(self.W_dec.T)
        return n

    @torch.no_grad()
    def fit_encoder_scale_(self, x_ND: torch.Tensor) -> float:
        """Scale W_enc by s = <x - b_dec, r> / ||r||^2 over a data sample, r the reconstruction
        (without b_dec) from the codes the current encoder chooses (topk variants: per example, or
        over the whole sample for batchtopk and matryoshka); returns s. The tied init W_enc =
        W_dec^T sums k decoder rows that all lean towards x, so it overshoots by a factor that
        depends on d, k and the data; s is the least-squares correction, in the data's own units.
        A sample on which s is not a positive number leaves W_enc as it is (returns 1.0)."""
        self._check_x(x_ND)
        if self.cfg.activation not in (*SPARSE_ACTIVATIONS, "matryoshka"):
            raise ConfigError(f"fit_encoder_scale_ is for topk variants, not activation {self.cfg.activation!r}")
        xc_ND = x_ND.to(self.W_enc.dtype) - self.b_dec
        pre_NS = xc_ND @ self.W_enc + self.b_enc
        k = self.cfg.k
        if self.cfg.activation == "topk":
            vals_NK, idx_NK = pre_NS.topk(k, dim=-1, sorted=False)
            f_NS = torch.zeros_like(pre_NS).scatter(-1, idx_NK, torch.relu(vals_NK))
        else:
            flat = pre_NS.reshape(-1)
            vals, idx = flat.topk(min(x_ND.shape[0] * k, flat.numel()), sorted=False)
            f_NS = torch.zeros_like(flat).scatter(0, idx, torch.relu(vals)).reshape(pre_NS.shape)
        r_ND = (f_NS @ self.W_dec).double()
        s = float((xc_ND.double() * r_ND).sum() / r_ND.pow(2).sum())
        if not (math.isfinite(s) and s > 0):
            return 1.0
        self.W_enc.mul_(s)
        return s

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Rescale every decoder row to unit L2 norm."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(torch.finfo(self.W_dec.dtype).tiny))

    @torch.no_grad()
    def remove_parallel_grads_(self) -> None:
        """Project out of W_dec.grad the component parallel to each decoder row.

        With unit-norm rows the step is then tangent to the sphere; renormalising after the
        optimizer step removes the remaining second-order drift.
        """
        g = self.W_dec.grad
        if g is None:
            return
        w = self.W_dec
        coef_S = (g * w).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        g.sub_(coef_S * w)

    # -- persistence ------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``sae.safetensors`` and ``config.json`` into ``directory`` (created; atomic writes)."""
        from safetensors.torch import save as st_save

        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.state_dict().items()}
        atomic_write_bytes(os.path.join(directory, WEIGHTS_FILE), st_save(tensors, metadata={"format": "pt"}))
        atomic_write_bytes(os.path.join(directory, CONFIG_FILE), (self.cfg.to_json() + "\n").encode())

    @classmethod
    def load(cls, directory: str | os.PathLike, device: str | torch.device | None = None) -> SAE:
        """The SAE saved in ``directory``. A finished run's files are first checked against the
        sizes and sha256 its done.json records (rundir.check_weights); a missing, damaged or
        mismatched file is one ConfigError/RunDirError line naming it."""
        from safetensors.torch import load_file

        from actcache.rundir import RunDirError, check_weights

        directory = os.fspath(directory)
        cfg_path, w_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
        for p in (cfg_path, w_path):
            if not os.path.isfile(p):
                what = "not a regular file" if os.path.lexists(p) else "missing"
                raise ConfigError(f"{directory} is not a saved SAE: {os.path.basename(p)} {what}")
        check_weights(directory)
        cfg = _read_config(cfg_path, w_path)
        sae = cls(cfg)
        tensors = _read_tensors(w_path, load_file, RunDirError)
        expected = sae.state_dict()
        if set(tensors) != set(expected):
            raise ConfigError(f"{w_path}: tensors {sorted(tensors)} do not match an SAE's {sorted(expected)}")
        for name, t in tensors.items():
            if t.shape != expected[name].shape:
                raise ConfigError(
                    f"{w_path}: {name} has shape {tuple(t.shape)}, {CONFIG_FILE} implies {tuple(expected[name].shape)}"
                )
            if t.dtype != expected[name].dtype:
                raise ConfigError(f"{w_path}: {name} is {t.dtype}, {CONFIG_FILE} implies {expected[name].dtype}")
        sae.load_state_dict(tensors)
        if device is not None:
            sae.to(device)
        return sae

    def extra_repr(self) -> str:
        c = self.cfg
        k = f", k={c.k}" if c.k is not None else ""
        if c.matryoshka_prefixes is not None:
            k += f", prefixes={list(c.matryoshka_prefixes)}"
        return f"d_vit={c.d_vit}, width={c.width}, activation={c.activation}{k}"
