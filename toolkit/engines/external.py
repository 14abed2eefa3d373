"""The `external` engine: a server someone else started (a URL); the toolkit only waits for it and uses it."""

from __future__ import annotations

from toolkit.engines.base import Engine

__all__ = ["ExternalEngine"]


class ExternalEngine(Engine):
    kind = "external"

    def start(self) -> None:
        self.url = self.engine.url.rstrip("/")
        self.api_key = self.engine.api_key
        self.starts += 1

    def alive(self) -> bool:
        return True  # nothing to watch: connection errors are retried, then fail the task

    def stop(self, timeout_s: float | None = None) -> None:
        pass
