"""A live progress bar for a local `toolkit run`: prompts done / total, tok/s, ETA, drawn with tqdm.

It reads what the workers already write for `status` (done manifests, `RUN/progress/NNNNN.json`,
rewritten every few seconds), so it needs nothing from the worker. It is drawn only when its stream
is a terminal; elsewhere (a pipe, a file, a Slurm log) it does nothing at all. While it is shown,
console log lines go through `tqdm.write`, which clears the bar, prints the line and draws the bar
again below it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TextIO

import msgspec

from toolkit.formats.progress import read_progress
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan

__all__ = ["LiveBar", "Snapshot", "snapshot"]

POLL_S = 0.5


class Snapshot(msgspec.Struct):
    done: int  # records written (ok + failed), all shards
    total: int
    failed: int
    tok_per_s: float  # of the shards generating now
    shards_done: int
    shards: int


def snapshot(
    rd: RunDir, plan: RunPlan, finished: dict[int, tuple[int, int]] | None = None
) -> Snapshot:
    """The run's progress from its files; `finished` caches {shard: (records, failed)} of completed
    shards."""
    finished = {} if finished is None else finished
    done = failed = 0
    rate = 0.0
    run = Run(rd, plan)
    for sp in plan.shards:
        k = sp.index
        if k not in finished:
            m = run.shard_state(k).done
            if m is not None:
                finished[k] = (m.records, m.failed)
        if k in finished:
            done += finished[k][0]
            failed += finished[k][1]
            continue
        p = read_progress(rd, k)
        if p is not None:
            done += p.done
            failed += p.failed
            rate += p.tok_per_s if p.state == "generating" else 0.0
    return Snapshot(
        done=done,
        total=plan.total,
        failed=failed,
        tok_per_s=rate,
        shards_done=len(finished),
        shards=len(plan.shards),
    )


def _fixed_size(stream: TextIO) -> tuple[int, int] | None:
    """None when the terminal tells its size (the bar follows it); a fixed size when it says 0x0
    (some ptys, where tqdm would hide the bar)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return 100, 20
    return None if size.columns > 0 and size.lines > 0 else (100, 20)


def _postfix(s: Snapshot) -> str:
    return f"{s.tok_per_s:,.0f} tok/s, {s.failed} failed, shards {s.shards_done}/{s.shards}"


class _BarLogHandler(logging.Handler):
    """Writes a console handler's lines above the bar (tqdm.write clears and redraws it)."""

    def __init__(self, original: logging.Handler, stream: TextIO):
        super().__init__(original.level)
        self.setFormatter(original.formatter)
        for f in original.filters:
            self.addFilter(f)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - as logging.StreamHandler does
            self.handleError(record)


class LiveBar:
    """`with LiveBar(rd, plan): ...` draws the run's bar on `stream` (stderr) while the block runs,
    if a terminal."""

    def __init__(
        self, rd: RunDir, plan: RunPlan, stream: TextIO | None = None, *, poll_s: float = POLL_S
    ):
        self.rd, self.plan, self.poll_s = rd, plan, poll_s
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        self._finished: dict[int, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []

    def __enter__(self) -> LiveBar:
        if not self.enabled:
            return self
        from tqdm import tqdm

        first = snapshot(self.rd, self.plan, self._finished)
        fixed = _fixed_size(self.stream)
        self.bar = tqdm(
            total=first.total,
            initial=first.done,
            file=self.stream,
            unit=self.plan.noun,
            dynamic_ncols=fixed is None,
            ncols=fixed and fixed[0],
            nrows=fixed and fixed[1],
            desc=self.plan.name,
            smoothing=0.1,
            mininterval=self.poll_s,
            postfix=_postfix(first),
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
            + self.plan.noun
            + "s "
            "[{elapsed}<{remaining}]{postfix}",
        )
        self._redirect_logging()
        self._thread = threading.Thread(target=self._poll, name="toolkit-livebar", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.update()
        self._restore_logging()
        self.bar.close()

    def update(self) -> None:
        """Read the run's files and redraw (the poll thread calls it every `poll_s`)."""
        if self.bar is None:
            return
        s = snapshot(self.rd, self.plan, self._finished)
        if s.done > self.bar.n:
            self.bar.update(s.done - self.bar.n)
        self.bar.set_postfix_str(_postfix(s), refresh=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.update()
            except Exception as e:  # noqa: BLE001 - a bar must never break the run
                logging.getLogger(__name__).debug("progress bar: %s", e)

    def _redirect_logging(self) -> None:
        root = logging.getLogger()
        for h in list(root.handlers):
            if type(h) is logging.StreamHandler and h.stream is self.stream:
                new = _BarLogHandler(h, self.stream)
                root.removeHandler(h)
                root.addHandler(new)
                self._swapped.append((h, new))

    def _restore_logging(self) -> None:
        root = logging.getLogger()
        for old, new in self._swapped:
            root.removeHandler(new)
            root.addHandler(old)
        self._swapped.clear()
