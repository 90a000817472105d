#!/usr/bin/env bash
# Stop the single-node Slurm cluster that scripts/slurm/up.sh started.
# Stops ONLY the daemons up.sh recorded in its state dir (TERM, wait, then KILL), in reverse start
# order, and removes the pid files the daemons leave behind. Idempotent: nothing recorded -> exit 0.
set -euo pipefail

STATE_DIR="${ACTCACHE_SLURM_STATE_DIR:-/run/actcache-slurm}"
WAIT="${ACTCACHE_SLURM_STOP_WAIT:-15}"            # seconds to wait after TERM before KILL
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged) # reverse start order

log() { echo "[slurm/down] $*" >&2; }

[[ $(id -u) -eq 0 ]] || { log "ERROR: must run as root"; exit 1; }

# alive PID: exists and is not a zombie (daemons whose parent never reaps them linger as Z)
alive() {
    local pid=$1 st
    [[ -n $pid && -r /proc/$pid/stat ]] || return 1
    st=$(sed -E 's/^[0-9]+ \(.*\) (.).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# Guard against PID reuse: only signal a PID whose command name still matches.
is_ours() { # NAME PID
    local comm
    comm="$(cat "/proc/$2/comm" 2>/dev/null)" || return 1
    [[ $comm == "$1" || ($1 == mariadbd && $comm == mysqld) ]]
}

stop_one() { # NAME
    local name=$1 f="$STATE_DIR/$1.pid" pid
    [[ -f $f ]] || return 0
    pid="$(tr -dc 0-9 <"$f")"
    if alive "$pid" && is_ours "$name" "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + WAIT))
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
        if alive "$pid"; then
            log "$name (pid $pid) ignored TERM for ${WAIT}s; sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
            deadline=$((SECONDS + 5))
            while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
            alive "$pid" && { log "ERROR: $name (pid $pid) survived KILL"; return 1; }
        fi
        log "stopped $name (pid $pid)"
    fi
    rm -f "$f"
}

rc=0
if [[ -d $STATE_DIR ]]; then
    for d in "${DAEMONS[@]}"; do stop_one "$d" || rc=1; done
fi

# Stale pid files: a leftover /run/slurmctld.pid breaks a later `apt-get purge`. Remove those
# whose process is gone (never one of a live daemon that someone else started).
for f in /run/slurmctld.pid /run/slurmd.pid /run/slurmdbd.pid /run/munge/munged.pid \
    /run/mysqld/mysqld.pid; do
    [[ -f $f ]] || continue
    alive "$(tr -dc 0-9 <"$f")" || rm -f "$f"
done
exit "$rc"
