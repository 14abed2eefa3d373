"""What the pre-flight learned rendering a job's prompts, kept in the run directory
(`RunDir.check_file`) so that `submit`, `run` and a second `check` of the same inputs render nothing
again, and load no tokenizer.

The file holds the tokenizer's ids (`TokenInfo`) and one `Outcome` per dataset, under two keys:
`render_key`, what every prompt's rendering depends on (the model, tokenizer and template files and
kwargs, the think tokens, expect_reasoning, the context length and where it comes from, the versions
of transformers, tokenizers and jinja2, this file's format), and per dataset `dataset_key` (its
name, path, bytes (sha256), regenerate and max_new_tokens). A change of any of them renders that
much again: a changed prompt file its own dataset, a changed tokenizer or template every dataset. A
file that cannot be read, or of another format, counts as none.
"""

from __future__ import annotations

import hashlib
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from toolkit.formats.files import atomic_write
from toolkit.job.chat import TokenInfo
from toolkit.job.render_slice import Outcome

__all__ = ["FORMAT", "CheckCache", "dataset_key", "load", "render_key", "save"]

log = logging.getLogger(__name__)

FORMAT = 1  # raise when what an Outcome holds, or how it is measured, changes
LIBRARIES = ("transformers", "tokenizers", "jinja2")


class CheckCache(msgspec.Struct):
    format: int
    fingerprint: str  # the run's when written (for a reader; the keys decide)
    key: str  # render_key
    info: TokenInfo
    outcomes: dict[str, Outcome]  # dataset_key -> what rendering that dataset learned


def _digest(obj: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def render_key(plan: Any, context: int | None, source: str, truncate: bool, exact: bool) -> str:
    """What rendering and judging any prompt of `plan` depends on, besides the prompt itself."""
    m = plan.spec.model
    parts = plan.parts
    return _digest(
        [
            FORMAT,
            parts["model"],
            parts["tokenizer"],
            parts["template"],
            m.trust_remote_code,
            m.expect_reasoning,
            context,
            source,
            truncate,
            exact,
            [_version(n) for n in LIBRARIES],
            plan.spec.inputs.on_bad_line,
            plan.spec.inputs.on_too_long,
        ]
    )


def dataset_key(dataset: Any, max_new_tokens: int) -> str:
    """What measuring one dataset (a plan.DatasetPlan) depends on, besides render_key."""
    return _digest([dataset.name, dataset.path, dataset.sha256, dataset.regenerate, max_new_tokens])


def load(path: Path, key: str) -> CheckCache | None:
    """The cache at `path` when it was written under `key`; None otherwise (missing, unreadable,
    stale)."""
    try:
        cache = msgspec.msgpack.decode(path.read_bytes(), type=CheckCache)
    except (OSError, msgspec.DecodeError):
        return None
    if cache.format != FORMAT or cache.key != key:
        log.debug("%s: written for other inputs, tokenizer or template: not used", path)
        return None
    return cache


def save(path: Path, cache: CheckCache) -> None:
    """Write the cache (atomically: a reader sees the old file or the new one); a folder that cannot
    take it is said in a warning, and the next command renders again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, msgspec.msgpack.encode(cache))
    except OSError as e:
        log.warning(
            "cannot keep what the check learned in %s (%s); the next command renders the prompts "
            "again",
            path,
            e.strerror or e,
        )
