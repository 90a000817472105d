"""Pareto frontiers over a sweep (actcache.visuals_pareto): which SAEs are on the frontier."""

from __future__ import annotations

import PIL.Image

from actcache.visuals_pareto import pareto_front
from actcache.visuals_plots import write_pareto


def pts(*rows):
    return [{"label": f"s{i}", "l0": l0, "fvu": fvu, "probe_acc": acc, "spliced_recovered": None}
            for i, (l0, fvu, acc) in enumerate(rows)]  # fmt: skip


def test_frontier_keeps_only_saes_no_other_beats_on_both_axes():
    p = pts((4, 0.5, 0.6), (8, 0.3, 0.9), (8, 0.4, 0.5), (16, 0.35, 0.95), (32, 0.1, 0.7))
    assert [x["label"] for x in pareto_front(p, "fvu", higher=False)] == ["s0", "s1", "s4"]
    assert [x["label"] for x in pareto_front(p, "probe_acc", higher=True)] == ["s0", "s1", "s3"]


def test_views_without_data_are_placeholders_that_say_why(tmp_path):
    made = write_pareto(pts((4, 0.5, None), (8, 0.3, None)), str(tmp_path))
    assert made == {"pareto_l0_fvu.png": True, "pareto_l0_spliced.png": False, "pareto_l0_probe.png": False}
    for name in made:
        with PIL.Image.open(tmp_path / name) as im:
            assert im.size[0] > 100


def test_page_gets_each_latents_best_class_and_the_best_latent_table():
    from actcache.visuals_probes import annotate_page

    page = ('<h2>Latents</h2><div class="latent-card" id="latent-3"><div class="card-head"><b>latent 3</b>'
            "<span>freq</span></div></div><b>latent 0</b>")  # fmt: skip
    probes = {"latent_best_class": [-1, -1, -1, 1], "class_names": ["cat", "dog"],
              "best_latent_per_class": [{"name": "dog", "latent": 3, "ap": 0.995, "n_images": 40},
                                        {"name": "cat", "latent": 2, "ap": 0.5, "n_images": 40}],
              "sparse_probe_acc": {"1": 0.9, "5": None}}  # fmt: skip
    out = annotate_page(page, probes)
    assert '<b>latent 3</b><span class="best-class">best class: dog</span>' in out
    assert "<b>latent 0</b><span" not in out  # never fired: no class
    assert '<a href="#latent-3">latent 3</a></td><td>0.995</td>' in out and "k=1: 0.900" in out
    assert '<a href="explorer/index.html#latent=2">latent 2</a>' in out  # no card on the page: the explorer
    assert out.index("Best latent per class") < out.index("<h2>Latents</h2>")
    assert annotate_page(page, None) == page


def test_saes_of_different_layers_token_sets_or_splits_get_their_own_panels(tmp_path):
    import json
    import os

    from actcache.rundir import EVAL_FILE, Run
    from actcache.visuals_pareto import panels, pareto_points

    def run(name, layer, patches, n_held):
        d = tmp_path / name
        os.makedirs(d)
        ev = {"l0": 4.0 + layer, "fvu": 0.2, "split": "random", "n_heldout_images": n_held}
        (d / EVAL_FILE).write_text(json.dumps(ev))
        return Run(str(d), {"sae_id": name}, "c", "abc", layer, patches, False)

    runs = [run("a", 7, "image", 10), run("b", 7, "image", 10), run("c", 9, "image", 10), run("d", 7, "all", 10),
            run("e", 7, "image", 12)]  # fmt: skip
    points = pareto_points(runs)
    groups = panels(points)
    assert sorted(sorted(p["sae_id"] for p in g) for g in groups.values()) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert all(f"layer {r.layer}" in p["label"] for r, p in zip(runs, points, strict=True))
    os.makedirs(tmp_path / "four")
    os.makedirs(tmp_path / "one")
    write_pareto(points, str(tmp_path / "four"))
    write_pareto(points[:2], str(tmp_path / "one"))
    with (
        PIL.Image.open(tmp_path / "four" / "pareto_l0_fvu.png") as four,
        PIL.Image.open(tmp_path / "one" / "pareto_l0_fvu.png") as one,
    ):
        assert four.size[1] > 3 * one.size[1]  # a panel each
