"""SAE quality against SAELens and sparsify, trained on identical batches of a known dictionary.

    python scripts/bench_quality.py [--only topk,batchtopk,matryoshka,jumprelu] [--sizes 64,256]
                                    [--regimes short,long] [--seeds 0,1,2] [--no-record]
                                    [--results PATH] [--libs actcache,saelens,sparsify] [--threads N]
                                    [--merge JSON ...] [--record-only] [--steps N] [--device cpu|cuda]

Data (generated in memory, seeded, identical for every trainer): n_true = 8 d unit-norm true
directions in R^d; each example is a mean offset (norm 2, one fixed direction) plus
``K_TRUE`` = 8 of the directions, drawn without replacement with Zipf-like frequencies
p_i proportional to (i + 1)^-0.8, each with a coefficient uniform in [0.5, 1.5], plus
Gaussian noise of total variance 1% of the signal's. Batch b of a cell is the same tensor for
every trainer (a generator seeded by (data seed, b)); the held-out set is 16,384 examples from
another seed. The trainers step in lockstep on each batch, in a rotating order, so their
steps/s are measured in alternating rounds under the same load.

Trainers, each through the lowest public layer that keeps its library's training maths:
- actcache: ``SAE``, ``make_objective``, ``make_optimizer``, ``LRSchedule`` and ``train_step``
  built from a ``RunConfig`` exactly as ``actcache train`` builds them (sae/train.py
  ``_Member``), initialised from the first batch by ``train.init_from_batch``; the loader is
  bypassed (batches come from memory).
- SAELens 6.54: ``SAETrainer.step`` (its public seam for external coordinators) on the
  ``*TrainingSAE`` of the objective, evaluated as the inference SAE it saves
  (``save_inference_model`` + ``SAE.load_from_disk``; BatchTopK becomes JumpReLU there).
- sparsify 1.3.3: ``SparseCoder`` with its trainer's step (b_dec = mean of the first batch,
  unit-norm decoder, loss = FVU + auxk_alpha * AuxK, parallel gradient removed, optimizer step).
Everything at the library's documented defaults except: width (8 d), k (8), batch 4096, the
optimizer (Adam, lr 2e-3, constant: sparsify's default optimizer is signum, and its Adam
default warms up over 1,000 steps), and for JumpReLU the swept sparsity coefficient.

Metrics on the held-out set: FVU = sum ||x - x_hat||^2 / sum ||x - mean||^2; recovery = mean
over the true directions of the best cosine with a decoder row (chance: ~0.3 at d=64 for 512
random rows); dead = fraction of latents that fire on none of the held-out examples; L0 = mean
latents firing per example; steps/s = training steps per second spent in that trainer's steps
(batch generation excluded). Means over seeds; "±" the largest deviation from the mean.
JumpReLU: each library's coefficient is swept over its grid (``--jumprelu-grid-*``) and the
point whose mean held-out L0 is closest to k (in ratio) is reported, with its coefficient.

Results of every run are merged into ``--results`` (JSON, one row per cell, library, seed;
default in the temporary directory); the recorded section ``quality`` of BENCHMARKS.md shows
every cell in that file, so cells run apart (``--only``, ``--sizes``, ...) add up; ``--merge``
takes rows of other results files, ``--record-only`` records without training. Steps/s compare
only within one run (one row of the cell's libraries trained together).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402

K_TRUE = 8
BATCH = 4096
LR = 2e-3
N_HELDOUT = 16_384
ZIPF = 0.8
L0_MATCH = 0.15  # jumprelu: L0 within 15% of k counts as matched
REGIMES = {"short": 512, "long": 3072}
OBJECTIVES = ("topk", "batchtopk", "matryoshka", "jumprelu")
LIBS = ("actcache", "saelens", "sparsify")
PEERS = {"topk": ("saelens", "sparsify"), "batchtopk": ("saelens",), "matryoshka": ("saelens",),
         "jumprelu": ("saelens",)}  # fmt: skip
GRID_ACTCACHE = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # l0_coeff (fractions of variance per latent)
GRID_SAELENS = (0.03, 0.1, 0.3, 1.0, 3.0)  # l0_coefficient (MSE summed over dimensions per latent)
EXTRA_PACKAGES = {"sparsify": "eai-sparsify==1.3.3"}  # in the pyproject extra "bench-quality"
DEFAULT_RESULTS = os.path.join(tempfile.gettempdir(), "actcache-bench-quality.json")


# -- data -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Data:
    """The ground truth of one (d, data seed): true directions, frequencies, offset, noise scale."""

    d: int
    seed: int
    true_TD: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(1_000 + self.seed)
        n_true = 8 * self.d
        t = torch.randn(n_true, self.d, generator=g, dtype=torch.float64)
        self.true_TD = (t / t.norm(dim=1, keepdim=True)).float()
        self.logp_T = -ZIPF * torch.log(torch.arange(1, n_true + 1, dtype=torch.float32))
        off = torch.randn(self.d, generator=g)
        self.offset_D = 2.0 * off / off.norm()
        signal_var = K_TRUE * (1.0 + 1.0 / 12.0)  # E[c^2] for c ~ U[0.5, 1.5], unit directions
        self.noise_std = math.sqrt(0.01 * signal_var / self.d)

    def batch(self, index: int, n: int = BATCH) -> torch.Tensor:
        """Batch ``index`` (>= 0: training; -1: the held-out set)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 17)
        gumbel = -torch.log(-torch.log(torch.rand(n, len(self.logp_T), generator=g).clamp_min(1e-20)))
        idx_NK = (self.logp_T + gumbel).topk(K_TRUE, dim=1).indices  # without replacement, prop. to p
        coef_NK = 0.5 + torch.rand(n, K_TRUE, generator=g)
        x = torch.einsum("nk,nkd->nd", coef_NK, self.true_TD[idx_NK])
        return x + self.offset_D + self.noise_std * torch.randn(n, self.d, generator=g)


