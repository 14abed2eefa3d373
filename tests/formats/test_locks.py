"""Locks: every lock taken without waiting goes through `locks.try_flock`, which tells taken, held
elsewhere and no flock apart; each caller says what the last two mean to it (tested where they act:
the shard writer, merge, the handover, the live-runs file)."""

from __future__ import annotations

import ast
import errno
import fcntl
import os
from pathlib import Path

import pytest

from toolkit.formats.locks import try_flock


def test_try_flock_tells_taken_held_and_no_flock_apart(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"")
    mine, other = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)  # two open files: two owners
    try:
        assert try_flock(mine) is True
        assert try_flock(other) is False and try_flock(other, shared=True) is False
        fcntl.flock(mine, fcntl.LOCK_UN)
        assert try_flock(mine, shared=True) is True and try_flock(other, shared=True) is True
        assert try_flock(other) is False  # exclusive against a shared one

        def fails(code):
            def flock(fd, op):
                raise OSError(code, os.strerror(code))

            return flock

        for code in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            monkeypatch.setattr(fcntl, "flock", fails(code))
            assert try_flock(mine) is None
        monkeypatch.setattr(fcntl, "flock", fails(errno.EIO))
        with pytest.raises(OSError) as e:
            try_flock(mine)
        assert e.value.errno == errno.EIO
    finally:
        os.close(mine)
        os.close(other)


def test_no_lock_is_tried_without_waiting_outside_formats_locks():
    """One home for "take it if free": LOCK_NB appears in formats/locks.py alone."""
    package = Path(__file__).resolve().parents[2] / "toolkit"
    users = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "LOCK_NB":
                users.add(path.relative_to(package).as_posix())
    assert users == {"formats/locks.py"}


def test_without_flock_a_shard_is_held_while_its_lock_files_writer_lives(tmp_path, no_flock):
    """What a claiming worker and `toolkit run` ask of a shard without flock: its lock file counts only while
    the writer that wrote it can still hold it (the rule by which a writer takes a stale one over)."""
    import socket
    import subprocess
    import time

    import msgspec

    from toolkit.formats.locks import STALE_LOCK_S, held_elsewhere

    shard = tmp_path / "00000.zst"
    shard.write_bytes(b"")
    lock = tmp_path / "00000.zst.lock"
    assert not held_elsewhere(shard)
    gone = subprocess.Popen(["true"])
    gone.wait()

    def holder(host, pid, age=0.0):
        lock.write_bytes(msgspec.json.encode({"host": host, "pid": pid, "started": 1.0}))
        os.utime(lock, (time.time() - age, time.time() - age))

    here = socket.gethostname()
    holder(here, os.getpid())
    assert held_elsewhere(shard)
    holder(here, gone.pid)  # killed: its pid is gone
    assert not held_elsewhere(shard)
    holder("gpu-17", 4242)
    assert held_elsewhere(shard)
    holder("gpu-17", 4242, age=STALE_LOCK_S + 60)  # another host's, untouched past the bound
    assert not held_elsewhere(shard)
    lock.write_bytes(b"{half writ")
    assert held_elsewhere(shard)  # being written
    os.utime(lock, (time.time() - 120, time.time() - 120))
    assert not held_elsewhere(shard)
