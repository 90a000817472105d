#!/usr/bin/env bash
# Create (or update) the project's virtual env in .venv and install actcache with its dev extra.
# torch is pinned first to the CPU wheel 2.13.0: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.actcache-installed
# re-install when the project's metadata or its C kernel (src/actcache/_native.c, built by setup.py
# next to its source) changed, or when the kernel is missing and a compiler could build it
rebuild=0
for f in pyproject.toml setup.py src/actcache/_native.c; do if [ "$f" -nt "$stamp" ]; then rebuild=1; fi; done
if ! ls src/actcache/_native*.so >/dev/null 2>&1 && command -v cc >/dev/null; then rebuild=1; fi
if [ ! -f "$stamp" ] || [ "$rebuild" = 1 ]; then
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -m pip install -q -e '.[dev,saelens]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c "import actcache, torch, transformers, snakemake" 
    touch "$stamp"
fi
