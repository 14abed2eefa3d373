"""The job spec's schema: the typed Structs a job's TOML file decodes into, one a table, with the
defaults of every key (templates/job.toml lists them for users). Reading and checking a spec is
job/spec's."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: unknown keys are errors, not silently ignored."""


class ModelSpec(_Config):
    path: str
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = {}
    think_start: str = "<think>"
    think_end: str = "</think>"
    tool_call_start: str | None = None
    # The data must hold reasoning: prompts the template renders with reasoning closed are refused
    # before any engine starts, and the audit fails a run whose outputs hold none. False:
    # non-thinking data (the audit then checks that outputs hold no think tokens).
    expect_reasoning: bool = True


class StubSpec(_Config):
    """Options of the `stub` engine: a stand-in for SGLang's protocol, not a model (see
    toolkit.stub)."""

    load_delay_s: float = 0.0
    warmup_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fixed_output_tokens: int | None = None
    # Output lengths drawn as shares of this many tokens rather than of each request's
    # max_new_tokens. Unset: the largest max_new_tokens of the job when [client] loop_stop asks for
    # some outputs in segments (so that those are the outputs of one request), else each request's
    # max_new_tokens.
    output_scale: int | None = None
    context_length: int = 32768
    crash_after: int | None = None
    hang: bool = False
    ignore_sigterm: bool = False
    hang_after: int | None = None
    fail_5xx: str | None = None
    # every N-th /generate ends in SGLang's NaN stop (finish matched "NaN happened")
    nan_every: int | None = None
    exit_at_start: int | None = None
    exit_at_start_if_exists: str | None = None
    no_think_end: bool = False
    double_think_start: bool = False
    degenerate_fraction: float = 0.0  # share of outputs that fall into a repetition loop until
    # max_new_tokens
    identical_samples: bool = False  # samples of one prompt (n > 1) token-identical even with a
    # sampling_seed
    version: str = "0.5.23"
    extra_args: list[str] = []


class EngineSpec(_Config):
    kind: Literal["sglang", "stub", "external"] = "sglang"
    tp_size: int = 1
    dp_size: int = 1
    # Nodes of one engine (one array task): SGLang runs on each through `srun`, rank 0 serving HTTP
    # on the first node beside the worker; tp_size then counts the GPUs of all nodes (see
    # engine_gpus).
    nodes: int = 1
    extra_args: list[str] = []
    env: dict[str, str] = {}
    ready_timeout_s: float = 3600.0
    max_restarts: int = 3
    # No request answered for this long while some are in flight, and /health_generate fails: the
    # engine is hung, and is restarted like one that died (counted against max_restarts); its
    # requests in flight go back to the queue.
    hang_timeout_s: float = 300.0
    shutdown_timeout_s: float = 60.0
    # Once the shard's work is over (every prompt answered, a stop signal, a failure), the worker
    # ends within shutdown_timeout_s + exit_grace_s (after a stop signal, plus the in-flight
    # saving's 30 s), whatever its tasks do: past that it logs what did not finish, kills the engine
    # and ends the process with exit code 6.
    exit_grace_s: float = 60.0
    url: str | None = None
    # kind = "external": where the worker reads the server's key when it starts, never the key
    # itself (the job file and the run's run.json are read by others): an environment variable's
    # name, or a file only the user can read.
    api_key_env: str | None = None
    api_key_file: str | None = None
    # the key in clear: refused in a job file (read only from run.json of older runs)
    api_key: str | None = None
    # A custom launch argv: placeholders {host} {port} {model_path}, and for the key {api_key_file}
    # or {config_file} (files only the user can read; $TOOLKIT_ENGINE_API_KEY holds it too), or
    # {api_key} (on the command line: warned).
    command: list[str] | None = None
    # The Python that runs SGLang (kind = "sglang" without `command`): a path or a name looked up on
    # the node's PATH. None: the first python3 on the task's PATH (as [slurm] setup left it) that
    # has sglang, else the toolkit's own.
    python: str | None = None
    stub: StubSpec = msgspec.field(default_factory=StubSpec)


class ClientSpec(_Config):
    # Requests in flight. "auto": sized from what the server says it can run (/server_info, then
    # /v1/loads as it generates): its running capacity plus a small waiting queue, so the engine
    # never waits for a request.
    concurrency: int | Literal["auto"] = 64
    max_concurrency: int = 1024  # "auto" never goes above this
    # On a stop signal, abort the requests in flight and keep their partial outputs (continued on
    # the next run) instead of throwing them away.
    save_in_flight: bool = True
    request_timeout_s: float = 3600.0
    retries: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    # Tries of a prompt within a run while it fails in a way that may pass (timeout, 5xx, reset, NaN
    # stop, abort): each try is a request with its own `retries`; the next try waits backoff_s *
    # 2^(tries-1) (at most backoff_max_s). Past the last one the failure is final for the run
    # ("failed 3 times: nan") and the shard is done; `toolkit retry` starts a fresh count.
    max_tries: int = 3
    # Stop repetition loops while they are generated: a request asks for at most segment_tokens new
    # tokens, and between segments the output so far is checked for a loop (formats/loops, with
    # these thresholds); a loop is recorded as it stands (finish "loop", never training data, never
    # generated again), anything else goes on from prompt + output so far, token for token the
    # output one request would have given.
    loop_stop: bool = True
    segment_tokens: int = 4096
    loop_window: int = 512  # tail ids looked at
    loop_max_period: int = 128  # longest repeated span looked for
    loop_match: float = 0.9  # share of the tail that must repeat the id one period before


