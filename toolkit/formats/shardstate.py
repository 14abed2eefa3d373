"""Whether shard k is finished, in one place: the state of a shard derived once from what lies
beside its file (its done manifest, a retry request, the lock of a writer, its progress file). Every
command asks this module rather than reading those files itself.

    DONE        a done manifest, no failure that may pass, no retry asked: nothing to do
    MAY_PASS    a done manifest counting failures that may pass (records.is_transient): generated
                again
    RETRY       `toolkit retry` (or a grown job) asked for ids to be generated again
                (RUN/shards/NNNNN.retry)
    UNTRUSTED   a done manifest of another run, or (when asked to check) its file changed since
    HELD        unfinished, its file locked by a writer elsewhere right now (only when asked)
    FAILED      unfinished, failed in this group of workers, which do not claim it again (only when
                asked)
    MISSING     unfinished: not started, or stopped part way

A run asks through `Run.shard_state(k, checks)`, which passes the run's fingerprint: a done
manifest of another run is never taken for this run's. The other checks differ in cost, so a caller
names the set it needs (`Checks`, one of the sets below): `verify` reads the whole file (sha256;
"cheap": its size, and its sha256 only when the file was written after its manifest or the manifest
later than the time it records, what `status` affords on every refresh), `held` tries the lock,
`group` reads the progress file (of a shard not DONE).
"""

from __future__ import annotations

import enum
import logging
from datetime import datetime
from pathlib import Path
from typing import Literal

import msgspec

from toolkit.formats.locks import held_elsewhere
from toolkit.formats.manifests import DoneManifest, RetryRequest, read_done, read_retry, verify_done
from toolkit.formats.progress import Progress, read_progress
from toolkit.formats.rundir import RunDir

log = logging.getLogger(__name__)


class ShardState(enum.Enum):
    DONE = "done"
    MAY_PASS = "done with failures that may pass"
    RETRY = "retry asked"
    UNTRUSTED = "untrusted"
    HELD = "held elsewhere"
    FAILED = "failed in this group"
    MISSING = "missing"


class ShardStatus(msgspec.Struct):
    shard: int
    state: ShardState
    # its done manifest, when there is one and it passed the checks asked for
    done: DoneManifest | None = None
    progress: Progress | None = None  # its progress file, when asked for (`group`, `Checks`)
    why: str | None = None  # UNTRUSTED: why its done manifest cannot be trusted
    foreign: bool = False  # UNTRUSTED: the manifest is another run's (not a changed file)

    @property
    def finished(self) -> bool:
        """Nothing left to generate."""
        return self.state is ShardState.DONE

    @property
    def busy(self) -> bool:
        """Being generated elsewhere: HELD, and no worker ended it yet (no done manifest)."""
        return self.state is ShardState.HELD and self.done is None

    @property
    def ended(self) -> bool:
        """A worker ended it: its done manifest is there (failures that may pass or not)."""
        return self.done is not None


class Checks(msgspec.Struct, frozen=True):
    """What `shard_state` checks besides the done manifest's fingerprint (always checked).

    `verify`: a done manifest whose file changed since (size, sha256; "cheap": the sha256 only of
    a file written after it) is UNTRUSTED; `remove`: an untrusted manifest is removed, said in one
    line (the shard's next run checks its file, salvages the intact frames and generates the rest);
    `held`: an unfinished shard whose file another writer holds is HELD; `progress`: its progress
    file is read ("unfinished": only when the shard is not DONE, all a claiming task needs: a done
    shard costs it one file)."""

    verify: bool | Literal["cheap"] = False
    remove: bool = False
    held: bool = False
    progress: bool | Literal["unfinished"] = False


# The sets callers ask for.
MANIFEST = Checks()  # its done manifest and retry request: what most callers need
BUSY = Checks(held=True)  # and whether a writer elsewhere holds an unfinished shard's file
VERIFIED = Checks(verify=True)  # and whether its file is still what the manifest says
REPAIRED = Checks(verify=True, remove=True)  # VERIFIED, an untrusted manifest removed
CHEAP = Checks(verify="cheap")  # VERIFIED as far as a refresh of `status` affords
STATUS = Checks(verify="cheap", progress=True)  # CHEAP, with its progress (`status`)
WATCHED = Checks(progress=True)  # with its progress (`logs`)
CLAIM = Checks(held=True, progress="unfinished")  # what a claiming task looks at


