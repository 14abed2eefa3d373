"""Builders of small job specs and prompt files for tests (real files, real tokenizers)."""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path
from typing import Any

from toolkit.job.prepare import prepare_run

_WORDS = " ".join(pydoc_data.topics.topics.values()).split()


def prepared_run(job, **kw):
    """(run directory, plan) of `job` after the pre-flight that run, check and submit share."""
    prep = prepare_run(job, **kw)
    return prep.run_dir, prep.plan


def write_prompts(
    path: Path,
    n: int,
    *,
    prefix: str = "p",
    long_every: int = 0,
    tools_every: int = 0,
    extra: Any = None,
) -> Path:
    """`n` prompts of real English words; every `long_every`-th one is long (to exceed a small context);
    `extra(i)`: more fields of line i (a dataset's own, e.g. `source`)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "Evaluate arithmetic.",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
    ]
    with open(path, "w") as f:
        for i in range(n):
            # (past the end of the word list, round again: no prompt is empty)
            words = [_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(12 + (i % 5) * 3)]
            if long_every and i % long_every == long_every - 1:
                words = _WORDS[:3000]
            line: dict[str, Any] = {
                "id": f"{prefix}{i:04d}",
                "messages": [{"role": "user", "content": " ".join(words)}],
            }
            if tools_every and i % tools_every == 0:
                line["tools"] = tools
            if extra is not None:
                line.update(extra(i))
            f.write(json.dumps(line) + "\n")
    return path


def toml_value(value: Any) -> str:
    """A Python value written as TOML (what the test job files need: scalars, inline tables, arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def make_job(
    tmp: Path,
    tokenizer: Path,
    *,
    n: int = 12,
    shards: int = 1,
    name: str = "t",
    prompts: Path | None = None,
    **tables: dict[str, Any],
) -> Path:
    """A job spec in `tmp` using the stub engine; `tables` override or add keys per table, e.g.
    `engine={"max_restarts": 1}, stub={"crash_after": 5}, sampling={"max_new_tokens": 64}`."""
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = prompts or write_prompts(tmp / "prompts.jsonl", n)
    t: dict[str, dict[str, Any]] = {
        "model": {"path": str(tokenizer)},
        "engine": {
            "kind": "stub",
            "ready_timeout_s": 60,
            "max_restarts": 2,
            "shutdown_timeout_s": 10,
        },
        "stub": {},
        "sampling": {"max_new_tokens": 256},
        "client": {
            "concurrency": 4,
            "request_timeout_s": 30,
            "retries": 3,
            "backoff_s": 0.05,
            "backoff_max_s": 0.2,
        },
        "sharding": {"shards": shards, "flush_records": 3, "flush_seconds": 0.5},
    }
    for table, keys in tables.items():
        t.setdefault(table, {}).update(keys)
    # the GPUs each task asks Slurm for: the engine's, each used (`check` and `submit` refuse idle ones)
    e = t["engine"]
    used = 0 if e.get("kind") == "external" else e.get("tp_size", 1) * e.get("dp_size", 1)
    t.setdefault("slurm", {}).setdefault("gpus_per_node", used)
    lines = [f'name = "{name}"', f'output_dir = "{tmp / "run"}"']
    for table in (
        "model",
        "engine",
        "sampling",
        "client",
        "sharding",
        "audit",
        "slurm",
        "inputs",
        "estimate",
    ):
        if table in t:
            lines.append(f"[{table}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in t[table].items()]
    if t["stub"]:
        lines.append("[engine.stub]")
        lines += [f"{k} = {toml_value(v)}" for k, v in t["stub"].items()]
    lines += ["[[datasets]]", 'name = "d"', f'path = "{prompts}"']
    job = tmp / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def process_running(pid: int) -> bool:
    """Alive and not a zombie (a killed process stays a zombie where nothing reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
