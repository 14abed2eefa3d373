"""The stub's "GPU": requests in flight, the running limit and the FIFO waiting queue of delayed
requests (--token-delay), aborts (by rid prefix, or all), the token counters of /stub/counters and
the batch occupancy.

At most `max_running` requests generate at once, the rest wait; `generated_tokens` counts every
token decoded, also those of requests aborted or dropped by their client (what a GPU spent),
`returned_tokens` those sent back. The batch occupancy (`Occupancy`) is the time-weighted mean of
running / max_running from the first request admitted to the last one ended: 1.0 when the batch is
full throughout, 1 / max_running for requests one at a time (only delayed, non-streamed requests
take running slots here, so only they count).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class InFlight(msgspec.Struct, kw_only=True):
    rid: str
    started: float
    aborted: asyncio.Event | None = None
    aborted_at: float = 0.0  # loop time of the abort
    prompt_len: int = 0
    # loop time generation began (None: waiting in the queue, or not delayed)
    begin: float | None = None
    planned: int = 0  # tokens it will write if nothing stops it


class Occupancy:
    """The time-weighted share of the running slots in use, from the first request that ran to the
    last that ended (`clock`: seconds, monotonic). `change(running)` is called with the new count at
    every change."""

    def __init__(self, slots: int, clock=time.monotonic):
        self.slots = max(1, slots)
        self.clock = clock
        self.first: float | None = None  # when the first request began running
        self.last = 0.0  # when the running count last dropped to zero
        self.at = 0.0  # the time of the last change
        self.running = 0
        self.area = 0.0  # integral of the running count up to `at`

    def change(self, running: int) -> None:
        now = self.clock()
        if self.first is None:
            if running <= 0:
                return
            self.first = self.at = now
        self.area += self.running * (now - self.at)
        self.at, self.running = now, running
        if running == 0:
            self.last = now

    def span(self) -> float:
        """Seconds from the first request to the last answer (to now while requests run)."""
        if self.first is None:
            return 0.0
        return (self.clock() if self.running else self.last) - self.first

    def share(self) -> float | None:
        """The batch occupancy in [0, 1]; None before any request has run (or over no time at
        all)."""
        span = self.span()
        if span <= 0:
            return None
        area = self.area + (self.running * (self.clock() - self.at) if self.running else 0.0)
        return area / (self.slots * span)


class Scheduler:
    """In-flight requests by rid, the running set and the waiting queue (one per process)."""

    def __init__(self, max_running: int, token_delay: float):
        self.max_running = max_running
        self.token_delay = token_delay
        self.in_flight: dict[str, InFlight] = {}
        self.running: dict[int, InFlight] = {}  # by id(): Structs compare by value
        self.waiting: list[tuple[InFlight, asyncio.Future]] = []
        self.occupancy = Occupancy(max_running)
        self.hung = 0  # requests wedged by --hang / --hang-after
        self.counters = {
            "generated_tokens": 0,
            "returned_tokens": 0,
            "aborted_running": 0,
            "aborted_waiting": 0,
            "cancelled": 0,
            "continued": 0,
        }

    # -- in flight -------------------------------------------------------------------------------
    def register(self, rids: list[str], abortable: bool) -> list[InFlight]:
        now = time.monotonic()
        states = [
            InFlight(rid=rid, started=now, aborted=asyncio.Event() if abortable else None)
            for rid in rids
        ]
        for state in states:
            self.in_flight[state.rid] = state
        return states

    def unregister(self, states: list[InFlight]) -> None:
        for state in states:
            if self.in_flight.get(state.rid) is state:
                del self.in_flight[state.rid]

    def abort(self, rid: str, abort_all: bool) -> bool:
        """SGLang's abort: forwarded only for an exact in-flight rid (or abort_all), then matched by
        prefix."""
        if not (abort_all or rid in self.in_flight):
            return False
        now = asyncio.get_running_loop().time()
        for state in list(self.in_flight.values()):
            if (
                (abort_all or state.rid.startswith(rid))
                and state.aborted is not None
                and not state.aborted.is_set()
            ):
                state.aborted_at = now
                state.aborted.set()
        return True

    async def hang(self, rids: list[str], *, wedge: bool = True) -> None:
        """Never answered (until the client goes away); with `wedge` generation as a whole is stuck
        (/health* fails), without it only these requests are (--poison hang: the others, and
        /health*, still answer)."""
        states = self.register(rids, abortable=False)
        self.hung += wedge
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self.hung -= wedge
            self.unregister(states)

    # -- load ------------------------------------------------------------------------------------
    def gen_throughput(self) -> float:
        delay = self.token_delay
        return round(len(self.running) / delay, 1) if delay > 0 else 0.0

    def used_tokens(self) -> int:
        now, delay = asyncio.get_running_loop().time(), self.token_delay
        used = sum(s.prompt_len for s, _ in self.waiting)
        for s in self.running.values():
            used += s.prompt_len + (
                min(s.planned, int((now - s.begin) / delay)) if s.begin is not None else 0
            )
        return used

    # -- running limit and queue -----------------------------------------------------------------
    async def admit(self, state: InFlight) -> bool:
        """Wait for a running slot (FIFO); False when aborted while waiting."""
        if len(self.running) < self.max_running and not self.waiting:
            self.running[id(state)] = state
            self.occupancy.change(len(self.running))
            return True
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        entry = (state, granted)
        self.waiting.append(entry)
        aborted = loop.create_task(state.aborted.wait())
        try:
            await asyncio.wait([granted, aborted], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release(state)
            raise
        finally:
            aborted.cancel()
            for i, e in enumerate(self.waiting):
                if e is entry:
                    del self.waiting[i]
                    break
        # aborted while queued (a slot freed by the same abort_all does not count)
        if state.aborted.is_set():
            if granted.done() and not granted.cancelled():
                self.release(state)
            granted.cancel()
            return False
        return True

    def release(self, state: InFlight) -> None:
        self.running.pop(id(state), None)
        while self.waiting and len(self.running) < self.max_running:
            nxt, fut = self.waiting.pop(0)
            if not fut.done() and not nxt.aborted.is_set():
                self.running[id(nxt)] = nxt
                fut.set_result(None)
        self.occupancy.change(len(self.running))

    async def decode(self, state: InFlight, prompt_len: int, planned: int) -> int | None:
        """Queue, then decode `planned` tokens at token_delay each. None: aborted in the queue;
        otherwise the tokens decoded (fewer than planned when aborted while running)."""
        loop = asyncio.get_running_loop()
        delay = self.token_delay
        state.prompt_len, state.planned = prompt_len, planned
        if not await self.admit(state):
            self.counters["aborted_waiting"] += 1
            return None
        begin = state.begin = loop.time()
        end = begin + delay * planned
        made = 0
        try:
            while not state.aborted.is_set() and loop.time() < end:
                waiter = loop.create_task(state.aborted.wait())
                try:
                    await asyncio.wait([waiter], timeout=end - loop.time())
                finally:
                    waiter.cancel()
            if state.aborted.is_set() and state.aborted_at < end:
                made = min(planned, max(0, int((state.aborted_at - begin) / delay)))
                self.counters["aborted_running"] += 1
            else:
                made = planned
            self.counters["returned_tokens"] += made
            return made
        # the client went away: what was decoded so far is spent all the same
        except asyncio.CancelledError:
            made = min(planned, max(0, int((loop.time() - begin) / delay)))
            self.counters["cancelled"] += 1
            raise
        finally:
            self.counters["generated_tokens"] += made
            self.release(state)
