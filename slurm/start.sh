#!/usr/bin/env bash
# Start a real single-machine Slurm cluster with 4 fake GPUs and accounting (sacct), for development, tests and CI,
# and two more hosts on the same machine for the multi-node tests.
#
# Everything lives in one state folder ($SLURM_LOCAL_DIR, default /tmp/toolkit-slurm) that is wiped at each start
# after stopping whatever a previous start left running: configs, munge key, fake GPU devices, MariaDB datadir,
# Slurm spool and state, pid files (run/) and logs (log/). Daemons: mariadbd, munged, slurmdbd, slurmctld, slurmd,
# all in the background. The script waits until the nodes are idle and sacct answers, then prints exactly one line
# on stdout, `export SLURM_CONF=<dir>/slurm.conf`, so that callers can run: eval "$(slurm/start.sh)".
# Everything else goes to stderr. Needs root and the packages of slurm/install.sh.
#
# The hosts ($SLURM_LOCAL_HOSTS, default 2: host1, host2 in partition `hosts`) are one slurmd each in its own
# network, UTS and mount namespace: its own hostname, its own address on a private /24 made here (a bridge on the
# machine holding the controller's address, a veth into each host), and its own /etc/hosts that maps its name to
# 127.0.1.1 as Debian does, so that the other hosts are known only through Slurm's NodeAddr. slurm/stop.sh
# removes the namespaces, the veths and the bridge. See slurm/README.md.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}
PORT_BASE=${SLURM_LOCAL_PORT_BASE:-16817}            # slurmctld, slurmd, slurmdbd, mariadb: base .. base+3
MAX_ARRAY_SIZE=${SLURM_LOCAL_MAX_ARRAY_SIZE:-100}
START_TIMEOUT=${SLURM_LOCAL_START_TIMEOUT:-60}       # seconds, for the whole start
CLUSTER=${SLURM_LOCAL_CLUSTER:-local}
NODE_CPUS=8
NODE_GPUS=4
HOSTS=${SLURM_LOCAL_HOSTS:-2}                        # namespaced hosts host1..hostN in partition `hosts`; 0: none
HOST_CPUS=4
HOST_GPUS=2

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
[[ $HOSTS =~ ^[0-9]$ ]] || die "SLURM_LOCAL_HOSTS must be a number from 0 to 9, got '$HOSTS'"
# The hosts' network: names and the subnet follow the port base, so that two clusters can run side by side.
source "$HERE/hosts-net.sh"
hosts_net_settings || die "$HOSTS_NET_ERROR"
if ((HOSTS)); then
    for cmd in ip nsenter unshare mount; do
        command -v "$cmd" >/dev/null || die "'$cmd' not found (the hosts need it): run slurm/install.sh first"
    done
    CTLD_ADDR=$HOSTS_NET_BRIDGE_ADDR   # the hosts reach the controller there; 127.0.0.1 is their own loopback
    NS_HINT="the hosts need CAP_NET_ADMIN and CAP_SYS_ADMIN; SLURM_LOCAL_HOSTS=0 starts the cluster without them"
else
    CTLD_ADDR=127.0.0.1
fi

NODE=$(hostname -s 2>/dev/null || uname -n)
NODE=${NODE%%.*}
CTLD_PORT=$PORT_BASE SLURMD_PORT=$((PORT_BASE + 1)) DBD_PORT=$((PORT_BASE + 2)) DB_PORT=$((PORT_BASE + 3))
MUNGE_SOCK=$DIR/munge/munge.socket.2
DB_SOCK=$DIR/db/mysqld.sock
MARKER=$DIR/.toolkit-slurm-local
T0=$SECONDS

# ---------------------------------------------------------------- stop the previous cluster, wipe the folder
if [[ -d $DIR && ! -e $MARKER && -n $(ls -A "$DIR") ]]; then
    die "$DIR exists, is not empty and was not made by slurm/start.sh; choose another SLURM_LOCAL_DIR"
fi
# Also when the folder is gone: the namespaces, veths and bridge of these settings that a crashed start left.
SLURM_LOCAL_DIR=$DIR "$HERE/stop.sh"
if [[ -d $DIR ]]; then
    rm -rf "${DIR:?}"
    log "wiped $DIR"
fi

