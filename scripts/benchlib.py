"""Shared helpers for the benchmark scripts: machine description, tables, BENCHMARKS.md sections.

Each benchmark owns one section of BENCHMARKS.md, delimited by
``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``; re-running a benchmark replaces only its
own section (under a lock file, so benchmarks can run at the same time). A section is rendered
by ``section_body`` from a short template: at most 5 setup lines, tables of at most
``MAX_COLUMNS`` columns, at most 5 conclusion bullets. The targets a benchmark checks
(``Check``) also replace that benchmark's rows of the summary table at the top of the file
(between ``<!-- bench:summary -->`` markers).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_MD = os.path.join(ROOT, "BENCHMARKS.md")
SUMMARY_COLUMNS = ("Target", "Figure", "Machine", "Date", "Result", "Section")
RERUN = (
    "How to re-run: each section names the command that measured it; run it from the repository\n"
    "root and it replaces its own section and its rows above (`--help` lists the options). Every\n"
    "figure is a ratio against a reference measured in the same run on the same machine, so compare\n"
    "ratios, not absolute rates, across machines. Columns left out of a section's table: the\n"
    "script's `--json` output (bench_loaders.py, bench_kernel.py).\n"
)
SUMMARY_HEAD = "| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "|".join("---" for _ in SUMMARY_COLUMNS) + "|\n"
HEADER = f"# Benchmarks\n\n<!-- bench:summary -->\n{SUMMARY_HEAD}<!-- /bench:summary -->\n\n{RERUN}"
MAX_SETUP, MAX_CONCLUSIONS, MAX_COLUMNS = 5, 5, 10


@dataclasses.dataclass(frozen=True)
class Check:
    """One target of a benchmark: what it asks, the figure measured, and whether it was met."""

    target: str  # e.g. "warm shuffled >= 0.9 x ref2 (1 layer)"
    figure: str  # e.g. "0.965 x ref2"
    met: bool | None  # None: a figure reported without a target

    @property
    def result(self) -> str:
        return "info" if self.met is None else "met" if self.met else "missed"

    def bullet(self) -> str:
        return f"{self.result}: {self.target}, measured {self.figure}"


def check(target: str, value: float, limit: float, unit: str = "", at_least: bool = True) -> Check:
    """A Check of ``value >= limit`` (``at_least``) or ``value <= limit``, its figure ``value unit``."""
    met = value >= limit if at_least else value <= limit
    return Check(target, f"{fmt(value)}{' ' + unit if unit else ''}", met)


def section_body(setup: list[str], tables: list[str], conclusions: list[str]) -> str:
    """A section's body from its template parts: setup lines, tables, conclusion bullets."""
    if len(setup) > MAX_SETUP or len(conclusions) > MAX_CONCLUSIONS:
        raise ValueError(f"a section has at most {MAX_SETUP} setup lines and {MAX_CONCLUSIONS} conclusions")
    for t in tables:
        header = next((line for line in t.splitlines() if line.startswith("|")), "|")
        if header.count("|") - 1 > MAX_COLUMNS:
            raise ValueError(f"a section's table has at most {MAX_COLUMNS} columns: {header}")
    parts = ["\n".join(f"- {line}" for line in setup), *(t.rstrip() for t in tables)]
    if conclusions:
        parts.append("Conclusions:\n\n" + "\n".join(f"- {c}" for c in conclusions))
    return "\n\n".join(p for p in parts if p) + "\n"


def _amd_generation(family: int, model: int) -> str | None:
    """Zen generation of an AMD CPU family/model: a VM's "model name" may say only "AMD EPYC", and
    the generations differ in memory speed, which the benchmarks' ratios depend on."""
    if family == 26:
        return "Zen 5"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    return None


SITE_FILE = os.path.join(ROOT, "profiles", "sites", "local-slurm.env")


