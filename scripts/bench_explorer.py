"""Benchmark the explorer app in headless Chromium: open time and browser memory by width.

    python scripts/bench_explorer.py [--widths 4096,16384,65536] [--rounds 3] [--out bench-out/explorer]

Per width, a synthetic explorer (tests/explorer_data.py: the app plus contract-conformant data,
196 patches + CLS per image, 1,024 images of which 64 explorable) is written once under ``--out``,
then opened from ``file://`` and over HTTP (`actcache serve`'s server, actcache.serve.make_server, on
127.0.0.1) in alternating rounds, each in a fresh browser context (Playwright
driving Debian's Chromium):

- ``blank``: the reference, measured in the same round: navigation start -> load event of an
  empty page in the same folder;
- ``open``: navigation start -> the latent table's first page rendered (``window.__explorerReady``);
- ``sort``: a click on the freq header -> the table sorted by frequency (loads every table chunk);
- memory after open, after the sort, after 20 random latent pages: the page's JS heap after a
  forced GC (CDP Performance.getMetrics, JSHeapUsedSize) and the memory of every renderer process of
  the browser (proportional set size, summed: /proc/PID/smaps_rollup; an upper bound on the
  page's own, as it includes the spare renderer), also after the blank page for reference.

Medians over the rounds. Targets (issue #60): open <= 2 s and memory <= 500 MB at width 65,536.
"""

from __future__ import annotations

import argparse
import http.server
import os
import shutil
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402
from tests.explorer_data import write_synthetic_explorer  # noqa: E402

from actcache.explorer_app import copy_app  # noqa: E402
from actcache.serve import make_server  # noqa: E402

GRID, N_IMGS, N_EXPLORABLE, N_PAGES = 14, 1024, 64, 20
MB = 2**20
GO = """async h => {
  location.hash = h;
  for (let i = 0; i < 6000 && document.body.dataset.rendered !== h; i++) await new Promise(r => setTimeout(r, 5));
  if (document.body.dataset.rendered !== h) throw new Error("not rendered: " + h);
}"""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("bench_explorer: needs Chromium (Debian: apt-get install chromium)")
    return exe


def build(out: str, width: int) -> tuple[str, float]:
    """The explorer folder for ``width`` (written once) and its data's size in MB."""
    folder = os.path.join(out, f"w{width}")
    if not os.path.exists(os.path.join(folder, "data", "meta.js")):
        shutil.rmtree(folder, ignore_errors=True)
        t = time.perf_counter()
        write_synthetic_explorer(folder, width, n_imgs=N_IMGS, n_explorable=N_EXPLORABLE, grid=GRID)
        print(f"wrote the width-{width:,} explorer in {time.perf_counter() - t:.1f} s", flush=True)
    copy_app(folder)  # the app as it is now (the data may be from an earlier run)
    with open(os.path.join(folder, "blank.html"), "w") as fh:
        fh.write('<!doctype html><title>blank</title><link rel="icon" href="data:,">\n')
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(folder, "data")) for f in fs)
    return folder, size / 1e6


def serve(root: str) -> tuple[http.server.ThreadingHTTPServer, str]:
    """`actcache serve`'s server of ``root`` on a free port of 127.0.0.1, serving in a thread."""
    srv = make_server(root, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def renderer_pss(browser) -> float:
    """Proportional set size (MB: shared pages split between their users) of every renderer
    process of ``browser``, summed."""
    cdp = browser.new_browser_cdp_session()
    pids = [p["id"] for p in cdp.send("SystemInfo.getProcessInfo")["processInfo"] if p["type"] == "renderer"]
    cdp.detach()
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("Pss:")) * 1024
        except (FileNotFoundError, StopIteration):
            pass
    return total / MB


def heap(session) -> float:
    """The page's JS heap in use after a forced GC, MB."""
    session.send("HeapProfiler.collectGarbage")
    return (
        next(m["value"] for m in session.send("Performance.getMetrics")["metrics"] if m["name"] == "JSHeapUsedSize")
        / MB
    )


