"""The real engine: SGLang's server, launched on the node's GPUs from the job spec (never a shell
string)."""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time

from toolkit.engines.base import LOOPBACK, Engine, EngineError, free_port
from toolkit.engines.keys import KEY_ENV
from toolkit.engines.sglang_contract.flags import MANAGED, check_extra_args

__all__ = ["SGLangEngine", "MANAGED", "check_extra_args", "engine_python"]

log = logging.getLogger(__name__)


def substitute(template: list[str], **values: str) -> list[str]:
    """Fill the placeholders of a custom launch argv: `{host}` `{port}` `{model_path}`, and for the
    key `{api_key_file}` `{config_file}` (files only the user can read) or `{api_key}` (the key
    itself: on a command line, readable by every user of the node)."""
    out = []
    for a in template:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


# Run with the engine's own interpreter and environment, before the weights load: SGLang's parser
# judges the command line. A subprocess, so that the worker never imports sglang (and torch) itself.
_ARGV_CHECK = """
import argparse, importlib.util, sys
if importlib.util.find_spec("sglang") is None:
    print("toolkit: no sglang here"); sys.exit(0)
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
parser.parse_args(sys.argv[1:])
"""
ARGV_CHECK_TIMEOUT_S = 600.0


def check_argv_with_sglang(
    args: list[str], env: dict[str, str], python: str = sys.executable, secret: str | None = None
) -> None:
    """Parse `args` (the flags after `-m sglang.launch_server`) with SGLang's own parser, where
    sglang is installed; a refusal raises EngineError with argparse's message. Anything else (no
    sglang, an import that fails, a timeout) is logged and left to the launch itself."""
    try:
        r = subprocess.run(
            [python, "-c", _ARGV_CHECK, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ARGV_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning(
            "could not check the command line with SGLang's parser (%s); launching anyway", e
        )
        return
    if r.returncode == 0:
        log.info(
            "SGLang's parser accepts the command line"
            if "no sglang here" not in r.stdout
            else "sglang is not importable here: the command line is not checked by its parser"
        )
        return
    lines = [x.replace(secret, "***") if secret else x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if "error:" in x]
    if r.returncode == 2 and errors:
        raise EngineError(
            f"SGLang's parser refuses the server command line: {errors[-1].strip()} — fix "
            "[engine] extra_args (nothing was launched)"
        )
    log.warning(
        "checking the command line with SGLang's parser failed (exit %s): %s; launching anyway",
        r.returncode,
        " | ".join(lines[-3:]) or "no output",
    )


# Asked of a candidate interpreter: its environment (sys.prefix) and whether sglang is importable
# there.
_PROBE = (
    "import importlib.util, sys; print(sys.prefix); "
    "print(importlib.util.find_spec('sglang') is not None)"
)
PROBE_TIMEOUT_S = 120.0


def _probe(python: str, env: dict[str, str]) -> tuple[str, bool] | None:
    """(sys.prefix, has sglang) of `python` run with `env`; None when it does not run."""
    try:
        r = subprocess.run(
            [python, "-c", _PROBE],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.split()
    return (lines[0], lines[1] == "True") if r.returncode == 0 and len(lines) == 2 else None


def has_sglang(python: str, env: dict[str, str]) -> bool:
    """Whether `sglang` is importable by `python` run with `env`."""
    seen = _probe(python, env)
    return seen is not None and seen[1]


def engine_python(python: str | None, env: dict[str, str]) -> tuple[str, str]:
    """(interpreter, why) that SGLang starts with in the environment `env` (the worker's, as the
    node's [slurm] setup left it, with [engine] env): [engine] python when the job names one (a
    path, or a name on env's PATH); else the first python3 (or python) on env's PATH whose
    environment is not the toolkit's own and has sglang, as `source ~/venvs/sglang/bin/activate` in
    the setup prepares; else the toolkit's own interpreter."""
    path = env.get("PATH", os.defpath)
    if python:
        found = shutil.which(os.path.expanduser(python), path=path)
        if found is None:
            raise EngineError(
                f"[engine] python = {python!r}: no such interpreter on this node (PATH {path}); "
                "give the path of the Python that has sglang here, or activate its environment in "
                "[slurm] setup and remove [engine] python"
            )
        return found, "[engine] python"
    for name in ("python3", "python"):
        found = shutil.which(name, path=path)
        if found is None:
            continue
        seen = _probe(found, env)
        if seen is None:
            continue
        prefix, has_sglang = seen
        if os.path.realpath(prefix) == os.path.realpath(sys.prefix):
            break  # the toolkit's own environment: its own interpreter
        if has_sglang:
            return (
                found,
                f"the first {name} on PATH, with sglang (the environment [slurm] setup prepared)",
            )
        break
    return sys.executable, "the toolkit's own Python"


class SGLangEngine(Engine):
    """SGLang on this node, or with `[engine] nodes = N > 1` on the N nodes of the task's
    allocation: one `srun` step with a rank per node (toolkit.engines.rank), rank 0 beside the
    worker. The srun process is the engine process: it exits when any rank does
    (`--kill-on-bad-exit`), so `alive()` covers every node."""

    kind = "sglang"
    argv_checked = False
    # Ranks of a multi-node engine per node: 1 on a real cluster. More only to run every rank on one
    # node of a cluster that has a single one, with a NodeAddr that is not loopback:
    # $TOOLKIT_ENGINE_RANKS_PER_NODE.
    RANKS_PER_NODE_ENV = "TOOLKIT_ENGINE_RANKS_PER_NODE"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dist_init_addr = ""
        self.first_host = ""
        self.step_name = ""
        self.step_id: str | None = None
        self.ranks_per_node = max(1, int(os.environ.get(self.RANKS_PER_NODE_ENV) or 1))
        self._python: str | None = None

    @property
    def python(self) -> str:
        """The interpreter SGLang starts with (engine_python), chosen once per engine and logged."""
        if self._python is None:
            self._python, why = engine_python(self.engine.python, self.command_env())
            log.info("SGLang starts with %s (%s)", self._python, why)
        return self._python

    @property
    def multi_node(self) -> bool:
        return self.engine.nodes > 1

    # SGLang sleeps 5 s "before crash diagnostics" (py-spy dumps, CUDA core dumps) on every shutdown
    # and every crash unless these are 0: a stop would take 5 s longer, and a crash be noticed 5 s
    # late. Off by default; [engine] env (or the task's environment) turns them back on.
    QUIET_CRASH_ENV = {
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    }

    def command_env(self) -> dict[str, str]:
        env = super().command_env()
        for k, v in self.QUIET_CRASH_ENV.items():
            env.setdefault(k, v)
        return env

    def before_launch(self, argv: list[str], env: dict[str, str]) -> None:
        """Once per engine: SGLang's own parser must accept the flags before a launch loads any
        weights."""
        if self.engine.command or self.argv_checked:
            return
        server = self.server_argv()
        if self.multi_node:
            from toolkit.engines.rank import rank_argv

            server = rank_argv(
                server, rank=0, nnodes=self.engine.nodes, dist_init_addr=self.dist_init_addr
            )
        check_argv_with_sglang(server[3:], env, python=server[0], secret=self.api_key)
        self.argv_checked = True

    def server_argv(self) -> list[str]:
        """The SGLang command line of this node (of each node, before its rank flags, with nodes >
        1), without the key: `argv` (or each rank) adds `--config FILE`, the file that holds it."""
        m, e = self.spec.model, self.engine
        if e.command:
            return self.custom_argv()
        argv = [self.python, "-m", "sglang.launch_server", "--model-path", m.path]
        if m.tokenizer_path:
            argv += ["--tokenizer-path", m.tokenizer_path]
        argv += [
            "--tp-size",
            str(e.tp_size),
            "--dp-size",
            str(e.dp_size),
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            # No --nccl-port: SGLang picks a free one below the ephemeral range itself, one per
            # data-parallel replica (a pinned port is bound once per replica, so dp_size > 1 could
            # not start).
        ]
        if m.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv + list(e.extra_args)

    def custom_argv(self) -> list[str]:
        """[engine] command with its placeholders filled; a key file is written only when the
        command names it."""
        command = self.engine.command or []
        files = {name: (lambda: "") for name in ("api_key_file", "config_file")}
        if self.key_files is not None:
            files = {"api_key_file": self.key_files.plain, "config_file": self.key_files.config}
        values = {
            name: str(make())
            for name, make in files.items()
            if any("{" + name + "}" in a for a in command)
        }
        if any("{api_key}" in a for a in command):
            log.warning(
                "[engine] command puts the engine's key on its command line ({api_key}), where "
                "every user of the node can read it: use {api_key_file} or {config_file} (files "
                "only you can read), or $%s",
                KEY_ENV,
            )
        return substitute(
            command,
            host=LOOPBACK,
            port=str(self.port),
            model_path=self.spec.model.path,
            api_key=self.api_key or "",
            **values,
        )

    def argv(self) -> list[str]:
        server = self.server_argv()
        if self.engine.command:
            return server
        if not self.multi_node:
            return (
                [*server, "--config", str(self.key_files.config())]
                if self.key_files is not None
                else server
            )
        return [
            *self.srun_argv(),
            sys.executable,
            "-m",
            "toolkit.engines.rank",
            "--nnodes",
            str(self.engine.nodes),
            "--dist-init-addr",
            self.dist_init_addr,
            "--first-host",
            self.first_host,
            "--",
            *server,
        ]

    def key_env(self) -> dict[str, str]:
        """The ranks of a multi-node engine write their own key file on their own node from the
        step's environment (a custom command may read it too)."""
        return {KEY_ENV: self.api_key or ""} if self.multi_node or self.engine.command else {}

    # -- several nodes -----------------------------------------------------------------------------
    def srun_argv(self) -> list[str]:
        """The step that runs one rank per node: every node of the task's allocation, its GPUs
        (shared with the worker's own step: --overlap), output prefixed by rank into the server log,
        and the step ended as soon as one rank fails."""
        n, per = self.engine.nodes, self.ranks_per_node
        return [
            "srun",
            f"--nodes={-(-n // per)}",
            f"--ntasks={n}",
            f"--ntasks-per-node={per}",
            "--overlap",
            "--kill-on-bad-exit=1",
            "--mpi=none",
            "--label",
            "--unbuffered",
            f"--job-name={self.step_name}",
        ]

    def start(self) -> None:
        if self.multi_node:
            self._prepare_step()
        super().start()

    def _prepare_step(self) -> None:
        """Check the allocation; choose the rendezvous address (the first node's address as Slurm
        knows it, a free port there) and the step name."""
        n = self.engine.nodes
        job = os.environ.get("SLURM_JOB_ID")
        if not job or shutil.which("srun") is None:
            raise EngineError(
                f"[engine] nodes = {n}: the engine is started with `srun` on the nodes of a Slurm "
                "allocation, and this process runs outside one (use `toolkit submit`, or salloc)"
            )
        have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        need = -(-n // self.ranks_per_node)
        if have < need:
            raise EngineError(
                f"[engine] nodes = {n}, but this task's allocation has {have} node(s): submit with "
                f"`toolkit submit` (it asks for --nodes={n})"
            )
        self.first_host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        hosts = _allocation_hosts()
        if hosts and hosts[0] != self.first_host:
            raise EngineError(
                f"[engine] nodes = {n}: the worker runs on {self.first_host}, not on the "
                f"allocation's first node {hosts[0]}, where the engine's rank 0 runs (start the "
                "worker as `toolkit submit` does: one task on the first node)"
            )
        ip = rendezvous_host(**_rendezvous_facts(self.first_host, hosts))
        self.dist_init_addr = f"{ip}:{dist_init_port(self.engine.dp_size)}"
        self.step_name = f"toolkit-engine-{secrets.token_hex(4)}"
        self.step_id = None

    def _find_step(self) -> str | None:
        """JOB.STEP of this start's srun step (by its unique name), once Slurm lists it."""
        if self.step_id is None and self.step_name:
            try:
                out = subprocess.run(
                    ["squeue", "-h", "-s", "-j", os.environ.get("SLURM_JOB_ID", ""), "-o", "%i|%j"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return None
            for line in out.splitlines():
                sid, _, name = line.strip().partition("|")
                if name == self.step_name:
                    self.step_id = sid
        return self.step_id

    def _scancel(self, *args: str) -> bool:
        step = self._find_step()
        if step is None:
            return False
        try:
            r = subprocess.run(["scancel", *args, step], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return r.returncode == 0

    def terminate(self) -> None:
        """SIGTERM to every process of every rank (`scancel --signal=TERM` on the step: srun itself
        would not forward it but end the step, killing after Slurm's KillWait), so every rank ends
        as on one node."""
        if not self.multi_node:
            return super().terminate()
        if self.proc.poll() is None and not self._scancel("--signal=TERM"):
            # no step id: srun ends the step (SIGTERM, then SIGKILL after KillWait)
            super().terminate()

    def kill(self) -> None:
        """Backstop: SIGKILL to every rank, then srun; nothing of the step is left on any node."""
        if not self.multi_node:
            return super().kill()
        if self.proc.poll() is None:
            self._scancel("--signal=KILL")
            super().terminate()  # srun on SIGTERM ends the step
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                log.warning("srun did not exit 30 s after the engine step was killed")
        super().kill()
        if self._step_listed():
            self._scancel()

    def _step_listed(self) -> bool:
        if self.step_id is None:
            return False
        for _ in range(20):
            try:
                out = subprocess.run(
                    ["squeue", "-h", "-s", "-j", os.environ.get("SLURM_JOB_ID", ""), "-o", "%i"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                return False
            if self.step_id not in out:
                return False
            time.sleep(0.5)
        return True


def _allocation_hosts() -> list[str]:
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


def _rendezvous_facts(node: str, hosts: list[str]) -> dict:
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
