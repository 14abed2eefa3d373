"""Every prompt of a job rendered through the chat template and measured, on all the cores of the
machine: the render stage of the pre-flight (`toolkit check`, and `run` and `submit`, which share
it).

A prompt file is cut into slices of whole lines (about SLICE_BYTES each). A slice is read, parsed,
rendered and measured on its own (job/render_slice), and what it teaches (`Outcome`: reasoning
modes, the longest prompt, the places of failures, of refused and of too long prompts) is merged
with the others in file order: the answer is the one a single process gives, whatever the number
of processes. Large jobs go to a pool of processes (`processes()`: the cores this process may run
on, or TOOLKIT_RENDER_PROCESSES), each holding the tokenizer once (inherited where processes fork,
loaded once each elsewhere); small ones are measured here, where a pool would cost more than it
saves.

While it works, a progress line is drawn on stderr when it is a terminal, and a log line is written
every LOG_EVERY_S seconds when it is not.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from toolkit.errors import BadInputError
from toolkit.job import chat, sources
from toolkit.job.render_slice import (
    Failure,
    Memo,
    Outcome,
    Setting,
    Slice,
    measure_slice,
)

__all__ = [
    "ENV_PROCESSES",
    "measure",
    "processes",
    "slices",
]

log = logging.getLogger(__name__)

# prompt lines read and rendered at a time (memory stays flat whatever the dataset size)
SLICE_BYTES = 1 << 19
# Below this many bytes of prompt lines the job is measured in this process: starting a pool, and
# the first slices of each process, cost about what a second core saves. Measured on 2 shared cores
# with short prompts: a pool of 2 saved 0.8 s of 5.2 at 40,000 prompts (7.6 MB), nothing measurable
# at 10,000 (1.9 MB).
POOL_MIN_BYTES = 4 << 20
ENV_PROCESSES = "TOOLKIT_RENDER_PROCESSES"
LOG_EVERY_S = 10.0
DRAW_EVERY_S = 0.2
DRAW_AFTER_S = 0.5  # a job measured faster than this draws no progress line at all


class RenderPoolError(BadInputError):
    """A slice that could not be measured (its prompt file changed since it was planned, say)."""


def processes() -> int:
    """How many processes render: TOOLKIT_RENDER_PROCESSES if set, else the cores this process may
    run on."""
    value = os.environ.get(ENV_PROCESSES, "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise BadInputError(
                f"{ENV_PROCESSES}={value!r}: must be a whole number of processes, at least 1"
            )
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def slices(
    path: str, *, size: int | None = None
) -> Iterator[tuple[int, int, int, bytes | None, bool]]:
    """(offset, size, first line, lines, rows) of consecutive slices of whole lines of a prompt
    source, about `size` bytes each (SLICE_BYTES by default), or of rows of a table (rows True:
    sources.Source.chunks); the lines are None where a slice is read from the file itself (a plain
    JSONL file)."""
    with contextlib.closing(sources.open_source(path)) as source:
        for chunk in source.chunks(size or SLICE_BYTES):
            yield (*chunk, source.rows)


def measure(
    tok: Any, setting: Setting, work: Sequence[Slice], *, total: int, workers: int | None = None
) -> Iterator[Outcome]:
    """The Outcome of every slice of `work`, in order, while a RenderProgress line counts `total`
    prompts. With more than one worker (default: processes()) and enough bytes to measure, the
    slices go to a process pool."""
    workers = processes() if workers is None else workers
    bar = RenderProgress(total)
    done = 0
    try:
        if workers > 1 and len(work) > 1 and sum(s.bytes for s in work) >= POOL_MIN_BYTES:
            results = _pooled(tok, setting, work, min(workers, len(work)))
        else:
            memo = Memo()
            results = (measure_slice(tok, setting, s, memo) for s in work)
        for r in results:
            if isinstance(r, Failure):
                raise RenderPoolError(r.message)
            done += r.prompts
            bar.update(done)
            yield r
    finally:
        bar.close()


def _pooled(
    tok: Any, setting: Setting, work: Sequence[Slice], n: int
) -> Iterator[Outcome | Failure]:
    methods = multiprocessing.get_all_start_methods()
    fork = "fork" in methods and sys.platform != "darwin"
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    # The processes encode one text at a time on one core each; a tokenizer that used its thread
    # pool here before the fork would warn in every child unless told so. The variable is set only
    # while the processes start.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(n, initializer=_init_worker, initargs=(tok if fork else None, setting))
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        yield from pool.imap(_work, work, chunksize=1)


# The state of a pool process: its tokenizer and setting, set once by _init_worker (each process has
# its own).
_worker: dict[str, Any] = {}


def _init_worker(tok: Any, setting: Setting) -> None:
    # Ctrl-C is the parent's to handle: it ends the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(
        tok=tok if tok is not None else chat.load_tokenizer(setting.model),
        setting=setting,
        memo=Memo(),
    )


def _work(s: Slice) -> Outcome | Failure:
    return measure_slice(_worker["tok"], _worker["setting"], s, _worker["memo"])


class RenderProgress:
    """Prompts measured so far: a line redrawn on stderr when it is a terminal, else a log line now
    and then."""

    def __init__(self, total: int, stream: Any = None):
        self.total, self.stream = total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.last = time.monotonic()
        self.drawn = False

    def text(self, done: int, now: float) -> str:
        elapsed = now - self.start
        share = done / self.total if self.total else 1.0
        left = f", about {_duration(elapsed / share - elapsed)} left" if 0 < share < 1 else ""
        return (
            f"rendering prompts: {done:,} / {self.total:,} ({share:.0%}), "
            f"{_duration(elapsed)}{left}"
        )

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self.start >= DRAW_AFTER_S and (
                now - self.last >= DRAW_EVERY_S or done >= self.total
            ):
                self.stream.write("\r\x1b[K" + self.text(done, now))
                self.stream.flush()
                self.last, self.drawn = now, True
        elif now - self.last >= LOG_EVERY_S:
            log.info("%s", self.text(done, now))
            self.last = now

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
