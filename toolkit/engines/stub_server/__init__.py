"""Stand-in SGLang server: a test double of SGLang's native HTTP protocol, not of a model.

The toolkit's `stub` engine runs this for dry runs on CPU nodes and as the test suite's engine:

    python -m toolkit.engines.stub_server --model-path DIR --host 127.0.0.1 --port P [options]

It speaks the wire contract of SGLang 0.5.23 (or of 0.5.9 with `--version 0.5.9`): the start-up sequence
(port closed while "loading weights", health 503 during warm-up, then 200), `/generate` with SGLang's
validation errors, response shape, stop-token and finish-reason rules, streaming, batches and `n > 1`,
`/abort_request`, auth, `/metrics` and graceful SIGTERM drain. Outputs are invented, deterministically, from
the job's own tokenizer: English text from Python's help topics as "reasoning", the think-end token, an
answer, sometimes a tool-call section, then EOS (see `plan_output`). Fault injection flags (`--crash-after`,
`--fail-5xx`, `--hang-after`, ...) make it misbehave on purpose. Every log line says it is the stub.

HTTP/1.1 is served by a small asyncio protocol (keep-alive, Content-Length or chunked bodies, pipelining);
JSON goes through msgspec, and a plain `/generate` is answered synchronously with no task per request, so
the server stays cheap next to the client it is benchmarked with.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import msgspec

logger = logging.getLogger(__name__)

LOG_PREFIX = "[stub-engine, not a model]"
VERSIONS = ("0.5.23", "0.5.9")
TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6
DEFAULT_MAX_RUNNING = 1024  # per DP rank, when --max-running-requests is not given
CORPUS_CHARS = 160_000  # of the help-topics text, encoded once at start: plenty of distinct "reasoning"
_json_encode = msgspec.json.encode
_json_decode = msgspec.json.decode


# ================================================================================================
# Configuration
# ================================================================================================


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
    truncate_fraction: float = 0.10
    tool_call_fraction: float = 0.15
    hang: bool = False
    ignore_sigterm: bool = False  # a server whose shutdown hangs: SIGTERM is logged and ignored (SIGKILL still works)
    hang_after: int | None = None
    crash_after: int | None = None
    fail_5xx: tuple[int, int] | None = None
    nan_every: int | None = None
    exit_at_start: int | None = None
    exit_at_start_if_exists: str | None = None
    warmup_fails: bool = False
    no_think_end: bool = False
    double_think_start: bool = False
    other_args: dict[str, Any] = {}  # SGLang flags that are accepted, echoed in /server_info, and otherwise ignored


# SGLang's own flags come from its flag data (engines/sglang_flags.json) of the release the stub imitates
# (`--version`): every flag that release accepts is accepted here, with the same spellings, aliases, values and
# unique-prefix abbreviations, and anything it refuses is refused (exit 2). Those listed below are modelled
# (StubConfig fields: SGLang's destination names -> the field); the rest are echoed in /server_info and
# otherwise ignored, except --disable-radix-cache, which turns off the prefix cache (cached_tokens stays 0).
MODELLED = {
    "model_path": ("model_path",), "tokenizer_path": ("tokenizer_path",), "host": ("host",), "port": ("port",),
    "api_key": ("api_key",), "trust_remote_code": ("trust_remote_code",),
    "skip_tokenizer_init": ("skip_tokenizer_init",), "context_length": ("context_length",),
    "max_total_tokens": ("max_total_tokens",), "max_running_requests": ("max_running_requests",),
    "served_model_name": ("served_model_name",),
    "tp_size": ("tp_size", "tensor_parallel_size"), "dp_size": ("dp_size", "data_parallel_size"),
    "enable_metrics": ("enable_metrics",), "stream_interval": ("stream_interval",),
    "incremental_streaming_output": ("incremental_streaming_output", "stream_output"),
    "skip_server_warmup": ("skip_server_warmup",), "preferred_sampling_params": ("preferred_sampling_params",),
    "reasoning_parser": ("reasoning_parser",), "tool_call_parser": ("tool_call_parser",), "log_level": ("log_level",),
}
MODELLED_KWARGS: dict[str, dict[str, Any]] = {
    "model_path": {"required": True}, "host": {"default": "127.0.0.1"}, "port": {"type": int, "default": 30000},
    "trust_remote_code": {"action": "store_true"}, "skip_tokenizer_init": {"action": "store_true"},
    "context_length": {"type": int, "default": 8192},
    "max_total_tokens": {"type": int, "help": "KV pool size in tokens (default 16 x context length)"},
    "max_running_requests": {"type": int, "help": "requests generating at once per DP rank; the rest wait in a "
                                                  "queue (default 1024; SGLang derives it from the KV pool)"},
    "tp_size": {"type": int, "default": 1}, "dp_size": {"type": int, "default": 1},
    "enable_metrics": {"action": "store_true"}, "stream_interval": {"type": int, "default": 1},
    "incremental_streaming_output": {"action": "store_true", "help": "0.5.23's name; 0.5.9's --stream-output"},
    "skip_server_warmup": {"action": "store_true"},
    "preferred_sampling_params": {"help": "JSON object merged under every request's sampling_params"},
    "log_level": {"default": "info"},
}


class _Parser(argparse.ArgumentParser):
    """SGLang's argparse semantics for SGLang's flags; the stub's own flags must be spelled in full.

    SGLang's parser accepts unique prefixes (allow_abbrev). Here only SGLang's flags take part in prefix
    matching, so a stub flag can never make an abbreviation ambiguous that SGLang accepts (e.g. `--tool-call`
    means --tool-call-parser in SGLang; --tool-call-fraction, the stub's, does not compete for it).
    """

    own_actions: set = set()

    def error(self, message: str):
        sys.stderr.write(f"{LOG_PREFIX} error: {message}\n")
        sys.exit(2)

    def _get_option_tuples(self, option_string):
        return [t for t in super()._get_option_tuples(option_string) if t[0] not in self.own_actions]


def _profile(argv: list[str] | None) -> str:
    """The `--version` (wire profile) on the command line, read before the rest: it picks SGLang's flag set."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--version", default="0.5.23")
    ns, _ = pre.parse_known_args(argv)
    return ns.version if ns.version in VERSIONS else "0.5.23"  # a bad one is refused by the full parser


def build_parser(version: str = "0.5.23") -> argparse.ArgumentParser:
    from ..sglang_flags import add_to_parser, flag_set

    flags = flag_set(version)
    p = _Parser(
        prog="python -m toolkit.engines.stub_server",
        description="Stand-in SGLang server (a protocol test double, not a model).",
    )
    by_dest = {f.dest: f for f in flags.flags}
    g = p.add_argument_group(f"SGLang {version} flags the stub models")
    modelled_dests = set()
    for name, dests in MODELLED.items():
        known = MODELLED_KWARGS.get(name, {})
        p.set_defaults(**{name: known.get("default", False if known.get("action") == "store_true" else None)})
        flag = next((by_dest[d] for d in dests if d in by_dest), None)
        if flag is None:
            continue
        modelled_dests.add(flag.dest)
        kwargs = dict(MODELLED_KWARGS.get(name, {}))
        if flag.choices is not None:
            kwargs["choices"] = list(flag.choices)
        g.add_argument(*flag.options, dest=name, **kwargs)
    add_to_parser(p.add_argument_group(f"other SGLang {version} flags (accepted, echoed in /server_info)"), flags,
                  skip_dests=modelled_dests)
    s = p.add_argument_group("stub behaviour and fault injection (spelled in full: no abbreviations)")
    before = set(p._actions)
    a = s.add_argument
    a("--version", choices=VERSIONS, default="0.5.23", help="wire profile to imitate, and SGLang flag set to accept")
    a("--think-start", default="<think>")
    a("--think-end", default="</think>")
    a("--load-delay", type=float, default=0.0, help="seconds before the port opens (weights 'loading')")
    a("--warmup-delay", type=float, default=0.0, help="seconds of 503 on /health* and /ready after the port opens")
    a("--token-delay", type=float, default=0.0, help="seconds per generated token")
    a("--drain-poll", type=float, default=5.0, help="poll interval of the SIGTERM drain (SGLang: 5 s)")
    a("--keep-alive-timeout", type=float, default=5.0,
      help="idle keep-alive connections close after this (uvicorn: 5 s)")
    a("--health-check-timeout", type=float, default=20.0,
      help="while generation is wedged (--hang-after), /health* waits this long, then 503 (SGLang: 20 s)")
    a("--fixed-output-tokens", type=int, help="every output exactly N tokens (think-end and EOS included)")
    a("--truncate-fraction", type=float, default=0.10, help="share of outputs longer than max_new_tokens")
    a("--tool-call-fraction", type=float, default=0.15, help="share of outputs with a tool-call section")
    a("--hang", action="store_true", help="listen but never become ready; /generate never answers")
    a("--ignore-sigterm", action="store_true", help="log SIGTERM and go on serving (a shutdown that hangs)")
    a("--hang-after", type=int, help="/generate requests after the N-th never answer")
    a("--crash-after", type=int, help="exit abruptly (status 1) on the N-th /generate request")
    a("--fail-5xx", metavar="START:COUNT", help="/generate requests START..START+COUNT-1 get HTTP 503")
    a("--nan-every", type=int, metavar="N", help="every N-th /generate request ends in SGLang's NaN stop: half its "
      "output, then an EOS id, finish_reason {type: stop, matched: 'NaN happened'}")
    a("--exit-at-start", type=int, metavar="CODE", help="exit with CODE at once")
    a("--exit-at-start-if-exists", metavar="PATH", help="exit 1 at once if PATH exists")
    a("--warmup-fails", action="store_true", help="the warm-up fails: the process kills itself when it ends")
    a("--no-think-end", action="store_true", help="outputs never contain the think-end token")
    a("--double-think-start", action="store_true", help="emit think-start even when the prompt opened it")
    p.own_actions = set(p._actions) - before
    clash = [o for act in p.own_actions for o in act.option_strings if o in flags]
    assert not clash, f"stub flags {clash} are SGLang {version} flags too: rename them"
    p.sglang_flags = flags
    p.modelled_dests = modelled_dests
    return p


def parse_config(argv: list[str] | None) -> StubConfig:
    """Parse the command line as SGLang would (a flag SGLang refuses makes the stub exit 2, like SGLang)."""
    parser = build_parser(_profile(argv))
    ns = parser.parse_args(argv)
    fail_5xx = None
    if ns.fail_5xx:
        try:
            start, count = (int(x) for x in ns.fail_5xx.split(":"))
        except ValueError:
            parser.error(f"--fail-5xx wants START:COUNT (two integers), got {ns.fail_5xx!r}")
        fail_5xx = (start, count)
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
    other = {f.dest: getattr(ns, f.dest, None) for f in parser.sglang_flags.flags
             if f.dest not in parser.modelled_dests and f.action != "help"}
    cfg = StubConfig(
        model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, host=ns.host, port=ns.port,
        api_key=ns.api_key or None, trust_remote_code=ns.trust_remote_code,
        skip_tokenizer_init=ns.skip_tokenizer_init, context_length=ns.context_length,
        max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
        served_model_name=ns.served_model_name, tp_size=ns.tp_size,
        dp_size=ns.dp_size, enable_metrics=ns.enable_metrics, stream_interval=max(1, ns.stream_interval),
        incremental_streaming_output=ns.incremental_streaming_output, skip_server_warmup=ns.skip_server_warmup,
        preferred_sampling_params=preferred, reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser, log_level=ns.log_level, version=ns.version,
        think_start=ns.think_start, think_end=ns.think_end, load_delay=ns.load_delay,
        warmup_delay=ns.warmup_delay, token_delay=ns.token_delay, drain_poll=max(0.01, ns.drain_poll),
        keep_alive_timeout=ns.keep_alive_timeout, health_check_timeout=ns.health_check_timeout,
        fixed_output_tokens=ns.fixed_output_tokens,
        truncate_fraction=ns.truncate_fraction, tool_call_fraction=ns.tool_call_fraction, hang=ns.hang, ignore_sigterm=ns.ignore_sigterm,
        hang_after=ns.hang_after, crash_after=ns.crash_after, fail_5xx=fail_5xx, nan_every=ns.nan_every,
        exit_at_start=ns.exit_at_start,
        exit_at_start_if_exists=ns.exit_at_start_if_exists, warmup_fails=ns.warmup_fails,
        no_think_end=ns.no_think_end, double_think_start=ns.double_think_start,
        other_args={k: v for k, v in other.items() if v not in (None, False)},
    )
    return cfg


# ================================================================================================
# The "model": token material taken from the job's tokenizer, and the deterministic output rule
# ================================================================================================

# Tool-call sections per family: (tokens that must each be one id, text format with {name}/{args}/{i}).
TOOL_FORMATS = (
    ("kimi", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
              "<|tool_call_end|>", "<|tool_calls_section_end|>"),
     "<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>",
     "<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"),
    ("qwen3", ("<tool_call>", "</tool_call>"),
     "{calls}",
     "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>"),
    ("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                  "<｜tool▁calls▁end｜>"),
     "<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>",
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"),
)
TOOL_CALLS = (
    (("get_weather", {"city": "Paris", "unit": "celsius"}),),
    (("search", {"query": "boiling point of water at altitude"}),),
    (("calculator", {"expression": "17 * 23 + 4"}),),
    (("get_weather", {"city": "Oslo"}), ("get_time", {"timezone": "Europe/Oslo"})),
    (("lookup", {"topic": "python context managers", "max_results": 3}),),
    (("run_python", {"code": "print(sum(range(10)))"}),),
)


class StubModel:
    """Token material of one tokenizer, loaded once at start; `plan_output` turns it into outputs."""

    def __init__(self, cfg: StubConfig):
        from transformers import AutoTokenizer

        path = cfg.tokenizer_path or cfg.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        tok = self.tokenizer
        self.vocab_size = len(tok)
        self.model_config = _read_json(Path(cfg.model_path) / "config.json")
        config_eos = _ids(self.model_config.get("eos_token_id"))
        generation_eos = _ids(_read_json(Path(cfg.model_path) / "generation_config.json").get("eos_token_id"))
        tokenizer_eos = _ids(tok.eos_token_id)
        # SGLang's stop set: config.json and generation_config.json eos ids, plus the tokenizer's eos unless
        # the tokenizer is not initialised (protocol notes §1.3).
        self.eos_ids = frozenset(config_eos + generation_eos + ([] if cfg.skip_tokenizer_init else tokenizer_eos))
        emitted = generation_eos or config_eos or tokenizer_eos
        if not emitted:
            raise SystemExit(f"{LOG_PREFIX} no eos_token_id in {path} (config.json, generation_config.json, tokenizer)")
        self.eos_id = emitted[0]
        if self.eos_id not in self.eos_ids:
            logger.warning("the EOS the stub emits (%d) is not a stop token in this mode; outputs run to "
                           "max_new_tokens", self.eos_id)
        self.think_start_id = self.single_id(cfg.think_start)
        self.think_end_id = self.single_id(cfg.think_end)
        if self.think_start_id is None or self.think_end_id is None:
            logger.warning("%r/%r are not single tokens of this tokenizer: outputs have no reasoning section",
                           cfg.think_start, cfg.think_end)
            self.think_start_id = self.think_end_id = None
        self.sep_ids = tok.encode("\n\n", add_special_tokens=False)
        self.tool_family, self.tool_sections = self._tool_sections()
        control = set(self.eos_ids) | {self.think_start_id, self.think_end_id} | set(tok.all_special_ids)
        for section in self.tool_sections:
            control.update(t for t in section if self.tokenizer.convert_ids_to_tokens(t) in _TOOL_TOKENS)
        self._encode_corpus(_help_text(CORPUS_CHARS), control)
        self._newline_only: dict[int, bool] = {}
        self._segment_text: dict[tuple[tuple[int, ...], bool], str] = {}
        self._fast_decode = self._pick_decoder()
        cleanup = getattr(tok, "clean_up_tokenization_spaces", False)  # rewrites text across token boundaries
        self.fast_text = self.cuts is not None and not cleanup and self._check_fast_text(cfg)

    def _encode_corpus(self, text: str, control: set) -> None:
        """Token ids of the help text, and where each token starts in it (for slicing text instead of decoding)."""
        tok = self.tokenizer
        self.corpus_text, self.cuts, self.unsafe_cuts = text, None, frozenset()
        try:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        except Exception:  # noqa: BLE001 - slow or remote-code tokenizers have no offsets: decode instead
            ids, offsets = tok.encode(text, add_special_tokens=False), None
        if any(t in control for t in ids):
            ids, offsets = [t for t in ids if t not in control], None
        self.corpus = ids
        if offsets and len(offsets) == len(ids):
            # cut[i]: where token i starts (the end of token i-1); a cut inside one character is unsafe.
            self.cuts = [0] + [end for _, end in offsets]
            self.unsafe_cuts = frozenset(i for i in range(1, len(ids)) if offsets[i][0] < offsets[i - 1][1])

    def _check_fast_text(self, cfg: StubConfig) -> bool:
        """Slicing the corpus text must give exactly `tokenizer.decode`; checked on sample outputs at start."""
        rng = random.Random(0)
        sp = Sampling(max_new_tokens=400)
        for k in range(60):
            prompt = [rng.randrange(self.vocab_size) for _ in range(8)]
            segments = plan_output(self, cfg, prompt, sp, 400, k)
            flat = [t for _, ids in segments for t in ids]
            for cut in (len(flat), rng.randrange(len(flat) + 1)):
                for skip in (True, False):
                    sliced = self._sliced_text(segments, cut, skip)
                    if sliced is not None and sliced != self.decode(flat[:cut], skip):
                        logger.info("text is decoded per request (slicing the corpus text differs from decode)")
                        return False
        return True

    def _sliced_text(self, segments: list[tuple[int, list[int]]], k: int, skip: bool) -> str | None:
        """Text of the first k planned tokens from corpus-text slices, or None where a cut splits a character."""
        parts, cuts, unsafe = [], self.cuts, self.unsafe_cuts
        for start, ids in segments:
            if k <= 0:
                break
            m = min(k, len(ids))
            if start >= 0:
                if start in unsafe or start + m in unsafe:
                    return None
                parts.append(self.corpus_text[cuts[start]:cuts[start + m]])
            else:
                key = (tuple(ids[:m]), skip)
                text = self._segment_text.get(key)
                if text is None:
                    text = self._segment_text[key] = self.decode(ids[:m], skip)
                parts.append(text)
            k -= m
        return "".join(parts)

    def prefix_text(self, segments: list[tuple[int, list[int]]], planned: list[int], k: int, skip: bool) -> str:
        """`decode(planned[:k])`, by slicing when that is known to give the same text."""
        if self.fast_text:
            text = self._sliced_text(segments, k, skip)
            if text is not None:
                return text
        return self.decode(planned[:k], skip)

    def single_id(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _tool_sections(self) -> tuple[str | None, list[list[int]]]:
        for family, tokens, section, call in TOOL_FORMATS:
            if all(self.single_id(t) is not None for t in tokens):
                out = []
                for calls in TOOL_CALLS:
                    body = "".join(call.format(name=name, args=json.dumps(args), i=i)
                                   for i, (name, args) in enumerate(calls))
                    out.append(self.tokenizer.encode(section.format(calls=body), add_special_tokens=False))
                return family, out
        return None, []

    def _pick_decoder(self) -> Callable[[list[int], bool], str]:
        """The tokenizers backend's decode when it gives the same text as `tokenizer.decode` (it is faster)."""
        tok = self.tokenizer
        slow = lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)  # noqa: E731
        raw = getattr(tok, "_tokenizer", None)
        if raw is None or getattr(tok, "clean_up_tokenization_spaces", False):
            return slow
        sample = self.corpus[:300] + [self.eos_id] + self.corpus[300:400]
        if self.think_end_id is not None:
            sample.insert(50, self.think_end_id)
        try:
            same = all(raw.decode(sample, skip_special_tokens=s) == slow(sample, s) for s in (True, False))
        except Exception:  # noqa: BLE001 - any mismatch of APIs means: use the slow path
            same = False
        return (lambda ids, skip: raw.decode(ids, skip_special_tokens=skip)) if same else slow

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast_decode(ids, skip_special_tokens)

    def is_newline_only(self, token_id: int) -> bool:
        known = self._newline_only.get(token_id)
        if known is None:
            try:
                text = self.tokenizer.decode([token_id])
            except Exception:  # noqa: BLE001 - prompt ids are not range-checked (neither are they in SGLang)
                text = ""
            known = self._newline_only[token_id] = bool(text) and not text.strip("\r\n")
        return known

    def prompt_ends_with(self, prompt: list[int], token_id: int | None) -> bool:
        """Whether the prompt ends with `token_id`, ignoring trailing newline-only tokens."""
        if token_id is None:
            return False
        for t in reversed(prompt[-16:]):
            if t == token_id:
                return True
            if not self.is_newline_only(t):
                return False
        return False


_TOOL_TOKENS = frozenset(t for _, tokens, _, _ in TOOL_FORMATS for t in tokens)


def _help_text(chars: int) -> str:
    """English prose shipped with Python (the pydoc help topics), in a fixed order."""
    from pydoc_data.topics import topics

    parts, total = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        total += len(topics[key])
        if total >= chars:
            break
    return "\n\n".join(parts)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise SystemExit(f"{LOG_PREFIX} {path} is not valid JSON ({e}); fix or remove it") from None
    return data if isinstance(data, dict) else {}


class Sampling(msgspec.Struct, kw_only=True):
    """One request's sampling_params after SGLang's defaults and normalisation."""

    max_new_tokens: int | None = 128
    max_new_tokens_given: bool = False
    stop: list[str] = []
    stop_token_ids: frozenset[int] = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] = {}
    sampling_seed: int | None = None
    grammars: int = 0


