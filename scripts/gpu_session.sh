#!/usr/bin/env bash
# The checks and benchmarks that need an NVIDIA GPU, for a machine that has one.
#
#   bash scripts/gpu_session.sh [STEP...]      STEP: env check dump train visuals (default: all five), profile,
#                                              true-size
#
# env      nvidia-smi, torch / transformers versions, the GPU torch sees
# check    ACTCACHE_TEST_DEVICE=cuda pytest tests/test_device.py: CUDA dump (3 families) equals
#          transformers' hidden states and any job split byte for byte; SAE training on the GPU
#          follows the CPU's curve; the visuals pass on the GPU equals the CPU's. Also
#          test_dump.py, test_dump_kill.py (SIGKILL at 10+ moments, concurrent dumps, bad input)
#          and test_models.py: their experiments use device "auto", which picks the GPU there
# dump     scripts/bench_dump.py --device cuda (I/O-bound: tiny model, cores - 2 image workers)
# train    scripts/bench_train.py --device cuda --quick (d=768, width 12,288, k=32, batch 16,384; 1 and 8
#          SAEs per pass, dense/sparse x fp32/tf32/bf16, 8 SAEs also stacked (batch_saes: on) against
#          one by one; a few minutes; rows also in $OUT/train.json)
# visuals  scripts/bench_visuals.py --device cuda (4 GiB cache; target visuals <= 1.5x one pass)
# profile  scripts/profile_train_step.py --device cuda: steps/s and the top operators of one SAE's
#          training step per variant (under a minute; not in the default list)
# quality  scripts/bench_quality.py --device cuda: the SAE quality grid against SAELens and sparsify
#          (needs the bench-quality extra: sae-lens, eai-sparsify; rows in $OUT/quality.json; not in
#          the default list: the whole grid, d=256 and 3,072 steps included, is hours on 2 CPU cores)
# true-size  the flagship job's figures in at most 8 minutes, each part bounded (not in the default
#          list): scripts/bench_dump_true.py (ViT-B/16, 2,048 photo-sized JPEGs written in parallel
#          there, decode / forward / write / dump for 1 and 4 layers x float32 / bfloat16, forward
#          precision, decoding per core; <= 270 s), scripts/bench_eval.py (held-out and spliced eval,
#          2 GiB cache; <= 100 s), scripts/bench_train.py A/B of 8 SAEs stacked (batch_saes: on) against
#          one by one and of torch.compile against eager, bf16 (section train-ab-cuda; <= 100 s), then
#          scripts/project_job.py (the projection, from the sections just written). TRUE_SIZE_DEVICE=cpu
#          TRUE_SIZE_QUICK=1 runs the same commands small on the CPU, without recording (a dry run)
#
# Extra arguments per step: DUMP_ARGS, TRAIN_ARGS, VISUALS_ARGS, CHECK_ARGS, PROFILE_ARGS, QUALITY_ARGS
# (word-split), e.g. TRAIN_ARGS="--repeats 1 --steps 50"; CHECK_TESTS replaces check's test files, CHECK_LOG its log's
# name (default check). STEP_TIMEOUT=S interrupts any one step after S seconds (SIGINT, so that
# pytest still prints the failures so far; SIGKILL 30 s later) and goes on with the next, so one
# slow step cannot eat a lent machine's whole time.
#
# Needs python3 with torch (CUDA), transformers, numpy, pillow, pyyaml, safetensors, matplotlib and
# pytest; actcache itself is used from src/ (no install). Logs go to $OUT (default
# bench-out/gpu), one per step, plus summary.txt and a copy of BENCHMARKS.md with the new
# sections (dump-cuda, train-cuda, visuals-cuda) to merge into the repository's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env check dump train visuals)
status=0
# the loaders' C copy kernel, built next to its source (optional: without it they use numpy)
"$PY" setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1 || echo "note: the C kernel did not build (see $OUT/build_ext.log); loaders use numpy"

