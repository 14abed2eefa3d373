"""The engine kinds by name: `make_engine` builds the one `[engine] kind` names."""

from __future__ import annotations

from pathlib import Path

from toolkit.engines.base import Engine, EngineError
from toolkit.engines.external import ExternalEngine
from toolkit.engines.sglang import SGLangEngine
from toolkit.engines.stub import StubEngine

__all__ = ["ENGINE_KINDS", "make_engine"]

ENGINE_KINDS = ("sglang", "stub", "external")


def make_engine(spec, server_log: Path, *, probe_ids: list[int], shard: int = 0) -> Engine:
    """The engine of `spec.engine.kind` (sglang, stub or external), not yet started."""
    kind = spec.engine.kind
    if kind == "sglang":
        return SGLangEngine(spec, server_log, probe_ids=probe_ids)
    if kind == "stub":
        return StubEngine(spec, server_log, probe_ids=probe_ids, shard=shard)
    if kind == "external":
        return ExternalEngine(spec, server_log, probe_ids=probe_ids)
    raise EngineError(f"unknown engine kind {kind!r}; use {', '.join(ENGINE_KINDS)}")
