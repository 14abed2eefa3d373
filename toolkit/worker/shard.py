"""What the parts of one shard's run share: the `Shard` state (its writer, progress, requests in
flight, partial outputs, its feed), and the `Batch` of the engine that serves it: the requests that
engine keeps in flight across every open shard (one concurrency target per engine)."""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import os
import socket
import time

import msgspec

from toolkit.engines.answer import Expect
from toolkit.engines.client import HttpClient
from toolkit.errors import BadInputError, FailedError
from toolkit.formats.progress import Progress, slurm_context, write_progress
from toolkit.formats.records import OK, PARTIAL, Record
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardfile import ShardWriter
from toolkit.worker.turn_order import Chains

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
        self.shards: list[Shard] = []  # the shards open on this engine, oldest first
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


def health_timeout(hang_timeout_s: float) -> float:
    """How long /health_generate may take to answer (SGLang answers 503 after 20 s when wedged)."""
    return min(30.0, max(2.0, hang_timeout_s))


class Shard:
    """State of one shard run inside one task."""

    def __init__(self, rd: RunDir, plan: RunPlan, shard: int):
        self.rd, self.plan, self.shard = rd, plan, shard
        self.spec = plan.spec
        self.sp = plan.shards[shard]
        self.writer = ShardWriter(
            rd.shard_file(shard),
            plan.fingerprint,
            shard,
            flush_records=self.spec.sharding.flush_records,
            flush_seconds=self.spec.sharding.flush_seconds,
        )
        self.progress = Progress(
            shard=shard,
            total=self.sp.count,
            host=socket.gethostname(),
            pid=os.getpid(),
            engine=self.spec.engine.kind,
            started=time.time(),
            **slurm_context(),
        )
        self.tokens = 0
        self.t_gen = 0.0
        self.recorded = 0  # distinct ids recorded (resumed ones included)
        self.transient = 0  # of those, transient failures left (see records.TRANSIENT)
        self.in_flight = 0  # requests sent and not answered
        self.last_answer = time.monotonic()
        self.chains: Chains | None = None  # regenerated datasets: the conversations' answers so far
        # regenerated datasets: turns recorded ok before this run
        self.history: dict[str, Record] = {}
        # PARTIAL records to continue, by id (see inflight._generate)
        self.partial: dict[str, Record] = {}
        # failed tries so far of ids redone in this budget (Record.tries)
        self.tries: dict[str, int] = {}
        # a stop signal came: nothing new is sent, what is in flight is saved
        self.stopping = False
        # rids in flight (aborted one by one on an engine the worker does not own)
        self.rids: set[str] = set()
        self.rid_seq = 0
        self.rid_tag = os.urandom(3).hex()
        # the requests in flight of the engine serving it (set by the session)
        self.batch: Batch | None = None
        self.feed = None  # feed.Feed of its rendered prompts, while it is open
        # the requests' client, one per engine start (the session's)
        self.http: HttpClient | None = None
        # what every answer is checked against (the vocabulary, SGLang's limit)
        self.expect: Expect | None = None
        # the engine's data-parallel ranks (/server_info, each start; 0: not said): where a
        # continuation may be pinned
        self.dp_ranks = 0
        # session.EngineSession: the engine this worker keeps across its shards
        self.session = None

    def save_progress(self, state: str | None = None) -> None:
        p = self.progress
        if state:
            p.state = state
        p.done = self.recorded
        # the shard's total; the rate is this attempt's alone
        p.output_tokens = p.resumed_tokens + self.tokens
        p.tok_per_s = round(self.tokens / (time.monotonic() - self.t_gen), 1) if self.t_gen else 0.0
        if self.session is not None:
            p.task, p.group = self.session.task, self.session.group
            p.task_engine_starts = self.session.starts
            p.task_shards = len(self.session.served)
            p.engine_shard = self.session.first_shard
        write_progress(self.rd.progress_file(self.shard), p)

    def add(self, record: Record, *, settled: bool = True) -> None:
        """Write `record`. Not `settled`: a failed try that is tried again in this run
        (inflight.consume), written so that its count survives a kill, but neither counted as done
        nor told to the turns after it."""
        if record.status not in (OK, PARTIAL) and settled:
            self.progress.failed += 1
            log.warning(
                "prompt %s (%s) failed (%s): %s",
                record.id,
                record.dataset,
                record.failure,
                record.error,
            )
        # a partial record is continued, not done
        self.recorded += record.status != PARTIAL and settled
        self.writer.add(record)
        # a partial turn is no answer yet
        if (
            settled
            and self.chains is not None
            and record.status != PARTIAL
            and self.plan.datasets[self.chains.dataset_of(record)].regenerate
        ):
            self.chains.recorded(record)
