#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the whole test suite (this is what CI runs).
# Extra arguments go to pytest, e.g. scripts/test.sh -k protocol
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -q --durations=25 "$@"
