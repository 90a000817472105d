"""Pareto frontiers over every SAE of a cache: L0 against each quality a researcher ranks by.

    points = pareto_points(runs)          # one dict per SAE from its eval.json
    front = pareto_front(points, "fvu", higher=False)
    # the plots: actcache.visuals_plots.write_pareto(points, out)

Each view puts L0 (latents per token on the held-out split; fewer is better) on x and one
quality on y: FVU (lower is better), the spliced headline (eval.json's spliced "headline",
kl_recovered_mean: CE-loss recovered against mean-ablation; higher is better) and the k-sparse
label-probe balanced accuracy at k = PROBE_K (higher is better; chance 0.5). Only SAEs that read
the same thing are compared: one panel per (cache, layer, token set, scale_norm, held-out split),
each with its own frontier. The frontier joins the SAEs that no other SAE of the panel beats on
both axes; an SAE off it has a sibling that is at least as sparse and at least as good. Each
point's label names its layer. CAPTIONS says the same under each plot.
"""

from __future__ import annotations

from actcache.rundir import PARETO_FVU_PLOT, PARETO_PROBE_PLOT, PARETO_SPLICED_PLOT, Run

PROBE_K = 5
# plot file -> (point key, axis label, higher is better)
VIEWS = {
    PARETO_FVU_PLOT: ("fvu", "FVU (held-out, lower is better)", False),
    PARETO_SPLICED_PLOT: ("spliced_recovered", "spliced: CE-loss recovered vs mean-ablation (higher is better)", True),
    PARETO_PROBE_PLOT: ("probe_acc", f"{PROBE_K}-sparse label-probe balanced accuracy (higher is better)", True),
}
CHANCE = {"probe_acc": 0.5}  # the chance level drawn on a view (balanced accuracy: 0.5)
CAPTIONS = {
    PARETO_FVU_PLOT: "Reconstruction against sparsity: each dot is one SAE (held-out FVU against L0); the line "
    "joins the SAEs no other SAE beats on both. Pick from the line: down and left is better.",
    PARETO_SPLICED_PLOT: "Downstream faithfulness against sparsity: the CE-loss recovered by splicing the SAE's "
    "reconstruction in, against mean-ablation, for a classifier on the clean final embeddings with the clean "
    "predictions as targets (1 = as clean, 0 = no better than setting each token to its position's mean; "
    "unbounded below), against L0. Up and left is better; the line is the frontier. SAEs without a value are "
    "counted under the plot with the reason. One panel per comparable set of SAEs.",
    PARETO_PROBE_PLOT: f"Concepts against sparsity: balanced accuracy of a {PROBE_K}-latent probe for each class "
    "(mean over classes, on the test half of the held-out images; the dashed line is chance, 0.5), against L0. "
    "Up and left is better; the line is the frontier.",
}
_SAME = (
    " One panel per (cache, layer, token set, scale_norm, held-out split): SAEs of different panels are not compared."
)
CAPTIONS = {name: text + _SAME for name, text in CAPTIONS.items()}


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def pareto_points(runs: list[Run]) -> list[dict]:
    """One point per SAE with a held-out evaluation: its label, l0 and whichever qualities it has."""
    pts = []
    for r in runs:
        ev = r.eval()
        l0 = _num(ev.get("l0"))
        if l0 is None:
            continue
        spliced, probes = ev.get("spliced") or {}, ev.get("probes") or {}
        pts.append({
            "sae_id": r.name, "run": r.dir, "label": f"{r.label()} layer {r.layer}", "panel": panel_of(r, ev), "imported": r.imported,
            "l0": l0, "fvu": _num(ev.get("fvu", ev.get("nmse"))),
            "spliced_recovered": _num(spliced.get(spliced.get("headline", "fraction_recovered_zero"))),
            "spliced_recovered_why": _why_missing(spliced),
            "probe_acc": _num((probes.get("sparse_probe_acc") or {}).get(str(PROBE_K))),
        })  # fmt: skip
    return pts


def panel_of(run: Run, ev: dict) -> str:
    """What a point is comparable on: cache, layer, token set, scale_norm and held-out split."""
    split = ev.get("split", "?")
    if ev.get("n_heldout_images") is not None:
        split = f"{split}, {ev['n_heldout_images']:,} images"
    cache = (run.cache_hash or "?")[:12]
    return (f"cache {cache} | layer {run.layer} | tokens {run.patches} | scale_norm {bool(run.scale_norm)} | "
            f"split: {split}")  # fmt: skip


def panels(points: list[dict]) -> dict[str, list[dict]]:
    """Points by panel (sorted by panel name); a point without one joins the panel "all"."""
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p.get("panel") or "all", []).append(p)
    return dict(sorted(out.items()))


def _why_missing(spliced: dict) -> str | None:
    """Why an SAE with a spliced section has no headline value (None when it has one or no section)."""
    key = spliced.get("headline", "fraction_recovered_zero")
    if not spliced or _num(spliced.get(key)) is not None:
        return None
    return spliced.get("task_note") or f"{key} is not a number"


def pareto_front(points: list[dict], key: str, higher: bool) -> list[dict]:
    """The points no other point beats on both L0 (lower) and ``key``; sorted by L0."""
    pts = sorted((p for p in points if p.get(key) is not None), key=lambda p: (p["l0"], -p[key] if higher else p[key]))
    front, best = [], None
    for p in pts:
        if best is None or (p[key] > best if higher else p[key] < best):
            front.append(p)
            best = p[key]
    return front