def output_seed(prompt: list[int], sp: Sampling, sample: int) -> int:
    """The PRNG seed of one output: a hash of the prompt ids and of the params that change sampling.

    Length and stop params (max_new_tokens, stop, ignore_eos, ...) are left out; parallel samples (n > 1)
    differ by their index unless decoding is greedy.
    """
    h = hashlib.blake2b(_json_encode(prompt), digest_size=8)
    h.update(_json_encode([sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.frequency_penalty,
                           sp.presence_penalty, sp.repetition_penalty, sp.sampling_seed]))
    if sp.top_k != 1:
        h.update(sample.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little")


Segments = list  # [(corpus offset, or -1 for control tokens, [ids])]: the plan of one output, in order


def plan_output(model: StubModel, cfg: StubConfig, prompt: list[int], sp: Sampling, budget: int,
                sample: int) -> Segments:
    """What the "model" writes for this prompt, before the server cuts at a stop or at `budget`.

    Rule: seed a PRNG from (prompt ids, sampling params). The output is [think-start] + reasoning +
    think-end + "\\n\\n" + answer + [tool-call section] + EOS. Think-start is written unless the prompt
    already ends with it (template-opened, Kimi/DeepSeek style), or always with --double-think-start. A prompt
    ending with think-end (thinking disabled by the template) gets an answer only. Reasoning and answer are
    contiguous runs of the help-topics token stream at PRNG-chosen offsets. The total length is a PRNG
    fraction of max_new_tokens (the budget); `truncate_fraction` of outputs are drawn longer than it, and
    `tool_call_fraction` end their answer with a tool-call section of the tokenizer's family.
    With --fixed-output-tokens N the total is exactly N and there is no tool call.
    """
    rng = random.Random(output_seed(prompt, sp, sample))
    fixed = cfg.fixed_output_tokens
    scale = sp.max_new_tokens if sp.max_new_tokens is not None else min(budget, 2048)
    scale = max(1, min(scale, budget) if scale else 1)
    if fixed is not None:
        total = max(0, fixed)
    elif rng.random() < cfg.truncate_fraction:
        total = scale + 1 + int(scale * rng.uniform(0.05, 0.5))
    else:
        total = max(1, min(scale, round(scale * rng.uniform(0.08, 0.95))))
    total = max(total, sp.min_new_tokens)

    thinking = model.think_end_id is not None and not model.prompt_ends_with(prompt, model.think_end_id)
    head, end, sep = [], [], []
    if thinking:
        opened = model.prompt_ends_with(prompt, model.think_start_id)
        if not opened or cfg.double_think_start:
            head = [model.think_start_id]
        if not cfg.no_think_end:
            end = [model.think_end_id]
        sep = model.sep_ids
    tool: list[int] = []
    if fixed is None and model.tool_sections and rng.random() < cfg.tool_call_fraction:
        tool = model.tool_sections[rng.randrange(len(model.tool_sections))]
    content = total - len(head) - len(end) - len(sep) - len(tool) - 1
    if content < 2 and tool:
        content += len(tool)
        tool = []
    if content < 2 and sep:
        content += len(sep)
        sep = []
    content = max(content, 2 if thinking else 1)
    reasoning = round(content * rng.uniform(0.55, 0.85)) if thinking else 0
    reasoning = min(max(reasoning, 1 if thinking else 0), content - 1)
    segments: Segments = []
    corpus, size = model.corpus, len(model.corpus)

    def run(n: int) -> None:  # n corpus tokens from a PRNG offset, wrapping around
        offset = rng.randrange(size)
        while n > 0:
            part = corpus[offset:offset + n]
            segments.append((offset, part))
            n -= len(part)
            offset = 0

    segments.append((-1, head))
    run(reasoning)
    segments += [(-1, end), (-1, sep)]
    run(content - reasoning)
    segments += [(-1, tool), (-1, [model.eos_id])]
    segments = [seg for seg in segments if seg[1]]
    written = sum(len(ids) for _, ids in segments)
    while fixed is not None and written > total:  # a tiny fixed length keeps the plan's end (think-end, EOS)
        start, ids = segments[0]
        drop = min(written - total, len(ids))
        segments[0] = (start + drop if start >= 0 else -1, ids[drop:])
        if not segments[0][1]:
            segments.pop(0)
        written -= drop
    if (sp.ignore_eos or model.eos_id not in model.eos_ids) and written < budget:
        run(budget - written)  # nothing stops it: the model writes on past its EOS
    return segments


def _positions(ids: list[int], token: int | None) -> list[int]:
    out: list[int] = []
    if token is None:
        return out
    i = -1
    try:
        while True:
            i = ids.index(token, i + 1)
            out.append(i)
    except ValueError:
        return out


def drop_planned(segments: Segments, n: int) -> Segments:
    """The plan without its first `n` tokens (corpus offsets moved along, so text slicing still works)."""
    out: Segments = []
    for start, ids in segments:
        if n >= len(ids):
            n -= len(ids)
            continue
        out.append((start + n if start >= 0 and n else start, ids[n:] if n else ids))
        n = 0
    return out


def plan_continuation(model: StubModel, cfg: StubConfig, prompt: list[int], sp: Sampling, budget: int,
                      sample: int) -> Segments | None:
    """The rest of an output when `prompt` is an earlier prompt plus the start of what the stub wrote for it.

    A request aborted mid-generation is continued by sending `input_ids = prompt + partial output` with
    max_new_tokens (and min_new_tokens) reduced by the partial's length. A model would go on writing from
    there; the stub does the same: it looks for a split `prompt[:k] | prompt[k:]` where the second part is the
    start of plan_output(prompt[:k]) with the original budget, and answers with the rest of that plan — so a
    stopped-and-continued output is token for token the uninterrupted one. Split candidates are only where an
    output can begin (at a think-start, or after a think-start / think-end that ends a prompt, give or take
    newline tokens), so a plain prompt costs a few list scans. A last token that is a think-start is not taken
    for a one-token output: a prompt the template opens in reasoning would be mistaken for a shorter prompt plus
    the think-start its output begins with. None: not a continuation.
    """
    n = len(prompt)
    cands: set[int] = set()
    for j in _positions(prompt, model.think_start_id):
        cands.update((j, j + 1, j + 2, j + 3))
    for j in _positions(prompt, model.think_end_id):
        cands.update((j + 1, j + 2, j + 3))
    for k in sorted(c for c in cands if 0 < c < n):
        head, p = prompt[:k], n - k
        if p == 1 and prompt[k] == model.think_start_id:
            continue
        sp0 = msgspec.structs.replace(
            sp, max_new_tokens=None if sp.max_new_tokens is None else sp.max_new_tokens + p,
            min_new_tokens=sp.min_new_tokens + p if sp.min_new_tokens else 0)
        segments = plan_output(model, cfg, head, sp0, budget + p, sample)
        got, need = 0, prompt[k:]
        for _, ids in segments:  # compare the plan's first p tokens with the tail, segment by segment
            m = min(len(ids), p - got)
            if ids[:m] != need[got:got + m]:
                break
            got += m
            if got == p:
                break
        if got == p:
            return drop_planned(segments, p)
    return None


# ================================================================================================
# Request validation: the 0.5.23 schema gate (serde-style texts) and SGLang's ValueErrors
# ================================================================================================


class ContractError(ValueError):
    """A schema-contract violation: 400 {"error": "<text>"} in 0.5.23 (a 500 in 0.5.9, which has no gate)."""


class RequestError(ValueError):
    """SGLang's ValueError path: 400 {"error": {"message": "<text>"}} (or an SSE error event when streaming)."""


SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
)
_SAMPLING_KINDS = {
    "max_new_tokens": "int", "stop": "strs", "stop_token_ids": "ints", "stop_regex": "strs", "temperature": "float",
    "top_p": "float", "top_k": "int", "min_p": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "repetition_penalty": "float", "min_new_tokens": "int", "n": "int", "json_schema": "str", "regex": "str",
    "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool", "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool", "no_stop_trim": "bool", "stream_interval": "int",
    "logit_bias": "float_map", "sampling_seed": "int", "custom_params": "any", "beam_width": "int",
}