def site_env() -> dict[str, str]:
    """This environment with profiles/sites/local-slurm.env applied (what `source` would do), for
    runs of the osc profile against the local Slurm of scripts/slurm/up.sh; the sources on PYTHONPATH."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "src"))
    with open(SITE_FILE) as fd:
        for line in fd:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.strip().split("=", 1)
                env[k.removeprefix("export ")] = v
    return env


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


def machine_short() -> str:
    """The machine in a few words for the summary table: cores, and the GPU when there is one."""
    gpu = ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            gpu = ", " + out.stdout.strip().splitlines()[0].removeprefix("NVIDIA ")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{platform.node()}, {os.cpu_count()} cores{gpu}"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root (``argv``: default this process's); an argument
    of more than 60 characters (a note, whose text the section holds) is shown as '...'."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    args = ["'...'" if len(a) > 60 else shlex.quote(a) for a in argv[1:]]
    return " ".join(["python", shlex.quote(script), *args])


def clip224_checkpoint(out: str, d: int) -> str:
    """A local CLIP-224 checkpoint under ``out`` with hidden size ``d``, as far as preprocessing
    goes (the display crop): enough for a cache's metadata and a visuals page; its absolute path."""
    ckpt = os.path.join(out, "ckpt-clip224")
    os.makedirs(ckpt, exist_ok=True)
    docs = {
        "config.json": {"model_type": "clip_vision_model", "hidden_size": d, "num_hidden_layers": 12,
                        "image_size": 224, "patch_size": 16},
        "preprocessor_config.json": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
                                     "crop_size": {"height": 224, "width": 224}},
    }  # fmt: skip
    for name, doc in docs.items():
        with open(os.path.join(ckpt, name), "w") as fh:
            json.dump(doc, fh)
    return os.path.abspath(ckpt)


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


def fmt(v) -> str:
    """A table cell: floats with 3 significant digits, integers with thousands separators."""
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Markdown table from a list of dicts (floats shown with 3 significant digits)."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def summary_rows(text: str, name: str, checks: list[Check], machine: str, date: str) -> str:
    """``text`` with the summary table's rows of section ``name`` replaced by ``checks``."""
    start, end = "<!-- bench:summary -->\n", "<!-- /bench:summary -->\n"
    if start not in text:
        title, _, rest = text.partition("\n")
        text = HEADER + rest.lstrip("\n").removeprefix(RERUN) if title.startswith("# ") else HEADER + text
    head, _, rest = text.partition(start)
    table_text, _, tail = rest.partition(end)
    lines = table_text.splitlines()
    new = [f"| {c.target} | {c.figure} | {machine} | {date} | {c.result} | {name} |" for c in checks]
    rows = lines[2:]
    at = next((i for i, r in enumerate(rows) if r.rstrip(" |").endswith(f"| {name}")), len(rows))
    rows = [r for r in rows if not r.rstrip(" |").endswith(f"| {name}")]
    rows[at:at] = new
    return head + start + "\n".join([*lines[:2], *rows]) + "\n" + end + tail


def record(
    name: str,
    title: str,
    body: str,
    path: str = BENCH_MD,
    when: float | None = None,
    checks: list[Check] | None = None,
    machines: tuple[str, str] | None = None,
) -> None:
    """Replace (or append) section ``name`` of BENCHMARKS.md with title, command, machine, date
    (``when``, a Unix time: when the figures were measured; default now), body; with ``checks``,
    also replace the section's rows of the summary table. ``machines``: (machine(), machine_short())
    of the machine that measured the figures, when that is not this one (a re-render)."""
    long_machine, short_machine = machines or (machine(), machine_short())
    stamp = datetime.datetime.now(datetime.UTC) if when is None else datetime.datetime.fromtimestamp(when, datetime.UTC)
    now = stamp.strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- bench:{name} -->\n## {title}\n\n"
        f"- command: `{command_line()}`\n- machine: {long_machine}\n- date: {now}\n\n{body.rstrip()}\n"
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
        if checks is not None:
            text = summary_rows(text, name, checks, short_machine, stamp.strftime("%Y-%m-%d"))
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
    random reads, leave small ones, and a gather out of small folios runs slower."""
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
    as on some VMs), or None. Such a scheme evicts "warm" cache files that
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
