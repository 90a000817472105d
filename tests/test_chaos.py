"""scripts/chaos.py in small: its fuzz rows find nothing, rows whose feature is on another branch
say "not built" instead of failing, and its rows land in a Reliability section of BENCHMARKS.md.
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


def test_fuzz_rows_find_no_traceback_and_unbuilt_rows_say_so(chaos, tmp_path):
    # fuzz-cache's cases run in tests/test_fuzz_inputs.py
    rows = chaos.run(["fuzz-experiment", "checkpoint-corrupt", "verify-corrupt"], 4, str(tmp_path))
    fuzz = rows[0]
    assert fuzz.trials == 4 and fuzz.failures == 0, fuzz.notes
    for r in rows:
        assert r.built or (r.trials == 0 and r.notes[0].startswith("not built"))


def test_rows_are_recorded_with_a_summary_row_each(chaos, tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    rows = [chaos.Row("fuzz-cache", trials=500, failures=0), chaos.not_built("verify-corrupt", "checksums")]
    chaos.record(rows, str(md))
    text = md.read_text()
    assert "<!-- bench:reliability -->" in text and "| fuzz-cache |" in text
    assert "| fuzz-cache: 0 failures | 0 of 500 |" in text and "| verify-corrupt: 0 failures | not built |" in text
