"""The run directory: where a trained SAE's files live, what they are called, how runs are found.

    <runs_to>/<HASH>/<sae-id>/          one SAE trained on the cache <HASH> (run_dir)
        run.json                        the RunConfig, cache path and hash, group id (written first)
        metrics.jsonl                   one line of training metrics every log_every steps
        train.lock                      flock'ed by the one `train` that owns the run (actcache.runlock)
        checkpoints/step-NNNNNNNN/      weights, optimizer state, position.json, manifest.json (the last
                                        keep_checkpoints of them; actcache.sae.checkpoint)
        sae.safetensors, config.json    the final weights (SAE.save / SAE.load)
        eval.json                       held-out metrics (actcache.sae.evaluate)
        done.json                       written last: the SAE is finished; its "files" record the final
                                        weights' and config's sizes and sha256 (check_weights)
        visuals/, visuals.html          `actcache visuals` (latents.npz, summary.json, index.html, plots)
    <runs_to>/<HASH>/visuals/           sweep plots over every SAE of the cache
    <runs_to>/<HASH>/groups/<group-id>.done   the workflow's mark of a finished training job

This module is the only one that spells these names; writers and readers import them from here.
It imports nothing heavy (no torch), so the workflow and the CLI can use it while they parse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import stat

from actcache.docfiles import load_json_file
from actcache.errors import ActCacheError, os_error_text

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
DONE_FILE = "done.json"
WEIGHTS_FILE = "sae.safetensors"
CONFIG_FILE = "config.json"
SAE_FILES = (CONFIG_FILE, WEIGHTS_FILE)
LOCK_FILE = "train.lock"  # the owning train's flock; holds "host pid" (actcache.runlock)
MAX_METRICS_BYTES = 512 * 2**20  # a million log lines; a larger metrics.jsonl is not a run's
CHECKPOINTS_DIR = "checkpoints"
POSITION_FILE = "position.json"
CHECKPOINT_STATE_FILE = "state.pt"  # a checkpoint's optimizer, objective and trainer state
MANIFEST_FILE = "manifest.json"  # a checkpoint's files with their sizes and checksums, written last
SET_ASIDE_MARK = ".invalid"  # a checkpoint found damaged is renamed step-NNNNNNNN.invalid[-k]
VISUALS_DIR = "visuals"
VISUALS_PAGE = "visuals.html"  # the visuals/ page in one small file, beside the folder (for snakemake --report)
PAGE_FILE = "index.html"
EXPLORER_DIR = "explorer"  # visuals/explorer/: the explorer's static files (actcache.explorer)
STATS_FILE = "latents.npz"
SUMMARY_FILE = "summary.json"
SWEEP_FILE = "sweep.json"
CURVES_PLOT = "curves.png"  # training curves: per run in visuals/, and over a sweep
FREQ_PLOT = "freq.png"
NMSE_L0_PLOT = "nmse_l0.png"
PARETO_FVU_PLOT = "pareto_l0_fvu.png"  # Pareto frontiers over a cache's SAEs (actcache.visuals_pareto)
PARETO_SPLICED_PLOT = "pareto_l0_spliced.png"
PARETO_PROBE_PLOT = "pareto_l0_probe.png"
PARETO_PLOTS = (PARETO_FVU_PLOT, PARETO_SPLICED_PLOT, PARETO_PROBE_PLOT)
SWEEP_PLOTS = (NMSE_L0_PLOT, CURVES_PLOT, *PARETO_PLOTS)  # in <runs_to>/<HASH>/visuals/
GROUPS_DIR = "groups"
SPLICED_MARK = "spliced.done"  # in GROUPS_DIR: `actcache eval` ran over every SAE of the cache
_CHECKPOINT_RE = re.compile(r"^step-(\d{8,})$")


class RunDirError(ActCacheError):
    """A path is not (or not yet) a trained SAE's run directory, or one of its files is unreadable."""


# ---- layout -----------------------------------------------------------------------------------


