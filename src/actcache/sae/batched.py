"""Several SAEs of equal shape stepped as one batched module: their parameters stacked (G, ...),
the encoder and decoder matmuls of all G run as one ``bmm``, one Adam over the stacks.

    stack = BatchedSAEs(saes, optimizers)     # copies weights and Adam state in (gather)
    outs = stack.step(objectives, x_BD, lr=lr, sparsity_scales=[1.0] * G, max_grad_norm=1.0)
    stack.scatter()                           # copies them back out (before a checkpoint or eval)

Each SAE's loss is its own objective's, computed on its slice of the batched forward with the
SAE's parameters swapped for views of the stacks (``unbind``, so the backward stacks the G
gradients once); the loss of the stack is their sum, so each SAE gets its own gradient. Then per
SAE, as ``optim.train_step`` does: decoder gradients made tangent, gradient norm clipped (each
SAE's own norm), Adam (elementwise, so stacking changes nothing), decoder rows renormalised.
The results equal stepping the SAEs one by one up to the rounding of ``bmm`` against ``mm``.

What may differ between the SAEs: the seed and the objective's coefficients (l1/l0/preact/aux
coefficients, sparsity warm-up). What must agree (:func:`batch_key`): the SAE config besides the
seed, decode mode, precision and the optimizer's settings. Sparse decoding batches only the
pre-activation matmul that chooses the codes; its gathers stay per SAE.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from actcache.sae.modeling import SAE
from actcache.sae.optim import matmul_precision
from actcache.sae.spec import BATCH_MODES


def batch_key(sae: SAE, optimizer: torch.optim.Optimizer, schedule: object = None) -> tuple:
    """SAEs with equal keys can be stepped as one stack (``schedule``: the caller's LR schedule)."""
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "lr"}
    return (
        dataclasses.replace(sae.cfg, seed=0), sae.decode_mode, sae.precision, str(sae.W_enc.device),
        type(optimizer).__name__, repr(sorted(defaults.items())), schedule,
    )  # fmt: skip


def choose_batching(mode: str, device: str, n_saes: int) -> bool:
    """``batch_saes``: on | off | auto. auto stacks only where stacking was measured faster: on
    the CPU, where the G matmuls already fill the cores, it measured within 6% of one by one
    (BENCHMARKS.md, train-stack); on CUDA it is not measured yet (scripts/gpu_session.sh train
    runs the A/B), so auto leaves the SAEs separate everywhere and ``on`` opts in."""
    if mode not in BATCH_MODES:
        raise ValueError(f"batch_saes must be one of {list(BATCH_MODES)}, got {mode!r}")
    if n_saes < 2 or mode == "off":
        return False
    del device  # the choice does not depend on it until a device measures stacking faster
    return mode == "on"


@contextlib.contextmanager
def _bound(sae: SAE, views: dict[str, torch.Tensor]):
    """The SAE's parameters replaced by ``views`` (tensors in the stacks' graph) inside the block."""
    saved = {name: sae._parameters[name] for name in views}
    try:
        sae._parameters.update(views)
        yield sae
    finally:
        sae._parameters.update(saved)


