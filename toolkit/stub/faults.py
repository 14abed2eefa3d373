"""Fault injection: every way the stub misbehaves on purpose, and the one place that decides when
each fires.

At start: `--exit-at-start CODE`, `--exit-at-start-if-exists PATH`. During start-up: `--hang` (never
ready), `--warmup-fails` (the process kills itself when the warm-up ends). Per /generate request, by
its 1-based number: `--crash-after N` (exit 1 on the N-th), `--fail-5xx START:COUNT` (HTTP 503, or
`--fail-status`), `--fail-5xx-for START:SECONDS` (the same for every request of SECONDS seconds from
the START-th on: an overloaded engine), `--hang-after N` (never answered, which also wedges
/health*), `--nan-every N` (SGLang's NaN stop). Per prompt: `--poison KIND` spoils the answer of
every /generate whose prompt holds `--poison-text` (of every one, without it) after the first
`--poison-after`: its connection cut (`reset`, `truncate`), an answer that breaks SGLang's contract,
a 503 or a 429, a NaN stop or no answer at all (POISONS); `--poison-prompt KIND=TEXT`
(repeatable) does the same to every prompt holding TEXT, every time, so several prompts can each
fail their own way in one run. At shutdown:
`--ignore-sigterm`. The decisions are pure functions of the configuration (and the request number,
or the prompt); the actions that end the process are here too, so that each fault logs the same line
wherever it is triggered.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable, NoReturn

import msgspec

from toolkit.stub.config import POISONS, StubConfig

logger = logging.getLogger(__name__)


class RequestFaults(msgspec.Struct, frozen=True):
    """What happens to one /generate request, in the order the checks apply: crash, then 503, then
    NaN and hang (after validation)."""

    crash: bool = False
    fail_5xx: bool = False
    nan: bool = False
    hang: bool = False


NONE = RequestFaults()


def request_faults(cfg: StubConfig, number: int, burst_s: float | None = None) -> RequestFaults:
    """The faults of the `number`-th /generate request (counted from 1, every request counts);
    `burst_s`: seconds since --fail-5xx-for's START-th request came (None: it has not)."""
    crash = cfg.crash_after is not None and number >= cfg.crash_after
    fail = (
        cfg.fail_5xx is not None and cfg.fail_5xx[0] <= number < cfg.fail_5xx[0] + cfg.fail_5xx[1]
    ) or (cfg.fail_5xx_for is not None and burst_s is not None and burst_s < cfg.fail_5xx_for[1])
    nan = bool(cfg.nan_every) and number % cfg.nan_every == 0
    hang = cfg.hang or (cfg.hang_after is not None and number > cfg.hang_after)
    if not (crash or fail or nan or hang):
        return NONE
    return RequestFaults(crash=crash, fail_5xx=fail, nan=nan, hang=hang)


# The --poison kinds (config.POISONS) that never answer: `reset` resets the connection (RST, nothing
# sent),
# `truncate` sends the headers and half the body, then closes it. The others answer 200 with one
# fault each.
CUTS = ("reset", "truncate")


class Cut(msgspec.Struct, frozen=True):
    """A /generate answer the HTTP layer cuts (--poison reset or truncate): `body` is what it would
    have been."""

    how: str
    body: bytes = b""


