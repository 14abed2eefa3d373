"""The engine lifecycle every server kind shares: launch, wait until really ready, probe, stop.

An engine is started in its own process group (so nothing it spawns outlives it), on 127.0.0.1 and a
free port the toolkit chose and checked, with a random API key drawn at each start and handed over
in a file only the user can read (toolkit.engines.keys: never on a command line), its output going
to the shard's server log with the key masked. Readiness is `/ready` (SGLang >= 0.5.23) or
`/health_generate` returning 200 — never an open port or `/v1/models`, which answer before warm-up
ends — followed by one real 1-token `/generate`. The wait is bounded and fails fast, with the server
log's tail, when the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path

import msgspec

from toolkit.engines.answer import parse_response
from toolkit.engines.client import BadResponse, HttpClient, Unreachable
from toolkit.engines.endpoints import health_generate
from toolkit.engines.keys import KEY_ENV, KeyFiles, LogPump, mask
from toolkit.engines.process_group import die_with_parent, wait_group_gone
from toolkit.errors import FailedError

__all__ = [
    "Engine",
    "EngineDied",
    "EngineError",
    "EngineHung",
    "EngineUnreachable",
    "free_port",
    "log_tail",
]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
PUMP_JOIN_S = 5.0  # how long a stop waits for the engine's last output to reach its log


class EngineError(FailedError):
    """The engine could not be started, never became ready, or died."""


class EngineDied(EngineError):
    """The engine's process ended mid-shard: the worker restarts it (up to `[engine]
    max_restarts`)."""


class EngineHung(EngineDied):
    """Alive, but answering nothing: stopped without the grace a draining server gets, then
    restarted."""


class EngineUnreachable(EngineError):
    """The engine is alive but cannot be reached: the shard cannot finish in this task."""


def free_port(block: int = 1, *, rng: random.Random | None = None) -> int:
    """The first of `block` consecutive TCP ports nothing listens on (checked by binding each),
    picked at random below the ephemeral range. A server binds its port only once it has loaded
    (seconds for the stub, minutes for SGLang): a port from the ephemeral range could meanwhile be
    taken by any outgoing connection on the node, and the server would die of "Address already in
    use"; ports below that range are handed out only on request."""
    rng = rng or random.Random()
    high = ephemeral_low() - block - 1
    for _ in range(200):
        port = rng.randint(20000, max(20001, high))
        if all(tcp_free(p) for p in range(port, port + block)):
            return port
    raise EngineError(
        f"no {block} free port(s) below the ephemeral range ({ephemeral_low()}) on this node"
    )


def ephemeral_low() -> int:
    """The first port of the range the kernel picks outgoing connections' ports from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def tcp_free(port: int) -> bool:
    """Whether nothing listens on `port` on any address of this node (binding it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            tail = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join(tail) or "(server log is empty)"


class Engine:
    """Base of the server kinds. Subclasses say how to launch (`argv`); `external` launches
    nothing."""

    kind = "base"
    is_model = True  # False for the stub: it speaks SGLang's protocol but is not a model

    def __init__(self, spec, server_log: Path, *, probe_ids: list[int]):
        self.spec = spec
        self.engine = spec.engine
        self.server_log = Path(server_log)
        self.probe_ids = probe_ids
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.api_key: str | None = None
        # where this start's key lives, until the engine stops
        self.key_files: KeyFiles | None = None
        # the engine's output on its way to the server log, the key masked
        self.pump: LogPump | None = None
        self.url = ""
        self.version: str | None = None
        self.starts = 0
        self.ready = False  # since the last start: /ready answered 200

    # -- launching ---------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        """The server's command line: never the key itself (`self.key_files` says where it is)."""
        raise NotImplementedError

    def key_env(self) -> dict[str, str]:
        """Environment that carries the key to a launch that cannot read this node's key files
        (ranks on other nodes, a custom launch command): none by default."""
        return {}

    def before_launch(self, argv: list[str], env: dict[str, str]) -> None:
        """Called with the argv and environment just before the server process is started (raise
        EngineError to refuse the launch)."""

    def command_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.engine.env)
        # The server calls itself on loopback during warm-up: a cluster's HTTP proxy must not be in
        # the way.
        no_proxy = ",".join(
            x for x in (env.get("NO_PROXY") or env.get("no_proxy"), "127.0.0.1", "localhost") if x
        )
        env["NO_PROXY"] = env["no_proxy"] = no_proxy
        return env

    def start(self) -> None:
        """Launch the server process (in its own process group); returns at once."""
        self.port = free_port()
        self.discard_key()  # a previous start's: each start has its own key
        self.api_key = secrets.token_hex(16)
        self.key_files = KeyFiles(self.api_key)
        self.url = f"http://{LOOPBACK}:{self.port}"
        try:
            self._launch()
        except BaseException:
            self.discard_key()
            raise
        log.info(
            "engine %s started: pid %d, %s, log %s",
            self.kind,
            self.proc.pid,
            self.url,
            self.server_log,
        )

    def _launch(self) -> None:
        argv = self.argv()
        env = self.command_env()
        env.pop(KEY_ENV, None)
        self.before_launch(argv, env)
        env.update(self.key_env())
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.ready = False
        with open(self.server_log, "ab") as out:
            out.write(
                f"\n===== toolkit: engine start #{self.starts}: "
                f"{_redact(argv, self.api_key)}\n".encode()
            )
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=write_fd,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.pump = LogPump(read_fd, self.server_log, self.api_key)

    def discard_key(self) -> None:
        """Remove this start's key files (the engine is stopped, or never started)."""
        if self.key_files is not None:
            self.key_files.remove()
            self.key_files = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the process group, wait `timeout_s` (default `shutdown_timeout_s`), then SIGKILL
        the group: nothing left running. A SIGSTOPped group is continued, so it can act on the
        SIGTERM. An engine that never became ready is killed at once: it is still loading, holds
        nothing, and ignores SIGTERM until it serves.

        A ready SGLang drains on the SIGTERM (its schedulers ignore it, see die_with_parent): its
        watchdog looks every 5 s, finds no request left (the worker aborted and recorded them
        first), shuts its schedulers down and exits 0, in about 3 to 7 s. Its crash diagnostics,
        which would add 5 s to every stop and crash, are off (SGLangEngine.command_env)."""
        proc = self.proc
        if proc is None:
            return
        grace = self.engine.shutdown_timeout_s if timeout_s is None else timeout_s
        if not self.ready:
            grace = 0.0
        log.info(
            "stopping the engine (pid %d): SIGTERM to its process group, SIGKILL after %g s",
            proc.pid,
            grace,
        )
        self.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("engine did not exit %g s after SIGTERM: killing it", grace)
        self.kill()
        proc.wait()
        left = wait_group_gone(proc.pid)
        if left:
            log.warning("processes of the engine's group still running after SIGKILL: %s", left)
        if self.pump is not None and not self.pump.join(PUMP_JOIN_S):
            log.warning(
                "the engine's output pipe is still open %g s after its group ended (a process "
                "outside the group holds it); what it writes still reaches the server log",
                PUMP_JOIN_S,
            )
        self.pump = None
        self.discard_key()
        log.info("engine stopped (exit code %s)", proc.returncode)
        self.proc = None

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM to its process group); `stop` waits, then calls
        `kill`."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)  # a SIGSTOPped group acts on the SIGTERM
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the process group: also reaches children that outlived the leader. The key files
        go too."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.discard_key()

    # -- readiness ---------------------------------------------------------------------------------
    async def wait_ready(self, http: HttpClient, *, poll_s: float = 1.0) -> None:
        """Poll `/ready` (or `/health_generate`) until 200, failing fast if the process exits; log
        the version."""
        deadline = time.monotonic() + self.engine.ready_timeout_s
        path = "/ready"
        last = "no answer yet"
        t0 = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(
                    f"engine exited with code {self.proc.returncode} before it was ready (after "
                    f"{time.monotonic() - t0:.0f} s). Last lines of "
                    f"{self.server_log}:\n{log_tail(self.server_log)}"
                )
            try:
                status, _ = await http.get(path, timeout=30.0)
                if status == 200:
                    break
                if status == 404 and path == "/ready":  # SGLang < 0.5.23 has no /ready
                    path = "/health_generate"
                    continue
                last = f"{path} answered {status}"
            except Unreachable as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise EngineError(
                    f"engine not ready after {self.engine.ready_timeout_s:g} s (last: {last}); "
                    "raise [engine] ready_timeout_s if weights load slowly. Last lines of "
                    f"{self.server_log}:\n{log_tail(self.server_log)}"
                )
            await asyncio.sleep(poll_s)
        self.ready = True
        await self._log_server_info(http)
        log.info("engine ready after %.1f s (%s answered 200)", time.monotonic() - t0, path)

    async def _log_server_info(self, http: HttpClient) -> None:
        try:
            status, body = await http.get("/server_info", timeout=30.0)
            info = msgspec.json.decode(body) if status == 200 else {}
        except (Unreachable, msgspec.DecodeError):
            info = {}
        self.version = (
            str(info.get("version")) if isinstance(info, dict) and info.get("version") else None
        )
        log.info("engine server version: %s", self.version or "unknown (no /server_info)")

    async def check_model(self, http: HttpClient, vocab_size: int | None, vocab_of) -> None:
        """Refuse (EngineError) a server that does not serve the job's model, before any prompt is
        sent: only a server the toolkit did not start can (engines.external); one it launched was
        given the job's model."""

    async def probe(self, http: HttpClient, *, attempts: int = 5) -> None:
        """One real 1-token /generate on known ids: readiness endpoints can pass while generation is
        broken.

        The ids are the probe conversation's (chat.probe_ids), none of the job's prompts: a prompt
        whose answer is bad every time fails as that prompt's record, never as the engine. A 5xx or
        a dropped connection is retried a few times (a server can be briefly overloaded right after
        warm-up); any other answer is final, and one that breaks the protocol is an EngineError
        saying so. A probe never answered while /health_generate answers 200 is let pass: the
        prompts' own requests say what becomes of them.
        """
        body = msgspec.json.encode(
            {
                "input_ids": self.probe_ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            }
        )
        for attempt in range(1, attempts + 1):
            try:
                status, data = await http.request("POST", "/generate", body, timeout=300.0)
            except Unreachable as e:
                status, data = 0, str(e).encode()
            if status == 200:
                break
            if (status == 0 or status >= 500) and attempt < attempts and self.alive():
                log.warning("probe /generate answered %s; retrying", status or data.decode())
                await asyncio.sleep(1.0)
                continue
            if status == 0 and self.alive() and await health_generate(http, timeout=30.0) is None:
                log.warning(
                    "the probe /generate got no answer (%s), but /health_generate answers 200: "
                    "going on; the prompts' own requests say what becomes of them",
                    data.decode(),
                )
                return
            raise EngineError(
                f"engine reported ready but the probe /generate failed ({status or 'no answer'}): "
                f"{data[:300]!r}"
            )
        try:
            ids, _ = parse_response(data)
        except BadResponse as e:
            raise EngineError(
                "engine reported ready but its answer to the probe /generate breaks SGLang's "
                f"protocol: {e}"
            ) from None
        if len(ids) != 1:
            raise EngineError(f"probe asked for 1 token and got {len(ids)}")


def _redact(argv: list[str], secret: str | None) -> str:
    """The command line as logged: a key a custom `command` put on it (`{api_key}`) masked wherever
    it stands."""
    return " ".join(a.replace(secret, mask(secret)) if secret else a for a in argv)