class BatchedSAEs:
    """G SAEs of equal :func:`batch_key` and their Adam optimizers, as stacked parameters."""

    def __init__(self, saes: list[SAE], optimizers: list[torch.optim.Optimizer]):
        if len(saes) < 2 or len(saes) != len(optimizers):
            raise ValueError("BatchedSAEs needs two or more SAEs, each with its optimizer")
        self.saes, self.opts = saes, optimizers
        self.names = [n for n, _ in saes[0].named_parameters()]
        self.params = {n: nn.Parameter(torch.stack([getattr(s, n).detach() for s in saes])) for n in self.names}
        opt0 = optimizers[0]
        self.opt = type(opt0)(list(self.params.values()), **opt0.defaults)
        self._gather_state()

    # -- copies in and out --------------------------------------------------------------------------
    def _member_params(self, g: int) -> list[nn.Parameter]:
        return [getattr(self.saes[g], n) for n in self.names]

    @torch.no_grad()
    def _gather_state(self) -> None:
        """Adam's state of every member, stacked (nothing when the members have not stepped yet)."""
        for i, stacked in enumerate(self.params.values()):
            states = [opt.state.get(self._member_params(g)[i]) for g, opt in enumerate(self.opts)]
            if not states[0]:
                continue
            self.opt.state[stacked] = {
                k: torch.stack([st[k] for st in states]) if v.ndim > 0 else v.clone() for k, v in states[0].items()
            }

    @torch.no_grad()
    def gather(self) -> None:
        """Weights and Adam state from the member SAEs and optimizers into the stacks."""
        for n, stacked in self.params.items():
            stacked.copy_(torch.stack([getattr(s, n).detach() for s in self.saes]))
        self.opt.state.clear()
        self._gather_state()

    @torch.no_grad()
    def scatter(self) -> None:
        """Weights and Adam state from the stacks into the member SAEs and optimizers."""
        for g, (sae, opt) in enumerate(zip(self.saes, self.opts, strict=True)):
            for n, stacked in self.params.items():
                getattr(sae, n).copy_(stacked[g])
            for p, stacked in zip(self._member_params(g), self.params.values(), strict=True):
                state = self.opt.state.get(stacked)
                if state:
                    opt.state[p] = {k: (v[g] if v.ndim > 0 else v).clone() for k, v in state.items()}

    # -- one step -----------------------------------------------------------------------------------
    def step(self, objectives, x_BD: torch.Tensor, *, lr: float, sparsity_scales: list[float],
             max_grad_norm: float | None) -> list:  # fmt: skip
        """One optimizer step of every SAE on ``x_BD``; returns each objective's LossOut."""
        sae0 = self.saes[0]
        if sae0.cfg.activation == "jumprelu" and not all(s._jumprelu_ready() for s in self.saes):
            self.scatter()  # each member's threshold from this batch, as its own first forward sets it
            for sae in self.saes:
                sae.init_jumprelu_(x_BD)
            self.gather()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        views = {n: p.unbind(0) for n, p in self.params.items()}
        per_sae = [{n: v[g] for n, v in views.items()} for g in range(len(self.saes))]
        with matmul_precision(sae0.precision):
            fwds = self._forward(objectives, x_BD, per_sae)
            outs = []
            for sae, obj, bound, fwd, scale in zip(self.saes, objectives, per_sae, fwds, sparsity_scales, strict=True):
                with _bound(sae, bound):
                    outs.append(obj(sae, x_BD, sparsity_scale=scale, fwd=fwd))
            torch.stack([o.loss for o in outs]).sum().backward()
        self._update(max_grad_norm)
        return outs

    def _forward(self, objectives, x_BD: torch.Tensor, per_sae: list[dict]) -> list[tuple]:
        """Each SAE's (x_hat_BD, f_BS, aux) as its own forward gives them, with the matmuls batched."""
        sae0, p = self.saes[0], self.params
        sae0._check_x(x_BD)
        x_BD = x_BD.to(p["W_enc"].dtype)
        with sae0.autocast():
            if sae0.decode_mode in ("sparse", "hybrid"):
                with torch.no_grad():
                    pre_GBS = self._sparse_pre_acts(x_BD)
                out = []
                for sae, obj, bound, pre_BS in zip(self.saes, objectives, per_sae, pre_GBS, strict=True):
                    with _bound(sae, bound):
                        out.append(sae._forward_sparse(x_BD, obj.needs_f, pre_BS=pre_BS))
                return out
            pre_GBS = torch.bmm(x_BD - p["b_dec"][:, None], p["W_enc"]) + p["b_enc"][:, None]
            pre_list = pre_GBS.unbind(0)
            f_list = []
            for sae, bound, pre_BS in zip(self.saes, per_sae, pre_list, strict=True):
                with _bound(sae, bound):
                    f_list.append(sae.activate(pre_BS))
            x_hat_GBD = torch.bmm(torch.stack(f_list), p["W_dec"]) + p["b_dec"][:, None]
        return [(x_hat_BD, f_BS, {"pre_BS": pre_BS}) for x_hat_BD, f_BS, pre_BS in zip(x_hat_GBD.unbind(0), f_list, pre_list, strict=True)]  # fmt: skip

    def _sparse_pre_acts(self, x_BD: torch.Tensor) -> torch.Tensor:
        """SAE._sparse_pre_acts of every SAE at once -> (G, B, S)."""
        p = self.params
        xc_GBD = x_BD - p["b_dec"][:, None]
        if self.saes[0].precision == "bf16":
            return torch.baddbmm(p["b_enc"][:, None], xc_GBD, p["W_enc"])
        return (torch.bmm(xc_GBD, p["W_enc"]) + p["b_enc"][:, None]).to(p["W_enc"].dtype)

    @torch.no_grad()
    def _update(self, max_grad_norm: float | None) -> None:
        """optim.train_step's update after the backward, per SAE on its slice of each stack."""
        normalize = self.saes[0].cfg.normalize_decoder
        W = self.params["W_dec"]
        if normalize and W.grad is not None:
            g = W.grad
            tiny = torch.finfo(W.dtype).tiny
            g.sub_((g * W).sum(2, keepdim=True) / (W * W).sum(2, keepdim=True).clamp_min(tiny) * W)
        if max_grad_norm is not None:
            self._clip(max_grad_norm)
        self.opt.step()
        if normalize:
            W.div_(W.norm(dim=2, keepdim=True).clamp_min(torch.finfo(W.dtype).tiny))

    def _clip(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ of each SAE's own parameters."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        norms_GP = torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in grads], dim=1)
        total_G = torch.linalg.vector_norm(norms_GP, dim=1)
        coef_G = (max_norm / (total_G + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef_G.view(-1, *([1] * (g.ndim - 1))).to(g.dtype))