def run_dir(runs_to: str | os.PathLike, cache_hash: str, run) -> str:
    """``<runs_to>/<HASH>/<sae-id>`` of ``run`` (a RunConfig, or an SAE id)."""
    sae_id = run if isinstance(run, str) else run.sae_id
    return os.path.join(os.fspath(runs_to), cache_hash, sae_id)


def done_path(directory: str) -> str:
    return os.path.join(directory, DONE_FILE)


def is_done(directory: str) -> bool:
    return os.path.exists(done_path(directory))


def done_paths(runs_to: str | os.PathLike, cache_hash: str, runs: list) -> list[str]:
    """The files a finished group (or sweep) leaves: ``<runs_to>/<HASH>/<sae-id>/done.json``."""
    return [done_path(run_dir(runs_to, cache_hash, r)) for r in runs]


def checkpoint_dir(directory: str, step: int) -> str:
    return os.path.join(directory, CHECKPOINTS_DIR, f"step-{step:08d}")


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory's name (``step-NNNNNNNN``); None for any other name."""
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def spliced_mark_of(directory: str) -> str:
    """The spliced evaluation's mark of the cache whose SAE lives in the run directory ``directory``."""
    return os.path.join(os.path.dirname(os.path.abspath(directory)), GROUPS_DIR, SPLICED_MARK)


def sweep_dir(runs_to: str | os.PathLike, cache_hash: str) -> str:
    """Where the sweep plots over every SAE of one cache go."""
    return os.path.join(os.fspath(runs_to), cache_hash, VISUALS_DIR)


def group_mark(runs_to: str | os.PathLike, cache_hash: str, mark_name: str) -> str:
    """``<runs_to>/<HASH>/groups/<mark_name>``: the workflow's mark of a training job."""
    return os.path.join(os.fspath(runs_to), cache_hash, GROUPS_DIR, mark_name)


