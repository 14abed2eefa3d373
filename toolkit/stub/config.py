"""The stub's command line: StubConfig, its parser, and the SGLang flag profiles it accepts
(`--version`)."""

from __future__ import annotations

import argparse
import json
import sys
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


# SGLang's own flags come from its flag data (engines/sglang_contract/sglang_flags.json) of the
# release the stub imitates (`--version`): every flag that release accepts is accepted here, with
# the same spellings, aliases, values and unique-prefix abbreviations, and anything it refuses is
# refused (exit 2). Those listed below are modelled (StubConfig fields: SGLang's destination names
# -> the field); the rest are echoed in /server_info and otherwise ignored, except
# --disable-radix-cache, which turns off the prefix cache (cached_tokens stays 0).
MODELLED = {
    "model_path": ("model_path",),
    "tokenizer_path": ("tokenizer_path",),
    "host": ("host",),
    "port": ("port",),
    "api_key": ("api_key",),
    "trust_remote_code": ("trust_remote_code",),
    "skip_tokenizer_init": ("skip_tokenizer_init",),
    "context_length": ("context_length",),
    "max_total_tokens": ("max_total_tokens",),
    "max_running_requests": ("max_running_requests",),
    "served_model_name": ("served_model_name",),
    "tp_size": ("tp_size", "tensor_parallel_size"),
    "dp_size": ("dp_size", "data_parallel_size"),
    "enable_metrics": ("enable_metrics",),
    "stream_interval": ("stream_interval",),
    "incremental_streaming_output": ("incremental_streaming_output", "stream_output"),
    "skip_server_warmup": ("skip_server_warmup",),
    "preferred_sampling_params": ("preferred_sampling_params",),
    "reasoning_parser": ("reasoning_parser",),
    "tool_call_parser": ("tool_call_parser",),
    "log_level": ("log_level",),
}
MODELLED_KWARGS: dict[str, dict[str, Any]] = {
    "model_path": {"required": True},
    "host": {"default": "127.0.0.1"},
    "port": {"type": int, "default": 30000},
    "trust_remote_code": {"action": "store_true"},
    "skip_tokenizer_init": {"action": "store_true"},
    "context_length": {"type": int, "default": 8192},
    "max_total_tokens": {
        "type": int,
        "help": "KV pool size in tokens (default 16 x context length)",
    },
    "max_running_requests": {
        "type": int,
        "help": "requests generating at once per DP rank; the rest wait in a "
        "queue (default 1024; SGLang derives it from the KV pool)",
    },
    "tp_size": {"type": int, "default": 1},
    "dp_size": {"type": int, "default": 1},
    "enable_metrics": {"action": "store_true"},
    "stream_interval": {"type": int, "default": 1},
    "incremental_streaming_output": {
        "action": "store_true",
        "help": "0.5.23's name; 0.5.9's --stream-output",
    },
    "skip_server_warmup": {"action": "store_true"},
    "preferred_sampling_params": {
        "help": "JSON object merged under every request's sampling_params"
    },
    "log_level": {"default": "info"},
}


class _Parser(argparse.ArgumentParser):
    """SGLang's argparse semantics for SGLang's flags; the stub's own flags must be spelled in full.

    SGLang's parser accepts unique prefixes (allow_abbrev). Here only SGLang's flags take part in
    prefix matching, so a stub flag can never make an abbreviation ambiguous that SGLang accepts
    (e.g. `--tool-call` means --tool-call-parser in SGLang; --tool-call-fraction, the stub's, does
    not compete for it).
    """

    own_actions: set = set()

    def error(self, message: str):
        sys.stderr.write(f"{LOG_PREFIX} error: {message}\n")
        sys.exit(2)

    def _get_option_tuples(self, option_string):
        return [
            t for t in super()._get_option_tuples(option_string) if t[0] not in self.own_actions
        ]


