"""Looking for an engine's key where others could read it: every process's command line, every file of a run.

The tests run as the engine's user, so they can read the key where the toolkit put it for the engine (the file
`--config` names) and then look for it everywhere else, as any user of the node could.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def cmdlines() -> dict[int, list[str]]:
    """Every process's command line, as `ps` shows it to anyone ({pid: argv}; processes that end meanwhile left
    out)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            if raw:
                out[int(entry.name)] = raw.decode("utf-8", "replace").rstrip("\0").split("\0")
    return out


def on_command_lines(secret: str) -> list[str]:
    """The command lines (pid: line) that hold `secret`."""
    return [
        f"{pid}: {' '.join(argv)}"
        for pid, argv in cmdlines().items()
        if any(secret in a for a in argv)
    ]


def files_holding(root: Path, secret: str) -> list[str]:
    """Every file under `root` (logs, run.json, shards, Slurm output, all of it) whose bytes hold `secret`."""
    needle = secret.encode()
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = parent_of(pid)
        if pid == ancestor:
            return True
    return False


def server_with_config(marker: str, ancestor: int) -> tuple[int, list[str]] | None:
    """(pid, argv) of a running process started (at any depth) by `ancestor` whose command line holds `marker` and
    `--config` (an engine the toolkit started), or None."""
    for pid, argv in cmdlines().items():
        if any(marker in a for a in argv) and "--config" in argv and descends_from(pid, ancestor):
            return pid, argv
    return None


def key_of(argv: list[str]) -> str:
    """The key in the YAML file an engine's `--config` names (readable by its user only: the tests' user)."""
    text = Path(argv[argv.index("--config") + 1]).read_text()
    m = re.fullmatch(r'api-key: "([^"]+)"\n', text)
    assert m, f"unexpected config file: {text!r}"
    return m.group(1)


def status_of(url: str, key: str | None, path: str = "/server_info") -> int:
    """The HTTP status `path` answers, with `key` as the bearer (or none); 0: no answer."""
    req = urllib.request.Request(
        url + path, headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # not listening yet (loading), or gone
        return 0


def watch_run(proc: subprocess.Popen, marker: str, timeout: float) -> dict:
    """While `proc` (a `toolkit run`) runs: find its engine (its command line holds `marker`), read its key, and
    look at every process's command line again and again until `proc` ends. {"key", "argv", "folder", "scans",
    "found" (command lines that held the key), "unauthorized", "authorized" (statuses of /server_info without and
    with the key)}."""
    deadline = time.monotonic() + timeout
    seen: dict = {"scans": 0, "found": []}
    while proc.poll() is None and time.monotonic() < deadline:
        if "key" not in seen:
            server = server_with_config(marker, proc.pid)
            if server is not None:
                pid, argv = server
                try:
                    seen["key"] = key_of(argv)
                except FileNotFoundError:  # that start ended meanwhile: the next one is looked for
                    continue
                seen["argv"] = argv
                seen["folder"] = Path(argv[argv.index("--config") + 1]).parent
                seen["url"] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        if "key" in seen and not seen.get("authorized"):  # once the server answers
            seen["unauthorized"], seen["authorized"] = (
                status_of(seen["url"], None),
                status_of(seen["url"], seen["key"]),
            )
        if "key" in seen:
            seen["scans"] += 1
            seen["found"] += on_command_lines(seen["key"])
        time.sleep(0.05)
    return seen
