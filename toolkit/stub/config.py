"""What the stub is configured with: StubConfig (everything its command line sets), the SGLang
releases it imitates (`--version`) and the ways it spoils an answer on purpose (`--poison`).
command_line parses the command line into it."""

from __future__ import annotations

from typing import Any

import msgspec

LOG_PREFIX = "[stub-engine, not a model]"
VERSIONS = ("0.5.23", "0.5.9")
DEFAULT_MAX_RUNNING = 1024  # per DP rank, when --max-running-requests is not given
# --poison KIND: how the answer of a poisoned prompt is spoiled (faults.spoil; faults.CUTS never
# answer)
POISONS = {
    "reset": "the connection is reset, nothing answered",
    "truncate": "the headers and half the body, then the connection closes",
    "wrong_rid": "meta_info.id is another request's rid",
    "over_max": "more output_ids than max_new_tokens (completion_tokens agreeing)",
    "early_length": "finish_reason length after a third of the output, short of max_new_tokens",
    "out_of_vocab": "an output id outside the vocabulary",
    "unknown_finish": "finish_reason of an unknown type",
    "finish_string": 'finish_reason as a string ("stop")',
    "finish_null": "finish_reason null",
    "no_completion_tokens": "meta_info without completion_tokens",
    "abort_500": "finish_reason abort with status_code 500 and half the output",
    "abort_empty": 'finish_reason abort ("Abort in waiting queue") with no output, as a request '
    "aborted before it ran",
    "status_503": "HTTP 503, as an overloaded server answers",
    "status_429": "HTTP 429, as a router that rate-limits answers",
    "nan": "SGLang's NaN stop: half the output, then an EOS id, finish_reason matched 'NaN "
    "happened'",
    "hang": "never answered (the other requests and /health* still are)",
}


class StubConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the command line sets (SGLang's flags the stub models, plus its own)."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    context_length: int = 8192
    max_total_tokens: int | None = None
    max_running_requests: int | None = None  # per data-parallel rank; None: DEFAULT_MAX_RUNNING
    served_model_name: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    enable_metrics: bool = False
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    skip_server_warmup: bool = False
    preferred_sampling_params: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    log_level: str = "info"
    # stub behaviour
    version: str = "0.5.23"
    think_start: str = "<think>"
    think_end: str = "</think>"
    load_delay: float = 0.0
    warmup_delay: float = 0.0
    token_delay: float = 0.0
    drain_poll: float = 5.0
    keep_alive_timeout: float = 5.0
    health_check_timeout: float = 20.0
    fixed_output_tokens: int | None = None
    # output lengths drawn as shares of this, not of each request's max_new_tokens
    output_scale: int | None = None
    # output lengths lognormal (median, sigma), cut by the budget
    lognormal_lengths: tuple[int, float] | None = None
    truncate_fraction: float = 0.10
    tool_call_fraction: float = 0.15
    hang: bool = False
    # a server whose shutdown hangs: SIGTERM is logged and ignored (SIGKILL still works)
    ignore_sigterm: bool = False
    hang_after: int | None = None
    crash_after: int | None = None
    fail_5xx: tuple[int, int] | None = None
    # (START, SECONDS): every /generate for SECONDS s from the START-th on gets --fail-status
    fail_5xx_for: tuple[int, float] | None = None
    fail_status: int = 503
    poison: str | None = None  # a key of POISONS
    poison_text: str | None = None
    poison_after: int = 0
    # (kind, text): --poison-prompt KIND=TEXT, every time
    poison_prompts: tuple[tuple[str, str], ...] = ()
    nan_every: int | None = None
    exit_at_start: int | None = None
    exit_at_start_if_exists: str | None = None
    warmup_fails: bool = False
    no_think_end: bool = False
    double_think_start: bool = False
    degenerate_fraction: float = 0.0
    identical_samples: bool = False
    check_args: bool = False
    # SGLang flags that are accepted, echoed in /server_info, and otherwise ignored
    other_args: dict[str, Any] = {}
