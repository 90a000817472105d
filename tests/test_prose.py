"""Prose rules for code and documents: code carries no dates and no paths outside the repository,
module docstrings stay short, and the two top-level documents stay readable.

Each test lists every offence as ``file:line: what`` so one run shows all there is to fix.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("src", "workflow")
CODE_SUFFIXES = {".py", ".smk", ".c"}
DOCUMENTS = ("README.md", "BENCHMARKS.md")
MAX_DOC_LINE = 400
MAX_DOCSTRING_LINES = 40

MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
SHORT_MONTHS = r"(?:Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\.?"
# an ISO date, or a month name (full or short) followed by a year, with or without a day between
DATE = re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b(?:{MONTHS}|{SHORT_MONTHS})\s+(?:\d{{1,2}},?\s+)?20\d\d\b")
OUTSIDE_PATH = re.compile(r"/tmp/|/work/|\.\./shared|/home/")


def code_files() -> list[Path]:
    files = []
    for top in CODE_DIRS:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and (p.suffix in CODE_SUFFIXES or p.name == "Snakefile"):
                files.append(p)
    if (ROOT / "Snakefile").is_file():
        files.append(ROOT / "Snakefile")
    return files


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def scan_lines(files: list[Path], pattern: re.Pattern, what: str) -> list[str]:
    found = []
    for p in files:
        for no, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            m = pattern.search(line)
            if m:
                found.append(f"{rel(p)}:{no}: {what} {m.group(0)!r}")
    return found


def check(found: list[str]) -> None:
    if found:
        pytest.fail(f"{len(found)} offence(s):\n" + "\n".join(found), pytrace=False)


def test_code_files_are_found():
    files = {rel(p) for p in code_files()}
    assert "src/actcache/_native.c" in files and "src/actcache/dump.py" in files
    assert any(f.endswith(".smk") for f in files)


def test_no_dates_in_code_or_comments():
    found = scan_lines(code_files(), DATE, "date")
    check(found)


def test_no_paths_outside_the_repository_in_code_or_comments():
    found = scan_lines(code_files(), OUTSIDE_PATH, "path outside the repository")
    check(found)


def test_module_docstrings_are_at_most_40_lines():
    found = []
    for p in code_files():
        if p.suffix != ".py":
            continue
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        n = len(doc.splitlines()) if doc else 0
        if n > MAX_DOCSTRING_LINES:
            found.append(f"{rel(p)}:1: module docstring of {n} lines (max {MAX_DOCSTRING_LINES})")
    check(found)


def test_documents_have_no_line_over_400_characters():
    found = []
    for name in DOCUMENTS:
        for no, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if len(line) > MAX_DOC_LINE:
                found.append(f"{name}:{no}: line of {len(line)} characters (max {MAX_DOC_LINE})")
    check(found)


def test_benchmarks_opens_with_the_summary_table():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert lines[0].startswith("# "), "BENCHMARKS.md:1: expected the title"
    body = [ln for ln in lines[1:] if ln.strip() and not ln.lstrip().startswith("<!--")]
    assert body and body[0].startswith("|"), f"BENCHMARKS.md: first content after the title is {body[:1]}"
    header = body[0].lower()
    for column in ("target", "figure", "machine", "date", "result"):
        assert column in header, f"BENCHMARKS.md: summary table lacks a {column!r} column: {body[0]}"


def test_date_pattern_catches_the_forms_it_should():
    # the rules above are only as good as this pattern: pin what it catches and what it lets pass
    assert DATE.search("measured 2026-11-27 on the VM")
    assert DATE.search("since November 2026") and DATE.search("Nov 27, 2026")
    assert not DATE.search("a shard of 2026 images") and not DATE.search("may 2 threads")
