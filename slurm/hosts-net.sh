# The private network of the local cluster's namespaced hosts; sourced by slurm/start.sh and slurm/stop.sh.
#
# One /24 made inside the machine: a bridge that holds the controller's address (.1) and, for host i, a network
# namespace whose eth0 (one end of a veth pair, the other end on the bridge) has address .(10+i). Every name and
# the subnet follow the settings, so that two clusters (two SLURM_LOCAL_PORT_BASE) can run side by side:
#   namespaces  tk<port base>-host<i>      (/run/netns, made with `ip netns add`)
#   bridge      tk<port base>br
#   veths       tk<port base>v<i> on the bridge, eth0 inside the namespace
#   subnet      $SLURM_LOCAL_SUBNET.0/24, default 10.<port base / 256 % 256>.<port base % 256>.0/24
# The functions set HOSTS_NET_ERROR and return 1 on a problem; they print nothing on stdout.

# hosts_net_settings: the names of these settings (needs PORT_BASE and HOSTS).
hosts_net_settings() {
    HOSTS_NET_TAG=tk$PORT_BASE
    HOSTS_NET_SUBNET=${SLURM_LOCAL_SUBNET:-10.$((PORT_BASE / 256 % 256)).$((PORT_BASE % 256))}
    HOSTS_NET_BRIDGE=${HOSTS_NET_TAG}br
    HOSTS_NET_BRIDGE_ADDR=$HOSTS_NET_SUBNET.1
    local o
    if [[ ! $HOSTS_NET_SUBNET =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]]; then
        HOSTS_NET_ERROR="SLURM_LOCAL_SUBNET must be the first three numbers of a /24 (such as 10.65.177), got '$HOSTS_NET_SUBNET'"
        return 1
    fi
    for o in "${BASH_REMATCH[@]:1}"; do
        ((10#$o <= 255)) || { HOSTS_NET_ERROR="SLURM_LOCAL_SUBNET '$HOSTS_NET_SUBNET' is not an IPv4 prefix"; return 1; }
    done
    [[ ${BASH_REMATCH[1]} != 127 ]] || { HOSTS_NET_ERROR="SLURM_LOCAL_SUBNET must not be loopback (127.*)"; return 1; }
    # Interface names have at most 15 characters.
    ((${#HOSTS_NET_TAG} <= 12)) || { HOSTS_NET_ERROR="SLURM_LOCAL_PORT_BASE '$PORT_BASE' is too long"; return 1; }
}

hosts_net_ns() { printf '%s-host%s' "$HOSTS_NET_TAG" "$1"; }
hosts_net_veth() { printf '%sv%s' "$HOSTS_NET_TAG" "$1"; }
hosts_net_addr() { printf '%s.%s' "$HOSTS_NET_SUBNET" $((10 + $1)); }

# hosts_net_save FILE: what stop.sh needs to remove this network, whatever its own settings are.
hosts_net_save() {
    printf 'HOSTS_NET_TAG=%q\nHOSTS_NET_SUBNET=%q\nHOSTS_NET_BRIDGE=%q\n' \
        "$HOSTS_NET_TAG" "$HOSTS_NET_SUBNET" "$HOSTS_NET_BRIDGE" >"$1"
}

_hosts_net() {   # run one `ip` command; on failure keep its message
    local out
    if ! out=$(ip "$@" 2>&1); then
        HOSTS_NET_ERROR="ip $*: ${out:-failed}"
        return 1
    fi
}

# hosts_net_up: the bridge and HOSTS namespaces with their veths and addresses (after hosts_net_down).
hosts_net_up() {
    local i ns veth taken
    taken=$({ ip -4 -br addr show to "$HOSTS_NET_SUBNET.0/24"; ip -4 route show to match "$HOSTS_NET_SUBNET.1" |
        grep -v '^default'; } 2>/dev/null | head -n1 | tr -s ' ')
    if [[ -n $taken ]]; then
        HOSTS_NET_ERROR="the subnet $HOSTS_NET_SUBNET.0/24 is already in use on this machine (${taken% }); set SLURM_LOCAL_SUBNET"
        return 1
    fi
    _hosts_net link add "$HOSTS_NET_BRIDGE" type bridge || return 1
    _hosts_net addr add "$HOSTS_NET_BRIDGE_ADDR/24" dev "$HOSTS_NET_BRIDGE" || return 1
    _hosts_net link set "$HOSTS_NET_BRIDGE" up || return 1
    for ((i = 1; i <= HOSTS; i++)); do
        ns=$(hosts_net_ns "$i") veth=$(hosts_net_veth "$i")
        _hosts_net netns add "$ns" || return 1
        _hosts_net link add "$veth" type veth peer name "${veth}p" || return 1
        _hosts_net link set "${veth}p" netns "$ns" || return 1
        _hosts_net -n "$ns" link set "${veth}p" name eth0 || return 1
        _hosts_net -n "$ns" addr add "$(hosts_net_addr "$i")/24" dev eth0 || return 1
        _hosts_net -n "$ns" link set eth0 up || return 1
        _hosts_net -n "$ns" link set lo up || return 1
        _hosts_net link set "$veth" master "$HOSTS_NET_BRIDGE" || return 1
        _hosts_net link set "$veth" up || return 1
    done
}

# hosts_net_down [WAIT_S]: end every process left in the namespaces of this tag (SIGTERM, SIGKILL to what is left
# after WAIT_S: slurmstepd ignores SIGTERM), then delete the namespaces, the veths and the bridge. Idempotent: what
# does not exist is skipped.
hosts_net_down() {
    local wait_s=${1:-2} ns name pids deadline f
    local spaces=()
    for f in /run/netns/"$HOSTS_NET_TAG"-host*; do
        [[ -e $f ]] && spaces+=("${f##*/}")
    done
    _hosts_net_pids() { for ns in "${spaces[@]}"; do ip netns pids "$ns" 2>/dev/null; done | tr '\n' ' '; }
    pids=$(_hosts_net_pids)
    if [[ -n ${pids// /} ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        deadline=$((SECONDS + wait_s))
        while pids=$(_hosts_net_pids) && [[ -n ${pids// /} ]] && ((SECONDS < deadline)); do sleep 0.1; done
        # shellcheck disable=SC2086
        [[ -z ${pids// /} ]] || kill -KILL $pids 2>/dev/null || true
        deadline=$((SECONDS + 5))
        while pids=$(_hosts_net_pids) && [[ -n ${pids// /} ]] && ((SECONDS < deadline)); do sleep 0.1; done
    fi
    for ns in "${spaces[@]}"; do
        ip netns del "$ns" 2>/dev/null || true
    done
    # A veth goes with its namespace; one left on the machine (a start that failed half-way) is deleted here.
    for f in /sys/class/net/"$HOSTS_NET_TAG"v*; do
        [[ -e $f ]] || continue
        name=${f##*/}
        [[ $name =~ ^${HOSTS_NET_TAG}v[0-9]+p?$ ]] && ip link del "$name" 2>/dev/null || true
    done
    if [[ -e /sys/class/net/$HOSTS_NET_BRIDGE ]]; then
        ip link del "$HOSTS_NET_BRIDGE" 2>/dev/null || true
    fi
    if [[ -e /sys/class/net/$HOSTS_NET_BRIDGE ]] || compgen -G "/run/netns/$HOSTS_NET_TAG-host*" >/dev/null; then
        HOSTS_NET_ERROR="could not remove the network of $HOSTS_NET_TAG (bridge $HOSTS_NET_BRIDGE, /run/netns/$HOSTS_NET_TAG-host*)"
        return 1
    fi
}
