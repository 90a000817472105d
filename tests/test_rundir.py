"""actcache.rundir: the run directory's layout, finding and reading runs, and its single ownership."""

from __future__ import annotations

import ast
import json
import os
import re

import pytest

from actcache import rundir
from actcache.rundir import RunDirError, done_paths, find_runs, load_run, read_metrics, run_dir
from actcache.sae.config import expand_train_section

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Names only rundir may spell (config.json is left out: model checkpoints have one too).
RUN_FILE_NAMES = {
    rundir.RUN_FILE, rundir.METRICS_FILE, rundir.EVAL_FILE, rundir.DONE_FILE, rundir.WEIGHTS_FILE,
    rundir.CHECKPOINTS_DIR, rundir.POSITION_FILE, rundir.VISUALS_PAGE, rundir.STATS_FILE, rundir.SUMMARY_FILE,
    rundir.SWEEP_FILE, rundir.NMSE_L0_PLOT, rundir.CURVES_PLOT, rundir.FREQ_PLOT, rundir.GROUPS_DIR,
    rundir.CHECKPOINT_STATE_FILE, rundir.MANIFEST_FILE, *rundir.PARETO_PLOTS, rundir.SPLICED_MARK,
}  # fmt: skip


def make_run(directory, sae_id="0123456789ab", with_weights=True, info=True):
    os.makedirs(directory, exist_ok=True)
    if info:
        doc = {"sae_id": sae_id, "cache": "/c", "cache_hash": "ab" * 32, "layer": -2,
               "run": {"patches": "all", "scale_norm": True}}  # fmt: skip
        with open(os.path.join(directory, rundir.RUN_FILE), "w") as fh:
            json.dump(doc, fh)
    if with_weights:
        for name in rundir.SAE_FILES:
            with open(os.path.join(directory, name), "w") as fh:
                fh.write("{}")
    return str(directory)


def test_run_dirs_and_done_files_of_a_sweep(tmp_path):
    runs = expand_train_section({"steps": 2, "sweep": {"k": [4, 8]}}, "x.yaml")
    dirs = [run_dir(tmp_path, "h" * 64, r) for r in runs]
    assert dirs == [os.path.join(tmp_path, "h" * 64, r.sae_id) for r in runs]
    assert run_dir(tmp_path, "h" * 64, runs[0].sae_id) == dirs[0]  # an id works as well as a RunConfig
    assert done_paths(tmp_path, "h" * 64, runs) == [os.path.join(d, "done.json") for d in dirs]


def test_find_runs_in_a_sweep_and_in_the_runs_root(tmp_path):
    a = make_run(tmp_path / "runs" / "h1" / "aaaaaaaaaaaa")
    b = make_run(tmp_path / "runs" / "h1" / "bbbbbbbbbbbb", info=False)  # weights alone are enough
    os.makedirs(tmp_path / "runs" / "h1" / "groups")  # not a run
    assert find_runs([str(tmp_path / "runs" / "h1")]) == [a, b]
    assert find_runs([str(tmp_path / "runs")]) == [a, b]
    assert find_runs([a, a]) == [a]


def test_find_runs_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(RunDirError, match="no such directory"):
        find_runs([str(tmp_path / "missing")])
    os.makedirs(tmp_path / "empty" / "x")
    with pytest.raises(RunDirError, match=re.escape(str(tmp_path / "empty")) + ".*not an SAE run directory"):
        find_runs([str(tmp_path / "empty")])


def test_load_run_reads_run_json_and_falls_back_without_it(tmp_path):
    run = load_run(make_run(tmp_path / "r1"))
    assert (run.name, run.layer, run.patches, run.scale_norm, run.cache) == ("0123456789ab", -2, "all", True, "/c")
    assert run.has_weights and load_run(run.dir, cache="/other").cache == "/other"
    bare = load_run(make_run(tmp_path / "r2", info=False))
    assert (bare.name, bare.layer, bare.patches, bare.cache) == ("r2", None, "image", None)


def test_an_unreadable_run_file_is_a_run_dir_error(tmp_path):
    d = make_run(tmp_path / "r")
    with open(os.path.join(d, rundir.RUN_FILE), "w") as fh:
        fh.write("{cut")
    with pytest.raises(RunDirError, match=re.escape(rundir.RUN_FILE)):
        load_run(d)


def test_metrics_lines_cut_by_a_kill_are_skipped(tmp_path):
    with open(tmp_path / rundir.METRICS_FILE, "w") as fh:
        fh.write('{"step": 10}\n{"step": 20}\n{"st')
    assert read_metrics(str(tmp_path)) == [{"step": 10}, {"step": 20}]
    assert read_metrics(str(tmp_path / "none")) == []


def test_checkpoint_names_round_trip():
    path = rundir.checkpoint_dir("r", 1000)
    assert os.path.dirname(path) == os.path.join("r", rundir.CHECKPOINTS_DIR)
    assert rundir.checkpoint_step(os.path.basename(path)) == 1000
    assert rundir.checkpoint_step(".step-00001000.tmp") is None


def _python_literals(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_other_module_spells_a_run_file_name():
    spelled = {}
    for dirpath, _, files in os.walk(os.path.join(REPO, "src", "actcache")):
        for f in files:
            path = os.path.join(dirpath, f)
            if f.endswith(".py") and path != rundir.__file__:
                hits = _python_literals(path) & RUN_FILE_NAMES
                if hits:
                    spelled[os.path.relpath(path, REPO)] = sorted(hits)
    rules = [os.path.join(REPO, "Snakefile")] + [
        os.path.join(REPO, "workflow", "rules", f) for f in os.listdir(os.path.join(REPO, "workflow", "rules"))
    ]
    for path in rules:
        with open(path, encoding="utf-8") as fh:
            quoted = set(re.findall(r"""["']([^"'\n]+)["']""", fh.read()))
        hits = {q for q in quoted if os.path.basename(q) in RUN_FILE_NAMES or q in RUN_FILE_NAMES}
        if hits:
            spelled[os.path.relpath(path, REPO)] = sorted(hits)
    assert not spelled, f"run file names outside actcache.rundir: {spelled}"
