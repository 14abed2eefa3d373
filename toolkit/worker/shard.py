"""What the parts of one shard run share: the `Shard` state (its writer, progress, requests in flight, partial
outputs, concurrency target) and the errors that say the engine died or hung.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from toolkit.engines.client import Expect, HttpClient
from toolkit.formats.progress import Progress, slurm_context, write_progress
from toolkit.formats.records import OK, PARTIAL, Record
from toolkit.formats.run import RunPlan
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardfile import ShardWriter
from toolkit.worker.turn_order import Chains

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

AUTO_START = 64        # concurrency "auto" before the server has said what it can run


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
            rd.shard_file(shard), plan.fingerprint, shard,
            flush_records=self.spec.sharding.flush_records, flush_seconds=self.spec.sharding.flush_seconds,
        )
        self.progress = Progress(shard=shard, total=self.sp.count, host=socket.gethostname(), pid=os.getpid(),
                                 engine=self.spec.engine.kind, started=time.time(), **slurm_context())
        self.tokens = 0
        self.t_gen = 0.0
        self.recorded = 0          # distinct ids recorded (resumed ones included)
        self.transient = 0         # of those, transient failures left (see records.TRANSIENT)
        self.in_flight = 0         # requests sent and not answered
        self.last_answer = time.monotonic()
        self.chains: Chains | None = None  # regenerated datasets: the conversations' answers so far
        self.history: dict[str, Record] = {}  # regenerated datasets: turns recorded ok before this run
        self.waiting_for: str | None = None  # what a stopping worker waits for (told to a second Ctrl-C)
        self.partial: dict[str, Record] = {}  # PARTIAL records to continue, by id (see inflight._generate)
        self.tries: dict[str, int] = {}  # failed tries so far of ids redone in this budget (Record.tries)
        self.stopping = False      # a stop signal came: nothing new is sent, what is in flight is saved
        self.rids: set[str] = set()  # rids in flight (aborted one by one on an engine the worker does not own)
        self.rid_seq = 0
        self.rid_tag = os.urandom(3).hex()
        c = self.spec.client
        self.target = c.concurrency if c.concurrency != "auto" else AUTO_START  # requests to keep in flight
        self.live = 0              # consumers running (see pool)
        self.resized: asyncio.Event | None = None
        self.http: HttpClient | None = None  # the requests' client, one per engine start
        self.expect: Expect | None = None  # what every answer is checked against (the vocabulary, SGLang's limit)
        self.exit_guard = None     # exitguard.ExitGuard of this run of the shard (bounds its end)
        self.session = None        # run.EngineSession: the engine this worker keeps across the shards it runs

    def save_progress(self, state: str | None = None) -> None:
        p = self.progress
        if state:
            p.state = state
        p.done = self.recorded
        p.output_tokens = p.resumed_tokens + self.tokens  # the shard's total; the rate is this attempt's alone
        p.tok_per_s = round(self.tokens / (time.monotonic() - self.t_gen), 1) if self.t_gen else 0.0
        if self.session is not None:
            p.task, p.group = self.session.task, self.session.group
            p.task_engine_starts = self.session.starts
            p.task_shards = len(self.session.served)
            p.engine_shard = self.session.first_shard
        write_progress(self.rd.progress_file(self.shard), p)

    def add(self, record: Record, *, settled: bool = True) -> None:
        """Write `record`. Not `settled`: a failed try that is tried again in this run (inflight.consume), written
        so that its count survives a kill, but neither counted as done nor told to the turns after it."""
        if record.status not in (OK, PARTIAL) and settled:
            self.progress.failed += 1
            log.warning("prompt %s (%s) failed (%s): %s", record.id, record.dataset, record.failure, record.error)
        self.recorded += record.status != PARTIAL and settled  # a partial record is continued, not done
        self.writer.add(record)
        if (settled and self.chains is not None and record.status != PARTIAL  # a partial turn is no answer yet
                and self.plan.datasets[self.chains.dataset_of(record)].regenerate):
            self.chains.recorded(record)
