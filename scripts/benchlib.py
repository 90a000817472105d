"""Shared helpers for the benchmark scripts: machine description, tables, BENCHMARKS.md sections.

Each benchmark owns one section of BENCHMARKS.md, delimited by
``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``; re-running a benchmark replaces only its
own section (under a lock file, so benchmarks can run at the same time).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_MD = os.path.join(ROOT, "BENCHMARKS.md")
HEADER = (
    "# Benchmarks\n\n"
    "Every figure is produced by a script in `scripts/` (command given per section) and is reported\n"
    "as a ratio against a reference measured in the same run on the same machine. Re-run a script\n"
    "to refresh its section.\n"
)


def _amd_generation(family: int, model: int) -> str | None:
    """Zen generation of an AMD CPU family/model (the VM's "model name" says only "AMD EPYC", and
    the project VM has been a Zen-4 and a Zen-5 host on different days, with different memory)."""
    if family == 26:
        return "Zen 5"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    return None


def machine() -> str:
    cpu = "unknown CPU"
    info = {}
    try:
        with open("/proc/cpuinfo") as fd:
            for line in fd:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "vendor_id") and key not in info:
                    info[key] = value.strip()
                if not line.strip():
                    break
    except OSError:
        pass
    if "model name" in info:
        cpu = info["model name"]
        if "cpu family" in info and "model" in info:
            cpu += f" family {info['cpu family']} model {info['model']}"
            gen = _amd_generation(int(info["cpu family"]), int(info["model"]))
            if info.get("vendor_id") == "AuthenticAMD" and gen:
                cpu += f", {gen}"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            gpu = ", GPU " + out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    damon = damon_pageout()
    return (
        f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM{gpu}, Python {platform.python_version()}"
        + (f"; {damon}" if damon else "")
    )


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root (``argv``: default this process's)."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    return " ".join(shlex.quote(a) for a in ["python", script, *argv[1:]])


class Device:
    """A benchmark's ``--device``: exits with a clear message when it names a GPU torch cannot see.

    ``cuda``: whether it is a GPU; ``words``: how the tables' text names it; ``sync()``: wait
    for the GPU before reading a clock; ``section(name, title)``: the BENCHMARKS.md section,
    ``NAME-cuda`` / ``TITLE (CUDA)`` for a GPU so the CPU figures stay beside them.
    """

    def __init__(self, name: str):
        import torch

        self.name, self.torch = name, torch
        self.cuda = torch.device(name).type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            sys.exit(f"--device {name}: torch {torch.__version__} sees no CUDA GPU here")
        self.words = f"{name} ({torch.cuda.get_device_name(torch.device(name))})" if self.cuda else "the CPU"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def section(self, name: str, title: str) -> tuple[str, str]:
        return (f"{name}-cuda", f"{title} (CUDA)") if self.cuda else (name, title)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Markdown table from a list of dicts (floats shown with 3 significant digits)."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])

    def fmt(v) -> str:
        if isinstance(v, float):
            if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
                return f"{v:.3g}"
            return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def record(name: str, title: str, body: str, path: str = BENCH_MD, when: float | None = None) -> None:
    """Replace (or append) section ``name`` of BENCHMARKS.md with title, command, machine, date
    (``when``, a Unix time: when the figures were measured; default now), body."""
    stamp = datetime.datetime.now(datetime.UTC) if when is None else datetime.datetime.fromtimestamp(when, datetime.UTC)
    now = stamp.strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"- command: `{command_line()}`\n- machine: {machine()}\n- date: {now}\n\n{body.rstrip()}\n"
        f"<!-- /bench:{name} -->\n"
    )
    lock = path + ".lock"
    with open(lock, "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        text = HEADER
        if os.path.exists(path):
            with open(path) as fh:
                text = fh.read()
        pat = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->\n", re.S)
        if pat.search(text):
            text = pat.sub(lambda _m: section, text)
        else:
            text = text.rstrip() + "\n\n" + section
        tmp = path + ".tmp"
        with open(tmp, "w") as fd:
            fd.write(text)
        os.replace(tmp, path)
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass


def _per_file_mapping(paths: list[str], measure) -> float | None:
    """Map each non-empty file read-only and sum ``measure(mm, address, size) -> (have, total)``
    over them: -> have / total, or None as soon as one measure returns None."""
    import mmap

    import numpy as np

    have = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
            a = np.frombuffer(mm, np.uint8)
            got = measure(mm, a.ctypes.data, size)
            del a
        if got is None:
            return None
        have += got[0]
        total += got[1]
    return have / total if total else 1.0


def resident_fraction(paths: list[str]) -> float | None:
    """The share of the files' pages in the page cache (mincore on a read-only mapping; no I/O),
    or None where mincore is not available."""
    import ctypes

    import numpy as np

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")

    def measure(mm, addr: int, size: int):
        vec = np.zeros(-(-size // page), np.uint8)
        if mincore(addr, size, vec.ctypes.data) != 0:
            return None
        return int((vec & 1).sum()), len(vec)

    return _per_file_mapping(paths, measure)


def read_through(paths: list[str], chunk: int = 8 * 2**20) -> tuple[float, int]:
    """Read the files once, sequentially, with chunk-sized reads into one reused buffer: a plain
    read's speed, and what brings back into the page cache the pages the kernel dropped (see
    damon_pageout). -> (seconds, bytes read)."""
    buf = bytearray(chunk)
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    return time.perf_counter() - t0, n


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED; other files keep theirs)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def huge_share(paths: list[str]) -> float | None:
    """The share of the files' bytes that the page cache holds in 2 MiB folios mapped 2 MiB at a
    time: each file is mapped (MADV_HUGEPAGE), its pages mapped in (MADV_POPULATE_READ; pages not
    cached are read) and the growth of FilePmdMapped read, then unmapped. None where the kernel
    cannot tell (no MADV_POPULATE_READ, no FilePmdMapped line). A plain sequential read of a whole
    file that was not cached leaves it almost all in such folios; reads that fill holes, or
    random reads, leave small ones, and a gather out of small folios runs ~1.4x slower."""
    import ctypes
    import mmap

    def pmd_kib() -> int | None:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("FilePmdMapped:"):
                    return int(line.split()[1])
        return None

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not hasattr(mmap, "MADV_HUGEPAGE") or pmd_kib() is None:
        return None

    def measure(mm, addr: int, size: int):
        mm.madvise(mmap.MADV_HUGEPAGE)
        k0 = pmd_kib()
        if madvise(addr, size, 22) != 0:  # MADV_POPULATE_READ
            return None
        return (pmd_kib() - k0) * 1024, size

    return _per_file_mapping(paths, measure)


def damon_pageout() -> str | None:
    """A description of a DAMON scheme that pages out file pages left unused (proactive reclaim,
    as on the project's Firecracker VMs), or None. Such a scheme evicts "warm" cache files that
    a benchmark has not read for a while, whatever memory is free."""
    root = "/sys/kernel/mm/damon/admin/kdamonds"

    def value(path: str) -> str:
        with open(path) as fh:
            return fh.read().strip()

    def numbered(path: str) -> list[str]:
        return sorted(x for x in os.listdir(path) if x.isdigit())

    try:
        for k in numbered(root):
            if value(f"{root}/{k}/state") != "on":
                continue
            for c in numbered(f"{root}/{k}/contexts"):
                ctx = f"{root}/{k}/contexts/{c}"
                aggr_s = int(value(f"{ctx}/monitoring_attrs/intervals/aggr_us")) / 1e6
                for sc in numbered(f"{ctx}/schemes"):
                    if value(f"{ctx}/schemes/{sc}/action") == "pageout":
                        age = int(value(f"{ctx}/schemes/{sc}/access_pattern/age/min"))
                        return f"DAMON pages out memory unused for ~{age * aggr_s:g} s"
    except (OSError, ValueError):
        return None
    return None


def drop_caches(paths: list[str]) -> str:
    """Evict files from the page cache: drop_caches as root, else posix_fadvise DONTNEED."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fd:
            fd.write("3\n")
        return "drop_caches"
    except OSError:
        evict(paths)
        return "fadvise"
