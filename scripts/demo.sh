#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the main job on the embedded default:
# the Snakemake workflow (profiles/local) over the offline demo experiment
# (config/experiments/demo.yaml: a small random CLIP ViT over 240 generated images) —
# plan -> dump shards -> gather -> verify -> train the SAE sweep -> visuals; then verify --deep.
# Afterwards: `.venv/bin/snakemake --report report.html` collects the plots and latent pages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/actcache demo-assets --root data/demo
.venv/bin/actcache plan
timeout -s KILL 3600 .venv/bin/snakemake --profile profiles/local "$@"
.venv/bin/actcache plan
dir=$(.venv/bin/actcache plan --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["dir"])')
.venv/bin/actcache verify --deep "$dir"
