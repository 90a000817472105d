#!/usr/bin/env bash
# Create (or update) the project's virtual env in .venv and install actcache with its dev extra.
# torch is pinned first to the CPU wheel 2.13.0: an unpinned torch would pull a multi-GB CUDA build.
# Quiet by default: a line per step, and pip's progress condensed into one status line (each
# package as it is collected or downloaded) plus its summary; SETUP_VERBOSE=1 shows pip's own output.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }

# pip's output as a status line that each "Collecting"/"Downloading" line replaces (on a terminal;
# elsewhere only the downloads are listed), then its last word; warnings and errors pass through.
condense() {
    local tty=0 line
    [ -t 1 ] && tty=1
    while IFS= read -r line; do
        case $line in
            Collecting*|Processing*|*Downloading*|*Using\ cached*|Building\ wheel*|Installing\ collected*)
                if [ $tty = 1 ]; then printf '\r\033[K  %.110s' "${line#"${line%%[! ]*}"}"
                elif [[ $line == *Downloading* ]]; then echo "  ${line#"${line%%[! ]*}"}"; fi ;;
            Successfully\ installed*)
                [ $tty = 1 ] && printf '\r\033[K'
                n=$(wc -w <<<"${line#Successfully installed }")
                echo "  installed $n package(s)" ;;
            *WARNING:\ Location*|Looking\ in*|Requirement\ already*|Obtaining*|Preparing*|Getting*|Checking*|Created\ wheel*|Stored\ in*|Attempting*|Found\ existing*|*Uninstalling*|Successfully\ uninstalled*|Successfully\ built*|Installing\ build*|" "*) ;;
            *) [ $tty = 1 ] && printf '\r\033[K'; echo "$line" ;;
        esac
    done
    [ $tty = 1 ] && printf '\r\033[K'
    return 0
}

pip_install() {
    if [ "${SETUP_VERBOSE:-0}" = 1 ]; then
        .venv/bin/python -m pip install "$@"
    else
        .venv/bin/python -m pip install --progress-bar off "$@" 2>&1 | condense
        return "${PIPESTATUS[0]}"
    fi
}

if [ ! -x .venv/bin/python ]; then
    say "creating the virtual env .venv ($("$PY" --version))"
    "$PY" -m venv .venv
fi
stamp=.venv/.actcache-installed
# re-install when the project's metadata or its C kernel (src/actcache/_native.c, built by setup.py
# next to its source) changed, or when the kernel is missing and a compiler could build it
rebuild=0
for f in pyproject.toml setup.py src/actcache/_native.c; do if [ "$f" -nt "$stamp" ]; then rebuild=1; fi; done
if ! ls src/actcache/_native*.so >/dev/null 2>&1 && command -v cc >/dev/null; then rebuild=1; fi
if [ ! -f "$stamp" ] || [ "$rebuild" = 1 ]; then
    say "upgrading pip"
    pip_install --upgrade pip
    say "installing torch ${TORCH_VERSION:-2.13.0} (the CPU wheel, about 200 MB)"
    pip_install "torch==${TORCH_VERSION:-2.13.0}"
    say "installing actcache and its dev and saelens extras (transformers, snakemake, pytest, ...; a few minutes the first time)"
    pip_install -e '.[dev,saelens]'
    .venv/bin/python -c "import actcache, torch, transformers, snakemake"
    touch "$stamp"
    say "done: run 'source .venv/bin/activate' in each new shell to put actcache and snakemake on PATH"
else
    say ".venv is up to date (source .venv/bin/activate to use it)"
fi
