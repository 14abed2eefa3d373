"""Small file-system primitives every writer shares: atomic replace and durable appends, and a log
file that a full disk does not turn into a traceback per line."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
from pathlib import Path

__all__ = ["FULL", "LogFile", "READ_ONLY", "atomic_write", "fsync_dir", "io_problem", "shown_path"]

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # a full file system, or a quota
# a read-only mount, or another user's folder
READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so readers see the old or the new content, never a mix.

    `durable=False` skips the fsyncs: for files that are rewritten every few seconds and only
    advisory (progress), where a lost update is harmless.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, say: nothing is left behind
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)  # (a failed write names no file)
        raise
    if durable:
        fsync_dir(path.parent)


def io_problem(e: OSError, where: str | Path, then: str) -> str:
    """One line for an OSError met reading or writing `where` (or the file the error names): what
    happened and what to do — free space, make it writable, check the file system — then `then`
    (e.g. "merge again")."""
    path = shown_path(e.filename if e.filename else where)
    what = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    if e.errno in FULL:
        return (
            f"cannot write {path}: {what}; free space (or quota) on that file system, then {then}"
        )
    if e.errno in READ_ONLY:
        return f"cannot write {path}: {what}; make it writable by this user, then {then}"
    return f"{path}: {what}; check the file system, then {then}"


def shown_path(path: str | Path) -> str:
    """A path as a user would type it: relative to the current directory when inside it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(p)


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class LogFile(logging.FileHandler):
    """A log file whose writes may fail (a full disk, a quota): the first failure is said in one
    line on stderr (`toolkit: warning: cannot write the log file ...`), not as logging's `---
    Logging error ---` traceback for every line; the lines still reach the other handlers
    (stderr)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            e = sys.exc_info()[1]
            sys.stderr.write(
                f"toolkit: warning: cannot write the log file {shown_path(self.baseFilename)} "
                f"({e}); its lines are not kept there\n"
            )

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)  # type: ignore[arg-type]

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            self.handleError(None)  # type: ignore[arg-type]