def one_round(browser, base: str, width: int, rng) -> dict:
    ctx = browser.new_context()
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(base + "/blank.html")
    blank = page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
    mem_blank = renderer_pss(browser)
    page.goto(base + "/index.html")
    page.wait_for_function("window.__explorerReady !== undefined", timeout=60000)
    r = {"blank": blank, "open": page.evaluate("window.__explorerReady"), "pss blank": mem_blank}
    s = ctx.new_cdp_session(page)
    s.send("Performance.enable")
    r["heap open"], r["pss open"] = heap(s), renderer_pss(browser)
    t = time.perf_counter()
    page.click("th[data-sort=freq]")
    page.wait_for_function("(document.body.dataset.table || '').startsWith('freq:desc:0')", timeout=60000)
    r["sort"] = (time.perf_counter() - t) * 1000
    r["heap sorted"], r["pss sorted"] = heap(s), renderer_pss(browser)
    for i in rng.choice(width, N_PAGES, replace=False):
        page.evaluate(GO, f"#latent={i}")
    r["heap pages"], r["pss pages"] = heap(s), renderer_pss(browser)
    ctx.close()
    if errors:
        raise RuntimeError(f"console errors on {base}: {errors[:3]}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="4096,16384,65536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(benchlib.ROOT, "bench-out", "explorer"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    folders = {w: build(args.out, w) for w in widths}
    srv, http_base = serve(args.out)
    load0 = os.getloadavg()[0]
    runs: dict[tuple[int, str], list[dict]] = {}
    rng = np.random.default_rng(0)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        for _ in range(args.rounds):  # alternating: every width and transport once per round
            for w in widths:
                for via, base in (("file", "file://" + folders[w][0]), ("http", f"{http_base}/w{w}")):
                    runs.setdefault((w, via), []).append(one_round(browser, base, w, rng))
        browser.close()
    srv.shutdown()
    load1 = os.getloadavg()[0]
    rows, med = [], {}
    for (w, via), rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med[(w, via)] = m
        rows.append({
            "width": w, "via": via, "data MB": folders[w][1], "blank ms": m["blank"], "open ms": m["open"],
            "open / blank": m["open"] / max(m["blank"], 1e-3), "sort ms": m["sort"],
            "JS heap MB: open / sorted / 20 pages": f"{m['heap open']:.1f} / {m['heap sorted']:.1f} / {m['heap pages']:.1f}",
            "renderers' PSS MB: blank / open / sorted / 20 pages":
                f"{m['pss blank']:.0f} / {m['pss open']:.0f} / {m['pss sorted']:.0f} / {m['pss pages']:.0f}",
        })  # fmt: skip
    top = max(widths)
    checks = []
    for via in ("file", "http"):
        m = med[(top, via)]
        checks.append(
            benchlib.check(f"explorer open <= 2 s at width {top:,} ({via})", m["open"] / 1000, 2, "s", at_least=False)
        )
        peak = max(m["pss open"], m["pss sorted"], m["pss pages"])
        checks.append(
            benchlib.check(
                f"explorer memory <= 500 MB at width {top:,} ({via}; renderers' PSS, peak)",
                peak,
                500,
                "MB",
                at_least=False,
            )
        )
    setup = [
        f"Synthetic explorers (tests/explorer_data.py): {GRID * GRID} patches + CLS per image, {N_IMGS:,} images "
        f"({N_EXPLORABLE} explorable), chunks of 1,024 (table) and 256 (detail) latents; the app from src/actcache/explorer_app.",
        "Headless Chromium (Debian) through Playwright, a fresh context per round; file:// and `actcache serve` on "
        "127.0.0.1; reference: an empty page's load in the same round (blank ms).",
        "open = navigation start -> the table's first 50 rows rendered; sort = click -> sorted by frequency (every table "
        f"chunk loaded); memory after open, after the sort, after {N_PAGES} random latent pages (LRU of 8 detail chunks).",
        "JS heap: JSHeapUsedSize after a forced GC (CDP); PSS: every renderer process of the browser, summed "
        "(/proc/PID/smaps_rollup; includes the spare renderer; blank = after the empty page).",
        f"Medians of {args.rounds} alternating rounds; 1-minute load average at the start / end: {load0:.1f} / {load1:.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    body = benchlib.section_body(setup, [benchlib.table(rows)], [c.bullet() for c in checks])
    if not args.no_record:
        benchlib.record("explorer", "explorer: open time and browser memory by width", body)  # summary rows: the lead's
    print(body)


if __name__ == "__main__":
    main()
