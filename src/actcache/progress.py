"""Progress reporting for long loops: a tqdm bar on a terminal, a log line every ~10 s otherwise.

    with Progress(total=n_imgs, desc="dump", unit="img") as bar:
        for batch in ...:
            bar.update(len(batch))

On a terminal (stderr is a TTY) it draws a tqdm bar with the rate and the ETA; in a Slurm log it
logs one line every ``every_s`` seconds (done/total, rate, ETA) and one at the end, instead of a
bar that fills the file with carriage returns. ``bar=False``: the lines even on a terminal;
``enabled=False`` shows neither.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("actcache.progress")


def fmt_duration(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


class Progress:
    def __init__(self, total: int, desc: str = "", unit: str = "it", enabled: bool = True, every_s: float = 10.0,
                 bar: bool = True):  # fmt: skip
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done = 0
        self.t0 = self._last = time.monotonic()
        self._bar = None
        self._redirect = None
        self._lines = False
        if enabled and total > 0:
            if bar and _isatty(sys.stderr):
                try:
                    from tqdm import tqdm
                    from tqdm.contrib.logging import logging_redirect_tqdm

                    self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=False, file=sys.stderr,
                                     dynamic_ncols=True, smoothing=0.1)  # fmt: skip
                    # Log lines (e.g. "wrote acts000003.bin") print above the bar instead of through it.
                    self._redirect = logging_redirect_tqdm()
                    self._redirect.__enter__()
                except ImportError:
                    self._lines = True
            else:
                self._lines = True

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines:
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last = now
                log.info("%s", self.line())

    def rate(self) -> float:
        dt = time.monotonic() - self.t0
        return self.done / dt if dt > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f}%), "
            f"{rate:,.1f} {self.unit}/s, elapsed {fmt_duration(time.monotonic() - self.t0)}, ETA {fmt_duration(eta)}"
        )

    def close(self) -> None:
        if self._lines and self.done:  # a job log ends with the count, the rate and the time taken
            self._lines = False
            log.info("%s", self.line())
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
