"""`python -m toolkit.stub`: the process: logging (every line carries the stub's prefix),
start-up (tokenizer "weights", load delay), serving, signals and the exit status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import uvicorn

from toolkit.stub import faults
from toolkit.stub.app import build_app
from toolkit.stub.command_line import parse_config
from toolkit.stub.config import LOG_PREFIX, StubConfig
from toolkit.stub.model import StubModel
from toolkit.stub.outputs import load_model
from toolkit.stub.server import StubServer

logger = logging.getLogger("toolkit.stub")


class _StubFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n".join(f"{LOG_PREFIX} {line}" for line in text.split("\n"))


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _StubFormatter("[%(asctime)s] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, exc, tb: logger.critical(
        "uncaught exception", exc_info=(kind, exc, tb)
    )


def _route_transformers_logging() -> None:
    """Send transformers' own log lines through the stub's formatter (so they carry the prefix
    too)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.set_verbosity_warning()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


class SchedulerProcess:
    """SGLang's process layout where it decides how a SIGTERM ends: its HTTP process runs the
    scheduler in a child process that installs no SIGTERM handler, and a watchdog thread
    (utils/watchdog.py, every second) that, when a child dies with a non-zero code, SIGQUITs the
    server, which kills its process tree with SIGKILL.

    So a SIGTERM to the server's pid alone drains (the stub's drain, as SGLang's), while a SIGTERM
    to the whole process group kills the child at once and the server within about a second, without
    draining, unless SIGTERM was ignored when the server was started (as the toolkit starts
    engines): ignored signals stay ignored in children, so the child lives on and the server drains.
    The stub's "scheduler" is a shell that ends on its own once the stub is gone; with
    --ignore-sigterm it ignores SIGTERM too, so that the whole engine waits for SIGKILL."""

    def __init__(self, ignore_sigterm: bool, interval: float = 1.0):
        script = (
            "trap '' TERM; " if ignore_sigterm else ""
        ) + f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done"
        self.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL)
        self.interval = interval
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="subprocess-watchdog").start()

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval):
            code = self.proc.poll()
            if code is None or code == 0:
                continue
            logger.error(
                "Subprocess scheduler_0 (pid=%d) crashed with exit code %d. Triggering SIGQUIT for "
                "cleanup...",
                self.proc.pid,
                code,
            )
            logger.error("SIGQUIT received. It usually means one child failed.")
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def stop(self) -> None:
        """After a graceful drain: the child's exit is expected, not a crash."""
        self.stopped.set()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: SIGTERM starts the stub's drain (or is
    ignored), as in SGLang, and the process exits 0 once drained instead of re-raising the
    signal."""

    def capture_signals(self):
        return contextlib.nullcontext()


def uvicorn_config(cfg: StubConfig, app) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_config=None,
        log_level=None,
        access_log=cfg.log_level == "debug",
        lifespan="off",
        ws="none",
        backlog=1024,
        timeout_keep_alive=cfg.keep_alive_timeout if cfg.keep_alive_timeout > 0 else 1 << 30,
    )


async def serve(
    cfg: StubConfig, model: StubModel, started: float, config: uvicorn.Config, sock
) -> int:
    srv = StubServer(cfg, model, started)
    config.app = build_app(srv)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    on_signal = faults.sigterm_handler(cfg, srv.on_sigterm)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    serving = loop.create_task(server.serve(sockets=[sock]))
    tasks = [
        loop.create_task(srv.warmup()),
        loop.create_task(srv.throughput_log()),
        loop.create_task(srv.drain_watchdog()),
    ]
    stopping = loop.create_task(srv.stop.wait())
    await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    # uvicorn polls should_exit every 0.1 s
    done, _ = await asyncio.wait((serving,), timeout=2.0 + 0.2)
    # connections still busy (a wedged request): drop them, which cancels their handlers
    if not done:
        for conn in list(server.server_state.connections):
            if conn.transport is not None:
                conn.transport.close()
    await serving
    for t in (*tasks, stopping):
        t.cancel()
    log_occupancy(srv)
    logger.info("Shutdown complete; exiting with status 0")
    return 0


def log_occupancy(srv: StubServer) -> None:
    """The batch occupancy at shutdown (what a benchmark reads from the server log). Only requests
    delayed by
    --token-delay take running slots: without it no request runs for any time, and the line says
    so."""
    occ, sched = srv.sched.occupancy, srv.sched
    share = occ.share()
    if share is None:
        logger.info(
            "Batch occupancy: none (no request ran for any time: the stub counts running slots "
            "only with --token-delay)"
        )
        return
    logger.info(
        "Batch occupancy %.4f (time-weighted running / max running %d) over %.1f s from the first "
        "request to the last answer; %d tokens decoded",
        share,
        sched.max_running,
        occ.span(),
        sched.counters["generated_tokens"],
    )


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cfg = parse_config(argv)
    if cfg.check_args:  # the command line alone, asked before a run is written
        return 0
    setup_logging(cfg.log_level)
    logger.info(
        "Stand-in SGLang server %s profile: a test double of the HTTP protocol, NOT a model; "
        "outputs are synthetic text from the tokenizer",
        cfg.version,
    )
    if cfg.other_args:
        logger.info(
            "SGLang flags accepted without effect on the stub: %s",
            ", ".join(sorted(cfg.other_args)),
        )
    early = faults.exit_at_start(cfg)
    if early is not None:
        logger.error("%s", early[1])
        return early[0]
    logger.info(
        "server_args=%s", {f: getattr(cfg, f) for f in cfg.__struct_fields__ if f != "api_key"}
    )
    scheduler = SchedulerProcess(cfg.ignore_sigterm)
    try:
        return _start(cfg)
    finally:
        scheduler.stop()


def _start(cfg: StubConfig) -> int:
    """Load the "weights" (the tokenizer), then serve until stopped."""
    started = time.time()
    logger.info(
        "Load weight begin. avail mem=0.00 GB (stub: no weights; loading the tokenizer only)"
    )
    t0 = time.monotonic()
    folder = cfg.tokenizer_path or cfg.model_path
    if not os.path.isdir(folder):
        logger.error(
            "%s is not a folder: pass the model (or --tokenizer-path) folder that holds the "
            "tokenizer",
            folder,
        )
        return 1
    _route_transformers_logging()
    try:
        model = load_model(cfg)
    except (OSError, ValueError) as e:
        logger.error(
            "Cannot load the tokenizer of %s: %s. The stub needs the job's tokenizer even with "
            "--skip-tokenizer-init; pass --tokenizer-path if it lives elsewhere.",
            cfg.tokenizer_path or cfg.model_path,
            e,
        )
        return 1
    logger.info(
        "Tokenizer: %d ids; think-start id %s, think-end id %s; EOS written %d, stop ids %s; "
        "tool-call format %s; %d corpus tokens; text %s",
        model.vocab_size,
        model.think_start_id,
        model.think_end_id,
        model.eos_id,
        sorted(model.eos_ids),
        model.tool_family or "none",
        len(model.corpus),
        "sliced from the corpus (checked equal to decode)"
        if model.fast_text
        else "decoded per request",
    )
    rest = cfg.load_delay - (time.monotonic() - t0)
    if rest > 0:
        time.sleep(rest)
    logger.info(
        "Load weight end. type=StubEngine, dtype=none, avail mem=0.00 GB, mem usage=0.00 GB."
    )
    config = uvicorn_config(cfg, None)
    # logs "Uvicorn running on ..."; a port in use exits 1, as uvicorn does
    sock = config.bind_socket()
    return asyncio.run(serve(cfg, model, started, config, sock))


if __name__ == "__main__":
    sys.exit(main())
