#!/usr/bin/env bash
# Start a real single-machine Slurm cluster with 4 fake GPUs and accounting (sacct), for development, tests and CI.
#
# Everything lives in one state folder ($SLURM_LOCAL_DIR, default /tmp/toolkit-slurm) that is wiped at each start
# after stopping whatever a previous start left running: configs, munge key, fake GPU devices, MariaDB datadir,
# Slurm spool and state, pid files (run/) and logs (log/). Daemons: mariadbd, munged, slurmdbd, slurmctld, slurmd,
# all in the background. The script waits until the node is idle and sacct answers, then prints exactly one line
# on stdout, `export SLURM_CONF=<dir>/slurm.conf`, so that callers can run: eval "$(slurm/start.sh)".
# Everything else goes to stderr. Needs root and the packages of slurm/install.sh.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}
PORT_BASE=${SLURM_LOCAL_PORT_BASE:-16817}            # slurmctld, slurmd, slurmdbd, mariadb: base .. base+3
MAX_ARRAY_SIZE=${SLURM_LOCAL_MAX_ARRAY_SIZE:-100}
START_TIMEOUT=${SLURM_LOCAL_START_TIMEOUT:-60}       # seconds, for the whole start
CLUSTER=${SLURM_LOCAL_CLUSTER:-local}
NODE_CPUS=8
NODE_GPUS=4

# The daemons must not inherit the caller's pipes, or `$(slurm/start.sh)` (and CI log capture) would wait for
# them to exit: close every inherited descriptor above stderr (bash keeps its script on 255, close-on-exec).
for fd in /proc/$$/fd/*; do
    fd=${fd##*/}
    ((fd > 2 && fd != 255)) || continue
    eval "exec $fd>&-" 2>/dev/null || true
