"""The `external` engine: a server someone else started (a URL); the toolkit only waits for it and
uses it.

Its key is never in the job nor in the run directory: the worker reads it when it starts, from the
environment variable `[engine] api_key_env` names or the file `api_key_file` names, and keeps it in
memory only.
"""

from __future__ import annotations

import logging
import os

from toolkit.engines.base import Engine, EngineError

__all__ = ["ExternalEngine", "read_key"]

log = logging.getLogger(__name__)


def read_key(engine) -> str | None:
    """The external server's key from where `[engine]` says it is (None: the server takes none).
    EngineError, saying what to do, when it is not there."""
    if engine.api_key_env:
        key = os.environ.get(engine.api_key_env, "").strip()
        if not key:
            raise EngineError(
                f"[engine] api_key_env = \"{engine.api_key_env}\": the environment variable "
                f"{engine.api_key_env} is not set (or empty) where the worker runs; export it "
                "before `toolkit run` or `toolkit submit` (sbatch passes the environment on), or "
                "set it in [slurm] setup"
            )
        return key
    if engine.api_key_file:
        try:
            with open(engine.api_key_file) as f:
                key = f.read().strip()
        except OSError as e:
            raise EngineError(
                f"[engine] api_key_file {engine.api_key_file}: cannot be read here ({e.strerror}); "
                "the worker reads the server's key from it: make it readable by you on the node"
            ) from None
        if not key:
            raise EngineError(
                f"[engine] api_key_file {engine.api_key_file} is empty: write the server's key in "
                "it"
            )
        return key
    if engine.api_key:  # a run planned before keys were kept out of run.json
        log.warning(
            "[engine] api_key: this run's run.json holds the server's key in clear; plan the job "
            "again with api_key_env or api_key_file (its settings are taken into the run) to "
            "remove it"
        )
        return engine.api_key
    return None


class ExternalEngine(Engine):
    kind = "external"

    def start(self) -> None:
        self.url = self.engine.url.rstrip("/")
        self.api_key = read_key(self.engine)
        self.starts += 1

    def alive(self) -> bool:
        return True  # nothing to watch: connection errors are retried, then fail the task

    def stop(self, timeout_s: float | None = None) -> None:
        pass
