"""A change to a run's pinned files that spans several of them (a run that grows: its prompt index,
its plan, the retry requests of prompts to generate again and their shards' done manifests), made
crash-safe by writing it whole first (`RunDir.pending_file`) and applying it after.

A crash before the pending file is complete leaves the run as it was; one after it leaves the change
to finish, which the next command that loads the run does (`finish`) before it reads anything.
Applying is idempotent: every file is written whole (atomically) with the content the pending file
holds.
"""

from __future__ import annotations

import logging

import msgspec

from toolkit.formats.files import atomic_write, fsync_dir
from toolkit.formats.manifests import RetryRequest, write_retry
from toolkit.formats.rundir import RunDir

__all__ = ["PendingChange", "apply", "finish", "read"]

log = logging.getLogger(__name__)


class PendingChange(msgspec.Struct):
    what: str  # the change in words, for the log of a command that finishes it
    plan: bytes  # run.json as it becomes
    prompts: bytes | None = None  # prompts.msgpack as it becomes (None: unchanged)
    # shard -> its retry request; the shard's done manifest is removed
    retries: dict[int, RetryRequest] = {}


def apply(rd: RunDir, change: PendingChange) -> None:
    """Make `change`: pinned whole in the pending file first, then applied, then the pending file
    removed."""
    atomic_write(rd.pending_file, msgspec.msgpack.encode(change))
    _apply(rd, change)


def read(rd: RunDir) -> PendingChange | None:
    """The change a crash interrupted after it was pinned, None when there is none. The pending file
    is written atomically, so one that cannot be decoded was damaged afterwards (the disk):
    msgspec's DecodeError, which `formats.run.Run.open` turns into a refusal, rather than a guess at
    what the change was."""
    try:
        data = rd.pending_file.read_bytes()
    except FileNotFoundError:
        return None
    return msgspec.msgpack.decode(data, type=PendingChange)


def finish(rd: RunDir) -> None:
    """Finish a change that a crash interrupted after it was pinned (nothing to do when there is
    none)."""
    change = read(rd)
    if change is None:
        return
    log.warning("run %s: finishing a change that was interrupted (%s)", rd.shown, change.what)
    _apply(rd, change)


def _apply(rd: RunDir, change: PendingChange) -> None:
    if change.prompts is not None:
        atomic_write(rd.prompts_file, change.prompts)
    atomic_write(rd.plan_file, change.plan)
    for k, request in change.retries.items():
        write_retry(rd.retry_file(k), request)
        rd.done_file(k).unlink(missing_ok=True)
    rd.pending_file.unlink(missing_ok=True)
    fsync_dir(rd.root)