def shard_state(
    rd: RunDir,
    k: int,
    fingerprint: str,
    checks: Checks = MANIFEST,
    *,
    group: str | None = None,
    recheck: bool = False,
) -> ShardStatus:
    """The state of shard `k` of the run in `rd` whose fingerprint is `fingerprint`, with `checks`
    (`Run.shard_state` passes the run's). `group`: an unfinished shard whose progress says it failed
    in this group of workers is FAILED (reads the progress of a shard not DONE); `recheck`: the
    caller already found its manifest untrusted.
    """
    m = read_done(rd.done_file(k))
    why, foreign = None, False
    if m is not None:
        if m.fingerprint != fingerprint:
            why, foreign = f"of run {m.fingerprint}, not of this run {fingerprint}", True
        elif checks.verify:
            since = _unedited_since(rd, k, m) if checks.verify == "cheap" else None
            why = verify_done(m, rd.shard_file(k), since=since)
        if why is None and recheck:
            why = "its file changed since it was written"
        if why is not None:
            if checks.remove:
                log.warning(
                    "%s: %s: the done manifest is removed; the shard's next run checks its file, "
                    "keeps what is intact and generates the rest",
                    rd.done_file(k),
                    why,
                )
                rd.done_file(k).unlink(missing_ok=True)
            m = None
    retry = rd.retry_file(k).exists()
    done = m is not None and not m.transient and not retry
    progress = checks.progress
    wanted = progress is True or (not done and (progress == "unfinished" or group is not None))
    p = read_progress(rd, k) if wanted else None
    if done:
        state = ShardState.DONE
    elif checks.held and held_elsewhere(rd.shard_file(k)):
        state = ShardState.HELD
    elif group is not None and p is not None and p.state == "failed" and p.group == group:
        state = ShardState.FAILED
    elif why is not None:
        state = ShardState.UNTRUSTED
    elif retry:
        state = ShardState.RETRY
    elif m is not None:
        state = ShardState.MAY_PASS
    else:
        state = ShardState.MISSING
    return ShardStatus(shard=k, state=state, done=m, progress=p, why=why, foreign=foreign)


# a done manifest whose mtime is later than the time it records by more was edited (the margin
# allows for a slow write and for clocks of a node and a file server a little apart)
EDITED_S = 60.0


def _unedited_since(rd: RunDir, k: int, m: DoneManifest) -> float | None:
    """When shard `k`'s done manifest was written, for the cheap check (a shard file not written
    since keeps its sha256); None when the manifest itself was written again later than the time
    it records (edited, or copied without its times): then the sha256 is read."""
    at = done_time(rd, k)
    try:
        finished = datetime.fromisoformat(m.finished).timestamp()
    except ValueError:
        return None
    return at if at is not None and at <= finished + EDITED_S else None


def done_time(rd: RunDir, k: int) -> float | None:
    """When shard `k`'s done manifest was written (its mtime); None when it has none."""
    try:
        return rd.done_file(k).stat().st_mtime
    except OSError:
        return None


def retry_request(rd: RunDir, k: int) -> RetryRequest | None:
    """The retry request of shard `k`: the ids to generate again, and from which byte of its file
    records count as the retry's own; None when there is none."""
    return read_retry(rd.retry_file(k))


def asked_again(rd: RunDir, k: int, ids: list[str]) -> RetryRequest:
    """A retry request for shard `k` naming `ids` besides those an earlier request still names,
    counted from the file's size now (records written after it are the retry's own)."""
    old = retry_request(rd, k)
    new = set(ids)
    keep = [i for i in old.ids if i not in new] if old else []
    path: Path = rd.shard_file(k)
    return RetryRequest(before=path.stat().st_size if path.exists() else 0, ids=keep + ids)