def _unexpected(v: Any) -> str:
    """serde's description of an unexpected JSON value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _want_int(v: Any, expected: str = "i64") -> None:
    if type(v) is not int:
        raise _invalid(v, expected)


def _want_bool(v: Any, expected: str = "a boolean") -> None:
    if type(v) is not bool:
        raise _invalid(v, expected)


def _want_str(v: Any, expected: str = "a string") -> None:
    if type(v) is not str:
        raise _invalid(v, expected)


def _want_seq(v: Any) -> list:
    if type(v) is not list:
        raise _invalid(v, "a sequence")
    return v


def _token_ids(v: list) -> None:
    for x in v:
        if type(x) is not int:
            raise _invalid(x, "i64")


def _token_ids_or_list(v: Any) -> None:
    if type(v) is not list:
        raise _invalid(v, "a value or an array of values for TokenIdsOrList")
    if not v or (type(v[0]) in (int, float)):
        _token_ids(v)
    else:
        for row in v:
            _token_ids(_want_seq(row))


def _str_or_list(v: Any, what: str = "StringOrList") -> None:
    if type(v) is list:
        for x in v:
            _want_str(x)
    else:
        _want_str(v, f"a value or an array of values for {what}")


def _sampling_params(v: Any) -> None:
    for key, x in v.items():
        kind = _SAMPLING_KINDS.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is None or kind == "any":
            continue
        if kind == "int":
            _want_int(x)
        elif kind == "float":
            if type(x) not in (int, float):
                raise _invalid(x, "f64")
        elif kind == "bool":
            _want_bool(x)
        elif kind == "str":
            _want_str(x)
        elif kind == "strs":
            _str_or_list(x)
        elif kind == "ints":
            for e in _want_seq(x):
                _want_int(e)
        elif kind == "float_map":
            if type(x) is not dict:
                raise _invalid(x, "a map")
            for e in x.values():
                if type(e) not in (int, float):
                    raise _invalid(e, "f64")


def check_contract(obj: Any) -> None:
    """0.5.23's schema gate over a /generate body (unknown top-level keys are ignored)."""
    if type(obj) is not dict:
        raise _invalid(obj, "struct GenerateRequest")
    for key, x in obj.items():
        if x is None:
            continue
        if key == "input_ids" or key == "token_ids_logprob":
            _token_ids_or_list(x)
        elif key == "rid" or key == "text":
            _str_or_list(x)
        elif key == "stream" or key == "return_text_in_logprobs":
            _want_bool(x)
        elif key == "sampling_params":
            if type(x) is list:
                for e in x:
                    if type(e) is not dict:
                        raise _invalid(e, "struct SamplingParams")
                    _sampling_params(e)
            elif type(x) is dict:
                _sampling_params(x)
            else:
                raise _invalid(x, "a value or an array of values for SamplingParamsOrList")
        elif key == "return_logprob" or key == "return_hidden_states":
            if type(x) is list:
                for e in x:
                    _want_bool(e)
            else:
                _want_bool(x, "a value or an array of values for BoolOrList")
        elif key == "logprob_start_len" or key == "top_logprobs_num":
            if type(x) is list:
                for e in x:
                    _want_int(e)
            else:
                _want_int(x, "a value or an array of values for Int64OrList")
        elif key == "routed_dp_rank" or key == "disagg_prefill_dp_rank":
            _want_int(x)


