"""Plots of `actcache visuals` (matplotlib, Agg): training curves, firing frequencies, and the
sweep outputs (NMSE against L0 across SAEs, the Pareto views, every SAE's curves, a small index page)."""

from __future__ import annotations

import html
import json
import os

import numpy as np

from actcache.errors import ActCacheError
from actcache.fsutil import atomic_write_bytes
from actcache.rundir import (
    CURVES_PLOT,
    EXPLORER_DIR,
    NMSE_L0_PLOT,
    PAGE_FILE,
    SWEEP_FILE,
    VISUALS_DIR,
    Run,
    read_metrics,
)
from actcache.topk import LatentSummary
from actcache.visuals_pareto import CAPTIONS, CHANCE, panels, pareto_front, pareto_points
from actcache.visuals_pareto import VIEWS as PARETO_VIEWS


class PlotError(ActCacheError):
    """The plots cannot be drawn (matplotlib is missing)."""


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _width(run: Run) -> int | None:
    return run.sae_config().get("width") or run.info.get("width")


def plot_curves(runs: list[Run], path: str) -> bool:
    """NMSE, L0 and inactive % (the trainer's AuxK window, not the dead count) against training
    step, one line per run; False when no metrics."""
    data = [(r, read_metrics(r.dir)) for r in runs]
    data = [(r, m) for r, m in data if m]
    if not data:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for r, m in data:
        step = [x.get("step") for x in m]
        width = _width(r)
        series = {
            "NMSE": [x.get("nmse") for x in m], "L0": [x.get("l0") for x in m],
            "inactive % (training window)": [100.0 * x["n_dead"] / width if width and x.get("n_dead") is not None
                                             else None for x in m],  # fmt: skip
        }  # fmt: skip
        for ax, (name, ys) in zip(axes, series.items(), strict=True):
            pts = [(s, y) for s, y in zip(step, ys, strict=True) if s is not None and y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=r.label(), lw=1.2)
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    if len(data) > 1:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def sweep_points(runs: list[Run]) -> list[dict]:
    pts = []
    for r in runs:
        ev = r.eval()
        if isinstance(ev.get("nmse"), (int, float)) and isinstance(ev.get("l0"), (int, float)):
            pts.append({"run": r.dir, "sae_id": r.name, "label": r.label(), "nmse": ev["nmse"], "l0": ev["l0"],
                        "source": "eval"})  # fmt: skip
            continue
        m = [x for x in read_metrics(r.dir) if x.get("nmse") is not None and x.get("l0") is not None]
        if m:
            pts.append({"run": r.dir, "sae_id": r.name, "label": r.label(), "nmse": m[-1]["nmse"], "l0": m[-1]["l0"],
                        "source": "train", "step": m[-1].get("step")})  # fmt: skip
    return pts


def plot_sweep(points: list[dict], path: str) -> bool:
    if not points:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for src, marker in (("eval", "o"), ("train", "s")):
        p = [x for x in points if x["source"] == src]
        if p:
            ax.scatter([x["l0"] for x in p], [x["nmse"] for x in p], marker=marker,
                       label="held-out eval" if src == "eval" else "last training metrics")  # fmt: skip
    _l0_axis(ax, points, "nmse", "L0 (latents per token)")
    ax.set_ylabel("NMSE")
    ax.set_title("NMSE against L0")
    _save_with_legend(plt, fig, ax, path)
    return True