done
# stdout is reserved for the final export line, kept on fd 3, which every daemon launch closes (3>&-).
exec 3>&1 1>&2
T0_US=${EPOCHREALTIME//[.,]/}
log() {   # prefixed with the time since the start, in seconds
    local us=$((${EPOCHREALTIME//[.,]/} - T0_US))
    printf '[slurm/start %d.%ds] %s\n' $((us / 1000000)) $((us / 100000 % 10)) "$*" >&2
}
STARTED=0   # set once the folder is wiped: from then on a failure shows the logs and stops the daemons
die() {
    log "ERROR: $*"
    if ((STARTED)); then
        trap - ERR
        log "start failed; last lines of the logs in $DIR/log:"
        local f
        for f in "$DIR"/log/*.log; do
            [[ -s $f ]] || continue
            printf '\n==> %s <==\n' "$f" >&2
            tail -n 15 "$f" >&2
        done
        log "stopping what was started (logs and configs stay in $DIR)"
        SLURM_LOCAL_DIR=$DIR "$HERE/stop.sh" || true
    fi
    exit 1
}

((EUID == 0)) || die "run as root: the daemons run as root and the fake GPUs are made with mknod"
for cmd in mariadbd mariadb-install-db mariadb munged slurmdbd slurmctld slurmd sinfo sacct; do
    command -v "$cmd" >/dev/null || die "'$cmd' not found: run slurm/install.sh first"
done
[[ $DIR == /* ]] || die "SLURM_LOCAL_DIR must be an absolute path, got '$DIR'"
DIR=${DIR%/}
[[ -n $DIR ]] || die "SLURM_LOCAL_DIR must not be /"
# Unix socket paths (munge, mariadb, slurmd step sockets) must stay well under the 108-byte limit.
((${#DIR} <= 60)) || die "SLURM_LOCAL_DIR '$DIR' is too long for unix sockets (keep it under 60 characters)"
[[ $MAX_ARRAY_SIZE =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_MAX_ARRAY_SIZE must be a number, got '$MAX_ARRAY_SIZE'"
[[ $PORT_BASE =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_PORT_BASE must be a number, got '$PORT_BASE'"

NODE=$(hostname -s 2>/dev/null || uname -n)
NODE=${NODE%%.*}
CTLD_PORT=$PORT_BASE SLURMD_PORT=$((PORT_BASE + 1)) DBD_PORT=$((PORT_BASE + 2)) DB_PORT=$((PORT_BASE + 3))
MUNGE_SOCK=$DIR/munge/munge.socket.2
DB_SOCK=$DIR/db/mysqld.sock
MARKER=$DIR/.toolkit-slurm-local
T0=$SECONDS

# ---------------------------------------------------------------- stop the previous cluster, wipe the folder
if [[ -d $DIR ]]; then
    if [[ -e $MARKER ]]; then
        SLURM_LOCAL_DIR=$DIR "$HERE/stop.sh"
    elif [[ -n $(ls -A "$DIR") ]]; then
        die "$DIR exists, is not empty and was not made by slurm/start.sh; choose another SLURM_LOCAL_DIR"
    fi
    rm -rf "${DIR:?}"
    log "wiped $DIR"
fi

port_busy() { (exec 9<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT" "$DB_PORT"; do
    ! port_busy "$port" || die "port $port on 127.0.0.1 is in use (another cluster?); set SLURM_LOCAL_PORT_BASE"
done

mkdir -p "$DIR"/{run,log,spool/ctld,spool/d,db,fakegpu,munge,munge-key}
touch "$MARKER"
chmod 755 "$DIR" "$DIR/munge"
chmod 700 "$DIR/munge-key"

STARTED=1
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

# wait_for WHAT CMD...: run CMD until it succeeds or the start timeout passes.
wait_for() {
    local what=$1; shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS - T0 < START_TIMEOUT)) || die "timed out after ${START_TIMEOUT}s waiting for $what"
        sleep 0.1
    done
}

# ---------------------------------------------------------------- fake GPUs
gpu_files=()
for ((i = 0; i < NODE_GPUS; i++)); do
    if mknod "$DIR/fakegpu/nvidia$i" c 1 3 2>/dev/null; then
        gpu_files+=("$DIR/fakegpu/nvidia$i")
    else
        gpu_files=()
        break
    fi
done
if ((${#gpu_files[@]} == NODE_GPUS)); then
    GPU_FILES="$DIR/fakegpu/nvidia[0-$((NODE_GPUS - 1))]"
else
    log "mknod not allowed: the fake GPUs are /dev/null, /dev/zero, /dev/full and /dev/urandom"
    GPU_FILES=/dev/null,/dev/zero,/dev/full,/dev/urandom
fi

# ---------------------------------------------------------------- configs
MEM_TOTAL_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
REAL_MEMORY=${SLURM_LOCAL_REAL_MEMORY:-$((MEM_TOTAL_MB * 9 / 10))}
[[ $REAL_MEMORY =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_REAL_MEMORY must be a number of MB, got '$REAL_MEMORY'"
DB_PASS=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

cat >"$DIR/slurm.conf" <<EOF
# Local single-node cluster written by slurm/start.sh; wiped at each start.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10

# No cgroups: processes are tracked through /proc, tasks are not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none

# Cores and GPUs are consumable; memory is only checked against the node's RealMemory, so several tasks
# asking for a few GB each run side by side even on a small machine.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides

MaxArraySize=$MAX_ARRAY_SIZE
SchedulerParameters=sched_interval=2,bf_interval=1,batch_sched_delay=0
KillWait=5
MinJobAge=300
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
InactiveLimit=0

AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none

NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$REAL_MEMORY Gres=gpu:$NODE_GPUS State=UNKNOWN
PartitionName=gpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

cat >"$DIR/gres.conf" <<EOF
NodeName=$NODE Name=gpu File=$GPU_FILES
EOF

(
    umask 077
    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
)
chmod 600 "$DIR/slurmdbd.conf"
export SLURM_CONF=$DIR/slurm.conf   # slurmdbd reads slurmdbd.conf next to it

# ---------------------------------------------------------------- mariadb
log "initialising MariaDB in $DIR/db"
# A throw-away database: small redo log, no doublewrite, lazy log flush (less disk I/O at init and wipe).
DB_OPTS=(--no-defaults --user=root --datadir="$DIR/db/data" --skip-name-resolve --innodb-buffer-pool-size=64M
    --innodb-log-file-size=8M --innodb-doublewrite=0 --innodb-flush-log-at-trx-commit=2)
mariadb-install-db "${DB_OPTS[@]}" --auth-root-authentication-method=socket --skip-test-db \
    >"$DIR/log/mariadb-install.log" 2>&1 \
    || die "mariadb-install-db failed, see $DIR/log/mariadb-install.log"
setsid mariadbd "${DB_OPTS[@]}" --socket="$DB_SOCK" --bind-address=127.0.0.1 --port="$DB_PORT" \
    --pid-file="$DIR/db/mariadbd.pid" --log-error="$DIR/log/mariadb.log" --innodb-lock-wait-timeout=900 \
    </dev/null >>"$DIR/log/mariadb.log" 2>&1 3>&- &
echo $! >"$DIR/run/mariadbd.pid"   # mariadbd stays in the foreground: its pid is known before it writes its own
sql() { mariadb --no-defaults --socket="$DB_SOCK" --user=root "$@"; }
wait_for "MariaDB on $DB_SOCK" sql -e 'SELECT 1'
log "MariaDB up on 127.0.0.1:$DB_PORT"
sql <<EOF
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF

# ---------------------------------------------------------------- munge
mungekey --create --keyfile="$DIR/munge-key/munge.key" 2>/dev/null \
    || dd if=/dev/urandom of="$DIR/munge-key/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge-key/munge.key"
munged --force --socket="$MUNGE_SOCK" --key-file="$DIR/munge-key/munge.key" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge-key/munged.seed" </dev/null >>"$DIR/log/munged.log" 2>&1 3>&-
wait_for "munged on $MUNGE_SOCK" bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'"
log "munged up"

# ---------------------------------------------------------------- slurm daemons
slurmdbd </dev/null >>"$DIR/log/slurmdbd.log" 2>&1 3>&-
wait_for "slurmdbd on port $DBD_PORT" port_busy "$DBD_PORT"
log "slurmdbd up on 127.0.0.1:$DBD_PORT; starting slurmctld and slurmd"
slurmctld -f "$DIR/slurm.conf" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 3>&-
slurmd -f "$DIR/slurm.conf" -N "$NODE" </dev/null >>"$DIR/log/slurmd.log" 2>&1 3>&-

node_idle() { [[ $(sinfo -h -n "$NODE" -o %T 2>/dev/null) == idle ]]; }
wait_for "node $NODE to be idle (sinfo)" node_idle
log "node $NODE idle"
wait_for "sacct to answer" sacct -n -X
trap - ERR

log "cluster '$CLUSTER' up: node $NODE, $NODE_CPUS CPUs, $NODE_GPUS GPUs, partition gpu; state in $DIR"
printf 'export SLURM_CONF=%q\n' "$DIR/slurm.conf" >&3