def make_sampling(raw: dict, preferred: dict | None, skip_tokenizer: bool, version: str) -> Sampling:
    """SamplingParams(**raw) then verify(), with SGLang's defaults for absent or null keys."""
    if preferred:
        raw = {**preferred, **raw}
    g = raw.get
    sp = Sampling()
    if "max_new_tokens" in raw:
        sp.max_new_tokens = g("max_new_tokens")
        sp.max_new_tokens_given = sp.max_new_tokens is not None
    stop = g("stop")
    sp.stop = [stop] if isinstance(stop, str) else list(stop or [])
    sp.stop_token_ids = frozenset(x for x in (g("stop_token_ids") or ()) if x is not None)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        v = g(name)
        if v is not None:
            setattr(sp, name, float(v))
    for name in ("min_new_tokens", "n", "stream_interval", "sampling_seed"):
        v = g(name)
        if v is not None:
            setattr(sp, name, v)
    top_k = g("top_k")
    sp.top_k = TOP_K_ALL if top_k is None or top_k == -1 else top_k
    for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        v = g(name)
        if v is not None:
            setattr(sp, name, v)
    sp.logit_bias = g("logit_bias") or {}
    sp.grammars = sum(g(k) is not None for k in ("json_schema", "regex", "ebnf"))
    if 0 <= sp.temperature < SAMPLING_EPS:  # greedy is top_k = 1
        sp.temperature, sp.top_k = 1.0, 1
    if skip_tokenizer:
        if sp.stop:
            raise RequestError(f"stop={sp.stop!r} is unavailable when skip_tokenizer_init=True "
                               "(requires tokenizer to decode tokens to text for matching).")
        if g("stop_regex"):
            regex = g("stop_regex")
            regex = [regex] if isinstance(regex, str) else regex
            raise RequestError(f"stop_regex={regex!r} is unavailable when skip_tokenizer_init=True "
                               "(requires tokenizer to decode tokens to text for matching).")
        if sp.min_new_tokens > 0:
            raise RequestError(f"min_new_tokens={sp.min_new_tokens} is unavailable when skip_tokenizer_init=True "
                               "(requires tokenizer for eos_token_id).")
    return sp


def verify_sampling(sp: Sampling, vocab_size: int, version: str) -> None:
    """SGLang's SamplingParams.verify messages."""
    t = sp.temperature
    if not (t == t and abs(t) != float("inf")) or t < 0.0:
        if version == "0.5.9":
            raise RequestError(f"temperature must be non-negative, got {t}.")
        raise RequestError(f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {sp.top_p}.")
    if not 0.0 <= sp.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {sp.min_p}.")
    if sp.top_k < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {sp.top_k}.")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}.")
    if not -2.0 <= sp.presence_penalty <= 2.0:
        raise RequestError(f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}.")
    if version == "0.5.9":
        if not 0.0 <= sp.repetition_penalty <= 2.0:
            raise RequestError(f"repetition_penalty must be in [0, 2], got {sp.repetition_penalty}.")
    elif not 0.0 < sp.repetition_penalty <= 2.0:
        raise RequestError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {sp.repetition_penalty}.")
    if not 0 <= sp.min_new_tokens:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {sp.min_new_tokens}.")
    if sp.max_new_tokens is not None:
        if sp.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
        if not sp.min_new_tokens <= sp.max_new_tokens:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({sp.max_new_tokens})], "
                               f"got {sp.min_new_tokens}.")
    for token_id in sp.logit_bias:
        try:
            ok = 0 <= int(token_id) < vocab_size
        except ValueError:
            ok = False
        if not ok:
            raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if sp.grammars > 1:
        raise RequestError("Only one of regex, json_schema, or ebnf can be set.")


# ================================================================================================
# Outputs: where generation stops, the text, the response objects
# ================================================================================================


class PrefixCache:
    """SGLang's radix cache, as far as `meta_info.cached_tokens` shows it: a prompt's tokens already computed for
    an earlier prompt with the same leading tokens. At most len(prompt) - 1 count (the last one is always
    computed, for its logits). Prompts are cached when admitted, outputs are not (a dataset's prompts share
    their template and system prompt, never another prompt's answer); `/flush_cache` empties it, and past
    `capacity` prefixes it is emptied too (eviction, coarsely).
    """

    def __init__(self, capacity: int = 4_000_000):
        self.capacity = capacity
        self._seen: set[int] = set()  # hashes of every cached prefix (prefix-closed: all shorter ones are in)

    def admit(self, prompt: list[int]) -> int:
        """The number of cached tokens of `prompt`, which is then cached itself."""
        if len(self._seen) + len(prompt) > self.capacity:
            self._seen.clear()
        seen, h, cached, hit = self._seen, 0, 0, True
        for k, token in enumerate(prompt):
            h = hash((h, token))
            if hit and h in seen:
                cached = k + 1
            else:
                hit = False
                seen.add(h)
        return min(cached, len(prompt) - 1)

    def clear(self) -> None:
        self._seen.clear()


class Item(msgspec.Struct, kw_only=True):
    """One sequence of a /generate request (a batch or n > 1 has several)."""

    rid: str
    index: int
    prompt: list[int]
    sp: Sampling
    budget: int  # max_new_tokens after the scheduler's clamp
    cached: int = 0  # prompt tokens found in the prefix cache
    segments: Segments = []  # the plan of what the "model" writes (see plan_output)
    planned: list[int] = []  # the same, flat and uncut
    output: list[int] = []  # generated tokens, through the stop token
    finish: dict | None = None
    trim: int = 0  # tokens of `output` left out of text (a trimmed stop token)
    stop_str: str | None = None  # matched stop string (text is cut at it)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


def finish_item(model: StubModel, item: Item) -> None:
    """Cut the planned tokens where SGLang would stop: stop string, stop token, or max_new_tokens.

    The plan holds an EOS only as its last token (the corpus is free of control ids), so only request
    `stop_token_ids` need a scan.
    """
    sp, planned, budget = item.sp, item.planned, item.budget
    window = planned[:budget]
    k_tok = None
    if not sp.ignore_eos:
        if planned and len(planned) <= budget and planned[-1] in model.eos_ids:
            k_tok = len(planned)
        for t in sp.stop_token_ids:
            if t in window:
                k = window.index(t) + 1
                k_tok = k if k_tok is None else min(k, k_tok)
    k_str, matched_str = _first_stop_string(model, window, sp) if sp.stop else (None, None)
    if k_str is not None and (k_tok is None or k_str <= k_tok):
        item.output = window[:k_str]
        item.finish = {"type": "stop", "matched": matched_str}
        item.stop_str = matched_str
    elif k_tok is not None:
        item.output = window[:k_tok]
        item.finish = {"type": "stop", "matched": window[k_tok - 1]}
        item.trim = 0 if sp.no_stop_trim else 1
    else:
        item.output = window
        item.finish = {"type": "length", "length": budget}


NAN_MATCHED = "NaN happened"


def nan_stop(model: StubModel, item: Item) -> None:
    """SGLang 0.5.23's NaN stop: the token sampled from NaN logits is replaced by a stop id and the output ends
    there, as if stopped, with finish_reason {"type": "stop", "matched": "NaN happened"} (schedule_batch.py)."""
    item.output = item.output[: len(item.output) // 2] + [model.eos_id]
    item.finish = {"type": "stop", "matched": NAN_MATCHED}
    item.trim, item.stop_str = 1, None


def _first_stop_string(model: StubModel, ids: list[int], sp: Sampling) -> tuple[int | None, str | None]:
    """The shortest prefix of ids whose text contains a stop string (binary search over decodes)."""
    skip = sp.skip_special_tokens
    full = model.decode(ids, skip)
    if not any(s and s in full for s in sp.stop):
        return None, None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = model.decode(ids[:mid], skip)
        if any(s and s in text for s in sp.stop):
            hi = mid
        else:
            lo = mid + 1
    text = model.decode(ids[:lo], skip)
    first = min((text.find(s), s) for s in sp.stop if s and s in text)
    return lo, first[1]


def item_text(model: StubModel, item: Item, ids: list[int], final: bool) -> str:
    """The `text` of ids (a prefix of the plan); a finished output loses its stop token or string (unless
    no_stop_trim)."""
    skip = item.sp.skip_special_tokens
    if final and item.stop_str is not None:
        text = model.decode(ids, skip)
        cut = text.find(item.stop_str)
        return text[:cut + len(item.stop_str)] if item.sp.no_stop_trim else text[:cut]
    k = len(ids) - (item.trim if final else 0)
    return model.prefix_text(item.segments, item.planned, k, skip)


def fake_logprob(token_id: int, position: int) -> float:
    """A deterministic, plausible log-probability (the stub has no model)."""
    return -round(((token_id * 2654435761 + position * 40503) % 9973) / 9973 * 3.0, 6)


# ================================================================================================
# The HTTP server
# ================================================================================================

REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 411: "Length Required", 413: "Payload Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable",
}
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
NOT_FOUND = (404, b'{"detail":"Not Found"}', JSON)
NOT_ALLOWED = (405, b'{"detail":"Method Not Allowed"}', JSON)
MAX_HEAD = 64 * 1024

