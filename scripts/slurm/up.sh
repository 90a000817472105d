#!/usr/bin/env bash
# Start a real single-node Slurm cluster (munge, mariadb, slurmdbd, slurmctld, slurmd) on this
# machine, with fake GPUs and accounting, for tests and local runs of the Slurm profile.
#
# Idempotent: when the daemons this script recorded are alive and the node is idle/mixed/alloc,
# it only makes sure the account exists and exits 0. Otherwise it stops whatever it recorded
# earlier (down.sh), rewrites the configs and starts everything in order.
# Needs root. Stop with scripts/slurm/down.sh. See scripts/slurm/README.md.
set -euo pipefail

ACCOUNT="${ACTCACHE_SLURM_ACCOUNT:-actcache}"
PARTITION="${ACTCACHE_SLURM_PARTITION:-debug}"
CLUSTER="${ACTCACHE_SLURM_CLUSTER:-actcache}"
STATE_DIR="${ACTCACHE_SLURM_STATE_DIR:-/run/actcache-slurm}"
LOG_DIR="${ACTCACHE_SLURM_LOG_DIR:-/var/log/actcache-slurm}"
NGPUS="${ACTCACHE_SLURM_NGPUS:-2}"
TIMEOUT="${ACTCACHE_SLURM_TIMEOUT:-60}"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ETC=/etc/slurm
FAKEGPU_DIR=/var/lib/slurm/fakegpu
MYSQL_SOCK=/run/mysqld/mysqld.sock
DB_NAME=slurm_acct_db
DB_USER=slurm
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)   # start order

