"""The import graph of src/actcache: data flows one way, the CLI sits on top, no circles.

Every module's imports are read with ``ast`` (function-level imports included, relative imports
resolved), so a lazy import counts as much as one at the top of the file.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = "actcache"


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    root = os.path.join(SRC, PKG)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), SRC)[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_pkg = MODULES[module].endswith("__init__.py")
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports anywhere in its file (ours by full name, others by top name)."""
    with open(MODULES[module], encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), MODULES[module])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for a in node.names:
                sub = f"{base}.{a.name}"
                names.add(sub if sub in MODULES else base)
    return {n if n.split(".")[0] == PKG else n.split(".")[0] for n in names} - {module}


GRAPH = {m: _imports(m) for m in MODULES}


def _ours(names: set[str]) -> set[str]:
    # importing a.b.c runs a/__init__ and a/b/__init__ too; those package inits are not edges here
    return {n for n in names if n in MODULES and n != PKG}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in _ours(GRAPH[todo.pop()]) - seen:
            seen.add(n)
            todo.append(n)
    return seen


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _library() -> list[str]:
    return [m for m in MODULES if not _within(m, "actcache.cli")]


def test_the_graph_sees_function_level_and_relative_imports():
    assert "actcache.visuals_plots" in GRAPH["actcache.visuals"]  # imported inside functions
    assert "actcache.rundir" in GRAPH["actcache.sae.train"]
    assert "torch" in GRAPH["actcache.sae.modeling"]
    assert {"actcache.cli.plan", "actcache.cli.train"} <= set(MODULES)


def test_no_import_circle():
    circles = sorted(m for m in MODULES if m in _reachable(m))
    assert not circles, f"modules on an import circle: {circles}"


def test_no_library_module_imports_the_cli():
    bad = {m: sorted(n for n in _ours(GRAPH[m]) if _within(n, "actcache.cli")) for m in _library()}
    assert not {m: v for m, v in bad.items() if v}


def test_sae_does_not_reach_plan():
    bad = [m for m in MODULES if _within(m, "actcache.sae") and "actcache.plan" in _reachable(m)]
    assert not bad


def test_loaders_reach_neither_sae_nor_visuals():
    bad = {}
    for m in MODULES:
        if _within(m, "actcache.loaders"):
            hits = [n for n in _reachable(m) if _within(n, "actcache.sae") or n.startswith("actcache.visuals")]
            if hits:
                bad[m] = sorted(hits)
    assert not bad


def test_protocol_needs_only_errors_and_fsutil_and_no_torch():
    assert _reachable("actcache.protocol") <= {"actcache.errors", "actcache.fsutil", "actcache.docfiles"}
    third_party = set().union(*(GRAPH[m] for m in {"actcache.protocol", *_reachable("actcache.protocol")}))
    assert "torch" not in third_party


def test_rundir_is_light():
    # the workflow and every CLI command read run files through it while they parse
    # docfiles and fsutil (the file digest): light
    assert _reachable("actcache.rundir") <= {"actcache.errors", "actcache.docfiles", "actcache.fsutil"}
    assert "torch" not in GRAPH["actcache.rundir"]


def test_hash_command_does_not_import_torch(tmp_path):
    from actcache.writer import synthetic_metadata

    md_path = synthetic_metadata(8).dump(tmp_path)
    code = (
        "import sys; from actcache.cli import main; rc = main(['hash', sys.argv[1]]); "
        "print('torch' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(md_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    digest, torch_loaded = proc.stdout.split()
    assert len(digest) == 64 and torch_loaded == "False"


def test_planning_the_workflow_loads_neither_torch_nor_the_c_kernel(tmp_path):
    """Snakemake plans again for every dry run and every cluster job: importing torch would cost
    each of them seconds."""
    from tests.fixtures_vit import make_checkpoint
    from tests.workflow_helpers import write_project

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), "clip")
    doc = {
        "name": "imports",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "synthetic", "n_imgs": 8, "seed": 1, "size": 40},
        "cache": {"max_patches_per_shard": 17 * 4},
        "train": {"batch_size": 16, "steps": 2, "sweep": {"k": [2, 4]}},
    }
    cfg = write_project(str(tmp_path / "proj"), {"imports": doc})
    # what workflow/rules/common.smk runs while Snakemake parses the workflow
    code = (
        "import sys; from actcache.plan import plan_from_config, train_jobs; "
        "planned = plan_from_config(sys.argv[1]); jobs = train_jobs(planned, sys.argv[2]); "
        "print(len(jobs), 'actcache._native' in sys.modules, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, cfg, str(tmp_path / "runs")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "False", "False"]
