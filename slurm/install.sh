#!/usr/bin/env bash
# Install the Debian packages of the local Slurm cluster: slurmctld, slurmd, the client commands, munge, the
# accounting side (slurmdbd with its MySQL plugin, MariaDB server and client) that `sacct` needs, and for the
# namespaced hosts iproute2 (`ip`) and mount (`nsenter` and `unshare` come with util-linux, which every Debian has).
#
# Idempotent: returns at once when every package is already installed. Packages are installed with their
# services held back (a temporary policy-rc.d when the machine has none): slurm/start.sh starts the daemons itself.
# Runs as root, or through sudo when that is available.
set -euo pipefail

PACKAGES=(
    slurmctld slurmd slurm-client munge
    slurmdbd slurm-wlm-mysql-plugin mariadb-server-core mariadb-client-core
    iproute2 mount
)

log() { printf '[slurm/install] %s\n' "$*" >&2; }

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
    log "all packages already installed"
    exit 0
fi

SUDO=()
if ((EUID != 0)); then
    command -v sudo >/dev/null || { log "run as root (or install sudo): missing ${missing[*]}"; exit 1; }
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

# Keep the packages' maintainer scripts from starting system-wide services; remove the guard afterwards.
POLICY=/usr/sbin/policy-rc.d
if [[ ! -e "$POLICY" ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null
    "${SUDO[@]}" chmod 755 "$POLICY"
    trap '"${SUDO[@]}" rm -f "$POLICY"' EXIT
fi

apt_install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

log "installing: ${missing[*]}"
# Refresh the package lists first when they do not know every package (fresh machine, empty lists).
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
    log "apt-get update"
    "${SUDO[@]}" apt-get update -q >&2
    apt_install
elif ! apt_install; then
    # Stale lists (a mirror dropped an old version): refresh once and retry.
    log "install failed; apt-get update and retry"
    "${SUDO[@]}" apt-get update -q >&2
    apt_install
fi
log "done"
