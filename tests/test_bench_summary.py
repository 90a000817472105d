"""The loader benchmark's summary (scripts/bench_loaders.py): ratios within a round, by the
round's direction, and the target checks, computed from stored measurements (no I/O)."""

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