Reply = tuple  # (status, body bytes, content type or None)


class Request(msgspec.Struct):
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class InFlight(msgspec.Struct, kw_only=True):
    rid: str
    started: float
    aborted: asyncio.Event | None = None
    aborted_at: float = 0.0  # loop time of the abort
    prompt_len: int = 0
    begin: float | None = None  # loop time generation began (None: waiting in the queue, or not delayed)
    planned: int = 0  # tokens it will write if nothing stops it


ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class Connection(asyncio.Protocol):
    """One client connection: parses HTTP/1.1 requests in order and writes the answers."""

    def __init__(self, server: "StubServer"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: tuple | None = None  # parsed head of the request whose body is still arriving
        self.busy = False
        self.closed = False
        self.task: asyncio.Task | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.writable: asyncio.Event | None = None
        self.keep_alive = True

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.idle:
            self.idle.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: SGLang aborts the request
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        self.writable = asyncio.Event()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()
            self.writable = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    # -- requests --------------------------------------------------------------------------------
    def _next(self) -> None:
        while not self.busy and not self.closed:
            req = self._parse()
            if req is None:
                return
            if self.idle:
                self.idle.cancel()
                self.idle = None
            self.busy = True
            self.keep_alive = req.keep_alive
            try:
                result = self.server.dispatch(self, req)
            except Exception:  # noqa: BLE001 - a handler bug must not kill the server
                logger.exception("request %s %s failed", req.method, req.path)
                result = (500, b"Internal Server Error", TEXT)
            if isinstance(result, tuple):
                self.send(*result)
                self._done(resume=False)  # this loop goes on with any pipelined request
            else:
                self.task = asyncio.get_running_loop().create_task(self._run(result))

    async def _run(self, coro) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001
            logger.exception("request handler failed")
            result = (500, b"Internal Server Error", TEXT)
        if result is not None and not self.closed:
            self.send(*result)
        self.task = None
        self._done(resume=True)

    def _done(self, resume: bool) -> None:
        self.busy = False
        if self.closed:
            return
        if not self.keep_alive:
            self.transport.close()
            self.closed = True
            return
        if not self.buf:
            self._arm_idle()
        elif resume:
            self._next()

    def _arm_idle(self) -> None:
        timeout = self.server.cfg.keep_alive_timeout
        if timeout > 0 and not self.closed:
            self.idle = asyncio.get_running_loop().call_later(timeout, self._close_idle)

    def _close_idle(self) -> None:
        if not self.busy and not self.buf and not self.closed:
            self.transport.close()

    def _parse(self) -> Request | None:
        buf = self.buf
        if self.head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(431)
                return None
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                self._fail(400)
                return None
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            try:
                length = 0 if chunked else int(headers.get("content-length") or 0)
            except ValueError:
                self._fail(400)
                return None
            if length > 1 << 30:
                self._fail(413)
                return None
            del buf[:end + 4]
            self.head = (parts[0], parts[1], parts[2], headers, chunked, length)
            if headers.get("expect", "").lower() == "100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        method, target, version, headers, chunked, length = self.head
        if chunked:
            body = self._dechunk()
            if body is None:
                return None
        else:
            if len(buf) < length:
                return None
            body = bytes(buf[:length])
            del buf[:length]
        self.head = None
        conn = headers.get("connection", "").lower()
        keep = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
        path, _, query = target.partition("?")
        return Request(method, path, query, headers, body, keep)

    def _dechunk(self) -> bytes | None:
        buf, pos, parts = self.buf, 0, []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            except ValueError:
                self._fail(400)
                return None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)
                if end < 0:
                    return None
                del buf[:end + 4]
                return b"".join(parts)
            if len(buf) < eol + 2 + size + 2:
                return None
            parts.append(bytes(buf[eol + 2:eol + 2 + size]))
            pos = eol + 2 + size + 2

    def _fail(self, status: int) -> None:
        self.keep_alive = False
        self.send(status, b"", None)
        self.transport.close()
        self.closed = True

    # -- writing ---------------------------------------------------------------------------------
    def send(self, status: int, body: bytes, ctype: str | None) -> None:
        if self.closed:
            return
        head = f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\nserver: sglang-stub (not a model)\r\n" \
               f"content-length: {len(body)}\r\n"
        if ctype:
            head += f"content-type: {ctype}\r\n"
        if not self.keep_alive:
            head += "connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n" + body if body else head.encode() + b"\r\n")

    def start_stream(self) -> None:
        head = "HTTP/1.1 200 OK\r\nserver: sglang-stub (not a model)\r\n" \
               "content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n"
        if not self.keep_alive:
            head += "connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n")

    async def stream_chunk(self, data: bytes) -> None:
        if self.closed:
            raise asyncio.CancelledError
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if self.writable is not None:
            await self.writable.wait()

    def end_stream(self) -> None:
        if not self.closed:
            self.transport.write(b"0\r\n\r\n")