log() { echo "[slurm/up] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (starts system daemons)"
[[ $NGPUS =~ ^[0-9]+$ ]] || die "ACTCACHE_SLURM_NGPUS must be a number, got '$NGPUS'"
for v in ACCOUNT PARTITION CLUSTER; do
    [[ ${!v} =~ ^[A-Za-z0-9_-]+$ ]] \
        || die "ACTCACHE_SLURM_$v must be letters, digits, '_' or '-', got '${!v}'"
done
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "ACTCACHE_SLURM_TIMEOUT must be seconds, got '$TIMEOUT'"

# ---- helpers ---------------------------------------------------------------------------------

# alive PID: the process exists and is not a zombie
alive() {
    local pid=$1 st
    [[ -n $pid && -r /proc/$pid/stat ]] || return 1
    st=$(sed -E 's/^[0-9]+ \(.*\) (.).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

recorded_alive() { # NAME
    local f="$STATE_DIR/$1.pid"
    [[ -f $f ]] && alive "$(cat "$f")"
}

node_state() { timeout 5 sinfo -h -p "$PARTITION" -o %T 2>/dev/null | head -n1 || true; }

node_ok() {
    case "$(node_state)" in
        idle|mixed|allocated|alloc|completing) return 0 ;;
        *) return 1 ;;
    esac
}

tail_logs() {
    local f
    for f in "$LOG_DIR"/*.log; do
        [[ -f $f ]] || continue
        echo "----- tail $f -----" >&2
        tail -n 25 "$f" >&2 || true
    done
}

# fail MESSAGE: print the message, every daemon log's tail, and the message again (it is the
# line people read last).
fail() { log "ERROR: $*"; tail_logs; log "ERROR: $* (daemon logs above, full logs in $LOG_DIR)"; exit 1; }

# wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.2 s
wait_for() {
    local secs=$1 what=$2; shift 2
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || fail "timed out after ${secs}s waiting for: $what"
        sleep 0.2
    done
}

ensure_account() {
    if [[ -z $(sacctmgr -n -P show account "$ACCOUNT" format=Account 2>/dev/null) ]]; then
        sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=actcache \
            Organization=actcache >/dev/null || fail "sacctmgr add account $ACCOUNT failed"
    fi
    if [[ -z $(sacctmgr -n -P show assoc where user=root account="$ACCOUNT" format=User 2>/dev/null) ]]; then
        sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null \
            || fail "sacctmgr add user root Account=$ACCOUNT failed"
    fi
}

# ---- fast path: already up -------------------------------------------------------------------

all_recorded_alive() {
    local d
    for d in "${DAEMONS[@]}"; do recorded_alive "$d" || return 1; done
}

if all_recorded_alive && node_ok; then
    ensure_account
    log "already up (node $(node_state), partition $PARTITION, account $ACCOUNT)"
    exit 0
fi

# Something of ours is half up (or nothing is): stop what we recorded, then start clean.
if compgen -G "$STATE_DIR/*.pid" >/dev/null; then
    log "not fully up; stopping recorded daemons first"
    bash "$HERE/down.sh"
fi

# Refuse to fight daemons we did not start (they hold the ports/sockets we need).
for d in slurmctld slurmd slurmdbd munged mariadbd mysqld; do
    if pids=$(pgrep -x "$d"); then
        for p in $pids; do
            alive "$p" && die "a '$d' (pid $p) that up.sh did not start is running; stop it first"
        done
    fi
done

# ---- packages --------------------------------------------------------------------------------

need_pkgs=()
for cmd_pkg in slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge slurmdbd:slurmdbd mariadbd:mariadb-server; do
    command -v "${cmd_pkg%%:*}" >/dev/null 2>&1 || need_pkgs+=("${cmd_pkg#*:}")
done
if ((${#need_pkgs[@]})); then
    log "installing: slurm-wlm munge slurmdbd mariadb-server"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends slurm-wlm munge slurmdbd mariadb-server >/dev/null 2>&1; then
        apt-get update -qq || die "apt-get update failed"
        apt-get install -y -qq --no-install-recommends slurm-wlm munge slurmdbd mariadb-server \
            || die "apt-get install failed"
    fi
fi
for cmd in slurmctld slurmd slurmdbd munged mungekey mariadbd mariadb sinfo sacct sacctmgr; do
    command -v "$cmd" >/dev/null || die "'$cmd' not found after install"
done

# ---- configs ---------------------------------------------------------------------------------

mkdir -p "$STATE_DIR" "$LOG_DIR" "$ETC" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd \
    "$FAKEGPU_DIR" /run/munge /run/mysqld /var/log/munge /var/lib/munge
chown slurm:slurm /var/lib/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd "$LOG_DIR"
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
chown mysql:mysql /run/mysqld

# Fake GPUs: character devices with NVIDIA's major number (195). Regular files work with a
# warning; /dev/null's numbers break job launch (see shared notes).
gres_files=()
for ((i = 0; i < NGPUS; i++)); do
    f="$FAKEGPU_DIR/gpu$i"
    if [[ ! -c $f ]]; then rm -f "$f"; mknod -m 666 "$f" c 195 "$i"; fi
    gres_files+=("$f")
done

HOST="$(hostname -s)"
# slurmd -C prints e.g. "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105"
read -r -a hw <<<"$(slurmd -C | head -n1)"
node_fields=()
real_mem=""
for kv in "${hw[@]}"; do
    case "$kv" in
        NodeName=*) ;;
        RealMemory=*) real_mem=${kv#RealMemory=} ;;
        *) node_fields+=("$kv") ;;
    esac
done
[[ $real_mem =~ ^[0-9]+$ ]] || die "could not read RealMemory from 'slurmd -C'"
# ~95%: a later reading a little smaller than the configured value makes the node INVAL.
mem=$((real_mem * 95 / 100))
gres_line=""
((NGPUS > 0)) && gres_line="Gres=gpu:$NGPUS"

write_if_changed() { # FILE MODE OWNER  (content on stdin)
    local f=$1 mode=$2 owner=$3 tmp
    tmp="$(mktemp "$f.XXXXXX")"
    cat >"$tmp"
    if [[ -f $f ]] && cmp -s "$tmp" "$f"; then rm -f "$tmp"; else mv -f "$tmp" "$f"; fi
    chmod "$mode" "$f"
    chown "$owner" "$f"
}

write_if_changed "$ETC/slurm.conf" 644 root:root <<EOF
# Generated by actcache scripts/slurm/up.sh. Rewritten on every cold start; do not edit.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
SlurmUser=slurm
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without DefMemPerCPU a job takes the whole node's memory and jobs run one at a time.
DefMemPerCPU=1000
MinJobAge=300
ReturnToService=2
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
# Keep --comment in accounting: the Snakemake plugin puts "rule_<name>_wildcards_..." there.
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 ${node_fields[*]} RealMemory=$mem $gres_line State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

write_if_changed "$ETC/cgroup.conf" 644 root:root <<EOF
# Generated by actcache scripts/slurm/up.sh.
CgroupPlugin=cgroup/v1
ConstrainCores=yes
ConstrainRAMSpace=yes
ConstrainDevices=no
EOF

{
    echo "# Generated by actcache scripts/slurm/up.sh. Fake GPUs (char devices, major 195)."
    ((NGPUS > 0)) && echo "NodeName=$HOST Name=gpu File=$FAKEGPU_DIR/gpu[0-$((NGPUS - 1))]"
    true
} | write_if_changed "$ETC/gres.conf" 644 root:root

# DB password: random once, kept in the state of the DB (root-only file).
DB_PASS_FILE=/var/lib/slurm/.actcache-dbpass
if [[ ! -s $DB_PASS_FILE ]]; then
    (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DB_PASS_FILE")
fi
DB_PASS="$(cat "$DB_PASS_FILE")"

write_if_changed "$ETC/slurmdbd.conf" 600 slurm:slurm <<EOF
# Generated by actcache scripts/slurm/up.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=localhost
SlurmUser=slurm
PidFile=/run/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
EOF

# munge key (the package normally creates it)
if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    mungekey -c -k /etc/munge/munge.key
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 700 /etc/munge
chmod 400 /etc/munge/munge.key

# Remove pid files that daemons may have left behind (they confuse the next start and apt).
rm -f /run/slurmctld.pid /run/slurmd.pid /run/slurmdbd.pid /run/munge/munged.pid /run/mysqld/mysqld.pid

# ---- start -----------------------------------------------------------------------------------

record() { echo "$2" >"$STATE_DIR/$1.pid"; }

# record_from_pidfile NAME PIDFILE: for daemons that fork themselves
record_from_pidfile() {
    local name=$1 pf=$2
    wait_for 15 "$name to write $pf" test -s "$pf"
    local pid
    pid="$(tr -dc 0-9 <"$pf")"
    alive "$pid" || fail "$name exited right after start"
    record "$name" "$pid"
}

t0=$SECONDS

# munged: forks itself, writes /run/munge/munged.pid
runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid \
    --log-file=/var/log/munge/munged.log </dev/null >>"$LOG_DIR/munged.log" 2>&1 \
    || fail "munged failed to start (see /var/log/munge/munged.log)"
record_from_pidfile munged /run/munge/munged.pid
wait_for 10 "munge round trip" bash -c 'munge -n | unmunge'

# mariadbd: runs in the foreground; we background it in its own session
if [[ ! -d /var/lib/mysql/mysql ]]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >>"$LOG_DIR/mariadb.log" 2>&1 \
        || fail "mariadb-install-db failed"
fi
setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --skip-networking \
    --socket="$MYSQL_SOCK" --pid-file=/run/mysqld/mysqld.pid --innodb-lock-wait-timeout=900 \
    --log-error="$LOG_DIR/mariadb.log" </dev/null >>"$LOG_DIR/mariadb.log" 2>&1 &
record mariadbd $!   # provisional; replaced by the pid file's value below
wait_for 30 "mariadb socket" mariadb --socket="$MYSQL_SOCK" -e 'SELECT 1'
record_from_pidfile mariadbd /run/mysqld/mysqld.pid
mariadb --socket="$MYSQL_SOCK" <<EOF || fail "creating the slurm database user failed"
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF

# slurmdbd: forks itself
slurmdbd </dev/null >>"$LOG_DIR/slurmdbd.log" 2>&1 || fail "slurmdbd failed to start"
record_from_pidfile slurmdbd /run/slurmdbd.pid
wait_for 30 "slurmdbd to answer sacctmgr" sacctmgr -n show cluster
if [[ -z $(sacctmgr -n -P show cluster "$CLUSTER" format=Cluster 2>/dev/null) ]]; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || fail "sacctmgr add cluster $CLUSTER failed"
fi

# slurmctld, slurmd: fork themselves
slurmctld </dev/null >>"$LOG_DIR/slurmctld.log" 2>&1 || fail "slurmctld failed to start"
record_from_pidfile slurmctld /run/slurmctld.pid
slurmd </dev/null >>"$LOG_DIR/slurmd.log" 2>&1 || fail "slurmd failed to start"
record_from_pidfile slurmd /run/slurmd.pid

ensure_account

deadline=$((SECONDS + TIMEOUT))
until node_ok; do
    for d in "${DAEMONS[@]}"; do recorded_alive "$d" || fail "$d died during start-up"; done
    # A node left DOWN/DRAIN from an earlier run: ReturnToService=2 normally fixes it; nudge it.
    case "$(node_state)" in
        down*|drain*|fail*) scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    ((SECONDS < deadline)) || fail "node not idle after ${TIMEOUT}s (sinfo state: '$(node_state)')"
    sleep 0.3
done
wait_for "$TIMEOUT" "sacct to work" sacct -n -X -S now

log "up in $((SECONDS - t0))s: node $HOST $(node_state), ${NGPUS} fake GPUs, partition $PARTITION, account $ACCOUNT, logs in $LOG_DIR"