# ---- reading runs ------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A run directory and what its run.json says (every field falls back when run.json is absent)."""

    dir: str
    info: dict  # run.json ({} when absent)
    cache: str | None
    cache_hash: str | None
    layer: int | None
    patches: str
    scale_norm: bool

    @property
    def name(self) -> str:
        sae_id = _field(self.info, "sae_id", str, self.file(RUN_FILE))
        return sae_id or os.path.basename(os.path.normpath(self.dir))

    @property
    def has_weights(self) -> bool:
        return all(os.path.isfile(os.path.join(self.dir, f)) for f in SAE_FILES)

    def file(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def sae_config(self) -> dict:
        """The final weights' config.json ({} before training ends)."""
        return _object(self.file(CONFIG_FILE))

    def eval(self) -> dict:
        return _object(self.file(EVAL_FILE))

    def label(self) -> str:
        r = self.info.get("run", {})
        cfg = self.sae_config()
        act = cfg.get("activation", r.get("activation", "?"))
        k = cfg.get("k", r.get("k"))
        width = cfg.get("width", self.info.get("width"))
        imported = " (imported)" if self.imported else ""
        return f"{self.name[:8]} {act}" + (f" k={k}" if k else "") + (f" w={width}" if width else "") + imported

    @property
    def imported(self) -> bool:
        """An SAE trained elsewhere (`actcache import`): read-only, never retrained."""
        return bool(self.info.get("imported"))


def read_json(path: str, what: str = "run file"):
    """The JSON document at ``path`` read within docfiles' bounds (a regular file, at most
    MAX_DOC_BYTES); None when it does not exist; RunDirError naming it when unreadable."""
    if not os.path.lexists(path):
        return None
    try:
        return load_json_file(path, RunDirError, what)
    except RunDirError as err:
        raise RunDirError(f"{err} Delete it or re-run actcache train for this SAE.") from None


def _object(path: str) -> dict:
    """The JSON object at ``path`` ({} when absent); RunDirError when it is another JSON value."""
    doc = read_json(path)
    if doc is not None and not isinstance(doc, dict):
        raise RunDirError(f"{path}: not a JSON object; delete it and re-run actcache train for this SAE.")
    return doc or {}


def read_metrics(directory: str) -> list[dict]:
    """The lines of a run's metrics.jsonl ([] without one) that are JSON objects with an integer
    step; a line cut short by a kill is skipped. Read within bounds: a regular file of at most
    MAX_METRICS_BYTES (RunDirError otherwise)."""
    raw = _read_bounded(os.path.join(directory, METRICS_FILE), MAX_METRICS_BYTES)
    out = []
    for ln in (raw or b"").splitlines():
        try:
            doc = json.loads(ln)
        except (ValueError, RecursionError):
            continue
        if isinstance(doc, dict) and type(doc.get("step")) is int:
            out.append(doc)
    return out


def _read_bounded(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (None when absent); RunDirError for any other kind of
    file, one larger than ``limit``, or an OS error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise RunDirError(f"{path}: cannot read it: {os_error_text(err)}; check the path and its permissions.") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunDirError(f"{path}: not a regular file; delete it (a run directory holds plain files).")
        if st.st_size > limit:
            raise RunDirError(f"{path}: {st.st_size:,} bytes, more than the {limit:,} allowed; check that it is this run's.")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit)
    except OSError as err:
        raise RunDirError(f"{path}: cannot read it: {os_error_text(err)}; check the disk or restore the file.") from None
    finally:
        os.close(fd)


# ---- the final weights' record -------------------------------------------------------------------


def file_record(path: str) -> dict:
    """``{"bytes": size, "sha256": hex}`` of a regular file (OSError when unreadable)."""
    from actcache.fsutil import sha256_file

    digest, n = sha256_file(path, regular_only=True)
    return {"bytes": n, "sha256": digest}


def weights_records(directory: str) -> dict:
    """The record done.json keeps of the final weights and config (``{"files": {name: record}}``'s
    value), made from the files as they are now on disk: call it right after writing them."""
    return {name: file_record(os.path.join(directory, name)) for name in SAE_FILES}


_warned_unrecorded: set[str] = set()


def check_weights(directory: str) -> None:
    """Check the final weights and config of the run ``directory`` against done.json's record:
    a missing, cut, grown or changed file is one RunDirError line naming it. A run without the
    record (trained before it was kept) is warned about once per process and passes: SAE.load then
    still checks the safetensors header and every tensor's shape. A run without done.json (not
    finished, or a bare SAE.save directory) has nothing to check against and passes."""
    done = read_json(os.path.join(directory, DONE_FILE), "done file")
    if done is None:
        return
    dpath = os.path.join(directory, DONE_FILE)
    if not isinstance(done, dict):
        raise RunDirError(f"{dpath}: not a JSON object; delete it and re-run actcache train for this SAE.")
    files = done.get("files")
    if files is None:
        if directory not in _warned_unrecorded:
            _warned_unrecorded.add(directory)
            log.warning("%s records no checksum of %s (trained by an older actcache); its weights are only "
                        "checked for a readable header and the right shapes", dpath, WEIGHTS_FILE)  # fmt: skip
        return
    for name in SAE_FILES:
        _check_one(directory, name, files.get(name) if isinstance(files, dict) else None, dpath)


def _check_one(directory: str, name: str, rec, dpath: str) -> None:
    path = os.path.join(directory, name)
    ok = isinstance(rec, dict) and type(rec.get("bytes")) is int and isinstance(rec.get("sha256"), str)
    if not ok:
        raise RunDirError(f"{dpath}: files.{name} is not a record of bytes and sha256; delete {DONE_FILE} and "
                          "re-run actcache train for this SAE.")  # fmt: skip
    again = "restore it from a backup or delete done.json and re-run actcache train for this SAE"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise RunDirError(f"{path}: not a regular file; {again}.")
        if st.st_size != rec["bytes"]:
            raise RunDirError(f"{path}: {st.st_size:,} bytes, {DONE_FILE} records {rec['bytes']:,}; the file was "
                              f"cut or replaced after training; {again}.")  # fmt: skip
        got = file_record(path)
    except OSError as err:
        raise RunDirError(f"{path}: cannot read it: {os_error_text(err)}; {again}.") from None
    if got["sha256"] != rec["sha256"] or got["bytes"] != rec["bytes"]:
        raise RunDirError(f"{path}: its sha256 differs from the one {DONE_FILE} records (the file changed after "
                          f"training); {again}.")  # fmt: skip


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_FILE)) or all(os.path.isfile(os.path.join(path, f)) for f in SAE_FILES)


