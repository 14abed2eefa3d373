#!/usr/bin/env bash
# Stop the local Slurm cluster that slurm/start.sh started: exactly the daemons named by the pid files in the
# state folder ($SLURM_LOCAL_DIR, default /tmp/toolkit-slurm), in the order slurmd, slurmctld, slurmdbd, munged,
# mariadbd. Each gets SIGTERM, then SIGKILL if it has not exited after a bounded wait; a zombie counts as exited.
# Exits 0 when nothing runs. The state folder itself (logs, configs) is left for inspection.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}
TERM_WAIT=${SLURM_LOCAL_STOP_TIMEOUT:-15}   # seconds each daemon gets after SIGTERM

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

# stop_daemons NAME...: SIGTERM every named daemon that runs, then wait for all of them.
stop_daemons() {
    local name pid pids=() names=() i deadline
    for name in "$@"; do
        [[ -s $DIR/run/$name.pid ]] || continue
        pid=$(head -n1 "$DIR/run/$name.pid" | tr -dc '0-9')
        [[ -n $pid ]] || continue
        if alive "$pid" "$name"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid"); names+=("$name")
        fi
    done
    ((${#pids[@]})) || return 0
    log "stopping ${names[*]}"
    deadline=$((SECONDS + TERM_WAIT))
    for i in "${!pids[@]}"; do
        while alive "${pids[i]}" "${names[i]}"; do
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

[[ -d $DIR/run ]] || exit 0
# slurmd and slurmctld first (slurmctld reports its last records to slurmdbd), then the services they use.
stop_daemons slurmd slurmctld
stop_daemons slurmdbd
stop_daemons munged mariadbd
