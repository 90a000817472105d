"""Training objectives for :class:`~actcache.sae.modeling.SAE`, with firing statistics.

    obj = make_objective(sae, l1_coeff=1e-3)          # ReLU: needs l1_coeff
    obj = make_objective(sae)                          # TopK / BatchTopK: MSE + AuxK
    obj = make_objective(sae, l0_coeff=1e-3)          # JumpReLU: MSE + L0 (+ pre-act penalty)
    obj = make_objective(sae, prefix_weights=None)     # Matryoshka: sum over prefixes + AuxK
    out = obj(sae, x_BD)                               # LossOut
    out.loss.backward(); out.to_dict()                 # {"mse": ..., "nmse": ..., "l0": ..., ...}

An objective is stateful: it counts, for each latent, the tokens seen since the latent last fired
(``FiringStats``), which defines dead latents (no firing within the last ``dead_tokens_threshold``
tokens) for the metrics, and the quiet latents (none within the last ``aux_tokens``) for AuxK.
Save ``obj.state_dict()`` with a checkpoint to resume.

Definitions (B batch, D d_vit, S latents):
- mse: mean over batch and dimensions of (x_hat - x)^2.
- nmse: mse / mean over dimensions of the batch variance of x (fraction of variance unexplained).
- l0: mean number of non-zero latents per example.
- l1: mean over batch of sum_s f_s * ||W_dec[s]|| (the ReLU penalty; reported for every variant).
- n_dead: latents that have not fired within the last ``dead_tokens_threshold`` tokens.
- n_dense: latents whose firing frequency (EMA over ~``dead_tokens_threshold`` tokens) exceeds
  ``dense_frac`` (10%).
- aux: the AuxK term (Gao et al. 2024) before its coefficient: the normalized MSE
  ||e_hat - e||^2 / ||e||^2 of reconstructing the (detached) residual e = x - x_hat from the top
  ``k_aux`` quiet latents (not fired within the last ``aux_tokens`` tokens; by default
  AUX_TOKENS_PER_LATENT x the width, or the dead window for TopK). As in the paper's
  nMSE + alpha * aux, it is added to the loss scaled by the batch variance of x (a detached
  constant), so the loss stays in MSE units: loss = mse + aux_coeff * var(x) * aux.  Zero when no
  latent is quiet.
JumpReLU and Matryoshka objectives add metrics of their own in ``LossOut.extras`` (their classes
say which).
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from actcache.errors import ConfigError, TrainError
from actcache.sae.modeling import SAE, Codes, HeavisideStep

# AuxK's window by default, in tokens per latent, so that it grows with the mean interval between
# a latent's firings (width / L0 tokens): 80 x the width for BatchTopK and Matryoshka (40,960
# tokens at width 512, 1.3M at 16,384), whose batch-level choice left 40% of the latents dead with
# Gao et al.'s 10M tokens, a window runs of a few million tokens never reach; 16 x for JumpReLU,
# whose latents, once below threshold, get no other gradient. TopK keeps the dead window
# (``dead_tokens_threshold``): a shorter one left more latents dead. Measured in config/README.md.
AUX_TOKENS_PER_LATENT = {"jumprelu": 16, "batchtopk": 80, "matryoshka": 80}


@dataclasses.dataclass
class LossOut:
    """``loss`` carries the graph (call ``backward``); every other field is a detached 0-d tensor."""

    loss: torch.Tensor
    mse: torch.Tensor
    nmse: torch.Tensor
    l0: torch.Tensor
    l1: torch.Tensor
    n_dead: torch.Tensor
    n_dense: torch.Tensor
    aux: torch.Tensor
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # an objective's own metrics

    def to_dict(self) -> dict[str, float]:
        """All values (``extras`` flattened in) as Python floats; ``loss`` detached."""
        out = {f.name: float(getattr(self, f.name).detach()) for f in dataclasses.fields(self) if f.name != "extras"}
        out.update({k: float(v.detach()) for k, v in self.extras.items()})
        return out


class FiringStats:
    """Per-latent counters: tokens since the latent last fired, and an EMA of its firing rate.
    Dead: not fired within ``dead_tokens_threshold`` tokens (metrics); quiet: within ``quiet_tokens``
    (AuxK's latents; default ``dead_tokens_threshold``)."""

    def __init__(self, width: int, dead_tokens_threshold: int, dense_frac: float = 0.1, quiet_tokens: int | None = None):
        if (
            not isinstance(dead_tokens_threshold, int)
            or isinstance(dead_tokens_threshold, bool)
            or dead_tokens_threshold < 1
        ):
            raise ConfigError(f"dead_tokens_threshold must be an integer >= 1, got {dead_tokens_threshold!r}")
        if not 0.0 < dense_frac < 1.0:
            raise ConfigError(f"dense_frac must be in (0, 1), got {dense_frac!r}")
        quiet_tokens = dead_tokens_threshold if quiet_tokens is None else quiet_tokens
        if not isinstance(quiet_tokens, int) or isinstance(quiet_tokens, bool) or quiet_tokens < 1:
            raise ConfigError(f"aux_tokens must be an integer >= 1, got {quiet_tokens!r}")
        self.width = width
        self.dead_tokens_threshold = dead_tokens_threshold
        self.quiet_tokens = quiet_tokens
        self.dense_frac = dense_frac
        self.tokens_since_fired_S = torch.zeros(width, dtype=torch.int64)
        self.freq_S = torch.zeros(width, dtype=torch.float32)
        self.n_tokens = 0
        # lag_host_reads (the trainer sets it on CUDA): n_quiet_before is read from a copy made
        # without waiting at the end of the previous update, so no step waits for the device.
        self.lag_host_reads = False
        self.n_quiet_before: int | None = None  # quiet latents before the latest update (lagged mode)
        self._host_copy = None  # (pinned int64 tensor, event or None) of the previous update

    @torch.no_grad()
    def update(self, f_BS: torch.Tensor) -> None:
        fired_BS = f_BS != 0
        self._update(fired_BS.any(0), fired_BS.float().mean(0), f_BS.shape[0])

    @torch.no_grad()
    def update_codes(self, col_N: torch.Tensor, val_N: torch.Tensor, batch: int) -> None:
        """The same update from sparse codes (latent ``col_N``, value ``val_N``) of ``batch`` examples,
        without a dense (B, S) tensor; each (example, latent) pair appears at most once."""
        fired_N = (val_N != 0).float()
        count_S = torch.zeros(self.width, dtype=torch.float32, device=col_N.device).index_add_(0, col_N, fired_N)
        self._update(count_S > 0, count_S / batch, batch)

    def _update(self, fired_S: torch.Tensor, rate_S: torch.Tensor, b: int) -> None:
        if self.tokens_since_fired_S.device != fired_S.device:
            self.tokens_since_fired_S = self.tokens_since_fired_S.to(fired_S.device)
            self.freq_S = self.freq_S.to(fired_S.device)
        if self.lag_host_reads:
            self.n_quiet_before = self._read_host_copy()
        self.tokens_since_fired_S += b
        self.tokens_since_fired_S.masked_fill_(fired_S, 0)
        # EMA with a horizon of ~dead_tokens_threshold tokens (the full mean while fewer were seen).
        self.n_tokens += b
        a = max(b / self.dead_tokens_threshold, b / self.n_tokens)
        a = min(a, 1.0)
        self.freq_S.mul_(1.0 - a).add_(rate_S, alpha=a)
        if self.lag_host_reads:
            self._start_host_copy()

    def _start_host_copy(self) -> None:
        cuda = self.tokens_since_fired_S.is_cuda
        if self._host_copy is None:
            self._host_copy = (torch.zeros((), dtype=torch.int64, pin_memory=cuda), None)
        host = self._host_copy[0]
        host.copy_(self.quiet_mask().sum(), non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        self._host_copy = (host, event)

    def _read_host_copy(self) -> int:
        if self._host_copy is None:  # first update (or after a resume): one read of the device
            return int(self.quiet_mask().sum())
        host, event = self._host_copy
        if event is not None:
            event.synchronize()  # recorded a whole step ago: done by now
        return int(host)

    def dead_mask(self) -> torch.Tensor:
        return self.tokens_since_fired_S >= self.dead_tokens_threshold

    def n_dead(self) -> torch.Tensor:
        return self.dead_mask().sum()

    def quiet_mask(self) -> torch.Tensor:
        return self.tokens_since_fired_S >= self.quiet_tokens

    def n_dense(self) -> torch.Tensor:
        return (self.freq_S > self.dense_frac).sum()

    def state_dict(self) -> dict:
        return {
            "tokens_since_fired_S": self.tokens_since_fired_S.clone(),
            "freq_S": self.freq_S.clone(),
            "n_tokens": self.n_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        t = state["tokens_since_fired_S"]
        if tuple(t.shape) != (self.width,):
            raise TrainError(f"FiringStats state is for width {tuple(t.shape)}, this objective has {self.width}")
        self.tokens_since_fired_S = t.clone().to(torch.int64)
        self.freq_S = state["freq_S"].clone().to(torch.float32)
        self.n_tokens = int(state["n_tokens"])
        self._host_copy = None


def _base_metrics(sae: SAE, x_BD: torch.Tensor, x_hat_BD: torch.Tensor, f_BS: torch.Tensor):
    x_BD = x_BD.to(x_hat_BD.dtype)
    mse = (x_hat_BD - x_BD).pow(2).mean()
    x_det = x_BD.detach()
    var_x = (x_det - x_det.mean(0)).pow(2).mean()  # two passes: torch's var over dim 0 is far slower on CPUs
    if f_BS is None:
        return mse, var_x, None
    l1 = (f_BS.abs() @ sae.W_dec.norm(dim=1)).mean()
    return mse, var_x, l1


def _codes_metrics(sae: SAE, aux: dict, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """l1 and l0 of a sparse forward from its codes (the values of f_BS elsewhere are zero)."""
    col_N, val_N = aux["codes"].col_N, aux["val_N"]
    l1 = (val_N.abs() * sae.W_dec.norm(dim=1)[col_N]).sum() / batch
    return l1, (val_N != 0).sum().float() / batch


class Objective(abc.ABC):
    """Shared state and metrics; subclasses define the sparsity / auxiliary term.

    ``extra_metrics``: names of the subclass's own metrics, which its calls put in ``LossOut.extras``.
    """

    extra_metrics: tuple[str, ...] = ()
    needs_f = False  # True: _extra reads the dense f_BS, so a sparse forward must build it
    aux_coeff = 0.0  # > 0: an AuxK term over the quiet latents (FiringStats.quiet_mask)
    auxk_took_dead_window = False  # checkpoints before aux_tokens: AuxK over the dead latents (TopK family)

    def __init__(self, sae: SAE, dead_tokens_threshold: int = 10_000_000, dense_frac: float = 0.1,
                 aux_tokens: int | None = None):  # fmt: skip
        """``aux_tokens``: AuxK's window (objectives with an AuxK term); null: AUX_TOKENS_PER_LATENT x width,
        or ``dead_tokens_threshold`` for the other activations."""
        if aux_tokens is None and sae.cfg.activation in AUX_TOKENS_PER_LATENT:
            aux_tokens = AUX_TOKENS_PER_LATENT[sae.cfg.activation] * sae.cfg.width
        self.stats = FiringStats(sae.cfg.width, dead_tokens_threshold, dense_frac, quiet_tokens=aux_tokens)

    def __call__(self, sae: SAE, x_BD: torch.Tensor, *, sparsity_scale: float = 1.0, fwd=None) -> LossOut:
        """``fwd``: the SAE's forward output (x_hat_BD, f_BS, aux) when the caller computed it (the
        batched step of several SAEs); otherwise ``sae(x_BD)`` is called here."""
        if x_BD.ndim != 2 or x_BD.shape[0] < 1:
            raise TrainError(f"objective: expected a non-empty batch shaped (B, d_vit), got {tuple(x_BD.shape)}")
        x_hat_BD, f_BS, aux = sae(x_BD, dense_f=self.needs_f) if fwd is None else fwd
        if f_BS is None:  # sparse forward: the metrics come from the codes
            self.stats.update_codes(aux["codes"].col_N, aux["val_N"], x_BD.shape[0])
            mse, var_x, _ = _base_metrics(sae, x_BD, x_hat_BD, None)
            l1, l0 = _codes_metrics(sae, aux, x_BD.shape[0])
        else:
            self.stats.update(f_BS)
            mse, var_x, l1 = _base_metrics(sae, x_BD, x_hat_BD, f_BS)
            l0 = (f_BS.detach() != 0).sum(1).float().mean()
        self.fwd_aux = aux  # the forward's extras (sparse codes) for _extra; dropped below
        extra, aux_term = self._extra(sae, x_BD, x_hat_BD, f_BS, aux["pre_BS"], mse, var_x, l1, sparsity_scale)
        self.fwd_aux = None
        return LossOut(
            loss=mse + extra,
            mse=mse.detach(),
            nmse=(mse.detach() / var_x.clamp_min(torch.finfo(var_x.dtype).tiny)),
            l0=l0,
            l1=l1.detach(),
            n_dead=self.stats.n_dead(),
            n_dense=self.stats.n_dense(),
            aux=aux_term.detach(),
        )

    @abc.abstractmethod
    def _extra(self, sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale):
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"stats": self.stats.state_dict(), "aux_tokens": self.stats.quiet_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])

    def _auxk(self, sae, x_BD, x_hat_BD, pre_BS, fwd=None) -> torch.Tensor:
        """:func:`auxk_loss` over the quiet latents (their count read a step late where host reads lag)."""
        stats = self.stats
        n_quiet = stats.n_quiet_before if stats.lag_host_reads else None
        return auxk_loss(sae, x_BD, x_hat_BD, pre_BS, stats.quiet_mask(), self.k_aux, n_dead=n_quiet, fwd=fwd)

    def incompatible(self, state: dict) -> str | None:
        """Why a checkpoint's objective state (from an older recipe) cannot be continued exactly, or None:
        one written before AuxK's window existed (AuxK then took the dead window; JumpReLU had none),
        when this objective's AuxK term differs from that."""
        if self.aux_coeff == 0 or "aux_tokens" in state:
            return None
        if self.auxk_took_dead_window and self.stats.quiet_tokens == self.stats.dead_tokens_threshold:
            return None
        return ("this checkpoint was written before AuxK's window (aux_tokens; and JumpReLU's AuxK term) and "
                "cannot be continued exactly")


class ReLUObjective(Objective):
    """loss = MSE + l1_coeff * sparsity_scale * mean_b sum_s f_bs ||W_dec[s]||."""

    def __init__(self, sae: SAE, l1_coeff: float, **kw):
        if isinstance(l1_coeff, bool) or not isinstance(l1_coeff, int | float) or l1_coeff < 0:
            raise ConfigError(f"l1_coeff must be a number >= 0, got {l1_coeff!r}")
        super().__init__(sae, **kw)
        self.l1_coeff = float(l1_coeff)

    def _extra(self, sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale):
        return self.l1_coeff * sparsity_scale * l1, torch.zeros((), device=l1.device)


class AuxKObjective(Objective):
    """loss = MSE + aux_coeff * var(x) * AuxK (see the module docstring).

    ``k_aux`` defaults to d_vit // 2 and is capped at the number of quiet latents.
    """

    auxk_took_dead_window = True

    def __init__(self, sae: SAE, aux_coeff: float = 1 / 32, k_aux: int | None = None, **kw):
        if isinstance(aux_coeff, bool) or not isinstance(aux_coeff, int | float) or aux_coeff < 0:
            raise ConfigError(f"aux_coeff must be a number >= 0, got {aux_coeff!r}")
        if k_aux is None:
            k_aux = max(1, sae.cfg.d_vit // 2)
        if not isinstance(k_aux, int) or isinstance(k_aux, bool) or k_aux < 1:
            raise ConfigError(f"k_aux must be an integer >= 1, got {k_aux!r}")
        super().__init__(sae, **kw)
        self.aux_coeff = float(aux_coeff)
        self.k_aux = k_aux

    def _extra(self, sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale):
        aux = self._auxk(sae, x_BD, x_hat_BD, pre_BS, fwd=self.fwd_aux)
        return self.aux_coeff * var_x * aux, aux


def auxk_loss(
    sae: SAE,
    x_BD: torch.Tensor,
    x_hat_BD: torch.Tensor,
    pre_BS: torch.Tensor,
    dead_S: torch.Tensor,
    k_aux: int,
    n_dead: int | None = None,
    fwd: dict | None = None,
) -> torch.Tensor:
    """Normalized MSE of reconstructing the residual x - x_hat (detached) from the top
    min(k_aux, n_dead) relu'd pre-activations of the dead latents (decoder without b_dec).

    Zero (with a graph-free zero tensor) when no latent is dead. ``k_aux`` is a Python int;
    ``n_dead`` (default: read from ``dead_S``, one device sync) may be a lagged count: picks
    beyond the latents dead now contribute zero. ``fwd`` holding "codes" (the forward was
    sparse): the reconstruction goes through SAE.encode_codes / decode_codes.
    """
    if n_dead is None:
        n_dead = int(dead_S.sum())
    if n_dead == 0:
        return torch.zeros((), dtype=x_hat_BD.dtype, device=x_hat_BD.device)
    e_BD = (x_BD.to(x_hat_BD.dtype) - x_hat_BD).detach()
    k = min(k_aux, n_dead, pre_BS.shape[1])
    dead_S = dead_S.to(pre_BS.device)
    dead_pre_BS = pre_BS.masked_fill(~dead_S, float("-inf"))
    if fwd is not None and "codes" in fwd:
        codes = Codes.per_row(dead_pre_BS.detach().topk(k, dim=-1, sorted=False).indices)
        val_N = torch.relu(sae.encode_codes(fwd["x_BD"], pre_BS, codes)) * dead_S[codes.col_N]
        with sae.autocast():
            e_hat_BD = sae.decode_codes(codes, val_N)
    else:
        vals_BK, idx_BK = dead_pre_BS.topk(k, dim=-1, sorted=False)
        f_aux_BS = torch.zeros_like(pre_BS).scatter(-1, idx_BK, torch.relu(vals_BK))
        with sae.autocast():
            e_hat_BD = (f_aux_BS @ sae.W_dec).to(e_BD.dtype)
    denom = e_BD.pow(2).sum().clamp_min(torch.finfo(e_BD.dtype).tiny)
    return (e_hat_BD - e_BD).pow(2).sum() / denom


def _number(name: str, v: object, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= low or v != v:
        raise ConfigError(f"{name} must be a number >= {low:g}, got {v!r}")
    return float(v)


class _ExtrasMixin:
    """Puts the metrics a subclass's ``_extra`` left in ``self._extras`` into ``LossOut.extras``."""

    def __call__(self, sae: SAE, x_BD: torch.Tensor, *, sparsity_scale: float = 1.0, fwd=None) -> LossOut:
        self._extras: dict[str, torch.Tensor] = {}
        out = super().__call__(sae, x_BD, sparsity_scale=sparsity_scale, fwd=fwd)
        out.extras = self._extras
        return out


class JumpReLUObjective(_ExtrasMixin, Objective):
    """loss = MSE + l0_coeff * sparsity_scale * var(x) * L0 + preact_coeff * P + aux_coeff * var(x) * AuxK.

    L0 is the mean number of latents with pre > theta, differentiated wrt theta by the
    straight-through estimator (:class:`~actcache.sae.modeling.HeavisideStep`); scaled by the
    (detached) batch variance of x, ``l0_coeff`` is the fraction of variance one active latent
    must explain to be worth its place, whatever the data's scale. P, the pre-activation penalty
    (Anthropic's variant, off by default): mean_b sum_s relu(theta_s - pre_bs) * ||W_dec[s]||,
    which raises the pre-activations of latents below threshold so that ones that never fire
    get a gradient again; it is in the units of the ReLU objective's L1 term.
    AuxK (:func:`auxk_loss`, as for TopK) over the quiet latents (none within ``aux_tokens``): a
    latent whose pre-activations all sit below its threshold gets no other gradient
    (closed gate; the straight-through estimator sees only pre-activations within half a
    bandwidth), so it would stay dead; AuxK turns its encoder and decoder towards what the SAE
    fails to reconstruct until it fires, without changing the forward pass.
    Extras: ``l0_penalty`` (the L0 term as added to the loss), ``preact`` (P), ``threshold_mean``.
    """

    extra_metrics = ("l0_penalty", "preact", "threshold_mean")
    needs_f = True

    def __init__(self, sae: SAE, l0_coeff: float, preact_coeff: float = 0.0, aux_coeff: float = 1.0, **kw):
        if sae.cfg.activation != "jumprelu":
            raise ConfigError(f"JumpReLUObjective needs a jumprelu SAE, got activation {sae.cfg.activation!r}")
        self.l0_coeff = _number("l0_coeff", l0_coeff)
        self.preact_coeff = _number("preact_coeff", preact_coeff)
        self.aux_coeff = _number("aux_coeff", aux_coeff)
        self.k_aux = max(1, sae.cfg.d_vit // 2)
        super().__init__(sae, **kw)

    def _extra(self, sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale):
        theta_S = sae.jumprelu_threshold()
        l0 = HeavisideStep.apply(pre_BS, theta_S, sae.jumprelu_bandwidth()).sum(1).mean()
        penalty = (self.l0_coeff * sparsity_scale) * var_x * l0
        with torch.set_grad_enabled(self.preact_coeff > 0 and torch.is_grad_enabled()):
            preact = (torch.relu(theta_S - pre_BS) @ sae.W_dec.norm(dim=1)).mean()
        extra = penalty + self.preact_coeff * preact if self.preact_coeff > 0 else penalty
        aux = torch.zeros((), dtype=mse.dtype, device=mse.device)
        if self.aux_coeff > 0:
            aux = self._auxk(sae, x_BD, x_hat_BD, pre_BS)
            extra = extra + self.aux_coeff * var_x * aux
        self._extras = {"l0_penalty": penalty.detach(), "preact": preact.detach(), "threshold_mean": theta_S.detach().mean()}
        return extra, aux



class MatryoshkaObjective(_ExtrasMixin, AuxKObjective):
    """loss = sum_m w_m * mse_m + aux_coeff * var(x) * AuxK, over the SAE's ``matryoshka_prefixes``.

    mse_m is the MSE of the reconstruction from the first m latents only (the last prefix is the
    whole SAE); the weights ``prefix_weights`` (default equal) are normalised to sum to 1, so the
    loss is in MSE units like the other objectives' and one prefix gives BatchTopK's loss.
    Extras: ``nmse_prefix_<m>`` (each prefix's FVU, mse_m / var(x)).
    """

    needs_f = True  # decode_prefixes reads f_BS

    def __init__(self, sae: SAE, prefix_weights: list[float] | tuple[float, ...] | None = None, **kw):
        if sae.cfg.activation != "matryoshka":
            raise ConfigError(f"MatryoshkaObjective needs a matryoshka SAE, got activation {sae.cfg.activation!r}")
        prefixes = sae.cfg.matryoshka_prefixes
        w = [1.0] * len(prefixes) if prefix_weights is None else list(prefix_weights)
        if len(w) != len(prefixes):
            raise ConfigError(f"matryoshka_weights has {len(w)} values for {len(prefixes)} prefixes {list(prefixes)}")
        w = [_number("each of matryoshka_weights", v) for v in w]
        if sum(w) <= 0:
            raise ConfigError(f"matryoshka_weights must not all be 0, got {w}")
        super().__init__(sae, **kw)
        self.prefixes = prefixes
        self.weights = [v / sum(w) for v in w]
        self.extra_metrics = tuple(f"nmse_prefix_{m}" for m in prefixes)

    def _extra(self, sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale):
        x_BD = x_BD.to(x_hat_BD.dtype)
        tiny = torch.finfo(var_x.dtype).tiny
        recon = torch.zeros((), dtype=mse.dtype, device=mse.device)
        for m, w, xm_BD in zip(self.prefixes, self.weights, sae.decode_prefixes(f_BS, self.prefixes), strict=True):
            mse_m = (xm_BD - x_BD).pow(2).mean()
            recon = recon + w * mse_m
            self._extras[f"nmse_prefix_{m}"] = mse_m.detach() / var_x.clamp_min(tiny)
        aux_loss, aux = super()._extra(sae, x_BD, x_hat_BD, f_BS, pre_BS, mse, var_x, l1, sparsity_scale)
        # The base class adds the full SAE's mse; the prefix sum replaces it.
        return recon - mse + aux_loss, aux


def make_objective(
    sae: SAE,
    *,
    l1_coeff: float | None = None,
    l0_coeff: float | None = None,
    preact_coeff: float = 0.0,
    prefix_weights: list[float] | tuple[float, ...] | None = None,
    **kw,
) -> Objective:
    """ReLUObjective for ``relu`` SAEs (``l1_coeff`` required), JumpReLUObjective for ``jumprelu``
    (``l0_coeff`` required, ``preact_coeff``, ``aux_coeff``), MatryoshkaObjective for ``matryoshka``
    (``prefix_weights``), AuxKObjective otherwise.

    Keyword arguments: dead_tokens_threshold, dense_frac; aux_coeff, aux_tokens (TopK variants and
    JumpReLU), k_aux (TopK variants).
    """
    act = sae.cfg.activation
    if act != "jumprelu" and (l0_coeff is not None or preact_coeff):
        raise ConfigError(f"l0_coeff and preact_coeff are only used by jumprelu SAEs; this SAE's activation is {act!r}")
    if act != "matryoshka" and prefix_weights is not None:
        raise ConfigError(f"prefix_weights are only used by matryoshka SAEs; this SAE's activation is {act!r}")
    if act == "jumprelu":
        if l0_coeff is None:
            raise ConfigError("a jumprelu SAE needs l0_coeff (the L0 sparsity coefficient)")
        if l1_coeff is not None:
            raise ConfigError("l1_coeff is only used by relu SAEs; a jumprelu SAE takes l0_coeff")
        return JumpReLUObjective(sae, l0_coeff, preact_coeff, **kw)
    if act == "matryoshka" and l1_coeff is None:
        return MatryoshkaObjective(sae, prefix_weights, **kw)
    if sae.cfg.activation == "relu":
        if l1_coeff is None:
            raise ConfigError("a relu SAE needs l1_coeff (the L1 sparsity coefficient)")
        return ReLUObjective(sae, l1_coeff, **kw)
    if l1_coeff is not None:
        raise ConfigError(f"l1_coeff is only used by relu SAEs; this SAE's activation is {sae.cfg.activation!r}")
    return AuxKObjective(sae, **kw)