def _profile(argv: list[str] | None) -> str:
    """The `--version` (wire profile) on the command line, read before the rest: it picks SGLang's
    flag set."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--version", default="0.5.23")
    ns, _ = pre.parse_known_args(argv)
    # a bad one is refused by the full parser
    return ns.version if ns.version in VERSIONS else "0.5.23"


def build_parser(version: str = "0.5.23") -> argparse.ArgumentParser:
    from toolkit.engines.sglang_contract.flags import add_to_parser, flag_set

    flags = flag_set(version)
    p = _Parser(
        prog="python -m toolkit.stub",
        description="Stand-in SGLang server (a protocol test double, not a model).",
    )
    by_dest = {f.dest: f for f in flags.flags}
    g = p.add_argument_group(f"SGLang {version} flags the stub models")
    modelled_dests = set()
    for name, dests in MODELLED.items():
        known = MODELLED_KWARGS.get(name, {})
        p.set_defaults(
            **{name: known.get("default", False if known.get("action") == "store_true" else None)}
        )
        flag = next((by_dest[d] for d in dests if d in by_dest), None)
        if flag is None:
            continue
        modelled_dests.add(flag.dest)
        kwargs = dict(MODELLED_KWARGS.get(name, {}))
        if flag.choices is not None:
            kwargs["choices"] = list(flag.choices)
        g.add_argument(*flag.options, dest=name, **kwargs)
    add_to_parser(
        p.add_argument_group(f"other SGLang {version} flags (accepted, echoed in /server_info)"),
        flags,
        skip_dests=modelled_dests,
    )
    s = p.add_argument_group(
        "stub behaviour and fault injection (spelled in full: no abbreviations)"
    )
    before = set(p._actions)
    a = s.add_argument
    a(
        "--version",
        choices=VERSIONS,
        default="0.5.23",
        help="wire profile to imitate, and SGLang flag set to accept",
    )
    a("--think-start", default="<think>")
    a("--think-end", default="</think>")
    a(
        "--load-delay",
        type=float,
        default=0.0,
        help="seconds before the port opens (weights 'loading')",
    )
    a(
        "--warmup-delay",
        type=float,
        default=0.0,
        help="seconds of 503 on /health* and /ready after the port opens",
    )
    a("--token-delay", type=float, default=0.0, help="seconds per generated token")
    a(
        "--drain-poll",
        type=float,
        default=5.0,
        help="poll interval of the SIGTERM drain (SGLang: 5 s)",
    )
    a(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="idle keep-alive connections close after this (uvicorn: 5 s)",
    )
    a(
        "--health-check-timeout",
        type=float,
        default=20.0,
        help="while generation is wedged (--hang-after), /health* waits this long, then 503 "
        "(SGLang: 20 s)",
    )
    a(
        "--fixed-output-tokens",
        type=int,
        help="every output exactly N tokens (think-end and EOS included)",
    )
    a(
        "--output-scale",
        type=int,
        help="draw output lengths as shares of N tokens instead of each request's max_new_tokens "
        "(as a model, whose outputs do not depend on the budget: an output asked for in segments "
        "is then the one-request output)",
    )
    a(
        "--lognormal-lengths",
        metavar="MEDIAN:SIGMA",
        help="draw output lengths from a lognormal of this median (tokens) and sigma, cut by "
        "max_new_tokens: the heavy tail of reasoning traces (instead of shares of the budget; "
        "--truncate-fraction then does not apply)",
    )
    a(
        "--truncate-fraction",
        type=float,
        default=0.10,
        help="share of outputs longer than max_new_tokens",
    )
    a(
        "--tool-call-fraction",
        type=float,
        default=0.15,
        help="share of outputs with a tool-call section",
    )
    a("--hang", action="store_true", help="listen but never become ready; /generate never answers")
    a(
        "--ignore-sigterm",
        action="store_true",
        help="log SIGTERM and go on serving (a shutdown that hangs)",
    )
    a("--hang-after", type=int, help="/generate requests after the N-th never answer")
    a("--crash-after", type=int, help="exit abruptly (status 1) on the N-th /generate request")
    a(
        "--fail-5xx",
        metavar="START:COUNT",
        help="/generate requests START..START+COUNT-1 get HTTP 503",
    )
    a(
        "--fail-5xx-for",
        metavar="START:SECONDS",
        help="every /generate request for SECONDS s from the START-th on gets HTTP 503 (an "
        "overloaded engine: its probes fail too)",
    )
    a(
        "--fail-status",
        type=int,
        default=503,
        metavar="CODE",
        help="the status of the --fail-5xx answers: 503, or 429 as a router that rate-limits "
        "answers",
    )
    a(
        "--poison",
        choices=sorted(POISONS),
        help="spoil the answer of every /generate whose prompt holds "
        "--poison-text (of every one, without it): "
        + "; ".join(f"{k}: {v}" for k, v in POISONS.items()),
    )
    a(
        "--poison-text",
        metavar="TEXT",
        help="--poison only the requests whose prompt, decoded, holds TEXT",
    )
    a(
        "--poison-after",
        type=int,
        default=0,
        metavar="N",
        help="--poison only after the first N /generate requests",
    )
    a(
        "--poison-prompt",
        action="append",
        default=[],
        metavar="KIND=TEXT",
        help="spoil the answer of every /generate whose prompt, decoded, holds TEXT, the way KIND "
        "(a --poison kind) says, every time; repeatable (the first that matches applies)",
    )
    a(
        "--nan-every",
        type=int,
        metavar="N",
        help="every N-th /generate request ends in SGLang's NaN stop: half its "
        "output, then an EOS id, finish_reason {type: stop, matched: 'NaN happened'}",
    )
    a("--exit-at-start", type=int, metavar="CODE", help="exit with CODE at once")
    a("--exit-at-start-if-exists", metavar="PATH", help="exit 1 at once if PATH exists")
    a(
        "--warmup-fails",
        action="store_true",
        help="the warm-up fails: the process kills itself when it ends",
    )
    a("--no-think-end", action="store_true", help="outputs never contain the think-end token")
    a(
        "--double-think-start",
        action="store_true",
        help="emit think-start even when the prompt opened it",
    )
    a(
        "--degenerate-fraction",
        type=float,
        default=0.0,
        help="share of outputs that fall into a repetition loop (a "
        "short span repeated) until max_new_tokens",
    )
    a(
        "--identical-samples",
        action="store_true",
        help="samples of one prompt are token-identical, even with a "
        "sampling_seed (a sampler that ignores it)",
    )
    a(
        "--check-args",
        action="store_true",
        help="parse the command line and exit: 0 when the stub takes it, else 2 with the error "
        "(the toolkit's pre-flight asks this before anything is written)",
    )
    p.own_actions = set(p._actions) - before
    clash = [o for act in p.own_actions for o in act.option_strings if o in flags]
    assert not clash, f"stub flags {clash} are SGLang {version} flags too: rename them"
    p.sglang_flags = flags
    p.modelled_dests = modelled_dests
    return p


def merge_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """SGLang's `--config FILE` (srt/utils/server_args_config_parser.py): the YAML file's server
    arguments, each `key: value` read as `--key value` (a switch when true, left out when false; a
    list as several values), placed before the command line's own, which win. The toolkit hands the
    engine its API key so (`api-key:`)."""
    at = [i for i, a in enumerate(argv) if a == "--config"]
    if not at:
        return argv
    if len(at) > 1:
        parser.error("--config: multiple config files specified, only one allowed")
    i = at[0]
    if i == len(argv) - 1:
        parser.error("--config: no config file specified after it")
    path = argv[i + 1]
    if not path.lower().endswith((".yaml", ".yml")):
        parser.error(f"--config: config file must be YAML format (.yaml or .yml), got {path}")
    import yaml  # transformers' dependency; only a --config needs it

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config: cannot read {path}: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config: {path} must hold a mapping of server arguments at its root")
    switches = {
        o[2:].replace("-", "_")
        for act in parser._actions
        if act.nargs == 0
        for o in act.option_strings
        if o.startswith("--")
    }
    args: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if isinstance(value, bool):
            if str(key).replace("-", "_") in switches:
                args += [flag] if value else []
            else:
                args += [flag, str(value).lower()]
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args + argv[:i] + argv[i + 2 :]


def parse_config(argv: list[str] | None) -> StubConfig:
    """Parse the command line as SGLang would (a flag SGLang refuses makes the stub exit 2, like
    SGLang); a `--config FILE` is read as SGLang reads it (merge_config_file)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_profile(argv))
    ns = parser.parse_args(merge_config_file(argv, parser))
    fail_5xx = None
    if ns.fail_5xx:
        try:
            start, count = (int(x) for x in ns.fail_5xx.split(":"))
        except ValueError:
            parser.error(f"--fail-5xx wants START:COUNT (two integers), got {ns.fail_5xx!r}")
        fail_5xx = (start, count)
    fail_5xx_for = None
    if ns.fail_5xx_for:
        try:
            first, seconds = ns.fail_5xx_for.split(":")
            fail_5xx_for = (int(first), float(seconds))
        except ValueError:
            parser.error(f"--fail-5xx-for wants START:SECONDS, got {ns.fail_5xx_for!r}")
    lognormal = None
    if ns.lognormal_lengths:
        try:
            median, sigma = ns.lognormal_lengths.split(":")
            lognormal = (int(median), float(sigma))
        except ValueError:
            lognormal = None
        if lognormal is None or lognormal[0] < 1 or not 0 <= lognormal[1] <= 5:
            parser.error(
                "--lognormal-lengths wants MEDIAN:SIGMA (a median of at least 1 token and a sigma "
                f"from 0 to 5), got {ns.lognormal_lengths!r}"
            )
    rules = []
    for rule in ns.poison_prompt:
        kind, eq, text = rule.partition("=")
        if not eq or not text or kind not in POISONS:
            parser.error(
                f"--poison-prompt wants KIND=TEXT with KIND one of {', '.join(sorted(POISONS))} "
                f"and a non-empty TEXT, got {rule!r}"
            )
        rules.append((kind, text))
    preferred = None
    if ns.preferred_sampling_params:
        try:
            preferred = json.loads(ns.preferred_sampling_params)
        except ValueError as e:
            parser.error(f"--preferred-sampling-params is not JSON: {e}")
    if ns.served_model_name and ":" in ns.served_model_name:
        parser.error("--served-model-name must not contain ':'")
    if ns.context_length < 16:
        parser.error("--context-length must be at least 16")
    other = {
        f.dest: getattr(ns, f.dest, None)
        for f in parser.sglang_flags.flags
        if f.dest not in parser.modelled_dests and f.action != "help"
    }
    cfg = StubConfig(
        model_path=ns.model_path,
        tokenizer_path=ns.tokenizer_path,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or None,
        trust_remote_code=ns.trust_remote_code,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        context_length=ns.context_length,
        max_total_tokens=ns.max_total_tokens,
        max_running_requests=ns.max_running_requests,
        served_model_name=ns.served_model_name,
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        enable_metrics=ns.enable_metrics,
        stream_interval=max(1, ns.stream_interval),
        incremental_streaming_output=ns.incremental_streaming_output,
        skip_server_warmup=ns.skip_server_warmup,
        preferred_sampling_params=preferred,
        reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser,
        log_level=ns.log_level,
        version=ns.version,
        think_start=ns.think_start,
        think_end=ns.think_end,
        load_delay=ns.load_delay,
        warmup_delay=ns.warmup_delay,
        token_delay=ns.token_delay,
        drain_poll=max(0.01, ns.drain_poll),
        keep_alive_timeout=ns.keep_alive_timeout,
        health_check_timeout=ns.health_check_timeout,
        fixed_output_tokens=ns.fixed_output_tokens,
        output_scale=ns.output_scale,
        lognormal_lengths=lognormal,
        truncate_fraction=ns.truncate_fraction,
        tool_call_fraction=ns.tool_call_fraction,
        hang=ns.hang,
        ignore_sigterm=ns.ignore_sigterm,
        hang_after=ns.hang_after,
        crash_after=ns.crash_after,
        fail_5xx=fail_5xx,
        fail_5xx_for=fail_5xx_for,
        fail_status=ns.fail_status,
        poison=ns.poison,
        poison_text=ns.poison_text,
        poison_after=ns.poison_after,
        poison_prompts=tuple(rules),
        nan_every=ns.nan_every,
        exit_at_start=ns.exit_at_start,
        exit_at_start_if_exists=ns.exit_at_start_if_exists,
        warmup_fails=ns.warmup_fails,
        no_think_end=ns.no_think_end,
        double_think_start=ns.double_think_start,
        degenerate_fraction=ns.degenerate_fraction,
        identical_samples=ns.identical_samples,
        check_args=ns.check_args,
        other_args={k: v for k, v in other.items() if v not in (None, False)},
    )
    return cfg