def _l0_axis(ax, points: list[dict], key: str, xlabel: str) -> None:
    """An L0 scatter's labels and x axis: each SAE's label beside its point (L0, ``key``); a log
    axis when L0 spans over 20x (a sweep of k), so the small-L0 SAEs do not crowd together."""
    for p in points:
        ax.annotate(p["label"], (p["l0"], p[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    l0 = [p["l0"] for p in points if p["l0"] > 0]
    if l0 and max(l0) / min(l0) > 20:
        ax.set_xscale("log")
    ax.margins(x=0.2, y=0.15)
    ax.set_xlabel(xlabel)


def _save_with_legend(plt, fig, ax, path: str) -> None:
    """Grid and legend on ``ax``, then ``fig`` saved to ``path`` and closed (the sweep plots' look)."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _placeholder(path: str, text: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 1.5))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_freq(res: LatentSummary, path: str) -> None:
    plt = _plt()
    alive = res.fire_count > 0
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    if alive.any():
        lf = np.log10(res.freq[alive])
        a.hist(lf, bins=50, color="#4a6fa5")
        b.scatter(lf, np.log10(np.maximum(res.mean_act[alive], 1e-12)), s=3, alpha=0.5, color="#4a6fa5")
    a.set_title(f"firing frequency ({(~alive).sum():,} of {res.width:,} silent in this pass)")
    a.set_xlabel("log10 frequency")
    a.set_ylabel("latents")
    b.set_title("mean activation when firing")
    b.set_xlabel("log10 frequency")
    b.set_ylabel("log10 mean activation")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.16, top=0.9, wspace=0.25)  # faster than tight_layout
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Sweep outputs


def write_sweep(runs: list[Run], out: str) -> dict:
    """Into ``out``: the SWEEP_PLOTS, sweep.json and an index.html; returns {plot file: whether it
    has data} (a plot without data shows why)."""
    os.makedirs(out, exist_ok=True)
    pts = sweep_points(runs)
    made = {NMSE_L0_PLOT: plot_sweep(pts, os.path.join(out, NMSE_L0_PLOT)),
            CURVES_PLOT: plot_curves(runs, os.path.join(out, CURVES_PLOT))}  # fmt: skip
    for name, ok in made.items():  # the files always exist (workflow outputs); say why one is empty
        if not ok:
            _placeholder(os.path.join(out, name), "no metrics.jsonl / eval.json in these runs yet")
    pareto = pareto_points(runs)
    made.update(write_pareto(pareto, out))
    doc = {"points": pts, "pareto_points": pareto}
    atomic_write_bytes(os.path.join(out, SWEEP_FILE), (json.dumps(doc, indent=2) + "\n").encode())
    rows = []
    for r in runs:
        p = next((x for x in pts if x["run"] == r.dir), {})
        explore = _explorer_link(r.dir, out, "explorer")
        page = os.path.join(r.dir, VISUALS_DIR, PAGE_FILE)
        link = (f'<a href="{html.escape(os.path.relpath(page, out))}">{html.escape(r.name)}</a>'
                if os.path.isfile(page) else html.escape(r.name))  # fmt: skip
        nmse, l0 = p.get("nmse"), p.get("l0")
        rows.append(f"<tr><td>{link}</td><td>{explore}</td><td>{html.escape(r.label())}</td>"
                    f"<td>{'' if nmse is None else f'{nmse:.4f}'}</td><td>{'' if l0 is None else f'{l0:.2f}'}</td>"
                    f"<td>{p.get('source', '')}</td></tr>")  # fmt: skip
    imgs = "".join(f'<img src="{n}" alt="{os.path.splitext(n)[0]}">'
                   + (f"<p>{html.escape(CAPTIONS[n])}</p>" if n in CAPTIONS else "") for n in made)  # fmt: skip
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>SAE sweep</title><style>'
        "body{font:14px system-ui,sans-serif;margin:16px} td,th{padding:2px 10px;text-align:left}"
        "img{max-width:100%;margin:6px 0;display:block}</style></head><body><h1>SAE sweep</h1>"
        f"{imgs}{_pareto_table(pareto, out)}<table><tr><th>SAE</th><th>explorer</th><th>config</th><th>NMSE</th>"
        f"<th>L0</th><th>from</th></tr>{''.join(rows)}</table></body></html>\n"
    )
    atomic_write_bytes(os.path.join(out, PAGE_FILE), page.encode())
    return made


def _explorer_link(run_dir: str, out: str, text: str) -> str:
    """A link from ``out`` to the run's explorer (the text alone where it has none yet)."""
    page = os.path.join(run_dir, VISUALS_DIR, EXPLORER_DIR, PAGE_FILE)
    if not os.path.isfile(page):
        return html.escape(text)
    return f'<a href="{html.escape(os.path.relpath(page, out))}">{html.escape(text)}</a>'


def _pareto_table(points: list[dict], out: str) -> str:
    """The Pareto views' numbered points, each linked to its SAE's explorer."""
    if not points:
        return ""
    rows = "".join(f"<tr><td>{i + 1}</td><td>{_explorer_link(p['run'], out, p['sae_id'])}</td>"
                   f"<td>{html.escape(p['label'])}</td><td>{p['l0']:.2f}</td></tr>"
                   for i, p in enumerate(points))  # fmt: skip
    return ("<h2>Pareto points</h2><p>The numbers beside the points of the Pareto views; each SAE links to its "
            f"explorer.</p><table><tr><th>#</th><th>SAE</th><th>config</th><th>L0</th></tr>{rows}</table>")  # fmt: skip


def plot_pareto(points: list[dict], key: str, ylabel: str, higher: bool, path: str) -> bool:
    """One Pareto view (actcache.visuals_pareto) into ``path``, one panel per comparable set of
    SAEs (visuals_pareto.panels), each with its own frontier, its points numbered and the numbers
    listed beside it; False when no SAE has ``key``."""
    have = [p for p in points if p.get(key) is not None]
    if not have:
        return False
    plt = _plt()
    groups = panels(have)
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 3.8 * len(groups)), squeeze=False)
    for ax, (title, pts) in zip(axes[:, 0], groups.items(), strict=True):
        front = pareto_front(pts, key, higher)
        own = [p for p in pts if not p.get("imported")]
        imported = [p for p in pts if p.get("imported")]  # `actcache import`: published SAEs, ranked beside
        ax.scatter([p["l0"] for p in own], [p[key] for p in own], color="#9aa9bf", label="SAE")
        if imported:
            ax.scatter([p["l0"] for p in imported], [p[key] for p in imported], color="#2c7fb8", marker="D",
                       label="imported SAE")  # fmt: skip
        ax.plot([p["l0"] for p in front], [p[key] for p in front], "o-", color="#c0392b", label="Pareto frontier")
        if key in CHANCE:
            ax.axhline(CHANCE[key], color="#555", ls="--", lw=1, label=f"chance ({CHANCE[key]:g})")
        _numbered(ax, pts, key)
        ax.set_xlabel("L0 (held-out latents per token, lower is better)")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    why = sorted({p[key + "_why"] for p in points if p.get(key) is None and p.get(key + "_why")})
    if why:  # an SAE without a value is counted, never dropped silently
        n = sum(1 for p in points if p.get(key) is None and p.get(key + "_why"))
        fig.text(0.01, 0.005, f"{n} SAE(s) not shown: " + "; ".join(why)[:300], fontsize=6, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")  # "tight": the numbers' listing right of the axes
    plt.close(fig)
    return True


_OFFSETS = ((4, 4), (4, -10), (-12, 4), (-12, -10))  # points near each other take turns around their dot


def _numbered(ax, points: list[dict], key: str) -> None:
    """Each point numbered beside its dot (offsets alternate by rank of L0) and the numbers' labels
    listed to the right of the axes, so that long labels never overlap one another."""
    order = sorted(range(len(points)), key=lambda i: (points[i]["l0"], points[i][key]))
    for rank, i in enumerate(order):
        p = points[i]
        ax.annotate(str(i + 1), (p["l0"], p[key]), fontsize=7, xytext=_OFFSETS[rank % 4], textcoords="offset points")
    l0 = [p["l0"] for p in points if p["l0"] > 0]
    if l0 and max(l0) / min(l0) > 20:
        ax.set_xscale("log")
    ax.margins(x=0.2, y=0.15)
    listing = "\n".join(f"{i + 1}: {p['label']}" for i, p in enumerate(points))
    ax.text(1.02, 1.0, listing, transform=ax.transAxes, fontsize=6, va="top", family="monospace")


def write_pareto(points: list[dict], out: str) -> dict[str, bool]:
    """Every Pareto view into ``out`` (a view without data: a placeholder saying why)."""
    made = {}
    for name, (key, ylabel, higher) in PARETO_VIEWS.items():
        path = os.path.join(out, name)
        made[name] = plot_pareto(points, key, ylabel, higher, path)
        if not made[name]:
            why = sorted({p[key + "_why"] for p in points if p.get(key + "_why")})
            _placeholder(path, f"no SAE of this sweep has {key} in its eval.json yet" + "".join(f"; {w}" for w in why))
    return made
