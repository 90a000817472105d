"""The label-probe parts of an SAE's page (eval.json "probes", actcache.sae.probes): each latent's
best class on its card, and a table of the best latent per class with the k-sparse probe balanced
accuracy, each with its n, chance level and bootstrap 95% interval.

    page = annotate_page(page, ev.get("probes"))   # the rendered page, with both added

Added to the rendered page (a section before the latent cards, a line in each card's head), so
the page renderer (actcache.visuals_html) stays as it is for caches without labels.
"""

from __future__ import annotations

import html
import re

_MARK = "<h2>Latents</h2>"
_CARD = re.compile(r'class="latent-card" id="latent-(\d+)"')
EXPLORER_HREF = "explorer/index.html"  # from visuals/index.html (actcache.rundir EXPLORER_DIR)


def _class_name(probes: dict, c: int) -> str:
    names = probes.get("class_names") or []
    return names[c] if 0 <= c < len(names) else str(c)


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "n/a"


def latent_link(s: int, on_page: set[int], explorer: str | None = EXPLORER_HREF) -> str:
    """A link to latent ``s``: its card when the page has it, else the explorer (no explorer: the
    text alone)."""
    href = f"#latent-{s}" if s in on_page else f"{explorer}#latent={s}" if explorer else None
    return f'<a href="{html.escape(href)}">latent {s}</a>' if href else f"latent {s}"


def best_latent_table(probes: dict, on_page: set[int] = frozenset(), explorer: str | None = EXPLORER_HREF) -> str:
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(b['name'])}</td><td>{latent_link(int(b['latent']), on_page, explorer)}</td>"
        f"<td>{b['ap']:.3f}</td><td>{_ci(b.get('ci95'))}</td><td>{b.get('chance', float('nan')):.3f}</td>"
        f"<td>{b['n_images']:,} of {b.get('n', 0):,}</td></tr>"
        for b in probes.get("best_latent_per_class", [])
    )
    acc, ci = probes.get("sparse_probe_acc") or {}, probes.get("sparse_probe_ci95") or {}
    accs = "; ".join(f"k={k}: {v:.3f} {_ci(ci.get(k))}" for k, v in acc.items() if isinstance(v, (int, float)))
    n_fit, n_test = probes.get("n_fit", "?"), probes.get("n_test", "?")
    return (
        '<h2>Best latent per class</h2><p class="note">On the held-out images the evaluation visited whole, cut '
        f"at random into a fit half ({n_fit} images) and a test half ({n_test}): per class, the latent whose "
        "per-image max activation ranks that class's images first on the fit half (tie-aware average precision, "
        "AP), with its AP on the test half, the bootstrap 95% interval and the chance level (the class's share "
        "of the test images). k-sparse probe balanced accuracy on the test half (mean over classes; chance "
        f"0.5), with its bootstrap 95% interval: {esc(accs) or 'n/a'}.</p>"
        '<table class="info"><tr><td>class</td><td>best latent</td><td>test AP</td><td>95% interval</td>'
        f"<td>chance AP</td><td>class images of test images</td></tr>{rows}</table>"
    )


def annotate_page(page: str, probes: dict | None, explorer: str | None = EXPLORER_HREF) -> str:
    """``page`` with the probe table and each card's best class (unchanged without probes); a
    best latent without a card on the page links into the explorer (``explorer``: its href)."""
    if not probes or "latent_best_class" not in probes:
        return page
    best = probes["latent_best_class"]

    def card_head(m: re.Match) -> str:
        s = int(m.group(1))
        c = best[s] if s < len(best) else -1
        extra = f'<span class="best-class">best class: {html.escape(_class_name(probes, c))}</span>' if c >= 0 else ""
        return m.group(0) + extra

    page = re.sub(r"<b>latent (\d+)</b>", card_head, page)
    on_page = {int(s) for s in _CARD.findall(page)}
    return page.replace(_MARK, best_latent_table(probes, on_page, explorer) + _MARK, 1)
