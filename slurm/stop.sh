#!/usr/bin/env bash
# Stop the local Slurm cluster that slurm/start.sh started: exactly the daemons named by the pid files in the
# state folder ($SLURM_LOCAL_DIR, default /tmp/toolkit-slurm), in the order slurmd (every node's), slurmctld,
# slurmdbd, munged, mariadbd. Each gets SIGTERM, then SIGKILL if it has not exited after a bounded wait; a zombie
# counts as exited. Then the hosts' network: whatever still runs in their namespaces (job steps the slurmds left)
# gets SIGTERM, then SIGKILL, and the namespaces, veths and bridge are deleted — those the state folder names, and
# those the current settings name (SLURM_LOCAL_PORT_BASE, SLURM_LOCAL_SUBNET), so that a start that crashed
# before writing anything is cleaned up too. Exits 0 when nothing runs and nothing is left (1 if the network
# could not be removed). The state folder itself (logs, configs) is left for inspection.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}
TERM_WAIT=${SLURM_LOCAL_STOP_TIMEOUT:-15}   # seconds each daemon gets after SIGTERM
PORT_BASE=${SLURM_LOCAL_PORT_BASE:-16817}
HOSTS=0
source "$HERE/hosts-net.sh"

log() { printf '[slurm/stop] %s\n' "$*" >&2; }

# alive PID COMM: the process exists, is not a zombie, and runs the program COMM (guards against pid reuse).
alive() {
    local pid=$1 comm=$2 stat
    [[ -r /proc/$pid/stat ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    # Field 3 (state) follows the ")" that closes the command name.
    [[ ${stat##*) } != Z* ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]]
}

# stop_daemons NAME...: SIGTERM every named daemon that runs (the program of run/NAME.pid is NAME up to its
# first "-": slurmd-host1 is a slurmd), then wait for all of them.
stop_daemons() {
    local name pid pids=() names=() i deadline
    for name in "$@"; do
        [[ -s $DIR/run/$name.pid ]] || continue
        pid=$(head -n1 "$DIR/run/$name.pid" | tr -dc '0-9')
        [[ -n $pid ]] || continue
        if alive "$pid" "${name%%-*}"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid"); names+=("$name")
        fi
    done
    ((${#pids[@]})) || return 0
    log "stopping ${names[*]}"
    deadline=$((SECONDS + TERM_WAIT))
    for i in "${!pids[@]}"; do
        while alive "${pids[i]}" "${names[i]%%-*}"; do
            if ((SECONDS >= deadline)); then
                log "${names[i]} (pid ${pids[i]}) ignored SIGTERM for ${TERM_WAIT}s: SIGKILL"
                kill -KILL "${pids[i]}" 2>/dev/null || true
                sleep 0.2
                break
            fi
            sleep 0.1
        done
    done
}

# remove_network: the network that the state folder names, then the one of the current settings.
remove_network() {
    local status=0 tags=() tag
    if [[ -s $DIR/run/hosts-net.env ]]; then
        tags+=("$(source "$DIR/run/hosts-net.env" && echo "$HOSTS_NET_TAG $HOSTS_NET_BRIDGE")")
    fi
    if hosts_net_settings 2>/dev/null; then
        tags+=("$HOSTS_NET_TAG $HOSTS_NET_BRIDGE")
    fi
    for tag in "${tags[@]}"; do
        read -r HOSTS_NET_TAG HOSTS_NET_BRIDGE <<<"$tag"
        if compgen -G "/run/netns/$HOSTS_NET_TAG-host*" >/dev/null || compgen -G "/sys/class/net/$HOSTS_NET_TAG[vb]*" >/dev/null
        then
            log "removing the hosts' network $HOSTS_NET_TAG (namespaces, veths, bridge $HOSTS_NET_BRIDGE)"
            hosts_net_down 2 || { log "ERROR: $HOSTS_NET_ERROR"; status=1; }
        fi
    done
    return $status
}

if [[ -d $DIR/run ]]; then
    # slurmd and slurmctld first (slurmctld reports its last records to slurmdbd), then the services they use.
    slurmds=()
    for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid; do
        [[ -e $f ]] && slurmds+=("$(basename "$f" .pid)")
    done
    stop_daemons "${slurmds[@]}" slurmctld
    stop_daemons slurmdbd
    stop_daemons munged mariadbd
fi
remove_network