port_busy() { (exec 9<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT" "$DB_PORT"; do
    ! port_busy "$port" || die "port $port on 127.0.0.1 is in use (another cluster?); set SLURM_LOCAL_PORT_BASE"
done

mkdir -p "$DIR"/{run,log,spool/ctld,spool/d,db,fakegpu,munge,munge-key,hosts}
touch "$MARKER"
hosts_net_save "$DIR/run/hosts-net.env"   # what stop.sh removes, written before anything is made
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

# ---------------------------------------------------------------- the hosts' network
if ((HOSTS)); then
    hosts_net_up || die "$HOSTS_NET_ERROR ($NS_HINT)"
    log "network $HOSTS_NET_SUBNET.0/24 up: bridge $HOSTS_NET_BRIDGE at $CTLD_ADDR, namespaces $HOSTS_NET_TAG-host[1-$HOSTS]"
fi

# ---------------------------------------------------------------- configs
MEM_TOTAL_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
REAL_MEMORY=${SLURM_LOCAL_REAL_MEMORY:-$((MEM_TOTAL_MB * 9 / 10))}
[[ $REAL_MEMORY =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_REAL_MEMORY must be a number of MB, got '$REAL_MEMORY'"
DB_PASS=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
HOST_NAMES=() HOST_LINES=""
for ((i = 1; i <= HOSTS; i++)); do
    HOST_NAMES+=("host$i")
    HOST_LINES+="NodeName=host$i NodeAddr=$(hosts_net_addr "$i") CPUs=$HOST_CPUS RealMemory=$REAL_MEMORY"
    HOST_LINES+=" Gres=gpu:$HOST_GPUS State=UNKNOWN"$'\n'
done
if ((HOSTS)); then
    HOST_LINES+="PartitionName=hosts Nodes=host[1-$HOSTS] Default=NO MaxTime=INFINITE State=UP"$'\n'
fi

cat >"$DIR/slurm.conf" <<EOF
# Local cluster written by slurm/start.sh; wiped at each start.
ClusterName=$CLUSTER
SlurmctldHost=$NODE($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/spool/ctld
# One slurmd per node on this machine: %n is the node's name.
SlurmdSpoolDir=$DIR/spool/d/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
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
AccountingStorageHost=$CTLD_ADDR
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none

NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$REAL_MEMORY Gres=gpu:$NODE_GPUS State=UNKNOWN
PartitionName=gpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
$HOST_LINES
EOF

cat >"$DIR/gres.conf" <<EOF
NodeName=$NODE Name=gpu File=$GPU_FILES
EOF
if ((HOSTS)); then
    case $GPU_FILES in
        /dev/*) HOST_GPU_FILES=$(cut -d, -f1-"$HOST_GPUS" <<<"$GPU_FILES") ;;
        *) HOST_GPU_FILES="$DIR/fakegpu/nvidia[0-$((HOST_GPUS - 1))]" ;;
    esac
    echo "NodeName=host[1-$HOSTS] Name=gpu File=$HOST_GPU_FILES" >>"$DIR/gres.conf"
fi

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
mkdir -p "$DIR/spool/d/$NODE"
slurmd -f "$DIR/slurm.conf" -N "$NODE" </dev/null >>"$DIR/log/slurmd-$NODE.log" 2>&1 3>&-

# Each host: a slurmd in its network namespace (nsenter, not `ip netns exec`, which remounts /sys), in a UTS
# namespace with its own hostname and a mount namespace (slave: the machine's later mounts still show) where its
# /etc/hosts says what Debian's does: its own name is 127.0.1.1, and no other host has a name.
for ((i = 1; i <= HOSTS; i++)); do
    h=${HOST_NAMES[i - 1]}
    mkdir -p "$DIR/spool/d/$h"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$h" >"$DIR/hosts/$h.hosts"
    nsenter --net="/run/netns/$(hosts_net_ns "$i")" -- unshare --uts --mount --propagation slave -- \
        /bin/sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' \
        sh "$h" "$DIR/hosts/$h.hosts" "$DIR/slurm.conf" </dev/null >>"$DIR/log/slurmd-$h.log" 2>&1 3>&- \
        || die "could not start slurmd of $h in namespace $(hosts_net_ns "$i") (see $DIR/log/slurmd-$h.log; $NS_HINT)"
done

ALL_NODES=("$NODE" "${HOST_NAMES[@]}")
nodes_idle() { [[ $(sinfo -h -N -o %T 2>/dev/null | grep -c '^idle$') == "${#ALL_NODES[@]}" ]]; }
wait_for "nodes ${ALL_NODES[*]} to be idle (sinfo)" nodes_idle
log "nodes ${ALL_NODES[*]} idle"
# The hosts reach each other on the subnet (what a multi-node engine's rendezvous needs).
for ((i = 2; i <= HOSTS; i++)); do
    wait_for "host1 to reach ${HOST_NAMES[i - 1]} at $(hosts_net_addr "$i")" nsenter --net="/run/netns/$(hosts_net_ns 1)" \
        bash -c "exec 9<>/dev/tcp/$(hosts_net_addr "$i")/$SLURMD_PORT"
done
wait_for "sacct to answer" sacct -n -X
trap - ERR

log "cluster '$CLUSTER' up: node $NODE, $NODE_CPUS CPUs, $NODE_GPUS GPUs, partition gpu; state in $DIR"
((HOSTS == 0)) || log "hosts ${HOST_NAMES[*]} ($HOST_CPUS CPUs, $HOST_GPUS GPUs each) in partition hosts," \
    "on $HOSTS_NET_SUBNET.0/24; controller at $CTLD_ADDR:$CTLD_PORT"
printf 'export SLURM_CONF=%q\n' "$DIR/slurm.conf" >&3
