"""Where an engine's API key lives: never on a command line, never in the run directory.

A process's command line is readable by every user of its node (`ps`, /proc/PID/cmdline), and a run
directory is often readable by a whole group. So each start of an engine draws a fresh key (it
guards only that server and is worth nothing once the server is gone) and hands it over in a file
only the user can read: a folder of its own, mode 0700, made in the node's temporary directory
($TMPDIR, else /tmp), holding files of mode 0600, removed when the engine stops (the folder of a
process killed before it could is removed by the next start on the node). SGLang and the stub read
it as `--config FILE` (SGLang's YAML server arguments, `api-key:`).

A multi-node engine's ranks run on other nodes, whose temporary directory is not this one: the key
travels to them in the environment of the `srun` step (KEY_ENV; a process's environment is readable
only by its user), and each rank writes its own file on its own node (toolkit.engines.rank), taking
the variable out of the server's environment.

A custom launch `command` may name `{api_key_file}` (the key alone, one line), `{config_file}` (the
YAML file for SGLang's `--config`), or read $TOOLKIT_ENGINE_API_KEY, which its environment then
holds; `{api_key}` puts the key itself on the command line, and is warned about.

The engine's output reaches its log through `LogPump`, which masks the key: SGLang logs its server
arguments, the key among them, when it starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["KEY_ENV", "KeyFiles", "LogPump", "mask", "sweep"]

log = logging.getLogger(__name__)

KEY_ENV = "TOOLKIT_ENGINE_API_KEY"
PREFIX = "toolkit-engine-key-"  # then the pid of the process that made the folder
CONFIG_NAME = "server-args.yaml"
KEY_NAME = "api-key"


def mask(secret: str) -> str:
    """What stands for `secret` in logs: as long as it, so a log's offsets do not move."""
    return "*" * len(secret)


def sglang_config(key: str) -> str:
    """SGLang's YAML server arguments holding the key (a JSON string is a YAML string: quoted, so
    that a key of digits stays text)."""
    return f"api-key: {json.dumps(key)}\n"


class KeyFiles:
    """The private folder of one engine start and the files that hold its key; `remove` when the
    engine stops."""

    def __init__(self, key: str):
        self.key = key
        sweep(Path(tempfile.gettempdir()))
        # mode 0700, this user's only
        self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))

    def _write(self, name: str, text: str) -> Path:
        path = self.folder / name
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        return path

    def config(self) -> Path:
        """The YAML file of SGLang's `--config` (the stub reads it too): `api-key: "KEY"`."""
        return self._write(CONFIG_NAME, sglang_config(self.key))

    def plain(self) -> Path:
        """The key alone, one line."""
        return self._write(KEY_NAME, self.key + "\n")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def sweep(tmp: Path) -> list[Path]:
    """Remove the key folders of this user's processes that are gone: killed (SIGKILL: a worker
    killed -9, a rank of a step Slurm cancelled) before they could remove their own. Their keys
    guarded servers that are gone too. The folders removed."""
    removed = []
    for folder in tmp.glob(PREFIX + "*-*"):
        try:
            pid = int(folder.name[len(PREFIX) :].split("-", 1)[0])
            if folder.stat().st_uid != os.getuid() or pid == os.getpid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        # not ours, or that process lives (or another user's has its pid)
        except (ValueError, OSError):
            continue
    return removed


class LogPump:
    """Copies what an engine writes (a pipe) into its log file, the key masked, until every writer
    has closed the pipe. A thread: it only reads and writes, and the worker's event loop never waits
    for it. A log that cannot be written (disk full) loses that output, not the engine: the pipe is
    still drained, so the engine never blocks. The pump ends when the pipe does (the engine's
    processes gone): `join` bounds the wait."""

    def __init__(self, read_fd: int, log_path: Path, secret: str):
        self.fd = read_fd
        self.log_path = log_path
        self.secret = secret.encode()
        self.mask = mask(secret).encode()
        self.thread = threading.Thread(target=self._run, daemon=True, name="engine-log")
        self.thread.start()

    def _run(self) -> None:
        carry = b""
        warned = False
        try:
            with open(self.log_path, "ab", buffering=0) as out:
                while True:
                    try:
                        chunk = os.read(self.fd, 1 << 16)
                    except InterruptedError:  # pragma: no cover - os.read retries on EINTR itself
                        continue
                    if not chunk:
                        break
                    data, carry = self._masked(carry + chunk)
                    warned = _write(out, data, self.log_path, warned)
                _write(out, carry, self.log_path, warned)
        except OSError as e:
            log.warning(
                "the engine's log %s cannot be opened (%s): its output is lost", self.log_path, e
            )
            while os.read(self.fd, 1 << 16):
                pass
        finally:
            os.close(self.fd)

    def _masked(self, data: bytes) -> tuple[bytes, bytes]:
        """`data` with every whole key masked, and the end held back that could be the start of a
        key cut in two."""
        data = data.replace(self.secret, self.mask)
        for k in range(min(len(self.secret) - 1, len(data)), 0, -1):
            if data.endswith(self.secret[:k]):
                return data[:-k], data[-k:]
        return data, b""

    def join(self, timeout_s: float) -> bool:
        """Wait until the engine's output has all reached the log (every writer gone); False after
        `timeout_s`."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


def _write(out, data: bytes, path: Path, warned: bool) -> bool:
    """Write `data` whole, or drop it when the log cannot be written (said once); whether that was
    said."""
    try:
        view = memoryview(data)
        while view:
            view = view[out.write(view) :]
    except OSError as e:
        if not warned:
            log.warning(
                "the engine's log %s cannot be written (%s): its output is lost until it can",
                path,
                e,
            )
        return True
    return warned
