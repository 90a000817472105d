#!/usr/bin/env bash
# Set everything up on a fresh machine, then run the main job on the embedded default:
# the Snakemake workflow (profiles/local) over the offline demo experiment
# (config/experiments/demo.yaml: a small random CLIP ViT over 240 generated images) —
# plan -> dump shards -> gather -> verify -> train the SAE sweep -> visuals; then verify --deep
# and the Snakemake report (report.zip).
# Quiet by default: a line per step, the workflow's progress, and where everything is at the end;
# Snakemake's own output goes to logs/demo/snakemake.log. `scripts/demo.sh --verbose` shows it as
# it runs; other arguments go to snakemake (e.g. --cores 4).
set -euo pipefail
cd "$(dirname "$0")/.."
verbose=0
args=()
for a in "$@"; do
    if [ "$a" = --verbose ]; then verbose=1; else args+=("$a"); fi
done
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
act=.venv/bin/actcache
log=logs/demo/snakemake.log
mkdir -p "$(dirname "$log")"

echo "demo: writing its tiny random CLIP ViT and 240 images under data/demo/"
$act demo-assets --root data/demo >/dev/null
$act plan
echo "demo: running the workflow (snakemake --profile profiles/local); its output: $log"
status=0
if [ "$verbose" = 1 ]; then
    timeout -s KILL 3600 .venv/bin/snakemake --profile profiles/local "${args[@]}" 2>&1 | tee "$log" || status=$?
else
    # only Snakemake's progress lines ("3 of 10 steps (30%) done") reach the screen
    timeout -s KILL 3600 .venv/bin/snakemake --profile profiles/local "${args[@]}" 2>&1 | tee "$log" |
        grep --line-buffered -E '^[0-9]+ of [0-9]+ steps' | sed -u 's/^/  /' || status=${PIPESTATUS[0]}
fi
if [ "$status" != 0 ]; then
    echo "demo: the workflow failed (exit $status); the failed jobs and their logs:" >&2
    $act plan --failures >&2
    exit 1
fi

echo "demo: verifying every byte of the cache (actcache verify --deep)"
dir=$($act plan --json 2>/dev/null | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["dir"])')
$act verify --deep "$dir" >/dev/null || { $act verify --deep "$dir"; exit 1; }
echo "demo: building the Snakemake report (report.zip)"
.venv/bin/snakemake --profile profiles/local --report report.zip >>"$log" 2>&1 ||
    { echo "demo: the report failed; see $log" >&2; exit 1; }

$act plan --json 2>/dev/null | .venv/bin/python -c "$(cat <<'PY'
import json, os, sys

(p,) = json.load(sys.stdin)
runs = [t["dir"] for t in p["training"]]
parent = os.path.dirname(runs[0]) if runs else "-"
print("demo: done. Where everything is:")
print(f"  cache    {p['dir']}/  ({p['cache']['n_shards']} shards, verified; actcache inspect DIR)")
print(f"  runs     {len(runs)} SAEs: {parent}/<sae-id>/  (sae.safetensors, eval.json, metrics.jsonl)")
for d in runs:
    print(f"  page     {d}/visuals.html")
print(f"  sweep    {parent}/visuals/  (curves.png, nmse_l0.png)")
print("  report   report.zip  (unzip it, then open report/report.html in a browser)")
print("  logs     logs/demo/snakemake.log (the workflow), logs/<rule>/ (each job)")
PY
)"