# -- trainers -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    objective: str
    d: int
    regime: str
    coeff: float | None = None  # jumprelu: the library's sparsity coefficient

    @property
    def width(self) -> int:
        return 8 * self.d

    @property
    def steps(self) -> int:
        return REGIMES[self.regime]

    @property
    def prefixes(self) -> tuple[int, ...]:
        w = self.width
        return (w // 4, w // 2, w)


class ActcacheTrainer:
    name = "actcache"

    def __init__(self, cell: Cell, seed: int, decode: str = "auto", device: str = "cpu"):
        from actcache.sae.config import RunConfig
        from actcache.sae.modeling import SAE
        from actcache.sae.objectives import make_objective
        from actcache.sae.optim import LRSchedule, make_optimizer

        kw: dict = {"activation": cell.objective, "width": cell.width, "exp_factor": None, "lr": LR, "seed": seed,
                    "batch_size": BATCH, "steps": cell.steps, "decode": decode}  # fmt: skip
        if cell.objective == "jumprelu":
            kw.update(k=None, l0_coeff=cell.coeff)
        else:
            kw["k"] = K_TRUE
        if cell.objective == "matryoshka":
            kw["matryoshka_prefixes"] = cell.prefixes
        self.run = run = RunConfig(**kw)
        self.sae = SAE(run.sae_config(cell.d)).to(device).set_compute(run.decode, run.precision)
        self.obj = make_objective(self.sae, **run.objective_kwargs())
        self.opt = make_optimizer(self.sae, lr=run.lr, betas=(run.beta1, run.beta2))
        self.sched = LRSchedule(lr=run.lr, warmup_steps=run.warmup_steps, total_steps=run.steps,
                                decay=run.lr_decay, final_frac=run.final_lr_frac)  # fmt: skip
        self.t = 0

    def step(self, x_BD: torch.Tensor) -> None:
        from actcache.sae.optim import sparsity_warmup, train_step
        from actcache.sae.train import init_from_batch

        run, sae = self.run, self.sae
        if self.t == 0:
            init_from_batch(sae, run, x_BD)
        self.sched.apply(self.opt, self.t)
        scale = sparsity_warmup(self.t, run.sparsity_warmup_steps)
        train_step(sae, self.obj, self.opt, x_BD, max_grad_norm=run.max_grad_norm, sparsity_scale=scale)
        self.t += 1
        if self.t == run.steps and sae.cfg.activation in ("batchtopk", "matryoshka"):
            sae.calibrate_threshold_(x_BD)  # as GroupTrainer._calibrate after the last step

    @torch.no_grad()
    def evaluate(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.sae.eval()
        x_hat, f, _ = self.sae(x_ND)
        self.sae.train()
        return x_hat, f != 0

    def decoder(self) -> torch.Tensor:
        return self.sae.W_dec.detach()


class SAELensTrainer:
    name = "saelens"

    def __init__(self, cell: Cell, seed: int, device: str = "cpu"):
        import sae_lens as sl
        from sae_lens.config import SAETrainerConfig

        common = {"d_in": cell.d, "d_sae": cell.width, "device": device}
        obj = cell.objective
        if obj == "topk":
            cfg, cls = sl.TopKTrainingSAEConfig(k=K_TRUE, **common), sl.TopKTrainingSAE
        elif obj == "batchtopk":
            cfg, cls = sl.BatchTopKTrainingSAEConfig(k=K_TRUE, **common), sl.BatchTopKTrainingSAE
        elif obj == "matryoshka":
            cfg = sl.MatryoshkaBatchTopKTrainingSAEConfig(k=K_TRUE, matryoshka_widths=list(cell.prefixes), **common)
            cls = sl.MatryoshkaBatchTopKTrainingSAE
        else:
            cfg, cls = sl.JumpReLUTrainingSAEConfig(l0_coefficient=cell.coeff, **common), sl.JumpReLUTrainingSAE
        torch.manual_seed(seed)
        self.sae = cls(cfg)
        # lr_end: what its runner config sets (lr / 10); the constant schedule never reads it
        tcfg = SAETrainerConfig(
            total_training_samples=cell.steps * BATCH, train_batch_size_samples=BATCH, lr=LR, lr_end=LR / 10,
            device=device,
        )
        self.trainer = sl.SAETrainer(tcfg, self.sae, data_provider=iter(()))

    def step(self, x_BD: torch.Tensor) -> None:
        tr = self.trainer
        tr.maybe_reset_sparsity()
        tr.step(x_BD)
        tr.n_training_steps += 1

    @torch.no_grad()
    def evaluate(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import sae_lens as sl

        with tempfile.TemporaryDirectory() as tmp:
            self.sae.save_inference_model(tmp)
            inf = sl.SAE.load_from_disk(tmp)
        inf.eval()
        f = inf.encode(x_ND)
        self.inference = inf
        return inf.decode(f), f != 0

    def decoder(self) -> torch.Tensor:
        return self.sae.W_dec.detach()


class SparsifyTrainer:
    name = "sparsify"

    def __init__(self, cell: Cell, seed: int, device: str = "cpu"):
        if cell.objective != "topk":
            raise ValueError("sparsify trains topk only here")
        from sparsify import SparseCoder, SparseCoderConfig, TrainConfig

        self.tcfg = TrainConfig(SparseCoderConfig(k=K_TRUE, num_latents=cell.width))
        torch.manual_seed(seed)
        self.sae = SparseCoder(cell.d, self.tcfg.sae, device=device)
        self.opt = torch.optim.Adam(self.sae.parameters(), lr=LR)
        self.since_fired_S = torch.zeros(cell.width, dtype=torch.long, device=device)
        self.t = 0

    def step(self, x_BD: torch.Tensor) -> None:
        sae, tcfg = self.sae, self.tcfg
        if self.t == 0:
            sae.b_dec.data = x_BD.mean(0)
        sae.set_decoder_norm_to_unit_norm()
        dead = self.since_fired_S > tcfg.dead_feature_threshold if tcfg.auxk_alpha > 0 else None
        out = sae(x_BD, dead_mask=dead)
        (out.fvu + tcfg.auxk_alpha * out.auxk_loss + out.multi_topk_fvu / 8).backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            self.since_fired_S += x_BD.shape[0]
            self.since_fired_S[out.latent_indices.flatten()] = 0
        self.t += 1

    @torch.no_grad()
    def evaluate(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top_acts, top_idx, _ = self.sae.encode(x_ND)
        fired = torch.zeros(x_ND.shape[0], self.sae.num_latents, dtype=torch.bool, device=x_ND.device)
        fired.scatter_(1, top_idx, top_acts != 0)
        return self.sae.decode(top_acts, top_idx), fired

    def decoder(self) -> torch.Tensor:
        return self.sae.W_dec.detach()


def make_trainer(lib: str, cell: Cell, seed: int, decode: str, device: str = "cpu"):
    if lib == "actcache":
        return ActcacheTrainer(cell, seed, decode, device)
    return {"saelens": SAELensTrainer, "sparsify": SparsifyTrainer}[lib](cell, seed, device)


# -- one cell -------------------------------------------------------------------------------------


def recovery(true_TD: torch.Tensor, dec_SD: torch.Tensor) -> float:
    dec = dec_SD.float().cpu()
    dec = dec / dec.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return float((true_TD @ dec.T).max(dim=1).values.mean())


def metrics(trainer, data: Data, x_ND: torch.Tensor) -> dict:
    x_hat, fired_NS = trainer.evaluate(x_ND)
    fvu = float((x_ND - x_hat.float()).pow(2).sum() / (x_ND - x_ND.mean(0)).pow(2).sum())
    return {"fvu": fvu, "recovery": recovery(data.true_TD, trainer.decoder()),
            "dead": float((~fired_NS.any(0)).float().mean()), "l0": float(fired_NS.sum(1).float().mean())}  # fmt: skip


def run_cell(
    cell: Cell, seed: int, runs: list[tuple[str, float | None]], decode: str, device: str = "cpu"
) -> list[dict]:
    """Train each (library, coefficient) of ``runs`` on the cell's batches in lockstep."""
    data = Data(cell.d, seed)
    trainers = []
    for lib, coeff in runs:
        c = dataclasses.replace(cell, coeff=coeff)
        trainers.append((lib, coeff, make_trainer(lib, c, seed, decode, device)))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    secs = [0.0] * len(trainers)
    for b in range(cell.steps):
        x_BD = data.batch(b).to(device)
        order = list(range(len(trainers)))
        order = order[b % len(order) :] + order[: b % len(order)]
        for i in order:
            sync()
            t0 = time.perf_counter()
            trainers[i][2].step(x_BD)
            sync()
            secs[i] += time.perf_counter() - t0
    x_ND = data.batch(-1, N_HELDOUT).to(device)
    rows = []
    for (lib, coeff, tr), s in zip(trainers, secs, strict=True):
        m = metrics(tr, data, x_ND)
        rows.append({"objective": cell.objective, "d": cell.d, "regime": cell.regime, "steps": cell.steps,
                     "lib": lib, "coeff": coeff, "seed": seed, "steps_per_s": cell.steps / s, **m})  # fmt: skip
    return rows


# -- the table ------------------------------------------------------------------------------------


def _cell_key(r: dict) -> tuple:
    return (r["objective"], r["d"], r["regime"])


def per_coeff(rows: list[dict]) -> list[dict]:
    """One row per (cell, library, coefficient): means over its seeds, and the FVU's spread."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((*_cell_key(r), r["lib"], r["coeff"]), []).append(r)
    out = []
    for (obj, d, regime, lib, coeff), rs in groups.items():
        mean = {m: sum(r[m] for r in rs) / len(rs) for m in ("fvu", "recovery", "dead", "l0", "steps_per_s")}
        spread = max(abs(r["fvu"] - mean["fvu"]) for r in rs)
        out.append({"objective": obj, "d": d, "regime": regime, "lib": lib, "coeff": coeff, "n": len(rs),
                    "fvu_spread": spread, **mean})  # fmt: skip
    return out


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (cell, library): ``per_coeff``'s; jumprelu: the coefficient with L0 nearest k."""
    best: dict[tuple, dict] = {}
    for r in per_coeff(rows):
        key = (r["objective"], r["d"], r["regime"], r["lib"])
        dist = abs(math.log(max(r["l0"], 1e-3) / K_TRUE))
        if key not in best or dist < best[key]["_dist"]:
            best[key] = {**r, "_dist": dist}
    return sorted(best.values(), key=lambda r: (OBJECTIVES.index(r["objective"]), r["d"], r["regime"],
                                                LIBS.index(r["lib"])))  # fmt: skip


def fvu_at_l0(points: list[dict], l0: float) -> float | None:
    """A library's FVU at ``l0``, linear between its two coefficients whose L0 bracket it; None when none do."""
    pts = sorted((p["l0"], p["fvu"]) for p in points)
    for (l0_a, fvu_a), (l0_b, fvu_b) in zip(pts, pts[1:], strict=False):
        if l0_a <= l0 <= l0_b and l0_b > l0_a:
            return fvu_a + (fvu_b - fvu_a) * (l0 - l0_a) / (l0_b - l0_a)
    return None


def judge(agg: list[dict], rows: list[dict] | None = None) -> list[dict]:
    """Per cell: actcache against the best peer (FVU, recovery - 0.01, dead + 1 point). JumpReLU:
    each peer's FVU interpolated to actcache's L0 between the peer's coefficients that bracket it
    (``rows``: every run), else taken at the peer's point nearest k if both L0 are within 15% of k."""
    points = per_coeff(rows or [])
    cells: dict[tuple, dict[str, dict]] = {}
    for r in agg:
        cells.setdefault(_cell_key(r), {})[r["lib"]] = r
    verdicts = []
    for key, libs in cells.items():
        ours = libs.get("actcache")
        peers = [v for k, v in libs.items() if k != "actcache"]
        if ours is None or not peers:
            continue
        best_fvu = min(p["fvu"] for p in peers)
        best_rec = max(p["recovery"] for p in peers)
        best_dead = min(p["dead"] for p in peers)
        v = {"objective": key[0], "d": key[1], "regime": key[2], "fvu_ok": ours["fvu"] <= best_fvu,
             "rec_ok": ours["recovery"] >= best_rec - 0.01, "dead_ok": ours["dead"] <= best_dead + 0.01}  # fmt: skip
        if key[0] == "jumprelu":  # the target: within 5% of SAELens's FVU at matched L0
            at = [fvu_at_l0([p for p in points if (*_cell_key(p), p["lib"]) == (*key, peer["lib"])], ours["l0"])
                  for peer in peers]  # fmt: skip
            if all(f is not None for f in at):
                v["peer_fvu_at_l0"] = min(at)
                v["fvu_ok"] = ours["fvu"] <= 1.05 * min(at)
            else:
                matched = all(abs(r["l0"] / K_TRUE - 1) <= L0_MATCH for r in (ours, *peers))
                v["fvu_ok"] = ours["fvu"] <= 1.05 * best_fvu if matched else None
        speed_peer = {"topk": "sparsify", "batchtopk": "saelens"}.get(key[0])
        if speed_peer in libs and not math.isnan(ours["steps_per_s"]):  # NaN: trained apart from its peers
            v["speed"] = ours["steps_per_s"] / libs[speed_peer]["steps_per_s"]
            v["speed_vs"] = speed_peer
        verdicts.append(v)
    return verdicts


def _label(r: dict) -> str:
    return r["lib"] if r["coeff"] is None else f"{r['lib']} ({r['coeff']:g})"


def render(agg: list[dict]) -> str:
    rows = []
    for r in agg:
        lib = _label(r)
        rows.append({"objective": r["objective"], "d": r["d"], "regime": r["regime"], "library (coeff)": lib,
                     "seeds": r["n"], "FVU": f"{r['fvu']:.4f} ± {r['fvu_spread']:.4f}",
                     "recovery": f"{r['recovery']:.3f}", "dead %": f"{100 * r['dead']:.1f}",
                     "L0": f"{r['l0']:.2f}",
                     "steps/s": "-" if math.isnan(r["steps_per_s"]) else f"{r['steps_per_s']:.2f}"})  # fmt: skip
    return benchlib.table(rows)


def _verdict(ok: bool | None) -> str:
    return "L0 not matched" if ok is None else "met" if ok else "missed"


def render_verdicts(verdicts: list[dict]) -> str:
    rows = []
    for v in verdicts:
        speed = f"{v['speed']:.2f}x {v['speed_vs']}" if "speed" in v else ""
        fvu = _verdict(v["fvu_ok"])
        if "peer_fvu_at_l0" in v:
            fvu += f" (peer {v['peer_fvu_at_l0']:.4f} at actcache's L0)"
        rows.append({"objective": v["objective"], "d": v["d"], "regime": v["regime"],
                     "FVU <= best peer": fvu,
                     "recovery >= best - 0.01": "met" if v["rec_ok"] else "missed",
                     "dead <= best + 1 pt": "met" if v["dead_ok"] else "missed", "actcache speed": speed})  # fmt: skip
    return benchlib.table(rows)


# -- main -----------------------------------------------------------------------------------------


def ensure_extras() -> None:
    """Install the bench-only packages (pyproject extra "bench-quality") when missing."""
    try:
        import sparsify  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *EXTRA_PACKAGES.values()], check=True)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def plan(args) -> list[tuple[Cell, list[tuple[str, float | None]]]]:
    libs = [v for v in args.libs.split(",") if v]
    out = []
    for obj in [v for v in args.only.split(",") if v]:
        if obj not in OBJECTIVES:
            raise SystemExit(f"--only: unknown objective {obj!r}; choose from {','.join(OBJECTIVES)}")
        for d in (int(v) for v in args.sizes.split(",") if v):
            for regime in [v for v in args.regimes.split(",") if v]:
                if regime not in REGIMES:
                    raise SystemExit(f"--regimes: unknown regime {regime!r}; choose from {','.join(REGIMES)}")
                runs: list[tuple[str, float | None]] = []
                for lib in libs:
                    if lib != "actcache" and lib not in PEERS[obj]:
                        continue
                    if obj != "jumprelu":
                        runs.append((lib, None))
                    else:
                        grid = args.jumprelu_grid_actcache if lib == "actcache" else args.jumprelu_grid_saelens
                        runs += [(lib, c) for c in _floats(grid)]
                out.append((Cell(obj, d, regime), runs))
    return out


def load_results(path: str) -> list[dict]:
    """A results file: this script's JSON list, or bench_jumprelu.py's JSON lines (jumprelu rows)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        if not path.endswith(".jsonl"):
            return json.load(fh)
        rows = [json.loads(line) for line in fh if line.strip()]
    return [{"objective": "jumprelu", "steps_per_s": math.nan, **r} for r in rows]  # trained apart: no lockstep


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """New rows replace old ones of the same (cell, library, coefficient, seed)."""

    def ident(r):
        return (*_cell_key(r), r["lib"], r["coeff"], r["seed"])

    fresh = {ident(r) for r in new}
    return [r for r in old if ident(r) not in fresh] + new


def _span(rows: list[dict], name: str) -> str:
    vals = [r[name] for r in rows if name in r]
    if not vals:
        return "?"
    lo, hi = min(vals), max(vals)
    return f"{lo:g}" if lo == hi else f"{lo:.1f}-{hi:.1f}"


def _grid(rows: list[dict], lib: str) -> str:
    vals = sorted({r["coeff"] for r in rows if r["lib"] == lib and r["coeff"] is not None})
    return ",".join(f"{v:g}" for v in vals) or "none"


def _cells_run(rows: list[dict]) -> str:
    """e.g. "seeds 0,1,2: topk d=64 short, batchtopk d=64 short; seed 0: topk d=256 short": what the table holds."""
    seeds: dict[tuple, set] = {}
    for r in rows:
        seeds.setdefault(_cell_key(r), set()).add(r["seed"])
    logged = {_cell_key(r) for r in rows if r.get("from_log")}  # a run stopped before writing its rows
    groups: dict[tuple, list[str]] = {}
    for (o, d, g), v in seeds.items():
        groups.setdefault((tuple(sorted(v)), (o, d, g) in logged), []).append(f"{o} d={d} {g}")
    parts = [f"seed{'s' if len(v) > 1 else ''} {','.join(map(str, v))}{' (rows read from a log)' if log else ''}: "
             + ", ".join(cells) for (v, log), cells in sorted(groups.items(), key=lambda kv: (-len(kv[0][0]), kv[0]))]  # fmt: skip
    return "; ".join(parts) + "; nothing else"


def _conclusions(verdicts: list[dict]) -> list[str]:
    """Cells where every point is met, cells with a miss (naming it), and cells of the grid not run."""
    def cell(v):
        return f"{v['objective']} d={v['d']} {v['regime']}"

    met = [cell(v) for v in verdicts if v["fvu_ok"] and v["rec_ok"] and v["dead_ok"]]
    missed = [f"{cell(v)} ({', '.join(k for k in ('fvu', 'rec', 'dead') if not v[k + '_ok'])})"
              for v in verdicts if not (v["fvu_ok"] and v["rec_ok"] and v["dead_ok"])]  # fmt: skip
    run = {(v["objective"], v["d"], v["regime"]) for v in verdicts}
    absent = [f"{o} d={d} {g}" for o in OBJECTIVES for d in (64, 256) for g in REGIMES if (o, d, g) not in run]
    out = [f"met (FVU, recovery and dead against the best peer): {'; '.join(met) or 'none'}"]
    if missed:
        out.append(f"missed: {'; '.join(missed)}")
    out.append(f"not run: {'; '.join(absent) or 'none'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(OBJECTIVES), help="objectives, e.g. topk,batchtopk")
    ap.add_argument("--sizes", default="64,256", help="d values (width = 8 d)")
    ap.add_argument(
        "--regimes", default="short,long", help=f"short ({REGIMES['short']} steps), long ({REGIMES['long']})"
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, help="every regime runs this many steps instead (smoke runs)")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--decode", default="auto", help="actcache's decode key (auto | dense | sparse)")
    ap.add_argument("--jumprelu-grid-actcache", default=",".join(map(str, GRID_ACTCACHE)), help="l0_coeff values")
    ap.add_argument("--jumprelu-grid-saelens", default=",".join(map(str, GRID_SAELENS)), help="l0_coefficient values")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: every library trains there")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="JSON file the rows are merged into")
    ap.add_argument("--no-record", action="store_true", help="print only; do not write BENCHMARKS.md")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="also merge the rows of this results file (of runs made apart; bench_jumprelu.py's "
                         ".jsonl too); repeatable")  # fmt: skip
    ap.add_argument("--record-only", action="store_true", help="train nothing: table and record from --results")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "sparsify" in args.libs and not args.record_only:
        ensure_extras()
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(v) for v in args.seeds.split(",") if v]
    if args.steps:
        REGIMES.update(dict.fromkeys(REGIMES, args.steps))
    for cell, runs in [] if args.record_only else plan(args):
        for seed in seeds:
            t0 = time.time()
            load1 = os.getloadavg()[0]
            rows = [
                {**r, "load": load1, "threads": torch.get_num_threads(), "device": args.device}
                for r in run_cell(cell, seed, runs, args.decode, args.device)
            ]
            kept = merge(load_results(args.results), rows)  # after every seed: an interrupted grid keeps its cells
            with open(args.results, "w") as fh:
                json.dump(kept, fh, indent=1)
            done = ", ".join(
                f"{_label(r)} fvu {r['fvu']:.4f} rec {r['recovery']:.3f} L0 {r['l0']:.2f} "
                f"dead {100 * r['dead']:.1f}% {r['steps_per_s']:.1f}/s"
                for r in rows
            )
            print(
                f"{cell.objective} d={cell.d} {cell.regime} seed {seed} ({time.time() - t0:.0f} s): {done}", flush=True
            )
    rows = load_results(args.results)
    for path in args.merge:
        rows = merge(rows, load_results(path))
    with open(args.results, "w") as fh:
        json.dump(rows, fh, indent=1)
    agg = aggregate(rows)
    verdicts = judge(agg, rows)
    print(render(agg))
    print(render_verdicts(verdicts))
    if args.no_record:
        return
    setup = [
        f"data: n_true = 8 d unit directions, {K_TRUE} per example with Zipf-like frequencies (exponent {ZIPF}), "
        "coefficients U[0.5, 1.5], offset of norm 2, noise 1% of the variance; width 8 d, k 8, batch 4096, "
        f"Adam lr {LR:g} constant for all; {N_HELDOUT:,} held-out examples",
        "actcache: RunConfig defaults through SAE/make_objective/train_step (the loader bypassed); SAELens "
        "SAETrainer.step at its defaults; sparsify SparseCoder + its trainer's step at its defaults (Adam instead of signum)",
        "dead: fires on none of the held-out examples; recovery: mean best decoder cosine per true direction; "
        f"steps/s: lockstep rounds on {'/'.join(sorted({r.get('device', 'cpu') for r in rows}))}, "
        f"{_span(rows, 'threads')} torch CPU thread(s), 1-min load "
        f"{_span(rows, 'load')} when the cells started (\"-\": trained apart from its peers)",
        f"jumprelu: coefficients run: actcache l0_coeff {_grid(rows, 'actcache')}, SAELens l0_coefficient "
        f"{_grid(rows, 'saelens')}; the point with held-out L0 nearest {K_TRUE} (in ratio) is shown; the verdict "
        "compares actcache's FVU with the peer's interpolated (linear in L0) to actcache's L0 between the peer's "
        "coefficients that bracket it, within 5%",
    ]
    setup.append("cells run: " + _cells_run(rows))
    conclusions = _conclusions(verdicts)
    body = benchlib.section_body(setup, [render(agg), render_verdicts(verdicts)], conclusions)
    benchlib.record("quality", "SAE quality against SAELens and sparsify (bench_quality.py)", body)


if __name__ == "__main__":
    main()
