"""Job specs: the TOML file a user writes, decoded into typed Structs and validated at load time.

A job spec says which model to serve, how to start the engine, how to sample, which prompt files to
generate for and how many shards to cut them into. `load_spec` reads it and refuses unknown keys,
wrong types and sampling keys SGLang would reject, naming the line; then come the checks of its
values (specchecks) and the resolution of its paths (specpaths), before any GPU time is spent."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import tomllib

from toolkit.formats.rundir import RunDir
from toolkit.job import specerrors
from toolkit.job.schema import (
    JobSpec,
)
from toolkit.job.sglang_checks import SAMPLING_KEYS
from toolkit.job.specchecks import validate
from toolkit.job.specerrors import SpecError

# The schema's Structs are read from here, with the spec that decodes into them.
__all__ = [
    "load_spec",
]


CLEAR_KEY = (
    "a key written here stays in clear in the job file and in the run's run.json, for whoever "
    "reads them "
    "(and travels with every copy of the run): put it in an environment variable and name it "
    '(`api_key_env = "NAME"`), or in a file only you can read (`api_key_file = "PATH"`)'
)


def load_spec(path: str | os.PathLike, *, check_paths: bool = True) -> JobSpec:
    """Read, decode and validate a job spec. Relative paths are resolved against the spec's
    folder."""
    source = Path(path)
    if source.is_dir():
        what = "a run directory" if RunDir.is_run(source) else "a folder"
        raise SpecError(
            f"{source}: is {what}, not a job spec (a .toml file); commands on a run directory are "
            "status, logs, resubmit, merge, audit and export"
        )
    try:
        raw = source.read_bytes()
    except FileNotFoundError:
        raise SpecError(
            f"{source}: job spec not found; see jobs/ for examples or templates/job.toml to start "
            "from"
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SpecError(f"{source}: not UTF-8 text ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{source}: invalid TOML: {e}") from None
    text = raw.decode("utf-8")
    engine = data.get("engine")
    if isinstance(engine, dict) and "api_key" in engine:
        raise SpecError(
            f"{_at(source, text, ('engine', 'api_key'))}: [engine] api_key: {CLEAR_KEY}"
        )
    for unknown, where_listed in (
        (specerrors.unknown_keys(data, JobSpec), "; templates/job.toml lists every key"),
        (_unknown_sampling_keys(data), ""),
    ):
        if unknown:
            first = unknown[0]
            more = (
                (
                    f" (and {len(unknown) - 1} more: "
                    + ", ".join(f"`{'.'.join(str(p) for p in u.path)}`" for u in unknown[1:4])
                    + ")"
                )
                if len(unknown) > 1
                else ""
            )
            listed = "" if first.message.endswith("?") and not more else where_listed
            raise SpecError(f"{_at(source, text, first.path)}: {first.message}{more}{listed}")
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as e:
        problem = specerrors.explain_validation(e, data, JobSpec)
        raise SpecError(f"{_at(source, text, problem.path)}: {problem.message}") from None
    return validate(spec, source, check_paths=check_paths)


def _unknown_sampling_keys(data: dict) -> list[specerrors.KeyProblem]:
    """Keys of [sampling] and of each dataset's `sampling` that SGLang's sampling_params does not
    take."""
    tables: list[tuple] = [("sampling",)]
    datasets = data.get("datasets")
    if isinstance(datasets, list):
        tables += [
            ("datasets", i, "sampling") for i, d in enumerate(datasets) if isinstance(d, dict)
        ]
    problems = []
    for path in tables:
        params = specerrors.value_at(data, path)
        if not isinstance(params, dict):
            continue
        for key in params:
            if key not in SAMPLING_KEYS:
                hint = (
                    "; there is no `seed`: use `sampling_seed`, honoured only with "
                    "--enable-deterministic-inference"
                    if key == "seed"
                    else f"; {SAMPLING_WORDS[key]}"
                    if key in SAMPLING_WORDS
                    else specerrors.did_you_mean(key, SAMPLING_KEYS)
                    or "; SGLang's sampling_params takes: " + ", ".join(sorted(SAMPLING_KEYS))
                )
                problems.append(
                    specerrors.KeyProblem(
                        (*path, key),
                        f"unknown sampling key `{key}` {specerrors.where(path, data)}{hint}",
                    )
                )
    return problems


# Other names of sampling keys (other APIs', the glossary's), and what SGLang calls them
SAMPLING_WORDS = {
    "samples": "samples per prompt are `n` (each sample is its own request)",
    "num_samples": "samples per prompt are `n` (each sample is its own request)",
    "max_tokens": "SGLang calls it `max_new_tokens`",
    "max_completion_tokens": "SGLang calls it `max_new_tokens`",
    "stop_sequences": "SGLang calls it `stop` (strings) or `stop_token_ids` (ids)",
}


def _at(source: Path, text: str, path: tuple) -> str:
    """`file:line` of the key at `path` in the spec's text (just the file when the line cannot be
    told)."""
    line = specerrors.key_line(text, path)
    return f"{source}:{line}" if line else str(source)
