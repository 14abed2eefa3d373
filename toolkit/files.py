"""Small file-system primitives every writer shares: atomic replace and durable appends."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir", "shown_path"]


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so readers see the old or the new content, never a mix.

    `durable=False` skips the fsyncs: for files that are rewritten every few seconds and only advisory
    (progress), where a lost update is harmless.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


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
