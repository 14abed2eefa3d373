"""What lies beside a shard file: its `done` manifest (written when the shard is complete, trusted
only while the file keeps its size and sha256) and the retry requests `toolkit retry --ids` leaves
for the next run."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import msgspec

from toolkit.formats.files import atomic_write, sha256_file
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.records import LOOP, OK, Record, is_given_up, is_transient
from toolkit.formats.text import utc_now

log = logging.getLogger(__name__)


class DoneManifest(msgspec.Struct):
    shard: int
    fingerprint: str
    records: int  # distinct ids (the newest record of each)
    ok: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    bytes: int
    sha256: str
    host: str
    finished: str
    # failed records worth generating again: while > 0 the shard is not complete
    transient: int = 0
    # older records of ids written again (kept in the file, not counted above)
    superseded: int = 0
    # failures that may pass, final for this run after client.max_tries tries (counted in
    # `failed`, not in `transient`): `toolkit retry` generates them again
    given_up: int = 0
    # records stopped in a repetition loop ([client] loop_stop; finish "loop")
    loops: int = 0


def write_done(
    path: Path, shard_path: Path, shard: int, fingerprint: str, *, positions: range
) -> DoneManifest:
    """Count the newest record of each of the shard's planned `positions` (formats.newest; records
    outside them are ignored), checksum the complete shard file and atomically write its `done`
    manifest."""
    totals, total = _count_newest(shard_path, positions)
    ok, failed, transient, ptok, otok = (
        totals.ok,
        totals.failed,
        totals.transient,
        totals.ptok,
        totals.otok,
    )
    given_up, loops = totals.given_up, totals.loops
    m = DoneManifest(
        shard=shard,
        fingerprint=fingerprint,
        records=ok + failed,
        ok=ok,
        failed=failed,
        prompt_tokens=ptok,
        output_tokens=otok,
        bytes=shard_path.stat().st_size,
        sha256=sha256_file(shard_path),
        host=socket.gethostname(),
        finished=utc_now(),
        transient=transient,
        superseded=total - ok - failed,
        given_up=given_up,
        loops=loops,
    )
    atomic_write(path, msgspec.json.encode(m))
    return m


class _DoneCounts:
    """What a done manifest counts of the records that count (the newest of each id)."""

    def __init__(self) -> None:
        self.ok = self.failed = self.transient = self.given_up = self.loops = self.ptok = (
            self.otok
        ) = 0

    def add(self, r: Record) -> None:
        if r.status == OK:
            self.ok += 1
        else:
            self.failed += 1
            self.transient += is_transient(r)
            self.given_up += is_given_up(r)
        self.loops += r.finish == LOOP
        self.ptok += r.n_prompt
        self.otok += r.n_output


def _count_newest(shard_path: Path, positions: range) -> tuple[_DoneCounts, int]:
    """(totals of the newest record of each planned position, records in the file). While no
    position has two records, the scan's one pass counts; else the newest are read again
    (formats.newest)."""
    once = _DoneCounts()
    sc = scan_shard(shard_path, positions.start, len(positions), each=once.add)
    if not sc.duplicates and not sc.continued:
        return once, sc.records
    newest = _DoneCounts()
    for r in newest_records(shard_path, sc):
        if r is not None:
            newest.add(r)
    return newest, sc.records


def verify_done(m: DoneManifest, shard_path: Path, *, since: float | None = None) -> str | None:
    """None when the shard file is exactly what its done manifest describes, else what differs.
    With `since` (the manifest's mtime), the sha256 is read only when the file was written after
    it: its size is what a cut or an append changes, its mtime what a change in place does."""
    try:
        st = shard_path.stat()
    except FileNotFoundError:
        return f"{shard_path} is gone"
    size = st.st_size
    if size != m.bytes:
        return f"{shard_path} has {size} bytes, its done manifest says {m.bytes}"
    if since is not None and st.st_mtime <= since:
        return None
    sha = sha256_file(shard_path)
    if sha != m.sha256:
        return f"{shard_path}'s sha256 is {sha[:12]}, its done manifest says {m.sha256[:12]}"
    return None


class RetryRequest(msgspec.Struct):
    """Ids to generate again although they are recorded (`toolkit retry`): those whose newest record
    lies before byte `before` of the shard file (records written since are the retry's own)."""

    before: int
    ids: list[str]


def write_retry(path: Path, request: RetryRequest) -> None:
    atomic_write(path, msgspec.json.encode(request))


def read_retry(path: Path) -> RetryRequest | None:
    """The retry request of a shard; None when there is none, or when it is damaged (said once, in
    one line)."""
    return _read_or_none(
        path,
        RetryRequest,
        "damaged retry request ({why}): ignored, so the ids it named are not "
        "generated again; ask again with `toolkit retry RUN --ids FILE`",
    )


def read_done(path: Path) -> DoneManifest | None:
    """The done manifest of a shard; None when there is none, or when it is damaged (said once, in
    one line): the shard is then not taken as finished, and its next run checks its file and writes
    the manifest again."""
    return _read_or_none(
        path,
        DoneManifest,
        "damaged done manifest ({why}): the shard is taken as not done; its "
        "next run checks its file and writes the manifest again",
    )


def _read_or_none(path: Path, schema: type, damaged: str):
    """`path` decoded as `schema`; None when it does not exist, or when it is damaged: then
    `damaged` (with {why}) is said once, in one line."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=schema)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as e:  # (ValidationError included)
        _damaged_once(path, damaged.format(why=_why(e)))
        return None


_said_damaged: set[str] = set()


def _damaged_once(path: Path, message: str) -> None:
    """A damaged small file, said once per process (status --watch reads it every refresh)."""
    key = f"{path}:{message}"
    if key not in _said_damaged:
        _said_damaged.add(key)
        log.warning("%s: %s", path, message)


def _why(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