class DatasetSpec(_Config):
    name: str
    path: str
    sampling: dict[str, Any] = {}
    # Regenerate every assistant turn of each conversation, one record per user turn, feeding the
    # model its own earlier answers (see turns.py); the source's assistant messages are never sent.
    regenerate: bool = False


class InputsSpec(_Config):
    """What a prompt line that cannot be used does: "fail" stops the job before any GPU time (every
    such line named), "skip" leaves it out of the run, each one reported (file:line: reason) by
    `check`, `run`, `submit` and the audit."""

    # malformed JSON, a missing or wrong field, a duplicate id, ...
    on_bad_line: Literal["fail", "skip"] = "fail"
    # its length + max_new_tokens does not fit the context length
    on_too_long: Literal["fail", "skip"] = "fail"


class ShardingSpec(_Config):
    shards: int = 1
    flush_records: int = 64
    flush_seconds: float = 10.0


class SlurmSpec(_Config):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    gpus_per_node: int = 8
    cpus_per_task: int = 16
    mem: str | None = None
    array_parallelism: int | None = None
    setup: list[str] = []
    signal_delay_s: int = 300
    merge_time: str = "02:00:00"
    merge_cpus: int = 2
    merge_mem: str | None = None
    merge_partition: str | None = None  # the merge + audit job's (no GPU); default: `partition`
    extra: dict[str, str | int | bool] = {}


class EstimateSpec(_Config):
    """What `check` and `submit --dry-run` estimate a run's cost from (job.cost); not part of the
    fingerprint."""

    tokens_per_s: float | None = None  # one engine's output tokens/s at full batch
    load_minutes: float | None = None  # one model load: weights read, CUDA graphs captured
    mean_output_tokens: int | None = None  # expected output length, until a run measures its own


class AuditSpec(_Config):
    """Thresholds the audit enforces; breaking one fails the run's final job."""

    min_think_end_share: float = 0.9
    max_stop_without_think_end_share: float = 0.01
    max_empty_reasoning_share: float = 0.05
    max_empty_content_share: float = 0.2
    max_double_think_start_share: float = 0.01
    max_length_share: float = 0.2
    max_failed_share: float = 0.01
    max_reasoning_share: float = 0.01  # expect_reasoning = false: outputs that hold a think token
    max_degenerate_share: float = 0.02  # outputs in a repetition loop (dataset.quality), per
    # dataset n > 1, temperature > 0: samples token-identical to an earlier one
    max_identical_sample_share: float = 0.01
    reprompt_sample: int = 64


class JobSpec(_Config):
    name: str
    output_dir: str
    model: ModelSpec
    sampling: dict[str, Any]
    datasets: list[DatasetSpec]
    inputs: InputsSpec = msgspec.field(default_factory=InputsSpec)
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    client: ClientSpec = msgspec.field(default_factory=ClientSpec)
    sharding: ShardingSpec = msgspec.field(default_factory=ShardingSpec)
    slurm: SlurmSpec = msgspec.field(default_factory=SlurmSpec)
    audit: AuditSpec = msgspec.field(default_factory=AuditSpec)
    estimate: EstimateSpec = msgspec.field(default_factory=EstimateSpec)

    def sampling_for(self, dataset: str) -> dict[str, Any]:
        """The sampling params sent for a prompt of `dataset`: job-wide keys, overridden per
        dataset."""
        for d in self.datasets:
            if d.name == dataset:
                return {**self.sampling, **d.sampling}
        raise KeyError(dataset)

    def samples_for(self, dataset: str) -> int:
        """How many independent samples each prompt of `dataset` gets ([sampling] n)."""
        return int(self.sampling_for(dataset).get("n", 1))

    def request_sampling(self, dataset: str, sample: int) -> dict[str, Any]:
        """The sampling_params of one request: sample `sample` of a prompt of `dataset`.

        Each sample is its own request, so `n` is not sent; a `sampling_seed` is offset by the
        sample index so that seeded samples differ (and stay reproducible).
        """
        params = self.sampling_for(dataset)
        params.pop("n", None)
        if sample and isinstance(params.get("sampling_seed"), int):
            params["sampling_seed"] += sample
        return params
