"""The `external` engine: a server someone else started (a URL); the toolkit only waits for it and
uses it.

It must serve the job's model: before any prompt is sent, `check_model` asks it what it serves
(SGLang's GET /model_info, /get_model_info before 0.5.23's name, else the OpenAI /v1/models) and
refuses a server whose model path has another name than the job's [model] path, or whose model's
vocabulary (its config.json, when this node can read the folder it names) is not the job's: the
records of a run are the model the run names.

Its key is never in the job nor in the run directory: the worker reads it when it starts, from the
environment variable `[engine] api_key_env` names or the file `api_key_file` names, and keeps it in
memory only.
"""

from __future__ import annotations

import logging
import os
from pathlib import PurePosixPath
from types import SimpleNamespace
from typing import Any, Callable

import msgspec

from toolkit.engines.base import Engine, EngineError
from toolkit.engines.client import HttpClient, Unreachable

__all__ = ["ExternalEngine", "read_key", "served_model", "check_served"]

log = logging.getLogger(__name__)

# a model folder's vocab_size and where it was read, or (None, why not): job.chat.model_vocab_size
VocabOf = Callable[[Any], "tuple[int | None, str]"]


def read_key(engine) -> str | None:
    """The external server's key from where `[engine]` says it is (None: the server takes none).
    EngineError, saying what to do, when it is not there."""
    if engine.api_key_env:
        key = os.environ.get(engine.api_key_env, "").strip()
        if not key:
            raise EngineError(
                f'[engine] api_key_env = "{engine.api_key_env}": the environment variable '
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

    async def check_model(
        self, http: HttpClient, vocab_size: int | None, vocab_of: VocabOf
    ) -> None:
        """Refuse (EngineError) a server that does not serve the job's model: see the module."""
        check_served(self.url, await served_model(http), self.spec.model, vocab_size, vocab_of)


async def served_model(http: HttpClient) -> dict[str, Any]:
    """What the server says it serves: SGLang's /model_info (model_path, served_model_name,
    tokenizer_path), else /get_model_info, else the first model of /v1/models (its `root`, else
    its `id`, as the model path); {} when none of them answers."""
    for path in ("/model_info", "/get_model_info", "/v1/models"):
        try:
            status, body = await http.get(path, timeout=30.0)
            info = msgspec.json.decode(body) if status == 200 else None
        except (Unreachable, msgspec.DecodeError):
            continue
        if not isinstance(info, dict):
            continue
        if path != "/v1/models":
            return {**info, "answered": path}
        cards = info.get("data")
        if isinstance(cards, list) and cards and isinstance(cards[0], dict):
            card = cards[0]
            return {
                "model_path": card.get("root") or card.get("id"),
                "served_model_name": card.get("id"),
                "answered": path,
            }
    return {}


def _name(path: str) -> str:
    """The last part of a model path or hub id, as compared: `/models/Qwen3-8B/` -> `qwen3-8b`."""
    return PurePosixPath(str(path).rstrip("/")).name.lower()


def check_served(
    url: str, info: dict[str, Any], model: Any, vocab_size: int | None, vocab_of: VocabOf
) -> None:
    """Refuse (EngineError) what a server says it serves (`served_model`) when it is not the job's
    [model]: another model path name, or a model whose config.json vocab_size is not the one the
    job's model folder gives, or smaller than the job's tokenizer (`vocab_size`, len(tokenizer)).
    `vocab_of(model)` reads a model folder's vocab_size (job.chat.model_vocab_size)."""
    served = info.get("model_path")
    if not isinstance(served, str) or not served:
        log.warning(
            "the server at %s does not say which model it serves (no model_path from "
            "/model_info or /v1/models): not checked against [model] path %s",
            url,
            model.path,
        )
        return
    where = f"GET {info.get('answered', '/model_info')}"
    if info.get("stub_engine"):  # toolkit.stub says what it is in /model_info
        log.warning(
            "the server at %s is the toolkit's STUB (%s): its outputs are synthetic text, not a "
            "model's, though this run's [engine] kind names a model",
            url,
            where,
        )
    names = {_name(n) for n in (served, info.get("served_model_name")) if isinstance(n, str)}
    if _name(model.path) not in names:
        raise EngineError(
            f"[engine] url {url} serves model {served!r} ({where}), but this job's model is "
            f"{model.path!r} ([model] path): its records would not be this model's. Point [engine] "
            f"url at a server of {model.path}; if it is the same model under another path, set "
            f'[model] path = "{served}" (and tokenizer_path to its tokenizer here)'
        )
    theirs, read = vocab_of(SimpleNamespace(path=served))
    if theirs is None:
        log.info(
            "the server's model folder cannot be read here (%s): its vocabulary is not checked",
            read,
        )
        return
    ours, ours_read = vocab_of(model)
    if ours is not None and ours != theirs:
        raise EngineError(
            f"[engine] url {url} serves {served!r} ({where}) with a vocabulary of {theirs:,} ids "
            f"({read}), but this job's model has {ours:,} ({ours_read}): it is another model. "
            f"Point [engine] url at a server of {model.path}"
        )
    if vocab_size is not None and vocab_size > theirs:
        raise EngineError(
            f"[engine] url {url} serves {served!r} ({where}) with a vocabulary of {theirs:,} ids "
            f"({read}), but this job's tokenizer makes {vocab_size:,}: ids past {theirs - 1:,} "
            f"are outside its embedding. Point [engine] url at a server of {model.path}, or use "
            "that model's own tokenizer ([model] tokenizer_path)"
        )
    log.info(
        "the server at %s serves %s (%s), vocabulary %d ids: the job's model",
        url,
        served,
        where,
        theirs,
    )
