"""scripts/chaos.py in small: its fuzz and verify rows find nothing wrong, and its rows (a row whose
feature is missing says "not built") land in a Reliability section of BENCHMARKS.md.
The kill trials' small versions are tests/test_dump_kill.py and tests/test_sae_resume.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("chaos", os.path.join(ROOT, "scripts", "chaos.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_fuzz_and_verify_rows_find_nothing_wrong(chaos, tmp_path):
    # fuzz-cache's cases run in tests/test_fuzz_inputs.py; checkpoint corruptions in
    # tests/test_sae_resume.py; damaged shards under the loaders in tests/loaders/test_faults.py
    rows = chaos.run(["fuzz-experiment", "verify-corrupt"], 5, str(tmp_path))
    for r in rows:
        assert r.built and r.trials == 5 and r.failures == 0, (r.name, r.notes)


def test_rows_are_recorded_with_a_summary_row_each(chaos, tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    rows = [chaos.Row("fuzz-cache", trials=500, failures=0), chaos.not_built("verify-corrupt", "checksums")]
    chaos.record(rows, str(md))
    text = md.read_text()
    assert "<!-- bench:reliability -->" in text and "| fuzz-cache |" in text
    assert "| fuzz-cache: 0 failures | 0 of 500 |" in text and "| verify-corrupt: 0 failures | not built |" in text