class StubServer:
    """Server state and request handlers (one instance per process)."""

    def __init__(self, cfg: StubConfig, model: StubModel, started: float):
        self.cfg = cfg
        self.model = model
        self.v9 = cfg.version == "0.5.9"
        self.started = started
        self.status = "starting"  # starting -> up <-> unhealthy; `exiting` is separate, as in SGLang
        self.exiting = False
        self.stop = asyncio.Event()  # set when the process should exit (drained, or forced)
        self.hung = 0  # requests wedged by --hang / --hang-after
        self.connections: set[Connection] = set()
        self.in_flight: dict[str, InFlight] = {}
        self.generate_count = 0
        self.served_name = cfg.served_model_name or cfg.model_path
        self.pool = cfg.max_total_tokens or 16 * cfg.context_length
        self.max_req_len = min(cfg.context_length - 1, self.pool - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.prefix_cache = None if cfg.other_args.get("disable_radix_cache") else PrefixCache()
        self.stats = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "e2e_sum": 0.0, "aborted": 0}
        # The scheduler of delayed requests (--token-delay): at most max_running generate at once, the rest
        # wait in a FIFO queue; `generated` counts every token decoded, also those of requests aborted or
        # dropped by their client (what a GPU spent), `returned` those sent back in answers.
        self.max_running = (cfg.max_running_requests or DEFAULT_MAX_RUNNING) * max(1, cfg.dp_size)
        self.running: dict[int, InFlight] = {}  # by id(): Structs compare by value
        self.waiting: list[tuple[InFlight, asyncio.Future]] = []
        self.counters = {"generated_tokens": 0, "returned_tokens": 0, "aborted_running": 0, "aborted_waiting": 0,
                         "cancelled": 0, "continued": 0}
        self.window = [0, 0, time.monotonic()]  # requests, tokens since the last throughput log line
        self.routes: dict[str, tuple[tuple[str, ...], Callable]] = {
            "/health": (("GET",), self.health), "/health_generate": (("GET",), self.health),
            "/model_info": (("GET",), self.model_info), "/get_model_info": (("GET",), self.model_info_deprecated),
            "/server_info": (("GET",), self.server_info), "/get_server_info": (("GET",), self.server_info),
            "/v1/models": (("GET",), self.v1_models), "/generate": (("POST", "PUT"), self.generate),
            "/abort_request": (("POST",), self.abort_request), "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/v1/loads": (("GET",), self.loads), "/get_loads": (("GET",), self.loads),
            "/stub/counters": (("GET",), self.stub_counters),
        }
        if not self.v9:
            self.routes["/ready"] = (("GET",), self.ready)
        if cfg.enable_metrics:
            self.routes["/metrics"] = (("GET",), self.metrics)

    # -- routing ---------------------------------------------------------------------------------
    def dispatch(self, conn: Connection, req: Request):
        path = req.path
        key = self.cfg.api_key
        if key and req.method != "OPTIONS" and not path.startswith(("/health", "/ready", "/metrics")):
            given = req.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return 401, b'{"error":"Unauthorized"}', JSON
        route = self.routes.get(path)
        if route is None:
            if path.startswith("/v1/models/") and req.method == "GET":
                return self.v1_model(path[len("/v1/models/"):])
            return NOT_FOUND
        if req.method not in route[0]:
            return NOT_ALLOWED
        if path == "/generate":
            return self.generate(conn, req)
        return route[1](req)

    # -- readiness and information ---------------------------------------------------------------
    def health(self, req: Request):
        """/health and /health_generate: 503 while starting or exiting; a wedged generation times out."""
        if self.exiting or self.status == "starting":
            return 503, b"", None
        if not self.hung:
            self.status = "up"
            return 200, b"", None
        return self._health_timeout()

    async def _health_timeout(self) -> Reply:
        await asyncio.sleep(self.cfg.health_check_timeout)  # SGLang: no output within the timeout
        if not self.hung:
            self.status = "up"
            return 200, b"", None
        if self.status != "unhealthy":
            logger.error("Health check failed. Server couldn't get a response from detokenizer for last "
                         "%g seconds. (the stub's generation is wedged on purpose)", self.cfg.health_check_timeout)
        self.status = "unhealthy"
        return 503, b"", None

    def ready(self, req: Request) -> Reply:
        return (200 if self.status == "up" and not self.exiting else 503), b"", None

    def model_info(self, req: Request) -> Reply:
        cfg, mc = self.cfg, self.model.model_config
        info: dict[str, Any] = {"model_path": cfg.model_path}
        if not self.v9:
            info["served_model_name"] = self.served_name
        info.update(tokenizer_path=cfg.tokenizer_path or cfg.model_path, is_generation=True,
                    preferred_sampling_params=json.dumps(cfg.preferred_sampling_params)
                    if cfg.preferred_sampling_params else None, weight_version="default")
        if not self.v9:
            info.update(load_format="auto", reasoning_parser=cfg.reasoning_parser,
                        tool_call_parser=cfg.tool_call_parser, disaggregation_mode="null")
        info.update(has_image_understanding=False, has_audio_understanding=False,
                    model_type=mc.get("model_type", "stub"), architectures=mc.get("architectures", ["StubEngine"]),
                    stub_engine="not a model: a test double of SGLang's HTTP protocol")
        return 200, _json_encode(info), JSON

    def model_info_deprecated(self, req: Request) -> Reply:
        logger.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                       "Please use '/model_info' instead.")
        return self.model_info(req)

    def server_info(self, req: Request) -> Reply:
        cfg = self.cfg
        args = {f: getattr(cfg, f) for f in cfg.__struct_fields__ if f not in ("api_key", "other_args", "fail_5xx")}
        args.update(cfg.other_args)
        args["fail_5xx"] = f"{cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}" if cfg.fail_5xx else None
        args.update(
            served_model_name=self.served_name, tokenizer_path=cfg.tokenizer_path or cfg.model_path,
            launch_command=_redacted_command(sys.argv, cfg.api_key),
            status="ready", max_total_num_tokens=self.pool, max_req_input_len=self.max_req_input_len,
            startup_time=round(time.time() - self.started, 3), kv_events=None,
            internal_states=[{"last_gen_throughput": self._gen_throughput() / max(1, cfg.dp_size),
                              "memory_usage": {"weight": 0.0, "kvcache": 0.0},
                              "effective_max_running_requests_per_dp": self.max_running // max(1, cfg.dp_size)}
                             for _ in range(max(1, cfg.dp_size))],
            version=cfg.version, frontend="python",
            stub_engine="not a model: a test double of SGLang's HTTP protocol",
        )
        return 200, _json_encode(args), JSON

    def _gen_throughput(self) -> float:
        delay = self.cfg.token_delay
        return round(len(self.running) / delay, 1) if delay > 0 else 0.0

    def _used_tokens(self) -> int:
        now, delay = asyncio.get_running_loop().time(), self.cfg.token_delay
        used = sum(s.prompt_len for s, _ in self.waiting)
        for s in self.running.values():
            used += s.prompt_len + (min(s.planned, int((now - s.begin) / delay)) if s.begin is not None else 0)
        return used

    def loads(self, req: Request) -> Reply:
        """GET /v1/loads (0.5.23): the load of each data-parallel rank, as SGLang's load snapshot reports it.

        The stub has one scheduler; with --dp-size N its requests are shared out over N ranks for the report.
        """
        if self.v9:
            return NOT_FOUND  # assumed absent in the 0.5.9 profile: clients must do without it
        dp = max(1, self.cfg.dp_size)
        used, pool = self._used_tokens(), self.pool
        share = lambda total, i: total // dp + (i < total % dp)  # noqa: E731
        rows = []
        for i in range(dp):
            running, waiting = share(len(self.running), i), share(len(self.waiting), i)
            rank_used = share(used, i)
            rows.append({
                "dp_rank": i, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting, "num_used_tokens": rank_used,
                "max_total_num_tokens": pool, "max_running_requests": self.max_running // dp,
                "token_usage": round(rank_used / pool, 4), "gen_throughput": self._gen_throughput() / dp,
                "cache_hit_rate": 0.0, "utilization": round(running / max(1, self.max_running // dp), 4),
            })
        body = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": self.cfg.version,
                "dp_rank_count": dp, "loads": rows}
        return 200, _json_encode(body), JSON

    def stub_counters(self, req: Request) -> Reply:
        """Stub only: what the "GPU" did (tokens decoded, returned, aborts), for benchmarks and tests."""
        return 200, _json_encode({**self.counters, "answered": self.stats["requests"], "running": len(self.running),
                                  "waiting": len(self.waiting),
                                  "max_running": self.max_running}), JSON

    def _model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                "root": self.served_name, "parent": None, "max_model_len": self.cfg.context_length}

    def v1_models(self, req: Request) -> Reply:
        return 200, _json_encode({"object": "list", "data": [self._model_card()]}), JSON

    def v1_model(self, name: str) -> Reply:
        if name == self.served_name:
            return 200, _json_encode(self._model_card()), JSON
        err = {"message": f"The model '{name}' does not exist", "type": "invalid_request_error", "param": "model",
               "code": "model_not_found"}
        return 404, _json_encode({"error": err}), JSON

    def flush_cache(self, req: Request) -> Reply:
        if self.in_flight:
            return 400, b"Flush cache failed.\n", TEXT
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return 200, (b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     b"waiting requests, the operation will not be performed.)\n"), TEXT

    def metrics(self, req: Request) -> Reply:
        s, name = self.stats, self.served_name
        label = f'{{model_name="{name}"}}'
        lines = [f"# stub-engine metrics: {LOG_PREFIX}"]
        for metric, kind, value in (
            ("num_running_reqs", "gauge", len(self.running) if self.cfg.token_delay > 0 else len(self.in_flight)),
            ("num_queue_reqs", "gauge", len(self.waiting)),
            ("token_usage", "gauge", round(self._used_tokens() / self.pool, 4)),
            ("gen_throughput", "gauge", self._gen_throughput()), ("cache_hit_rate", "gauge", 0.0),
            ("prompt_tokens_total", "counter", s["prompt_tokens"]),
            ("generation_tokens_total", "counter", s["generation_tokens"]),
            ("num_requests_total", "counter", s["requests"]),
        ):
            lines += [f"# HELP sglang:{metric} {metric} (stub engine)", f"# TYPE sglang:{metric} {kind}",
                      f"sglang:{metric}{label} {value}"]
        lines += ["# HELP sglang:e2e_request_latency_seconds e2e latency (stub engine)",
                  "# TYPE sglang:e2e_request_latency_seconds summary",
                  f"sglang:e2e_request_latency_seconds_sum{label} {s['e2e_sum']}",
                  f"sglang:e2e_request_latency_seconds_count{label} {s['requests']}"]
        return 200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8"

    def abort_request(self, req: Request) -> Reply:
        try:
            obj = _json_decode(req.body) if req.body else {}
        except msgspec.DecodeError:
            obj = {}
        obj = obj if isinstance(obj, dict) else {}
        rid, abort_all = obj.get("rid") or "", bool(obj.get("abort_all"))
        if abort_all or (isinstance(rid, str) and rid in self.in_flight):
            for state in list(self.in_flight.values()):
                if (abort_all or state.rid.startswith(rid)) and state.aborted is not None \
                        and not state.aborted.is_set():
                    state.aborted_at = asyncio.get_running_loop().time()
                    state.aborted.set()
            logger.info("Abort request rid=%r abort_all=%s", rid, abort_all)
        return 200, b"", None

    # -- /generate -------------------------------------------------------------------------------
    def generate(self, conn: Connection, req: Request):
        cfg = self.cfg
        self.generate_count += 1
        number = self.generate_count
        t0 = time.perf_counter()
        if cfg.crash_after is not None and number >= cfg.crash_after:
            logger.error("Injected crash (--crash-after %d) on /generate request #%d: exiting abruptly with status 1",
                         cfg.crash_after, number)
            logging.shutdown()
            os._exit(1)
        if cfg.fail_5xx and cfg.fail_5xx[0] <= number < cfg.fail_5xx[0] + cfg.fail_5xx[1]:
            msg = f"Injected failure (--fail-5xx {cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}) of /generate request #{number}"
            logger.warning(msg)
            body = {"object": "error", "message": msg, "type": "503", "param": None, "code": 503}
            return 503, _json_encode(body), JSON
        hang = cfg.hang or (cfg.hang_after is not None and number > cfg.hang_after)
        try:
            obj = _json_decode(req.body)
        except msgspec.DecodeError as e:
            body = {"object": "error", "message": f"JSON decode error: {e}", "type": "Bad Request", "param": None,
                    "code": 400}
            return 400, _json_encode(body), JSON
        try:
            check_contract(obj)
        except ContractError as e:
            if self.v9:  # no schema gate: the bad value raises a TypeError somewhere, which nobody catches
                logger.error("Exception in /generate (0.5.9 has no schema gate): %s", e)
                return 500, b"Internal Server Error", TEXT
            return 400, _json_encode({"error": str(e)}), JSON
        stream = bool(obj.get("stream"))
        try:
            items, single = self.prepare(obj)
        except RequestError as e:
            if stream:
                return self.stream_error(conn, str(e))
            return 400, _json_encode({"error": {"message": str(e)}}), JSON
        if cfg.nan_every and number % cfg.nan_every == 0:
            logger.warning("Injected NaN (--nan-every %d) in /generate request #%d", cfg.nan_every, number)
            for item in items:
                nan_stop(self.model, item)
        if hang:
            return self.hang_forever(items)
        if stream:
            return self.stream(conn, items, single, t0)
        if cfg.token_delay > 0:
            return self.delayed(items, single, t0)
        return 200, self.render(items, single, t0), JSON

    def prepare(self, obj: dict) -> tuple[list[Item], bool]:
        """Normalise a /generate body into items (GenerateReqInput normalisation + tokenizer-manager checks)."""
        cfg, model = self.cfg, self.model
        text, ids = obj.get("text"), obj.get("input_ids")
        if text is None and ids is None:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            single = isinstance(text, str)
            batch = 1 if single else len(text)
        else:
            if len(ids) == 0:
                raise RequestError("input_ids cannot be empty.")
            single = type(ids[0]) is int
            batch = 1 if single else len(ids)
        raw_sp = obj.get("sampling_params")
        if isinstance(raw_sp, list):
            n = raw_sp[0].get("n") or 1 if raw_sp else 1
            if any((s.get("n") or 1) != n for s in raw_sp):
                raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
            if len(raw_sp) != batch:
                raise RequestError(f"The length of sampling_params ({len(raw_sp)}) should be equal to the batch "
                                   f"size ({batch}).")
        else:
            n = (raw_sp or {}).get("n") or 1
        n = max(1, n)
        if ids is not None:
            prompts = [ids] if (single or (type(ids[0]) is int)) else ids
        else:
            if cfg.skip_tokenizer_init:
                raise RequestError("The engine initialized with skip_tokenizer_init=True cannot accept text "
                                   "prompts. Please provide input_ids or re-initialize the engine with "
                                   "skip_tokenizer_init=False.")
            prompts = [model.tokenizer.encode(t) for t in ([text] if single else text)]
        if len(prompts) != batch:
            prompts = (prompts * batch)[:batch]
        for p in prompts:
            if not p:
                raise RequestError("input_ids cannot be empty.")
        if n > 1:
            single = False
        rid = obj.get("rid")
        total = batch * n
        if single:
            rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
        elif n > 1:
            rids = [uuid.uuid4().hex for _ in range(total)]
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in range(total)]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(total)]
        else:
            if len(rid) != batch:
                raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
            if len(set(rid)) != len(rid):
                dups = sorted({r for r in rid if rid.count(r) > 1})
                raise RequestError(f"Duplicate request IDs detected within the request: {dups}")
            rids = list(rid)
        return_logprob = obj.get("return_logprob")
        start_len = obj.get("logprob_start_len")
        top_num = obj.get("top_logprobs_num")
        items: list[Item] = []
        for i, prompt in enumerate(prompts):
            sp_dict = raw_sp[i] if isinstance(raw_sp, list) else (raw_sp or {})
            for j in range(n):
                sp = make_sampling(sp_dict, cfg.preferred_sampling_params, cfg.skip_tokenizer_init, cfg.version)
                position = i * n + j
                item = Item(rid=rids[position], index=position, prompt=prompt, sp=sp, budget=0,
                            return_logprob=bool(_pick(return_logprob, i, False)),
                            logprob_start_len=_pick(start_len, i, -1), top_logprobs_num=_pick(top_num, i, 0) or 0)
                self.check_lengths(item)
                verify_sampling(sp, model.vocab_size, cfg.version)
                items.append(item)
        for item in items:
            if not self.v9 and item.rid in self.in_flight:
                raise RequestError(f"Duplicate request ID detected: {item.rid}")
            if len(item.prompt) >= self.max_req_input_len:
                raise RequestError(
                    f"Input length ({len(item.prompt)} tokens) exceeds the maximum allowed length "
                    f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
            if item.return_logprob and item.logprob_start_len is not None and item.logprob_start_len > len(item.prompt):
                raise RequestError(f"logprob_start_len ({item.logprob_start_len}) is superior to the number of "
                                   f"input tokens ({len(item.prompt)}).")
            if self.prefix_cache is not None:
                item.cached = self.prefix_cache.admit(item.prompt)
            segments = None
            if cfg.token_delay > 0:  # only a delayed request can be aborted mid-way, and so continued
                segments = plan_continuation(model, cfg, item.prompt, item.sp, item.budget, item.index % n)
            if segments is not None:
                self.counters["continued"] += 1
            else:
                segments = plan_output(model, cfg, item.prompt, item.sp, item.budget, item.index % n)
            item.segments = segments
            item.planned = [t for _, ids in item.segments for t in ids]
            finish_item(model, item)
        return items, single

    def check_lengths(self, item: Item) -> None:
        """The tokenizer manager's context checks, then the scheduler's silent clamp of max_new_tokens."""
        ctx, n_in, sp = self.cfg.context_length, len(item.prompt), item.sp
        if n_in >= ctx:
            raise RequestError(f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens).")
        if sp.max_new_tokens_given:
            total = sp.max_new_tokens + n_in
            if (total >= ctx) if self.v9 else (total > ctx):
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                    f"requested a total of {total} tokens: {n_in} tokens from the input messages and "
                    f"{sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                    "input messages or the completion to fit within the limit.")
        room = max(0, self.max_req_len - n_in - 1)
        item.budget = room if sp.max_new_tokens is None else max(0, min(sp.max_new_tokens, room))

    # -- answers ---------------------------------------------------------------------------------
    def meta(self, item: Item, ids: list[int], finish: dict | None, e2e: float | None, first: bool) -> dict:
        m: dict[str, Any] = {"id": item.rid, "finish_reason": finish, "prompt_tokens": len(item.prompt)}
        done = finish is not None
        if done:
            m["weight_version"] = "default"
        if self.v9:
            m["total_retractions"] = 0
        else:
            m["num_retractions"] = 0
            m["reasoning_tokens"] = 0
        m["completion_tokens"] = len(ids)
        m["cached_tokens"] = item.cached
        if done and not self.v9:
            m["weight_versions"] = [{"version": "default", "start": 0, "end": len(ids)}]
        if not self.v9:
            m["dp_rank"] = None
        if item.return_logprob:
            self.add_logprobs(m, item, ids)
        if e2e is not None:
            m["e2e_latency"] = round(e2e, 6)
        if first or done:
            m["response_sent_to_client_ts"] = time.time()
        return m

    def add_logprobs(self, m: dict, item: Item, ids: list[int]) -> None:
        start = item.logprob_start_len
        start = len(item.prompt) if start is None or start < 0 else start
        m["input_token_logprobs"] = [[None if k == 0 else fake_logprob(t, k), t, None]
                                     for k, t in enumerate(item.prompt[start:], start)]
        m["output_token_logprobs"] = [[fake_logprob(t, k), t, None] for k, t in enumerate(ids)]
        m["output_token_logprobs_length"] = len(ids)
        if item.top_logprobs_num > 0:
            vocab = self.model.vocab_size
            m["output_top_logprobs"] = [
                [[fake_logprob(t, k)] + [t, None]] + [[fake_logprob(t, k) - 1.0 - r, (t + 7 * (r + 1)) % vocab, None]
                                                      for r in range(item.top_logprobs_num - 1)]
                for k, t in enumerate(ids)]

    def output_object(self, item: Item, ids: list[int], finish: dict, e2e: float) -> dict:
        out: dict[str, Any] = {}
        if not self.cfg.skip_tokenizer_init:
            out["text"] = item_text(self.model, item, ids, finish is item.finish)
        out["output_ids"] = ids
        out["meta_info"] = self.meta(item, ids, finish, e2e, first=False)
        self.account(item, ids, e2e)
        return out

    def account(self, item: Item, ids: list[int], e2e: float) -> None:
        s = self.stats
        s["requests"] += 1
        s["prompt_tokens"] += len(item.prompt)
        s["generation_tokens"] += len(ids)
        s["e2e_sum"] += e2e
        self.window[0] += 1
        self.window[1] += len(ids)

    def render(self, items: list[Item], single: bool, t0: float) -> bytes:
        e2e = time.perf_counter() - t0
        objs = [self.output_object(it, it.output, it.finish, e2e) for it in items]
        return _json_encode(objs[0] if single else objs)

    def register(self, items: list[Item], abortable: bool) -> list[InFlight]:
        now = time.monotonic()
        states = [InFlight(rid=it.rid, started=now, aborted=asyncio.Event() if abortable else None) for it in items]
        for state in states:
            self.in_flight[state.rid] = state
        return states

    def unregister(self, states: list[InFlight]) -> None:
        for state in states:
            if self.in_flight.get(state.rid) is state:
                del self.in_flight[state.rid]

    async def hang_forever(self, items: list[Item]) -> Reply:
        states = self.register(items, abortable=False)
        logger.warning("Injected hang: /generate request #%d will never be answered", self.generate_count)
        self.hung += 1
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self.hung -= 1
            self.unregister(states)

    async def delayed(self, items: list[Item], single: bool, t0: float) -> Reply:
        """Answer after token_delay per generated token, or with partial output for the items aborted; items
        wait in the queue while max_running others generate."""
        states = self.register(items, abortable=True)
        try:
            objs = await asyncio.gather(*(self._run_item(it, st, t0) for it, st in zip(items, states)))
            return 200, _json_encode(objs[0] if single else objs), JSON
        finally:
            self.unregister(states)

    async def _admit(self, state: InFlight) -> bool:
        """Wait for a running slot (FIFO); False when aborted while waiting."""
        if len(self.running) < self.max_running and not self.waiting:
            self.running[id(state)] = state
            return True
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        entry = (state, granted)
        self.waiting.append(entry)
        aborted = loop.create_task(state.aborted.wait())
        try:
            await asyncio.wait([granted, aborted], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._release(state)
            raise
        finally:
            aborted.cancel()
            for i, e in enumerate(self.waiting):
                if e is entry:
                    del self.waiting[i]
                    break
        if state.aborted.is_set():  # aborted while queued (a slot freed by the same abort_all does not count)
            if granted.done() and not granted.cancelled():
                self._release(state)
            granted.cancel()
            return False
        return True

    def _release(self, state: InFlight) -> None:
        self.running.pop(id(state), None)
        while self.waiting and len(self.running) < self.max_running:
            nxt, fut = self.waiting.pop(0)
            if not fut.done() and not nxt.aborted.is_set():
                self.running[id(nxt)] = nxt
                fut.set_result(None)

    async def _run_item(self, it: Item, state: InFlight, t0: float) -> dict:
        loop = asyncio.get_running_loop()
        delay = self.cfg.token_delay
        state.prompt_len, state.planned = len(it.prompt), len(it.output)
        if not await self._admit(state):
            self.counters["aborted_waiting"] += 1
            self.stats["aborted"] += 1
            return self.waiting_abort_object(it, time.perf_counter() - t0)
        begin = state.begin = loop.time()
        end = begin + delay * len(it.output)
        made = 0
        try:
            while not state.aborted.is_set() and loop.time() < end:
                waiter = loop.create_task(state.aborted.wait())
                try:
                    await asyncio.wait([waiter], timeout=end - loop.time())
                finally:
                    waiter.cancel()
            if state.aborted.is_set() and state.aborted_at < end:
                made = min(len(it.output), max(0, int((state.aborted_at - begin) / delay)))
                self.counters["aborted_running"] += 1
                self.stats["aborted"] += 1
                obj = self.output_object(it, it.output[:made], dict(ABORTED), time.perf_counter() - t0)
            else:
                made = len(it.output)
                obj = self.output_object(it, it.output, it.finish, time.perf_counter() - t0)
            self.counters["returned_tokens"] += made
            return obj
        except asyncio.CancelledError:  # the client went away: what was decoded so far is spent all the same
            made = min(len(it.output), max(0, int((loop.time() - begin) / delay)))
            self.counters["cancelled"] += 1
            raise
        finally:
            self.counters["generated_tokens"] += made
            self._release(state)

    def waiting_abort_object(self, item: Item, e2e: float) -> dict:
        """A request aborted while still queued: no output, and no prompt_tokens / cached_tokens (§5.5)."""
        m: dict[str, Any] = {"id": item.rid, "finish_reason": dict(ABORTED_WAITING)}
        if not self.v9:
            m.update(weight_version="default", weight_versions=[])
        m.update(e2e_latency=round(e2e, 6), completion_tokens=0)
        out: dict[str, Any] = {} if self.cfg.skip_tokenizer_init else {"text": ""}
        out.update(output_ids=[], meta_info=m)
        return out

    def stream_error(self, conn: Connection, message: str):
        if self.v9:
            err = {"message": message}
        else:
            err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}

        async def send() -> None:
            conn.start_stream()
            await conn.stream_chunk(b"data: " + _json_encode({"error": err}) + b"\n\n")
            await conn.stream_chunk(b"data: [DONE]\n\n")
            conn.end_stream()

        return send()

    async def stream(self, conn: Connection, items: list[Item], single: bool, t0: float) -> None:
        """SSE: an event every `stream_interval` tokens (cumulative, or incremental, text and output_ids)."""
        states = self.register(items, abortable=True)
        try:
            conn.start_stream()
            loop = asyncio.get_running_loop()
            delay, begin = self.cfg.token_delay, loop.time()
            incremental = self.cfg.incremental_streaming_output
            delta_text = incremental and not self.v9  # 0.5.9's --stream-output keeps text cumulative
            with_text = not self.cfg.skip_tokenizer_init
            intervals = [max(1, it.sp.stream_interval or self.cfg.stream_interval) for it in items]
            sent = [0] * len(items)
            texts = [_IncrementalText(self.model, it.sp.skip_special_tokens) for it in items]
            live = list(range(len(items)))

            def due(k: int) -> int:
                return min(len(items[k].output), sent[k] + intervals[k])

            while live:
                now = loop.time()
                for k in list(live):
                    it, state = items[k], states[k]
                    aborted = state.aborted.is_set()
                    if not aborted and delay > 0 and begin + delay * due(k) > now + 1e-4:
                        continue
                    upto = sent[k] if aborted else due(k)
                    last = aborted or upto >= len(it.output)
                    ids = it.output[:upto]
                    finish = None
                    if last:
                        finish = dict(ABORTED) if upto < len(it.output) else it.finish
                    chunk: dict[str, Any] = {}
                    if with_text:
                        if finish is it.finish or self.model.fast_text:
                            full = item_text(self.model, it, ids, finish is it.finish)
                        else:
                            full = texts[k].extend(ids)
                        chunk["text"] = full[texts[k].sent_chars:] if delta_text else full
                        texts[k].sent_chars = len(full)
                    chunk["output_ids"] = ids[sent[k]:] if incremental else ids
                    e2e = time.perf_counter() - t0 if last else None
                    chunk["meta_info"] = self.meta(it, ids, finish, e2e, first=sent[k] == 0)
                    if not single:
                        chunk["index"] = it.index
                    sent[k] = upto
                    await conn.stream_chunk(b"data: " + _json_encode(chunk) + b"\n\n")
                    if last:
                        live.remove(k)
                        self.account(it, ids, e2e or 0.0)
                if not live:
                    break
                if delay > 0:
                    target = min(begin + delay * due(k) for k in live)
                    waiters = [loop.create_task(states[k].aborted.wait()) for k in live]
                    await asyncio.wait(waiters, timeout=max(0.0, target - loop.time()),
                                       return_when=asyncio.FIRST_COMPLETED)
                    for w in waiters:
                        w.cancel()
                else:
                    await asyncio.sleep(0)
            await conn.stream_chunk(b"data: [DONE]\n\n")
            conn.end_stream()
        finally:
            self.unregister(states)

    # -- background ------------------------------------------------------------------------------
    async def warmup(self) -> None:
        cfg = self.cfg
        if cfg.hang:
            logger.warning("Injected hang (--hang): the server will never become ready")
            return
        delay = 0.0 if cfg.skip_server_warmup else cfg.warmup_delay
        if delay > 0:
            await asyncio.sleep(delay)
        if cfg.warmup_fails:
            logger.error("Initialization failed. warmup error: injected (--warmup-fails); killing the process tree")
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.exiting:
            return
        self.status = "up"
        logger.info("The server is fired up and ready to roll!")

    async def throughput_log(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            reqs, tokens, since = self.window
            now = time.monotonic()
            if reqs:
                logger.info("Decode batch. #running-req: %d, #finished-req: %d, gen throughput (token/s): %.1f",
                            len(self.in_flight), reqs, tokens / max(1e-9, now - since))
            self.window[:] = [0, 0, now]

    async def drain_watchdog(self) -> None:
        """SGLang's sigterm watchdog: poll until SIGTERM, then until no request is left (or at once when the
        last health check failed), then stop."""
        poll = self.cfg.drain_poll
        while not self.exiting:
            await asyncio.sleep(poll)
        while True:
            if self.status == "unhealthy":
                logger.error("Signal SIGTERM received while health check failed. Force exiting.")
                break
            logger.info("Gracefully exiting... Remaining number of requests %d. Remaining requests "
                        "remaining_rids=%s.", len(self.in_flight), list(self.in_flight)[:20])
            if not self.in_flight:
                break
            await asyncio.sleep(poll)
        self.stop.set()

    def on_sigterm(self, signame: str) -> None:
        if not self.exiting:
            logger.info("Received %s: gracefully_exit=True; /health* and /ready answer 503 while requests drain",
                        signame)
        self.exiting = True


class _IncrementalText:
    """Text of a growing id list, decoded through a short window (the detokenizer's incremental scheme)."""

    def __init__(self, model: StubModel, skip: bool):
        self.model, self.skip = model, skip
        self.text = ""
        self.prefix_offset = self.read_offset = 0
        self.sent_chars = 0

    def extend(self, ids: list[int]) -> str:
        if len(ids) > self.read_offset:
            prefix = self.model.decode(ids[self.prefix_offset:self.read_offset], self.skip)
            full = self.model.decode(ids[self.prefix_offset:], self.skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text


def _pick(value: Any, i: int, default: Any) -> Any:
    if value is None:
        return default
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return value


def _redacted_command(argv: list[str], secret: str | None) -> str:
    words = [sys.executable, "-m", "toolkit.engines.stub_server"] + argv[1:]
    return " ".join("***" if secret and w == secret else w for w in words)


# ================================================================================================
# Process lifecycle
# ================================================================================================


class _StubFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "\n".join(f"{LOG_PREFIX} {line}" for line in text.split("\n"))


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StubFormatter("[%(asctime)s] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, exc, tb: logger.critical("uncaught exception", exc_info=(kind, exc, tb))


def _route_transformers_logging() -> None:
    """Send transformers' own log lines through the stub's formatter (so they carry the prefix too)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.set_verbosity_warning()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


async def serve(cfg: StubConfig, model: StubModel, started: float) -> int:
    server = StubServer(cfg, model, started)
    loop = asyncio.get_running_loop()
    try:
        listener = await loop.create_server(lambda: Connection(server), cfg.host, cfg.port, reuse_address=True,
                                            backlog=1024)
    except OSError as e:
        logger.error("%s", e)  # e.g. [Errno 98] error while attempting to bind on address (...): address in use
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        if cfg.ignore_sigterm:
            loop.add_signal_handler(sig, logger.warning, "Received %s: ignored (--ignore-sigterm)", sig.name)
        else:
            loop.add_signal_handler(sig, server.on_sigterm, sig.name)
    logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", cfg.host, cfg.port)
    tasks = [loop.create_task(server.warmup()), loop.create_task(server.throughput_log()),
             loop.create_task(server.drain_watchdog())]
    await server.stop.wait()
    listener.close()
    for conn in list(server.connections):
        if not conn.busy and conn.transport is not None:
            conn.transport.close()
    deadline = loop.time() + 2.0
    while loop.time() < deadline and any(c.transport and c.transport.get_write_buffer_size()
                                         for c in server.connections):
        await asyncio.sleep(0.01)
    for t in tasks:
        t.cancel()
    logger.info("Shutdown complete; exiting with status 0")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cfg = parse_config(argv)
    setup_logging(cfg.log_level)
    started = time.time()
    logger.info("Stand-in SGLang server %s profile: a test double of the HTTP protocol, NOT a model; outputs are "
                "synthetic text from the tokenizer", cfg.version)
    if cfg.other_args:
        logger.info("SGLang flags accepted without effect on the stub: %s", ", ".join(sorted(cfg.other_args)))
    if cfg.exit_at_start is not None:
        logger.error("Exiting at start with status %d (--exit-at-start)", cfg.exit_at_start)
        return cfg.exit_at_start
    if cfg.exit_at_start_if_exists and os.path.exists(cfg.exit_at_start_if_exists):
        logger.error("Exiting at start with status 1: %s exists (--exit-at-start-if-exists)",
                     cfg.exit_at_start_if_exists)
        return 1
    logger.info("server_args=%s", {f: getattr(cfg, f) for f in cfg.__struct_fields__ if f != "api_key"})
    logger.info("Load weight begin. avail mem=0.00 GB (stub: no weights; loading the tokenizer only)")
    t0 = time.monotonic()
    folder = cfg.tokenizer_path or cfg.model_path
    if not os.path.isdir(folder):
        logger.error("%s is not a folder: pass the model (or --tokenizer-path) folder that holds the tokenizer", folder)
        return 1
    _route_transformers_logging()
    try:
        model = StubModel(cfg)
    except (OSError, ValueError) as e:
        logger.error("Cannot load the tokenizer of %s: %s. The stub needs the job's tokenizer even with "
                     "--skip-tokenizer-init; pass --tokenizer-path if it lives elsewhere.",
                     cfg.tokenizer_path or cfg.model_path, e)
        return 1
    logger.info("Tokenizer: %d ids; think-start id %s, think-end id %s; EOS written %d, stop ids %s; tool-call "
                "format %s; %d corpus tokens; text %s", model.vocab_size, model.think_start_id, model.think_end_id,
                model.eos_id, sorted(model.eos_ids), model.tool_family or "none", len(model.corpus),
                "sliced from the corpus (checked equal to decode)" if model.fast_text else "decoded per request")
    rest = cfg.load_delay - (time.monotonic() - t0)
    if rest > 0:
        time.sleep(rest)
    logger.info("Load weight end. type=StubEngine, dtype=none, avail mem=0.00 GB, mem usage=0.00 GB.")
    return asyncio.run(serve(cfg, model, started))

