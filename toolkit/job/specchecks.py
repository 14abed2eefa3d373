"""The checks a decoded job spec must pass before any GPU time is spent: names, datasets, sampling,
sharding, [client], [engine] (sizes, nodes, the external server's key) and [estimate], in the order
their errors are said; and the warnings about where an engine's key is kept."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.engines.layout import check_engine_layout
from toolkit.job.readers import is_hub
from toolkit.job.sglang_checks import check_engine_args, check_requests, check_sampling
from toolkit.job.specerrors import SpecError
from toolkit.job.specpaths import check_unset_variables, relative, resolve, resolve_model_paths

if TYPE_CHECKING:
    from toolkit.job.schema import ClientSpec, EngineSpec, EstimateSpec, JobSpec, ShardingSpec

MAX_TRIES = 100  # [client] max_tries above this is a typo, not a bound


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_estimate(est: EstimateSpec, source: Path) -> None:
    for key in ("tokens_per_s", "load_minutes", "mean_output_tokens"):
        value = getattr(est, key)
        if value is not None and value <= 0:
            raise SpecError(
                f"{source}: [estimate] {key} = {value:g} must be positive (or left out: unknown)"
            )


def validate(spec: JobSpec, source: Path, *, check_paths: bool) -> JobSpec:
    """Check a decoded job spec, step by step in the order its errors are said, and resolve its
    paths (from the job file's folder); the first problem is a SpecError."""
    base = source.resolve().parent
    if check_paths:
        check_unset_variables(spec, source)
    if not spec.name or "/" in spec.name:
        raise SpecError(f"{source}: `name` must be a non-empty name without '/', got {spec.name!r}")
    check_sampling(spec.sampling, "[sampling]", str(source), top_level=True)
    _check_datasets(spec, source, base, check_paths)
    _check_samples(spec, source)
    _check_sharding(spec.sharding, source)
    _check_client(spec.client, source)
    _check_engine(spec, source, base, check_paths)
    check_requests(spec, source)
    _check_estimate(spec.estimate, source)
    resolve_model_paths(spec.model, spec.engine.kind, source, base, check_paths)
    spec.output_dir = resolve(base, spec.output_dir, "output_dir" if check_paths else None, source)
    return spec


def _check_datasets(spec: JobSpec, source: Path, base: Path, check_paths: bool) -> None:
    """At least one dataset, each named once, with sampling SGLang takes and a prompt file that
    exists (its path resolved; a hub dataset is read from the hub cache)."""
    if not spec.datasets:
        raise SpecError(f"{source}: no [[datasets]]: add at least one prompt file")
    seen: set[str] = set()
    for i, d in enumerate(spec.datasets):
        where = f"[[datasets]] #{i + 1} ({d.name!r})"
        if d.name in seen:
            raise SpecError(
                f"{source}: {where}: dataset name {d.name!r} is used twice; names must be unique"
            )
        seen.add(d.name)
        check_sampling(d.sampling, f"{where} sampling", str(source), top_level=False)
        if is_hub(d.path):  # hf://datasets/ORG/NAME[:SPLIT]: read from the hub cache
            continue
        written = d.path
        d.path = resolve(base, d.path, f"{where} path" if check_paths else None, source)
        if check_paths and not Path(d.path).exists():
            raise SpecError(
                f"{source}: {where}: prompt file {d.path} does not exist{relative(written, base)}"
            )


def _check_samples(spec: JobSpec, source: Path) -> None:
    """Several samples of a prompt differ only if they are sampled (temperature > 0)."""
    for d in spec.datasets:
        params = spec.sampling_for(d.name)
        if params.get("n", 1) > 1 and params.get("temperature", 1.0) == 0:
            raise SpecError(
                f"{source}: dataset {d.name!r}: n = {params['n']} samples with temperature = 0 "
                f"would be {params['n']} identical greedy outputs; set a temperature > 0 or n = 1"
            )


def _check_sharding(s: ShardingSpec, source: Path) -> None:
    if s.shards < 1:
        raise SpecError(f"{source}: [sharding] shards must be >= 1, got {s.shards}")
    if s.flush_records < 1 or s.flush_seconds <= 0:
        raise SpecError(f"{source}: [sharding] flush_records must be >= 1 and flush_seconds > 0")


def _check_client(c: ClientSpec, source: Path) -> None:
    """[client]: concurrency, retries, tries, the loop stop's thresholds and the backoff."""
    if (
        (c.concurrency != "auto" and c.concurrency < 1)
        or c.max_concurrency < 1
        or c.retries < 0
        or c.request_timeout_s <= 0
    ):
        raise SpecError(
            f'{source}: [client] needs concurrency >= 1 (or "auto"), max_concurrency >= 1, '
            "retries >= 0, request_timeout_s > 0"
        )
    if c.max_tries < 1 or c.max_tries > MAX_TRIES:
        raise SpecError(
            f"{source}: [client] max_tries must be between 1 and {MAX_TRIES} (tries of a prompt "
            f"whose failure may pass, within a run), got {c.max_tries}"
        )
    if (
        c.segment_tokens < 256
        or c.loop_max_period < 1
        or c.loop_window < 4 * c.loop_max_period
        or not 0.5 <= c.loop_match <= 1.0
        or c.loop_window > c.segment_tokens
    ):
        raise SpecError(
            f"{source}: [client] loop stop needs segment_tokens >= 256, loop_max_period >= 1, "
            "loop_window between 4 * loop_max_period and segment_tokens, loop_match between 0.5 "
            f"and 1; got segment_tokens = {c.segment_tokens}, loop_window = {c.loop_window}, "
            f"loop_max_period = {c.loop_max_period}, loop_match = {c.loop_match:g}"
        )
    if c.backoff_s < 0 or c.backoff_max_s < 0:
        raise SpecError(
            f"{source}: [client] backoff_s and backoff_max_s must be >= 0, got {c.backoff_s:g} and "
            f"{c.backoff_max_s:g}"
        )


def _check_engine(spec: JobSpec, source: Path, base: Path, check_paths: bool) -> None:
    """[engine]: sizes, nodes, the Python, the external server's url and key, a custom command and
    the SGLang arguments."""
    e = spec.engine
    if e.tp_size < 1 or e.dp_size < 1 or e.max_restarts < 0:
        raise SpecError(f"{source}: [engine] needs tp_size >= 1, dp_size >= 1, max_restarts >= 0")
    if e.exit_grace_s <= 0 or e.shutdown_timeout_s < 0:
        raise SpecError(
            f"{source}: [engine] needs exit_grace_s > 0 and shutdown_timeout_s >= 0, got "
            f"{e.exit_grace_s:g} and {e.shutdown_timeout_s:g}"
        )
    if e.nodes < 1:
        raise SpecError(f"{source}: [engine] nodes must be >= 1, got {e.nodes}")
    if e.nodes > 1:
        if e.kind != "sglang" or e.command is not None:
            raise SpecError(
                f'{source}: [engine] nodes = {e.nodes} needs kind = "sglang" without `command`: '
                "only "
                "the toolkit's own SGLang launch starts one rank per node"
            )
        problem = check_engine_layout(e, spec.slurm.gpus_per_node)
        if problem:
            raise SpecError(f"{source}: {problem}")
    if e.python is not None and (
        e.kind != "sglang" or e.command is not None or not e.python.strip()
    ):
        raise SpecError(
            f'{source}: [engine] python = {e.python!r}: only for kind = "sglang" without `command` '
            "(the "
            "Python the toolkit starts SGLang with), and not empty; remove it"
        )
    if e.kind == "external" and not e.url:
        raise SpecError(
            f'{source}: [engine] kind = "external" needs `url` (e.g. "http://127.0.0.1:30000")'
        )
    _check_key_source(e, source, base, check_paths)
    if e.command is not None and (not e.command or not all(isinstance(a, str) for a in e.command)):
        raise SpecError(
            f"{source}: [engine] `command` must be a non-empty list of strings (an argv, not a "
            "shell line)"
        )
    if e.kind in ("sglang", "stub") and e.command is None:
        check_engine_args(e, source)


def _check_key_source(e: EngineSpec, source: Path, base: Path, check_paths: bool) -> None:
    """[engine] api_key_env / api_key_file: only for an external server (the toolkit draws the key
    of an engine it starts), one of the two, a valid name, a file that exists (its path resolved
    like every path of the job)."""
    given = [k for k in ("api_key_env", "api_key_file") if getattr(e, k) is not None]
    if not given:
        return
    if e.kind != "external":
        raise SpecError(
            f'{source}: [engine] {given[0]} is for kind = "external": an engine the toolkit starts '
            "gets a fresh key at each start, in a file only you can read; remove it"
        )
    if len(given) > 1:
        raise SpecError(
            f"{source}: [engine] api_key_env and api_key_file are both set: keep the one the key "
            "is in"
        )
    if e.api_key_env is not None and not _ENV_NAME.fullmatch(e.api_key_env):
        raise SpecError(
            f"{source}: [engine] api_key_env = {e.api_key_env!r} is not an environment variable's "
            "name (letters, digits and _): name the variable that holds the key, not the key"
        )
    if e.api_key_file is not None:
        e.api_key_file = resolve(
            base, e.api_key_file, "[engine] api_key_file" if check_paths else None, source
        )
        if check_paths and not Path(e.api_key_file).is_file():
            raise SpecError(
                f"{source}: [engine] api_key_file {e.api_key_file} does not exist (or is not a "
                "file): write the server's key there, readable only by you (chmod 600)"
            )


def key_source_warnings(e: EngineSpec) -> list[str]:
    """What may keep an engine's key from the worker, or open it to others, as seen from here: a
    custom `command` that puts it on its command line, the variable `api_key_env` names unset, a key
    file other users may read."""
    if e.command and any("{api_key}" in a for a in e.command):
        return [
            "[engine] command: {api_key} puts the engine's key on its command line, where every "
            "user of the node can read it (ps): use {api_key_file} or {config_file} (files only "
            "you can read, removed when the engine stops), or $TOOLKIT_ENGINE_API_KEY"
        ]
    if e.kind != "external":
        return []
    if e.api_key_env is not None and not os.environ.get(e.api_key_env):
        return [
            f"[engine] api_key_env: the environment variable {e.api_key_env} is not set here; the "
            "worker reads the server's key from it, so set it where the worker runs (export it "
            "before `toolkit run` or `toolkit submit`, whose sbatch passes this environment on, "
            "or in [slurm] setup)"
        ]
    if e.api_key_file is not None:
        try:
            mode = os.stat(e.api_key_file).st_mode
        except OSError:
            return []
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            return [
                f"[engine] api_key_file {e.api_key_file} may be read by other users (mode "
                f"{stat.filemode(mode)}): `chmod 600 {e.api_key_file}`"
            ]
    return []
