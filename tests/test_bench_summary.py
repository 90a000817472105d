"""The benchmarks' rendering: the loader benchmark's summary (scripts/bench_loaders.py: ratios
within a round, by the round's direction, target checks) and the BENCHMARKS.md templates
(scripts/benchlib.py), computed from stored or synthetic measurements (no benchmark runs)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_loaders", os.path.join(ROOT, "scripts", "bench_loaders.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def benchlib(bench):
    return bench.benchlib  # the module the benchmark scripts import (scripts/ is on their sys.path)


def _m(mbps: float, **kw) -> dict:
    return {"MBps": mbps, **kw}


def test_cold_rows_give_the_ratio_by_direction_and_check_the_median(bench):
    # 4 rounds: forward (0, 2) with a fast ref, reversed (1, 3) with a slow one
    loader = dict(examples_per_s=1.0, first_batch_s=0.1, rss_growth_GB=0.1, anon_growth_GB=0.1,
                  held_GB=1.0, file_mapped_GB=1.0)  # fmt: skip
    run = {
        "n_layers": 1,
        "batch_size": 16384,
        "buffer_bytes": 3_200_000_000,
        "results": {
            "cold": {
                "ref": [_m(2000), _m(1000), _m(2400), _m(900)],
                "ref2": [_m(2000)] * 4,
                "ordered": [_m(1800, **loader), _m(1900, **loader), _m(1900, **loader), _m(2000, **loader)],
            }
        },
    }
    rows = {r["loader"]: r for r in bench.summarize(run)}
    o = rows["ordered"]
    # in-round ratios 0.9, 1.9, 0.7917, 2.2222: forward median 0.8458, reversed 2.0611
    assert o["x ref fwd / rev"] == "0.846 / 2.061"
    assert o["x ref"] == pytest.approx((0.9 + 1.9) / 2)
    assert o["targets"] == "ok xref>=0.9"
    assert "x ref fwd / rev" not in rows["ref"]  # ref against itself says nothing
    run["results"]["cold"]["ordered"] = [_m(1000, **loader)] * 4
    (o,) = [r for r in bench.summarize(run) if r["loader"] == "ordered"]
    assert o["targets"] == "MISSED xref>=0.9" and o["x ref fwd / rev"] == "0.458 / 1.056"


def test_several_layers_compare_with_ref2_over_the_same_bytes(bench):
    # one layer of four: the loader delivers a quarter of what ref2 reads; "ref2 same bytes" reads
    # that quarter in its own fresh process, and its ratio is reported beside the target's
    loader = dict(examples_per_s=1.0, first_batch_s=0.1, rss_growth_GB=0.1, anon_growth_GB=0.1,
                  held_GB=1.0, file_mapped_GB=1.0, entropy_image=0.97, entropy_patch=0.99,
                  exactly_once=True)  # fmt: skip
    run = {
        "n_layers": 4,
        "batch_size": 16384,
        "buffer_bytes": 3_200_000_000,
        "results": {
            "warm": {
                "ref": [_m(8000)] * 2,
                "ref2": [_m(10000), _m(12000)],
                bench.SAME_BYTES: [_m(8000), _m(10000)],
                "ref layer": [_m(5000)] * 2,
                "shuffled": [_m(8000, **loader), _m(9000, **loader)],
            }
        },
    }
    rows = {r["loader"]: r for r in bench.summarize(run)}
    s = rows["shuffled"]
    assert s["x ref2"] == pytest.approx((0.8 + 0.75) / 2)
    assert s["x ref2 same bytes"] == pytest.approx((1.0 + 0.9) / 2)
    assert s["targets"].startswith("ok xref>=0.3; MISSED xref2>=0.9")  # the target stays against ref2
    assert rows["ref2"]["x ref2 same bytes"] == pytest.approx((1.25 + 1.2) / 2)


def test_layer_bytes_counts_one_layers_patch_tokens(bench, tmp_path):
    (tmp_path / "metadata.json").write_text('{"n_imgs": 10}')
    assert bench.layer_bytes(str(tmp_path)) == 10 * (bench.T - 1) * bench.D * 4


def _loader_rows(x_ref2_warm: float) -> list[dict]:
    common = {"first batch s": 0.05, "targets": "ok xref>=0.3; ok mem<=buffer+few batches"}
    return [
        {"mode": "warm", "loader": "ref", "MB/s": 9000.0, "x ref": 1.0, "x ref2": 0.8},
        {"mode": "warm", "loader": "ref2", "MB/s": 11000.0, "x ref": 1.2, "x ref2": 1.0},
        {"mode": "warm", "loader": "ordered", "MB/s": 11000.0, "x ref": 1.2, "x ref2": 1.0, **common},
        {"mode": "warm", "loader": "shuffled", "MB/s": 10000.0, "x ref": 1.1, "x ref2": x_ref2_warm, **common},
        {"mode": "warm", "loader": "shuffled 2nd epoch", "MB/s": 12000.0, "x ref": 1.3, "x ref2": 1.05, **common},
        {"mode": "cold", "loader": "ref", "MB/s": 1300.0, "x ref": 1.0, "x ref2": 0.7},
        {"mode": "cold", "loader": "ordered", "MB/s": 1600.0, "x ref": 1.25, "x ref2": 0.95, **common},
        {"mode": "cold", "loader": "shuffled", "MB/s": 1400.0, "x ref": 0.7, "x ref2": 0.9, **common},
    ]


def test_loader_section_renders_a_short_template_with_computed_conclusions(bench):
    caches = [
        {"caption": "**1 recorded layer(s)**", "n_layers": 1, "rows": _loader_rows(0.95)},
        {"caption": "**4 recorded layer(s)**", "n_layers": 4, "rows": _loader_rows(0.7)},
    ]
    body, checks = bench.render(caches, 3_200_000_000, 16384)
    tables = [ln for ln in body.splitlines() if ln.startswith("| loader |")]
    assert len(tables) == 2 and all(ln.count("|") - 1 <= 10 for ln in tables)  # one row per loader
    assert "| shuffled | 10,000 | 1.1 | 0.95 | 0.7 |" in body  # warm MB/s, x ref, x ref2, then cold x ref
    assert max(len(ln) for ln in body.splitlines()) < 400
    # one summary row per target over both caches, met only where every cache met it
    by_target = {c.target: c for c in checks}
    warm = by_target["warm shuffled >= 0.9 x ref2"]
    assert warm.figure == "0.95 x ref2 (1 layer), 0.7 x ref2 (4 layers)" and warm.met is False
    assert by_target["cold shuffled >= 0.8 x ref"].met is False
    assert by_target["warm ordered >= 0.6 x ref"].met is True
    assert "- 4 recorded layer(s): 3 of 5 targets met; missed: warm shuffled >= 0.9 x ref2 (4 layers)" in body


def test_summary_rows_of_a_section_are_replaced_in_place(benchlib, tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    benchlib.record("alpha", "Alpha", "body a", path=str(md), checks=[benchlib.check("a >= 1", 2.0, 1.0)])
    benchlib.record("beta", "Beta", "body b", path=str(md), checks=[benchlib.check("b <= 1", 2.0, 1.0, at_least=False)])
    benchlib.record("alpha", "Alpha", "body a2", path=str(md), checks=[benchlib.check("a >= 1", 0.5, 1.0)])
    text = md.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| a") or ln.startswith("| b")]
    assert [r.split(" | ")[-2] for r in rows] == ["missed", "missed"]  # alpha re-measured, still first
    assert rows[0].startswith("| a >= 1 | 0.5 |") and rows[0].endswith("| alpha |")
    assert text.index("<!-- /bench:summary -->") < text.index("<!-- bench:alpha -->")
    assert "body a2" in text and "body a\n" not in text


def test_a_section_template_refuses_a_wide_table(benchlib):
    wide = benchlib.table([{f"c{i}": i for i in range(11)}])
    with pytest.raises(ValueError, match="at most 10 columns"):
        benchlib.section_body(["setup"], [wide], [])