def poisoned(
    cfg: StubConfig, number: int, prompts: list[list[int]], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the `number`-th /generate request, of these prompts, gets --poison."""
    if cfg.poison is None or number <= cfg.poison_after:
        return False
    return cfg.poison_text is None or any(cfg.poison_text in decode(p) for p in prompts)


def poison_of(
    cfg: StubConfig, number: int, prompts: list[list[int]], decode: Callable[[list[int]], str]
) -> str | None:
    """The poison kind of the `number`-th /generate request, of these prompts: --poison's, else that
    of the first
    --poison-prompt rule whose text a prompt holds (deterministic: the same prompt gets it every
    time); None."""
    if poisoned(cfg, number, prompts, decode):
        return cfg.poison
    if cfg.poison_prompts:
        texts = [decode(p) for p in prompts]
        for kind, text in cfg.poison_prompts:
            if any(text in t for t in texts):
                return kind
    return None


def health_broken(cfg: StubConfig, number: int) -> bool:
    """A cut on every request (no --poison-text) past --poison-after breaks generation itself:
    /health* fails."""
    return cfg.poison in CUTS and cfg.poison_text is None and number > cfg.poison_after


def log_poison(kind: str, number: int) -> None:
    logger.warning("Injected poison (%s) in /generate request #%d: %s", kind, number, POISONS[kind])


STATUSES = {"status_503": 503, "status_429": 429}  # the --poison kinds answered with a status


def poison_status_body(kind: str, number: int) -> dict:
    """The answer of a request poisoned with status_503 or status_429 (SGLang's HTTPException
    shape)."""
    code = STATUSES[kind]
    return {
        "object": "error",
        "message": f"Injected failure (poison {kind}) of /generate request #{number}",
        "type": str(code),
        "param": None,
        "code": code,
    }


def spoil(kind: str, out: dict, budget: int, vocab_size: int) -> None:
    """Break one /generate answer object (output_ids, meta_info) the way `kind` says (not a cut)."""
    meta, ids = out["meta_info"], out["output_ids"]
    if kind == "wrong_rid":
        meta["id"] = "x" + meta["id"][1:]
    elif kind == "over_max":
        ids = out["output_ids"] = ids + [ids[-1] if ids else 1] * (budget + 1 - len(ids) + 3)
        meta["completion_tokens"] = len(ids)
    elif kind == "early_length":
        ids = out["output_ids"] = ids[: max(1, min(len(ids), budget) // 3)]
        meta["completion_tokens"] = len(ids)
        meta["finish_reason"] = {"type": "length", "length": len(ids)}
    elif kind == "out_of_vocab":
        out["output_ids"] = [vocab_size + 7, *ids[1:]] if ids else [vocab_size + 7]
        meta["completion_tokens"] = len(out["output_ids"])
    elif kind == "unknown_finish":
        meta["finish_reason"] = {"type": "finished", "matched": None}
    elif kind == "finish_string":
        meta["finish_reason"] = "stop"
    elif kind == "finish_null":
        meta["finish_reason"] = None
    elif kind == "no_completion_tokens":
        del meta["completion_tokens"]
    elif kind == "abort_empty":
        out["output_ids"] = []
        meta["completion_tokens"] = 0
        meta["finish_reason"] = {
            "type": "abort",
            "message": "Abort in waiting queue",
            "status_code": None,
            "err_type": None,
        }
    elif kind == "abort_500":
        ids = out["output_ids"] = ids[: len(ids) // 2]
        meta["completion_tokens"] = len(ids)
        meta["finish_reason"] = {
            "type": "abort",
            "message": "Internal server error (injected: --poison abort_500)",
            "status_code": 500,
            "err_type": None,
        }


def exit_at_start(
    cfg: StubConfig, exists: Callable[[str], bool] = os.path.exists
) -> tuple[int, str] | None:
    """(exit status, log message) when the process is to exit at once, else None."""
    if cfg.exit_at_start is not None:
        return (
            cfg.exit_at_start,
            f"Exiting at start with status {cfg.exit_at_start} (--exit-at-start)",
        )
    if cfg.exit_at_start_if_exists and exists(cfg.exit_at_start_if_exists):
        return (
            1,
            f"Exiting at start with status 1: {cfg.exit_at_start_if_exists} exists "
            "(--exit-at-start-if-exists)",
        )
    return None


def fail_5xx_body(cfg: StubConfig, number: int) -> dict:
    """The answer (status --fail-status, 503 by default) of a request inside the --fail-5xx (or
    --fail-5xx-for) window (SGLang's HTTPException shape)."""
    if cfg.fail_5xx is not None and cfg.fail_5xx[0] <= number < sum(cfg.fail_5xx):
        flag = f"--fail-5xx {cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}"
    else:
        flag = f"--fail-5xx-for {cfg.fail_5xx_for[0]}:{cfg.fail_5xx_for[1]:g}"
    msg = f"Injected failure ({flag}) of /generate request #{number}"
    logger.warning(msg)
    code = cfg.fail_status
    return {"object": "error", "message": msg, "type": str(code), "param": None, "code": code}


def crash(cfg: StubConfig, number: int) -> NoReturn:
    logger.error(
        "Injected crash (--crash-after %d) on /generate request #%d: exiting abruptly with status "
        "1",
        cfg.crash_after,
        number,
    )
    logging.shutdown()
    os._exit(1)


def log_nan(cfg: StubConfig, number: int) -> None:
    logger.warning("Injected NaN (--nan-every %d) in /generate request #%d", cfg.nan_every, number)


def log_hang(number: int) -> None:
    logger.warning("Injected hang: /generate request #%d will never be answered", number)


def fail_warmup() -> NoReturn:
    """SGLang's failed warm-up: kill_process_tree of itself."""
    logger.error(
        "Initialization failed. warmup error: injected (--warmup-fails); killing the process tree"
    )
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(1)  # not reached


def sigterm_handler(cfg: StubConfig, on_sigterm: Callable[[str], None]) -> Callable[[str], None]:
    """What a SIGTERM or SIGINT does: the graceful drain, or (--ignore-sigterm) a log line and
    nothing else."""
    if cfg.ignore_sigterm:
        return lambda signame: logger.warning("Received %s: ignored (--ignore-sigterm)", signame)
    return on_sigterm
