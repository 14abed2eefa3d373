"""The real engine: SGLang's server, launched on the node's GPUs from the job spec (never a shell
string)."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

from toolkit.engines.base import LOOPBACK, Engine, EngineError
from toolkit.engines.keys import KEY_ENV
from toolkit.engines.rendezvous import (
    allocation_hosts,
    dist_init_port,
    rendezvous_facts,
    rendezvous_host,
)
from toolkit.engines.sglang_python import check_argv_with_sglang, engine_python

__all__ = ["SGLangEngine"]

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
        hosts = allocation_hosts()
        if hosts and hosts[0] != self.first_host:
            raise EngineError(
                f"[engine] nodes = {n}: the worker runs on {self.first_host}, not on the "
                f"allocation's first node {hosts[0]}, where the engine's rank 0 runs (start the "
                "worker as `toolkit submit` does: one task on the first node)"
            )
        ip = rendezvous_host(**rendezvous_facts(self.first_host, hosts))
        self.dist_init_addr = f"{ip}:{dist_init_port(self.engine.dp_size)}"
        self.step_name = f"toolkit-engine-{secrets.token_hex(4)}"
        self.step_id = None

    def _find_step(self) -> str | None:
        """JOB.STEP of this start's srun step (by its unique name), once Slurm lists it."""
        if self.step_id is None and self.step_name:
            out = _job_steps("%i|%j")
            if out is None:
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
            out = _job_steps("%i")
            if out is None:
                return False
            if self.step_id not in out.split():
                return False
            time.sleep(0.5)
        return True


def _job_steps(fields: str) -> str | None:
    """squeue's list of this Slurm job's steps, each line its `fields` (squeue's -o format); None
    when squeue does not answer."""
    try:
        return subprocess.run(
            ["squeue", "-h", "-s", "-j", os.environ.get("SLURM_JOB_ID", ""), "-o", fields],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