run_step() {  # name command...: log to $OUT/name.log, one line per step in summary.txt
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo "== $name: $*" | tee "$OUT/$name.log"
    local limit=()
    [ -n "${STEP_TIMEOUT:-}" ] && limit=(timeout -s INT -k 30 "$STEP_TIMEOUT")
    "${limit[@]}" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (log: $name.log)" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

for step in "${steps[@]}"; do
    case $step in
        env)
            run_step env bash -c "nvidia-smi; nproc; free -g; df -h .; $PY -c 'import sys, torch, transformers, numpy;
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available());
print(\"transformers\", transformers.__version__, \"numpy\", numpy.__version__);
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")'" ;;
        check)
            # shellcheck disable=SC2086 # word-split on purpose
            run_step "${CHECK_LOG:-check}" env ACTCACHE_TEST_DEVICE=cuda "$PY" -m pytest \
                ${CHECK_TESTS:-tests/test_device.py tests/test_dump.py tests/test_dump_kill.py tests/test_models.py} \
                -q -p no:cacheprovider --durations=15 ${CHECK_ARGS:-} ;;
        dump)
            run_step dump "$PY" scripts/bench_dump.py --device cuda --dir "${BENCH_DIR:-bench-out}/dump" ${DUMP_ARGS:-} ;;
        train)
            run_step train "$PY" scripts/bench_train.py --device cuda --quick --json "$OUT/train.json" \
                --out "${BENCH_DIR:-bench-out}/train" ${TRAIN_ARGS:-} ;;
        visuals)
            run_step visuals "$PY" scripts/bench_visuals.py --device cuda --out "${BENCH_DIR:-bench-out}/visuals" ${VISUALS_ARGS:-} ;;
        quality)
            run_step quality "$PY" scripts/bench_quality.py --device cuda --results "$OUT/quality.json" ${QUALITY_ARGS:-} ;;
        profile)
            run_step profile "$PY" scripts/profile_train_step.py --device cuda ${PROFILE_ARGS:-} ;;
        true-size)
            dev=${TRUE_SIZE_DEVICE:-cuda}
            dump_q=() eval_q=(--size-gib 2 --images 256 --rounds 2) train_q=() proj_q=()
            if [ -n "${TRUE_SIZE_QUICK:-}" ]; then
                dump_q=(--quick) eval_q=(--size-gib 0.05 --images 4 --rounds 1 --width 256 --no-record)
                train_q=(--d 64 --steps 1 --warmup 1 --exp-factor 2 --batch 256 --n-imgs 64 --no-record) proj_q=(--no-record)
            fi
            STEP_TIMEOUT=${TRUE_SIZE_DUMP_S:-270} run_step true-size-dump "$PY" scripts/bench_dump_true.py \
                --device "$dev" --dir "${BENCH_DIR:-bench-out}/dump-true" "${dump_q[@]}"
            STEP_TIMEOUT=${TRUE_SIZE_EVAL_S:-100} run_step true-size-eval "$PY" scripts/bench_eval.py \
                --device "$dev" --out "${BENCH_DIR:-bench-out}/eval" "${eval_q[@]}"
            STEP_TIMEOUT=${TRUE_SIZE_TRAIN_S:-100} run_step true-size-train "$PY" scripts/bench_train.py \
                --device "$dev" --quick --saes 1,8 --variants hybrid-bf16,hybrid-bf16+compile,sparse-bf16 \
                --stacked-variants hybrid-bf16,sparse-bf16 --loader-variants '' --section train-ab \
                --json "$OUT/train-ab.json" --out "${BENCH_DIR:-bench-out}/train" "${train_q[@]}"
            STEP_TIMEOUT=30 run_step true-size-projection "$PY" scripts/project_job.py "${proj_q[@]}" ;;
        *)
            echo "unknown step '$step': use env, check, dump, train, visuals, profile, quality or true-size" >&2
            exit 2 ;;
    esac
done
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit $status
