"""`python -m toolkit.engines.stub_server`: the process lifecycle (logging, serving, start-up and shutdown)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from . import faults
from .config import LOG_PREFIX, StubConfig, parse_config
from .http import Connection
from .model import StubModel
from .server import StubServer

logger = logging.getLogger(__name__)

class _StubFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n".join(f"{LOG_PREFIX} {line}" for line in text.split("\n"))


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StubFormatter("[%(asctime)s] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, exc, tb: logger.critical("uncaught exception", exc_info=(kind, exc, tb))


def _route_transformers_logging() -> None:
    """Send transformers' own log lines through the stub's formatter (so they carry the prefix too)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.set_verbosity_warning()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


async def serve(cfg: StubConfig, model: StubModel, started: float) -> int:
    server = StubServer(cfg, model, started)
    loop = asyncio.get_running_loop()
    try:
        listener = await loop.create_server(lambda: Connection(server), cfg.host, cfg.port, reuse_address=True,
                                            backlog=1024)
    except OSError as e:
        logger.error("%s", e)  # e.g. [Errno 98] error while attempting to bind on address (...): address in use
        return 1
    faults.install_signal_handlers(loop, cfg, server.on_sigterm)
    logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", cfg.host, cfg.port)
    tasks = [loop.create_task(server.warmup()), loop.create_task(server.throughput_log()),
             loop.create_task(server.drain_watchdog())]
    await server.stop.wait()
    listener.close()
    for conn in list(server.connections):
        if not conn.busy and conn.transport is not None:
            conn.transport.close()
    deadline = loop.time() + 2.0
    while loop.time() < deadline and any(c.transport and c.transport.get_write_buffer_size()
                                         for c in server.connections):
        await asyncio.sleep(0.01)
    for t in tasks:
        t.cancel()
    logger.info("Shutdown complete; exiting with status 0")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cfg = parse_config(argv)
    setup_logging(cfg.log_level)
    started = time.time()
    logger.info("Stand-in SGLang server %s profile: a test double of the HTTP protocol, NOT a model; outputs are "
                "synthetic text from the tokenizer", cfg.version)
    if cfg.other_args:
        logger.info("SGLang flags accepted without effect on the stub: %s", ", ".join(sorted(cfg.other_args)))
    code = faults.exit_at_start(cfg)
    if code is not None:
        return code
    logger.info("server_args=%s", {f: getattr(cfg, f) for f in cfg.__struct_fields__ if f != "api_key"})
    logger.info("Load weight begin. avail mem=0.00 GB (stub: no weights; loading the tokenizer only)")
    t0 = time.monotonic()
    folder = cfg.tokenizer_path or cfg.model_path
    if not os.path.isdir(folder):
        logger.error("%s is not a folder: pass the model (or --tokenizer-path) folder that holds the tokenizer", folder)
        return 1
    _route_transformers_logging()
    try:
        model = StubModel(cfg)
    except (OSError, ValueError) as e:
        logger.error("Cannot load the tokenizer of %s: %s. The stub needs the job's tokenizer even with "
                     "--skip-tokenizer-init; pass --tokenizer-path if it lives elsewhere.",
                     cfg.tokenizer_path or cfg.model_path, e)
        return 1
    logger.info("Tokenizer: %d ids; think-start id %s, think-end id %s; EOS written %d, stop ids %s; tool-call "
                "format %s; %d corpus tokens; text %s", model.vocab_size, model.think_start_id, model.think_end_id,
                model.eos_id, sorted(model.eos_ids), model.tool_family or "none", len(model.corpus),
                "sliced from the corpus (checked equal to decode)" if model.fast_text else "decoded per request")
    faults.slow_load(cfg, t0)
    logger.info("Load weight end. type=StubEngine, dtype=none, avail mem=0.00 GB, mem usage=0.00 GB.")
    return asyncio.run(serve(cfg, model, started))


if __name__ == "__main__":
    sys.exit(main())
