"""The bound on a worker's end: once its work is over, the process ends within a bounded time,
whatever its event loop and tasks do.

The work of an engine session (worker.session) is over when every prompt of the shards it served has
been answered, or when a stop signal came. From then on the worker only has to stop its tasks, flush
its files and stop the engine; a task that does not end (a cancel swallowed, a call that never
returns) would otherwise hold the node, and its GPUs, until the job's time limit, deaf to SIGTERM
and SIGINT. `ExitGuard` is a thread of its own, outside the event loop: armed (by the session, in
one place) with a bound when the work is over and disarmed when the session has ended, it ends the
process if the bound passes first — after logging which tasks did not finish and where they wait,
flushing the records not yet written and killing the engine — with exit code EXIT_STUCK."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from toolkit.errors import EXIT_STUCK

__all__ = ["ExitGuard", "cancel_and_wait", "cancel_left", "describe_tasks"]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger


def describe_tasks(tasks) -> str:
    """`coroutine (waiting at file:line in function)` for each task: what a task that did not end is
    doing."""
    out = []
    for t in tasks:
        coro = t.get_coro()
        name = getattr(coro, "__qualname__", None) or repr(coro)
        try:
            frames = t.get_stack()
        except RuntimeError:
            frames = []
        where = (
            (
                " waiting at "
                f"{os.path.basename(frames[-1].f_code.co_filename)}:{frames[-1].f_lineno} in "
                f"{frames[-1].f_code.co_name}"
            )
            if frames
            else ""
        )
        out.append(f"{name}{where}" + (" (cancel requested)" if _cancelling(t) else ""))
    return "; ".join(out) or "none"


def _cancelling(t: asyncio.Task) -> bool:
    cancelling = getattr(t, "cancelling", None)  # Python >= 3.11
    return bool(cancelling()) if cancelling is not None else False


class ExitGuard:
    """Ends the process when the work of a shard is over and its event loop has not returned within
    a bound.

    `arm(seconds, why)` starts the clock (a later arm with an earlier deadline brings it forward;
    never later); `disarm()` stops it. `before_exit` callbacks (flush what is buffered, kill the
    engine) run in the guard's thread, each bounded by what it does itself, before
    `os._exit(EXIT_STUCK)`."""

    def __init__(
        self,
        name: int | str,
        loop: asyncio.AbstractEventLoop,
        *,
        exit: Callable[[int], None] = os._exit,
    ):
        # whose end it bounds, in its lines
        self.name = f"shard {name}" if isinstance(name, int) else name
        self.loop = loop
        self.before_exit: list[Callable[[], None]] = []
        self._exit = exit
        self._deadline: float | None = None
        self._why = ""
        self._armed_at = 0.0
        self._cond = threading.Condition()
        self._disarmed = False
        self._thread: threading.Thread | None = None
        self.fired = False

    def arm(self, seconds: float, why: str) -> None:
        with self._cond:
            if self._disarmed:
                return
            deadline = time.monotonic() + seconds
            if self._deadline is not None and self._deadline <= deadline:
                return
            self._deadline, self._why, self._armed_at = deadline, why, time.monotonic()
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="exit-guard", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        with self._cond:
            self._disarmed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        with self._cond:
            while not self._disarmed:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._disarmed:
                return
            why, waited = self._why, time.monotonic() - self._armed_at
        self.fired = True
        self._fire(why, waited)

    def _fire(self, why: str, waited: float) -> None:
        try:
            tasks = describe_tasks(asyncio.all_tasks(self.loop))
        except RuntimeError as e:  # the loop's task set changed too often while it was read
            tasks = f"(could not list them: {e})"
        where = _thread_stack(self.loop)
        at = f"; the event loop's thread is at {where}" if where else ""
        log.error(
            "%s: the worker has not ended %.0f s after %s; still running: %s%s. Ending the "
            "process (exit %d): the engine is killed; what was written is kept, and the "
            "shard resumes from it when run again",
            self.name,
            waited,
            why,
            tasks,
            at,
            EXIT_STUCK,
        )
        for step in self.before_exit:
            try:
                step()
            except Exception as e:  # each step is best effort: the process ends whatever happens
                log.error(
                    "%s: before ending the process, %s failed: %s",
                    self.name,
                    getattr(step, "__name__", step),
                    e,
                )
        for h in logging.getLogger("toolkit").handlers:
            try:
                h.flush()
            except Exception:
                pass
        sys.stderr.flush()
        self._exit(EXIT_STUCK)


def _thread_stack(loop: asyncio.AbstractEventLoop) -> str:
    """file:line (function) where the thread running `loop` is now, when it can be told."""
    ident = getattr(loop, "_thread_id", None)  # set by asyncio while the loop runs
    frame = sys._current_frames().get(ident) if ident else None
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


# how long cancelled tasks may take to end before they are reported and left behind
CANCEL_WAIT_S = 10.0


async def cancel_and_wait(tasks, *, timeout_s: float = CANCEL_WAIT_S) -> None:
    """Cancel `tasks` and wait until they end, at most `timeout_s`: a task that does not end when
    cancelled (a swallowed cancel) is logged, with where it waits, and left behind instead of
    blocking its caller forever."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in done:
        if not t.cancelled():
            t.exception()  # retrieved: its caller has already seen the error that matters
    if pending:
        log.error(
            "%d task(s) did not end %g s after they were cancelled: %s",
            len(pending),
            timeout_s,
            describe_tasks(pending),
        )


def cancel_left() -> None:
    """Cancel every task of the event loop but the current one, saying which: at the end of the
    shards a session served, nothing they started may still run."""
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if left:
        log.error(
            "%d task(s) still running at the end of the shard: %s; cancelling them",
            len(left),
            describe_tasks(left),
        )
        for t in left:
            t.cancel()
