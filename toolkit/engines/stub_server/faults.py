"""Fault injection: every way the stub misbehaves on purpose, and the one place that decides when each fires.

At start: `--exit-at-start CODE`, `--exit-at-start-if-exists PATH`. During start-up: `--hang` (never ready),
`--warmup-fails` (the process kills itself when the warm-up ends). Per /generate request, by its 1-based number:
`--crash-after N` (exit 1 on the N-th), `--fail-5xx START:COUNT` (HTTP 503), `--hang-after N` (never answered,
which also wedges /health*), `--nan-every N` (SGLang's NaN stop). At shutdown: `--ignore-sigterm`. The
decisions are pure functions of the configuration (and the request number); the actions that end the process
are here too, so that each fault logs the same line wherever it is triggered.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable, NoReturn

import msgspec

from .config import StubConfig

logger = logging.getLogger(__name__)


class RequestFaults(msgspec.Struct, frozen=True):
    """What happens to one /generate request, in the order the checks apply: crash, then 503, then NaN and
    hang (after validation)."""

    crash: bool = False
    fail_5xx: bool = False
    nan: bool = False
    hang: bool = False


NONE = RequestFaults()


def request_faults(cfg: StubConfig, number: int) -> RequestFaults:
    """The faults of the `number`-th /generate request (counted from 1, every request counts)."""
    crash = cfg.crash_after is not None and number >= cfg.crash_after
    fail = cfg.fail_5xx is not None and cfg.fail_5xx[0] <= number < cfg.fail_5xx[0] + cfg.fail_5xx[1]
    nan = bool(cfg.nan_every) and number % cfg.nan_every == 0
    hang = cfg.hang or (cfg.hang_after is not None and number > cfg.hang_after)
    if not (crash or fail or nan or hang):
        return NONE
    return RequestFaults(crash=crash, fail_5xx=fail, nan=nan, hang=hang)


def exit_at_start(cfg: StubConfig, exists: Callable[[str], bool] = os.path.exists) -> tuple[int, str] | None:
    """(exit status, log message) when the process is to exit at once, else None."""
    if cfg.exit_at_start is not None:
        return cfg.exit_at_start, f"Exiting at start with status {cfg.exit_at_start} (--exit-at-start)"
    if cfg.exit_at_start_if_exists and exists(cfg.exit_at_start_if_exists):
        return 1, f"Exiting at start with status 1: {cfg.exit_at_start_if_exists} exists (--exit-at-start-if-exists)"
    return None


def fail_5xx_body(cfg: StubConfig, number: int) -> dict:
    """The 503 answer of a request inside the --fail-5xx window (SGLang's HTTPException shape)."""
    start, count = cfg.fail_5xx
    msg = f"Injected failure (--fail-5xx {start}:{count}) of /generate request #{number}"
    logger.warning(msg)
    return {"object": "error", "message": msg, "type": "503", "param": None, "code": 503}


def crash(cfg: StubConfig, number: int) -> NoReturn:
    logger.error("Injected crash (--crash-after %d) on /generate request #%d: exiting abruptly with status 1",
                 cfg.crash_after, number)
    logging.shutdown()
    os._exit(1)


def log_nan(cfg: StubConfig, number: int) -> None:
    logger.warning("Injected NaN (--nan-every %d) in /generate request #%d", cfg.nan_every, number)


def log_hang(number: int) -> None:
    logger.warning("Injected hang: /generate request #%d will never be answered", number)


def fail_warmup() -> NoReturn:
    """SGLang's failed warm-up: kill_process_tree of itself."""
    logger.error("Initialization failed. warmup error: injected (--warmup-fails); killing the process tree")
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(1)  # not reached


def sigterm_handler(cfg: StubConfig, on_sigterm: Callable[[str], None]) -> Callable[[str], None]:
    """What a SIGTERM or SIGINT does: the graceful drain, or (--ignore-sigterm) a log line and nothing else."""
    if cfg.ignore_sigterm:
        return lambda signame: logger.warning("Received %s: ignored (--ignore-sigterm)", signame)
    return on_sigterm
