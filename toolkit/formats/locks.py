"""The lock a shard file's writer holds: two tasks never interleave frames.

flock on the shard file where the file system has it. Where it does not (older NFS, Lustre mounted
without flock: ENOLCK, EOPNOTSUPP, ENOSYS), an exclusive lock file `NNNNN.zst.lock` created with
O_CREAT|O_EXCL stands in (`LockFile`): it names host, pid and start time (a `LockHolder`), a stale
one is taken over (same host and pid gone, or another host's untouched for STALE_LOCK_S), any other
is refused with how to remove it. Where flock works but is node-local, two tasks on two nodes could
take the same shard (worker.claims: the lock is the claim); the merge keeps each id once, but the
work is done twice.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

import msgspec

from toolkit.errors import FailedError
from toolkit.formats.text import local_time

log = logging.getLogger(__name__)


class ShardLocked(FailedError):
    """Another writer holds this shard file (or may): the message says who and what to do."""


# file systems without flock
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
# another host's lock file untouched this long is stale (its writer touches it per batch)
STALE_LOCK_S = 2 * 3600


def pid_alive(pid: int) -> bool:
    """Whether process `pid` lives on this host (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockHolder(msgspec.Struct):
    """What a shard's lock file holds: who took it and when (`started` in epoch seconds, `since` for
    people)."""

    host: str
    pid: int
    started: float
    since: str = "?"


def judge_lock_file(seen: bytes, age: float) -> tuple[str | None, str]:
    """Whether the writer that wrote lock file content `seen` (untouched for `age` s) holds it
    still: (why it does, or None when it is gone or stale; what a stale one is, to take it over).
    Alive: a pid running on this host, or another host's lock touched within STALE_LOCK_S."""
    try:
        holder = msgspec.json.decode(seen, type=LockHolder)
    except msgspec.DecodeError:  # msgspec.ValidationError included
        if age < 60:  # being written right now
            return "its lock file is being written", ""
        holder = LockHolder("", 0, 0.0)
    host, pid, since = holder.host, holder.pid, holder.since
    if host == socket.gethostname():
        if pid_alive(pid):
            return f"pid {pid} on this host holds it since {since}", ""
        return None, f"the lock of pid {pid} on this host, which is gone"
    if host:
        if age < STALE_LOCK_S:
            return (
                f"pid {pid} on host {host} holds it since {since}, last written {age:.0f} s ago",
                "",
            )
        return None, (
            f"the lock of pid {pid} on host {host}, untouched for {age:.0f} s (over {STALE_LOCK_S} "
            "s)"
        )
    return None, f"an unreadable lock file untouched for {age:.0f} s"


def read_lock_file(path: Path) -> tuple[bytes, float] | None:
    """A lock file's content and the seconds since it was last touched (None: there is none)."""
    try:
        return path.read_bytes(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def lock_file_held(path: Path) -> bool:
    """Whether the lock file `path` exists and its writer holds it still (judge_lock_file)."""
    found = read_lock_file(path)
    return found is not None and judge_lock_file(*found)[0] is not None


class LockFile:
    """The writer's lock where flock is not available: `NNNNN.zst.lock`, created with
    O_CREAT|O_EXCL, holding a `LockHolder`; touched at every batch written, removed when the writer
    closes."""

    def __init__(self, path: Path):
        self.path = path
        self.held = False
        self.mine = b""

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._judge()  # raises ShardLocked, or has moved a stale lock aside
                continue
            now = time.time()
            self.mine = msgspec.json.encode(
                LockHolder(socket.gethostname(), os.getpid(), now, local_time(now))
            )
            try:
                os.write(fd, self.mine)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.held = True
            return
        raise ShardLocked(
            f"{self.path}: other writers keep taking this shard's lock file; is the shard "
            "submitted twice?"
        )

    def _refuse(self, why: str) -> ShardLocked:
        return ShardLocked(
            f"{self.path.parent / self.path.name[:-5]} is locked by another worker of this shard: "
            f"{why} (this file system has no flock, so the lock file {self.path.name} stands in). "
            f"If no task of this shard runs any more (squeue, ps), remove it: rm {self.path}"
        )

    def _judge(self) -> None:
        found = read_lock_file(self.path)
        if found is None:
            return  # released meanwhile: try again
        seen, age = found
        live, stale = judge_lock_file(seen, age)
        if live is not None:
            raise self._refuse(live)
        log.warning("%s: taking over %s", self.path, stale)
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)  # atomic: of two takers, one moves the stale lock
        except FileNotFoundError:
            return
        # moved the fresh lock of a faster taker: put it back, and refuse
        if aside.read_bytes() != seen:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            raise self._refuse("another worker took it over at the same moment")
        aside.unlink()

    def touch(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if self.path.read_bytes() == self.mine:
                    self.path.unlink()
            except FileNotFoundError:
                pass


def try_flock(fd: int, *, shared: bool = False) -> bool | None:
    """Take the flock of `fd` without waiting: True when taken, False when another process holds
    it, None when the file system has no flock (NO_FLOCK); any other error is raised. Every lock of
    the toolkit is taken through here (each caller says what "held" and "no flock" mean to it)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in NO_FLOCK:
            return None
        raise


def flock_or_lockfile(fd: int, path: Path) -> LockFile | None:
    """Lock `fd` (the shard file) for this writer: flock, or where the file system has none, a lock
    file."""
    try:
        taken = try_flock(fd)
    except OSError as e:
        raise ShardLocked(
            f"{path}: cannot lock it ({e.strerror}); check the file system it is on"
        ) from None
    if taken:
        return None
    if taken is False:
        raise ShardLocked(
            f"{path} is locked by another worker of this shard (a task still running, or a requeue "
            "racing the old one); wait for it to end or cancel it"
        )
    log.warning("%s: this file system has no flock: an exclusive lock file stands in", path)
    lock = LockFile(path.with_name(path.name + ".lock"))
    lock.acquire()
    return lock


def flock_held(path: Path) -> bool | None:
    """Whether another process holds the flock of `path` at this moment (False when the file is
    absent; None when its file system has no flock to tell). Only looked at: the probe's own shared
    lock is released at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        taken = try_flock(fd, shared=True)
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases the probe's lock)
    return None if taken is None else not taken


def held_elsewhere(path: Path) -> bool:
    """Whether another writer holds the lock of shard file `path` at this moment (its flock; where
    the file system has none, its lock file, unless stale: judge_lock_file). Only looked at: a
    writer may take the lock the next moment (ShardLocked says so)."""
    held = flock_held(path)
    return lock_file_held(path.with_name(path.name + ".lock")) if held is None else held
