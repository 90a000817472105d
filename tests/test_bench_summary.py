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
