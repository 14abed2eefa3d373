"""Where the ranks of an engine over several nodes meet: the allocation's nodes, the IPv4 address
of its first node that the others reach (`rendezvous_host`, SGLang's `--dist-init-addr` host, never
a loopback address) and a port for it (`dist_init_port`)."""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
import subprocess

from toolkit.engines.base import EngineError, free_port

__all__ = [
    "allocation_hosts",
    "dist_init_port",
    "parse_node_addrs",
    "rendezvous_facts",
    "rendezvous_host",
]

log = logging.getLogger("toolkit.engines.sglang")  # the SGLang engine's lines name one logger


def allocation_hosts() -> list[str]:
    """The nodes of this Slurm job, in order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split()


def _reachable_ipv4(text: str) -> bool:
    """An IPv4 address another node could use: not loopback (Debian names a node 127.0.1.1), not
    0.0.0.0."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return ip.version == 4 and not ip.is_loopback and not ip.is_unspecified


def rendezvous_host(node: str, node_addr: str, resolved: list[str], routes: list[str]) -> str:
    """The IPv4 address at which the other ranks reach rank 0 on `node`, the allocation's first node
    (SGLang's `--dist-init-addr` host), chosen from what is known of that node — never a loopback
    address:

    - `node_addr`: its NodeAddr as Slurm knows it (`scontrol show node`; "" when Slurm did not say),
      used when it is an IPv4 address;
    - `resolved`: the IPv4 addresses that NodeAddr (or the node's name) resolves to on the node
      itself, the first that is not loopback (on Debian a node's own name is 127.0.1.1);
    - `routes`: the node's own address toward each other node of the allocation (the source address
      the kernel picks), the first that is not loopback.

    EngineError when nothing but loopback (or IPv6, on which SGLang's rendezvous hangs) is known.
    Pure."""
    if _reachable_ipv4(node_addr):
        return node_addr
    for ip in (*resolved, *routes):
        if _reachable_ipv4(ip):
            return ip
    known = [f"NodeAddr {node_addr}" if node_addr else "no NodeAddr (Slurm did not answer)"]
    if resolved:
        known.append(f"{node_addr or node} resolves to {', '.join(resolved)} here")
    if routes:
        known.append(f"its address toward the other nodes is {', '.join(routes)}")
    raise EngineError(
        f"[engine] nodes > 1: no address of {node}, the first node (rank 0), that the other nodes "
        f"can reach — {'; '.join(known)}: only loopback (or none) is known, and the other ranks "
        "could not join SGLang's rendezvous (--dist-init-addr) there. Give the node its network "
        "address in Slurm (NodeAddr= in slurm.conf) or in DNS / /etc/hosts instead of 127.0.1.1"
    )


def parse_node_addrs(scontrol_out: str) -> dict[str, str]:
    """{NodeName: NodeAddr} from `scontrol show node -o` (one node a line). Pure."""
    out = {}
    for line in scontrol_out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("NodeName") and fields.get("NodeAddr"):
            out[fields["NodeName"]] = fields["NodeAddr"]
    return out


def rendezvous_facts(node: str, hosts: list[str]) -> dict:
    """What rendezvous_host chooses from, gathered on the first node `node` (of the allocation
    `hosts`): Slurm's NodeAddr of every node, what the first one's resolves to here, and, when
    neither gives an address, the route toward each other node."""
    addrs: dict[str, str] = {}
    try:
        r = subprocess.run(
            ["scontrol", "show", "node", "-o", ",".join(hosts or [node])],
            capture_output=True,
            text=True,
            timeout=30,
        )
        addrs = parse_node_addrs(r.stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("scontrol show node %s: %s", node, e)
    node_addr = addrs.get(node, "")
    resolved = [] if _reachable_ipv4(node_addr) else _ipv4_of(node_addr or node)
    routes = []
    if not any(_reachable_ipv4(ip) for ip in (node_addr, *resolved)):
        for peer in hosts:
            if peer != node:
                routes += [_route_from(ip) for ip in _ipv4_of(addrs.get(peer) or peer)][:1]
    return dict(node=node, node_addr=node_addr, resolved=resolved, routes=[r for r in routes if r])


def _ipv4_of(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def _route_from(peer_ip: str) -> str:
    """This node's source address toward `peer_ip` ("" if there is no route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_ip, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return ""


def dist_init_port(dp_size: int = 1, *, rng: random.Random | None = None) -> int:
    """A rendezvous port free on this node, below the ephemeral range (so no outgoing connection
    takes it meanwhile), as SGLang picks its own NCCL port; SGLang also uses the next few ports (the
    scheduler and detokenizer ports it derives from --dist-init-addr, one more per data-parallel
    replica): those are free too."""
    return free_port(8 + dp_size, rng=rng)
