"""What the parts of a shard's run share: how it ends (`ShardEnd`, or the errors it fails with, a
file-system error said as what to do: `disk_failure`), the shard a log line is about (`SHARD`,
`shard_lines`, and `TailLog`: the log of the shard closed last), the `Batch` of the engine that
serves it (the requests that engine keeps in flight across every open shard: one concurrency target
per engine), and what an engine session serves (`Shards`, its one collaborator). The open shard
itself is worker.openshard.Shard."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import errno
import logging
import time

import msgspec

from toolkit.errors import BadInputError, FailedError
from toolkit.formats.files import FULL, READ_ONLY, shown_path
from toolkit.formats.progress import Progress, read_progress, write_progress
from toolkit.formats.rundir import RunDir

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

AUTO_START = 64  # concurrency "auto" before the server has said what it can run

# The shard a log line is about, set in each shard's tasks and while the worker opens or ends it:
# the shard's log keeps its own lines and the engine's (none set), never another's (run.ShardLog).
SHARD: contextvars.ContextVar[int | None] = contextvars.ContextVar("shard", default=None)


class End(str, enum.Enum):
    """How a shard's run in this task ended."""

    DONE = "done"
    STOPPED = "stopped"


class ShardEnd(msgspec.Struct, frozen=True):
    """A shard's run that ended without failing: done, or stopped by `stop_signal` (SIGUSR2,
    SIGTERM, SIGINT; None when done, or when the worker stopped for another shard's failure)."""

    shard: int
    end: End
    stop_signal: str | None = None


class ShardFailed(FailedError):
    """The shard cannot finish in this task (engine never ready, died too often, unreachable, disk
    full, shard locked by another worker): exit 1."""


class ShardRefused(BadInputError):
    """The shard cannot run on this input (a run directory this job cannot write, a shard file of
    another run, a tokenizer or model folder the render thread refuses): exit 2. It ends the shard
    as ShardFailed does."""


SHARD_ERRORS = (ShardFailed, ShardRefused)  # how a shard's run fails


class ShardBusy(ShardFailed):
    """Another worker holds the shard's file (its lock): the shard is being generated elsewhere."""


@contextlib.contextmanager
def shard_lines(shard: int):
    """Log lines said inside are about `shard`: they go to its log only."""
    token = SHARD.set(shard)
    try:
        yield
    finally:
        SHARD.reset(token)


def disk_failure(e: OSError, rd: RunDir, shard: int) -> ShardFailed | ShardRefused:
    """The ShardFailed of a file-system error, saying what to do (ShardRefused, exit 2, for a run
    directory this job cannot write), logged, and the shard's progress marked failed."""
    where = (
        shown_path(e.filename)
        if e.filename
        else f"the shard file {shown_path(rd.shard_file(shard))}"
    )
    what = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    if e.errno in FULL:
        failed = ShardFailed(
            f"cannot write {where}: {what}; free space (or quota) on that file system, then "
            f"`{rd.finish_command()}` resumes the shard: nothing written is lost"
        )
    elif e.errno in READ_ONLY:
        failed = ShardRefused(
            f"cannot write {where}: {what}; the run directory {rd.shown} must be writable by this "
            "job (a read-only mount, or another user's folder): fix its permissions or move it"
        )
    else:
        failed = ShardFailed(
            f"{where}: {what}; check the file system, then `{rd.finish_command()}` resumes the "
            "shard"
        )
    _mark_failed(rd, shard, str(failed))
    log.error("shard %d failed: %s", shard, failed)
    return failed


def _mark_failed(rd: RunDir, shard: int, msg: str) -> None:
    """Best effort: the shard's progress file says failed and why (it may itself be unwritable)."""
    try:
        p = read_progress(rd, shard) or Progress(shard=shard, total=0)
        p.state, p.error = "failed", msg
        write_progress(rd.progress_file(shard), p)
    except (OSError, ValueError):
        pass


class TailLog:
    """The log of the shard an engine session closed last: while no shard is open, the session's own
    lines (the engine's stop) go there too, until a shard opens or the session ends."""

    def __init__(self):
        self.handler: logging.Handler | None = None

    def keep(self, handler: logging.Handler | None) -> None:
        """Keep `handler` (None: none), closing the one kept before."""
        if self.handler is not None and self.handler is not handler:
            logging.getLogger("toolkit").removeHandler(self.handler)
            self.handler.close()
        self.handler = handler

    def closed(self, handler: logging.Handler | None, *, last: bool) -> None:
        """A shard closed, its log `handler` handed over: kept when it was the `last` open, else
        closed."""
        if last and handler is not None:
            self.keep(handler)
        elif handler is not None:
            logging.getLogger("toolkit").removeHandler(handler)
            handler.close()


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Batch:
    """The requests one engine keeps in flight, across the shards it serves at once: the target
    (concurrency, or "auto" from the server's load), the consumers running (`live`), the shards
    open, and a wake-up for the pools waiting for room."""

    def __init__(self, client):
        self.client = client
        self.target = client.concurrency if client.concurrency != "auto" else AUTO_START
        self.live = 0  # consumers running, all shards together (see concurrency.pool)
        self.capacity = 0  # what the server says it can run (0: not said)
        self.shards: list = []  # openshard.Shard  # the shards open on this engine, oldest first
        self._waiters: list[asyncio.Future] = []

    @property
    def in_flight(self) -> int:
        return sum(sh.in_flight for sh in self.shards)

    @property
    def last_answer(self) -> float:
        return max((sh.last_answer for sh in self.shards), default=time.monotonic())

    @property
    def unsent(self) -> int:
        """Prompts the open shards still have to send (1 for a shard still rendering)."""
        return sum(sh.feed.unsent() if sh.feed is not None else 1 for sh in self.shards)

    def changed(self) -> asyncio.Future:
        """A future resolved at the next change of room (a consumer ended, the target moved)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class Shards:
    """What a session serves, and its one collaborator while it does: the shard it is given first,
    then those `next_shard` opens (`more`: whether it may open any; worker.claims.Claims does); each
    shard's end (its ShardEnd, or the ShardFailed it failed with) goes to `shard_ended`; at the
    run's tail `hand_over` decides whether this task leaves. This one serves one shard and keeps its
    end."""

    more = False

    def __init__(self):
        self.ends: list = []

    async def next_shard(self):  # -> openshard.Shard | None
        return None

    def shard_ended(self, sh, out) -> None:
        self.ends.append(out)

    def hand_over(self, batch: Batch) -> bool:
        return False


def health_timeout(hang_timeout_s: float) -> float:
    """How long /health_generate may take to answer (SGLang answers 503 after 20 s when wedged)."""
    return min(30.0, max(2.0, hang_timeout_s))
