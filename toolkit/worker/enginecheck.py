"""Whose failure it is: the engine's or the prompt's.

A request that fails past its own retries with a 5xx, a 429 or a cut connection may fail because of
its prompt, or because the engine fails every request at that moment (overloaded, restarting its
scheduler, a router with no worker). `EngineCheck.unwell` tells them apart before any prompt is
charged a try: it sends the engine a 1-token /generate of its probe conversation (none of the job's
prompts). When that is answered, the engine takes requests and the failure is the prompt's (a try
of it). When it is not, the engine is unwell: every request that fails meanwhile waits on the same
check, which asks again with a backoff until the engine answers — then the prompts go out again,
uncharged — or until `[engine] ready_timeout_s`, when it raises EngineHung and the session restarts
the engine (bounded by `[engine] max_restarts`). One check per engine start, shared by every shard
it serves; a stop signal ends the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from toolkit.engines.base import EngineDied, EngineHung
from toolkit.engines.client import HttpClient, TimedOut, Unreachable

__all__ = ["EngineCheck"]

log = logging.getLogger("toolkit.worker")

FIRST_WAIT_S = 0.5  # the first wait after a failed probe; doubled after each, up to MAX_WAIT_S
MAX_WAIT_S = 10.0


class EngineCheck:
    """The engine's health as the prompts' failures see it (see the module's docstring)."""

    def __init__(self, engine, stop, http: HttpClient, *, probe_timeout_s: float):
        # stop: the session's (anything with is_set()); http: its probe client
        self.engine, self.stop, self.http = engine, stop, http
        self.ready_timeout_s = engine.engine.ready_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._current: asyncio.Future | None = None  # the check every failure joins meanwhile
        self.probes = self.waits = 0  # probes sent, waits for an unwell engine (said at the end)

    async def unwell(self, why: str) -> bool:
        """Whether the engine was unwell when a request failed (`why`): False when it answers its
        probe at once (the failure is the prompt's); True once it answers again after a wait (the
        prompt goes out again, not charged), or a stop came meanwhile. Raises EngineDied when its
        process ended, EngineHung when it did not answer within [engine] ready_timeout_s. Requests
        that fail while a check runs join it: one probe, one wait, for all of them."""
        if self._current is None:
            self._current = asyncio.ensure_future(self._check(why))
            self._current.add_done_callback(self._checked)
        return await asyncio.shield(self._current)

    def _checked(self, fut: asyncio.Future) -> None:
        if self._current is fut:
            self._current = None
        if not fut.cancelled():
            fut.exception()  # said by the requests that wait on it

    async def _check(self, why: str) -> bool:
        failed = await self._probe()
        if failed is None:
            return False
        await self._wait(why, failed)
        return True

    async def _wait(self, why: str, failed: str) -> None:
        """Probe with a backoff until the engine answers, a stop comes, or the bound is past."""
        self.waits += 1
        t0 = time.monotonic()
        log.warning(
            "a request failed (%s) and so did the engine's probe (%s): the engine is unwell; "
            "no prompt is charged a try while it is; waiting up to %g s ([engine] "
            "ready_timeout_s) for it to answer again",
            why,
            failed,
            self.ready_timeout_s,
        )
        delay = FIRST_WAIT_S
        while not self.stop.is_set():
            if not self.engine.alive():
                raise EngineDied(f"engine exited with code {self.engine.exit_code()}")
            waited = time.monotonic() - t0
            if waited > self.ready_timeout_s:
                raise EngineHung(
                    f"engine unwell for {waited:.0f} s: requests failed ({why}) and its probe "
                    f"/generate still fails ({failed}) (limit engine.ready_timeout_s = "
                    f"{self.ready_timeout_s:g})"
                )
            await self._sleep(min(delay, self.ready_timeout_s - waited + 0.1))
            delay = min(MAX_WAIT_S, delay * 2)
            again = await self._probe()
            if again is None:
                log.warning(
                    "the engine answers its probe again after %.1f s: the requests that failed "
                    "meanwhile go out again, not counted as tries",
                    time.monotonic() - t0,
                )
                return
            failed = again

    async def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.1, left))

    async def _probe(self) -> str | None:
        """None when a 1-token /generate of the probe conversation is answered 200 (or refused
        with a 4xx but 429: the engine takes requests), or taken and not answered in time (a busy
        engine, not a failing one: the hang watch judges a wedged one); else what went wrong, in
        words: a 5xx, a 429, a refused or cut connection."""
        self.probes += 1
        body = msgspec.json.encode(
            {
                "input_ids": self.engine.probe_ids or [1],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            }
        )
        try:
            status, _ = await self.http.request(
                "POST", "/generate", body, timeout=self.probe_timeout_s
            )
        except TimedOut:
            return None
        except Unreachable as e:
            return str(e)
        if status >= 500 or status == 429:
            return f"HTTP {status}"
        return None

    def close(self) -> None:
        if self._current is not None:
            self._current.cancel()
