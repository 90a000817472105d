#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the main job on the embedded default.
# Until the workflow is wired in, this writes a small cache of synthetic activations and
# inspects and deep-verifies it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
dir=$(.venv/bin/actcache demo-cache --dump-to data/demo-synthetic)
.venv/bin/actcache inspect "$dir"
.venv/bin/actcache verify --deep "$dir"
