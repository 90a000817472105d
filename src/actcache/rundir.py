"""The run directory: where a trained SAE's files live, what they are called, how runs are found.

    <runs_to>/<HASH>/<sae-id>/          one SAE trained on the cache <HASH> (run_dir)
        run.json                        the RunConfig, cache path and hash, group id (written first)
        metrics.jsonl                   one line of training metrics every log_every steps
        checkpoints/step-NNNNNNNN/      weights, optimizer state, position.json, manifest.json (the last
                                        keep_checkpoints of them; actcache.sae.checkpoint)
        sae.safetensors, config.json    the final weights (SAE.save / SAE.load)
        eval.json                       held-out metrics (actcache.sae.evaluate)
        done.json                       written last: the SAE is finished
        visuals/, visuals.html          `actcache visuals` (latents.npz, summary.json, index.html, plots)
    <runs_to>/<HASH>/visuals/           sweep plots over every SAE of the cache
    <runs_to>/<HASH>/groups/<group-id>.done   the workflow's mark of a finished training job

This module is the only one that spells these names; writers and readers import them from here.
It imports nothing heavy (no torch), so the workflow and the CLI can use it while they parse.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from actcache.errors import ActCacheError

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
DONE_FILE = "done.json"
WEIGHTS_FILE = "sae.safetensors"
CONFIG_FILE = "config.json"
SAE_FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHECKPOINTS_DIR = "checkpoints"
POSITION_FILE = "position.json"
CHECKPOINT_STATE_FILE = "state.pt"  # a checkpoint's optimizer, objective and trainer state
MANIFEST_FILE = "manifest.json"  # a checkpoint's files with their sizes and checksums, written last
SET_ASIDE_MARK = ".invalid"  # a checkpoint found damaged is renamed step-NNNNNNNN.invalid[-k]
VISUALS_DIR = "visuals"
VISUALS_PAGE = "visuals.html"  # the visuals/ page in one small file, beside the folder (for snakemake --report)
PAGE_FILE = "index.html"
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
        return self.info.get("sae_id") or os.path.basename(os.path.normpath(self.dir))

    @property
    def has_weights(self) -> bool:
        return all(os.path.isfile(os.path.join(self.dir, f)) for f in SAE_FILES)

    def file(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def sae_config(self) -> dict:
        """The final weights' config.json ({} before training ends)."""
        return read_json(self.file(CONFIG_FILE)) or {}

    def eval(self) -> dict:
        return read_json(self.file(EVAL_FILE)) or {}

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


def read_json(path: str):
    """The JSON document at ``path``; None when it does not exist; RunDirError when unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: nested too deeply
        raise RunDirError(f"{path}: cannot read it as JSON ({err}); delete it or re-run actcache train") from None


def read_metrics(directory: str) -> list[dict]:
    """The lines of a run's metrics.jsonl ([] without one); a line cut short by a kill is skipped."""
    out = []
    try:
        with open(os.path.join(directory, METRICS_FILE), encoding="utf-8") as fh:
            for ln in fh:
                try:
                    out.append(json.loads(ln))
                except (ValueError, RecursionError):
                    continue
    except FileNotFoundError:
        pass
    return out


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
    """The Run at ``path``; ``cache`` overrides the cache directory recorded in run.json."""
    info = read_json(os.path.join(path, RUN_FILE)) or {}
    run = info.get("run", {})
    return Run(
        dir=path, info=info, cache=cache or info.get("cache"), cache_hash=info.get("cache_hash"),
        layer=info.get("layer", run.get("layer")), patches=run.get("patches", "image"),
        scale_norm=bool(run.get("scale_norm", False)),
    )  # fmt: skip
