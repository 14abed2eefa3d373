"""Fault injection: every way the stub misbehaves on purpose, and the one place that decides when each fires.

Per /generate request (numbered from 1): --crash-after, --fail-5xx, --hang / --hang-after, --nan-every. At
start: --exit-at-start, --exit-at-start-if-exists, --load-delay (a slow start), --hang (never ready),
--warmup-fails. At shutdown: --ignore-sigterm. The `*_due` functions are the decisions (pure); the others
carry a fault out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any, Callable

import msgspec

from .config import StubConfig
from .model import Item, StubModel

logger = logging.getLogger(__name__)
_json_encode = msgspec.json.encode

NAN_MATCHED = "NaN happened"


# -- decisions ------------------------------------------------------------------------------------
def crash_due(cfg: StubConfig, number: int) -> bool:
    """--crash-after N: the N-th /generate request (and any later one) exits the process."""
    return cfg.crash_after is not None and number >= cfg.crash_after


def fail_5xx_due(cfg: StubConfig, number: int) -> bool:
    """--fail-5xx START:COUNT: requests START..START+COUNT-1 get HTTP 503."""
    return bool(cfg.fail_5xx) and cfg.fail_5xx[0] <= number < cfg.fail_5xx[0] + cfg.fail_5xx[1]


def hang_due(cfg: StubConfig, number: int) -> bool:
    """--hang: every request; --hang-after N: those after the N-th never answer."""
    return cfg.hang or (cfg.hang_after is not None and number > cfg.hang_after)


def nan_due(cfg: StubConfig, number: int) -> bool:
    """--nan-every N: every N-th request ends in SGLang's NaN stop."""
    return bool(cfg.nan_every) and number % cfg.nan_every == 0


# -- per /generate request ------------------------------------------------------------------------
def crash(cfg: StubConfig, number: int) -> None:
    logger.error("Injected crash (--crash-after %d) on /generate request #%d: exiting abruptly with status 1",
                 cfg.crash_after, number)
    logging.shutdown()
    os._exit(1)


def fail_5xx_reply(cfg: StubConfig, number: int) -> tuple:
    msg = f"Injected failure (--fail-5xx {cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}) of /generate request #{number}"
    logger.warning(msg)
    body = {"object": "error", "message": msg, "type": "503", "param": None, "code": 503}
    return 503, _json_encode(body), "application/json"


def nan_stop(model: StubModel, item: Item) -> None:
    """SGLang 0.5.23's NaN stop: the token sampled from NaN logits is replaced by a stop id and the output ends
    there, as if stopped, with finish_reason {"type": "stop", "matched": "NaN happened"} (schedule_batch.py)."""
    item.output = item.output[: len(item.output) // 2] + [model.eos_id]
    item.finish = {"type": "stop", "matched": NAN_MATCHED}
    item.trim, item.stop_str = 1, None


def inject_nan(cfg: StubConfig, number: int, model: StubModel, items: list[Item]) -> None:
    logger.warning("Injected NaN (--nan-every %d) in /generate request #%d", cfg.nan_every, number)
    for item in items:
        nan_stop(model, item)


async def hang_forever(server: Any, items: list[Item]) -> tuple:
    """A wedged generation: the items stay in flight, unanswered, and /health* times out while any is."""
    states = server.register(items, abortable=False)
    logger.warning("Injected hang: /generate request #%d will never be answered", server.generate_count)
    server.hung += 1
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        server.hung -= 1
        server.unregister(states)


# -- start-up and shutdown ------------------------------------------------------------------------
def exit_at_start(cfg: StubConfig) -> int | None:
    """The status to exit with at once (--exit-at-start, --exit-at-start-if-exists), or None to go on."""
    if cfg.exit_at_start is not None:
        logger.error("Exiting at start with status %d (--exit-at-start)", cfg.exit_at_start)
        return cfg.exit_at_start
    if cfg.exit_at_start_if_exists and os.path.exists(cfg.exit_at_start_if_exists):
        logger.error("Exiting at start with status 1: %s exists (--exit-at-start-if-exists)",
                     cfg.exit_at_start_if_exists)
        return 1
    return None


def slow_load(cfg: StubConfig, t0: float) -> None:
    """--load-delay: the port stays closed until this many seconds after loading began (time.monotonic t0)."""
    rest = cfg.load_delay - (time.monotonic() - t0)
    if rest > 0:
        time.sleep(rest)


def never_ready(cfg: StubConfig) -> bool:
    """--hang: the warm-up never ends."""
    if cfg.hang:
        logger.warning("Injected hang (--hang): the server will never become ready")
        return True
    return False


def fail_warmup(cfg: StubConfig) -> None:
    """--warmup-fails: the warm-up fails and the process kills itself, as SGLang's launcher does."""
    if cfg.warmup_fails:
        logger.error("Initialization failed. warmup error: injected (--warmup-fails); killing the process tree")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def install_signal_handlers(loop: asyncio.AbstractEventLoop, cfg: StubConfig,
                            on_sigterm: Callable[[str], None]) -> None:
    """SIGTERM and SIGINT start the graceful drain, or with --ignore-sigterm are logged and ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if cfg.ignore_sigterm:
            loop.add_signal_handler(sig, logger.warning, "Received %s: ignored (--ignore-sigterm)", sig.name)
        else:
            loop.add_signal_handler(sig, on_sigterm, sig.name)
