"""The worker's stop, with one holder (`Stop`, the engine session's): a signal (SIGTERM, SIGUSR2,
SIGINT) stops every open shard and the worker after them; a handover at the run's tail (`leave`)
and a failure that must end the worker (`halt`) stop it the same way. It installs the signal
handlers and the exit guard (worker.exitguard: the bound on the worker's end, armed once the work
is over, `ending`), tells a second signal what the worker still waits for, and races a wait against
the stop (`race`: `Stopped` when the stop came first)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from toolkit.worker.exitguard import ExitGuard, cancel_and_wait
from toolkit.worker.inflight import ABORT_GRACE_S
from toolkit.worker.shard import Batch

__all__ = ["SIGNALS", "Stop", "Stopped", "exit_bound", "race", "race_value"]

log = logging.getLogger("toolkit.worker")

SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


class Stopped(Exception):
    """The stop came while the session waited (`race`)."""


def exit_bound(spec) -> float:
    """Seconds the worker may take to end once its work is over: stop its tasks, flush, stop the
    engine."""
    return spec.engine.shutdown_timeout_s + spec.engine.exit_grace_s


class Stop:
    """The worker's stop (see the module's docstring): whether it stops, the signal that asked
    (None for a handover or a failure), whether what is in flight is being saved (`saving`: every
    open shard sends nothing new, its requests come back as partial outputs), the failure that ended
    the worker (`halted`), and whether it hands its requests over (`leaving`, with the requests and
    shards it `handed`)."""

    def __init__(self, spec, batch: Batch):
        self.spec, self.batch = spec, batch
        self._event = asyncio.Event()
        self.signal: str | None = None
        self.saving = False
        self.halted: BaseException | None = None  # a failure that ends the session
        self.leaving = False  # it hands its requests over: its open shards stop, then it ends
        self.handed: tuple[int, list[int]] = (0, [])  # requests and shards it handed over
        self.waiting_for: str | None = None  # what a second signal is told it waits for
        self.guard: ExitGuard | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def begin(self, name: str, before_exit: list[Callable[[], None]]) -> None:
        """Install the signal handlers and the exit guard of worker `name` (armed only once the
        work is over: `ending`), which calls `before_exit` before it ends the process."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.guard = ExitGuard(name, loop)
        self.guard.before_exit += before_exit

    def end(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        if self.guard is not None:
            self.guard.disarm()

    def ending(self, why: str, extra_s: float = 0.0) -> None:
        """The work is over (`why`): from now on the process ends within the exit bound."""
        if self.guard is not None:
            self.guard.arm(extra_s + exit_bound(self.spec), why)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.is_set():
            if self.signal is None:  # stopping for a handover: the signal counts too
                self.signal = name
            log.warning(
                "got %s again: still stopping, %s",
                name,
                self.waiting_for or "saving and writing what is done",
            )
            return
        self.signal = name
        shards = self.batch.shards
        if not shards:  # between shards: no shard is claimed after this
            log.warning("got %s: stopping; no further shard is started", name)
            self.set()
            return
        log.warning(
            "got %s: stopping; what is done is written, prompts in flight %s",
            name,
            "are saved as partial outputs and continued next time"
            if self.spec.client.save_in_flight
            else "are generated again next time",
        )
        for sh in shards:
            sh.stopped_by(name)
        self.set()
        self.ending(f"{name} asked it to stop", ABORT_GRACE_S)

    def leave(self) -> None:
        """Hand the run's tail over: every open shard stops as at a stop signal (what is in flight
        kept as partial outputs, its lock released), for a task with room to claim and continue;
        then this one ends."""
        b = self.batch
        self.leaving = True
        self.handed = (b.in_flight, [sh.shard for sh in b.shards])
        log.warning(
            "handing the run's tail over: %d requests in flight of shards %s, kept as partial "
            "outputs for a task with room to continue; this task then ends",
            *self.handed,
        )
        self.set()
        self.ending("it handed its requests over", ABORT_GRACE_S)

    def halt(self, e: BaseException) -> None:
        """A shard failed and the worker must not go on (claims without keep_going): the others
        stop."""
        if self.halted is None:
            self.halted = e
        self.set()


async def race(stop: Stop, *aws) -> None:
    """Run `aws` until the first finishes (raising its error); the stop cancels them all
    (Stopped)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            raise Stopped()
        for t in done:
            t.result()
    finally:
        await cancel_and_wait([*tasks, stopper])


async def race_value(stop: Stop, fut: asyncio.Future):
    await race(stop, asyncio.shield(fut))
    return fut.result()