def _subdirs(paths: list[str]) -> list[str]:
    return [os.path.join(d, c) for d in paths for c in sorted(os.listdir(d)) if os.path.isdir(os.path.join(d, c))]


def find_runs(paths: list[str]) -> list[str]:
    """Run directories named by ``paths``: each a run directory, or a directory holding run
    directories one or two levels down (``<runs_to>/<HASH>/`` or ``<runs_to>/``)."""
    out: list[str] = []
    for p in paths:
        if not os.path.isdir(p):
            raise RunDirError(
                f"{p}: no such directory. Pass an SAE run directory <runs_to>/<HASH>/<sae-id>/ written by "
                "`actcache train` (`actcache plan` lists them), or a directory holding such runs."
            )
        if is_run_dir(p):
            out.append(p)
            continue
        found: list[str] = []
        level = [p]
        for _ in (1, 2):
            level = _subdirs(level)
            found = [d for d in level if is_run_dir(d)]
            if found:
                break
        if not found:
            raise RunDirError(
                f"{p}: not an SAE run directory (no {RUN_FILE}, no {' + '.join(SAE_FILES)}) and no run directories "
                "below it. Pass <runs_to>/<HASH>/<sae-id>/ of an SAE trained by `actcache train`."
            )
        out.extend(found)
    return list(dict.fromkeys(out))


def load_run(path: str, cache: str | None = None) -> Run:
    """The Run at ``path``; ``cache`` overrides the cache directory recorded in run.json. A field of
    run.json of the wrong type (or an integer out of range) is one RunDirError line naming it."""
    rpath = os.path.join(path, RUN_FILE)
    info = read_json(rpath) or {}
    if not isinstance(info, dict):
        raise RunDirError(f"{rpath}: not a JSON object; delete it and re-run actcache train for this SAE.")
    run = _field(info, "run", dict, rpath) or {}
    layer = _field(info, "layer", int, rpath)
    return Run(
        dir=path, info=info, cache=cache or _field(info, "cache", str, rpath),
        cache_hash=_field(info, "cache_hash", str, rpath),
        layer=layer if layer is not None else _field(run, "layer", int, rpath, "run."),
        patches=_field(run, "patches", str, rpath, "run.") or "image",
        scale_norm=bool(_field(run, "scale_norm", bool, rpath, "run.")),
    )  # fmt: skip


_TYPE_NAMES = {dict: "an object", int: "an integer", str: "a string", bool: "true or false"}
MAX_FIELD_INT = 2**31  # layers, widths and steps are far below it


def _field(doc: dict, key: str, kind: type, path: str, prefix: str = ""):
    """``doc[key]`` when it is of ``kind`` (None when absent or null); RunDirError otherwise."""
    v = doc.get(key)
    if v is None:
        return None
    ok = type(v) is kind if kind in (int, bool) else isinstance(v, kind)
    if ok and kind is int and abs(v) >= MAX_FIELD_INT:
        raise RunDirError(f"{path}: {prefix}{key} is {str(v)[:20]}... ({len(str(v))} digits), out of range; "
                          "delete run.json and re-run actcache train for this SAE.")  # fmt: skip
    if not ok:
        raise RunDirError(f"{path}: {prefix}{key} is {json.dumps(v)[:60]}, not {_TYPE_NAMES[kind]}; delete run.json "
                          "and re-run actcache train for this SAE.")  # fmt: skip
    return v
