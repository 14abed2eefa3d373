"""The stub's command line, read as SGLang reads its own: the flags of the SGLang release it
imitates (`--version`), its own flags (own_flags), a `--config FILE`, parsed into a StubConfig.
A flag SGLang refuses makes the stub exit 2, as SGLang does."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from toolkit.stub.config import LOG_PREFIX, POISONS, VERSIONS, StubConfig
from toolkit.stub.own_flags import add_stub_flags

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
    """The parser of the stub's command line: SGLang `version`'s flags (those the stub models set
    StubConfig's fields; the others are accepted and echoed), then the stub's own."""
    from toolkit.engines.sglang_contract.flags import add_to_parser, flag_set

    flags = flag_set(version)
    p = _Parser(
        prog="python -m toolkit.stub",
        description="Stand-in SGLang server (a protocol test double, not a model).",
    )
    modelled_dests = _add_modelled_flags(p, version, flags)
    add_to_parser(
        p.add_argument_group(f"other SGLang {version} flags (accepted, echoed in /server_info)"),
        flags,
        skip_dests=modelled_dests,
    )
    s = p.add_argument_group(
        "stub behaviour and fault injection (spelled in full: no abbreviations)"
    )
    before = set(p._actions)
    add_stub_flags(s)
    p.own_actions = set(p._actions) - before
    clash = [o for act in p.own_actions for o in act.option_strings if o in flags]
    assert not clash, f"stub flags {clash} are SGLang {version} flags too: rename them"
    p.sglang_flags = flags
    p.modelled_dests = modelled_dests
    return p


def _add_modelled_flags(p: _Parser, version: str, flags) -> set[str]:
    """The SGLang flags the stub models (MODELLED), as `version` spells them, each setting its
    StubConfig field (defaulted when the release has no such flag); their SGLang destinations."""
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
    return modelled_dests


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
    read = {
        "fail_5xx": _fail_5xx(parser, ns.fail_5xx),
        "fail_5xx_for": _fail_5xx_for(parser, ns.fail_5xx_for),
        "lognormal_lengths": _lognormal(parser, ns.lognormal_lengths),
        "poison_prompts": _poison_prompts(parser, ns.poison_prompt),
        "preferred_sampling_params": _preferred(parser, ns.preferred_sampling_params),
    }
    if ns.served_model_name and ":" in ns.served_model_name:
        parser.error("--served-model-name must not contain ':'")
    if ns.context_length < 16:
        parser.error("--context-length must be at least 16")
    read |= {
        "api_key": ns.api_key or None,
        "stream_interval": max(1, ns.stream_interval),
        "drain_poll": max(0.01, ns.drain_poll),
        "other_args": _other_args(parser, ns),
    }
    # every other field is the flag of its name, as parsed
    given = {f: getattr(ns, f) for f in StubConfig.__struct_fields__ if f not in read}
    return StubConfig(**given, **read)


def _fail_5xx(parser: _Parser, value: str | None) -> tuple[int, int] | None:
    """--fail-5xx START:COUNT."""
    if not value:
        return None
    try:
        start, count = (int(x) for x in value.split(":"))
    except ValueError:
        parser.error(f"--fail-5xx wants START:COUNT (two integers), got {value!r}")
    return (start, count)


def _fail_5xx_for(parser: _Parser, value: str | None) -> tuple[int, float] | None:
    """--fail-5xx-for START:SECONDS."""
    if not value:
        return None
    try:
        first, seconds = value.split(":")
        return (int(first), float(seconds))
    except ValueError:
        parser.error(f"--fail-5xx-for wants START:SECONDS, got {value!r}")


def _lognormal(parser: _Parser, value: str | None) -> tuple[int, float] | None:
    """--lognormal-lengths MEDIAN:SIGMA: a median of at least 1 token, a sigma from 0 to 5."""
    if not value:
        return None
    try:
        median, sigma = value.split(":")
        lognormal = (int(median), float(sigma))
    except ValueError:
        lognormal = None
    if lognormal is None or lognormal[0] < 1 or not 0 <= lognormal[1] <= 5:
        parser.error(
            "--lognormal-lengths wants MEDIAN:SIGMA (a median of at least 1 token and a sigma "
            f"from 0 to 5), got {value!r}"
        )
    return lognormal


def _poison_prompts(parser: _Parser, given: list[str]) -> tuple[tuple[str, str], ...]:
    """Each --poison-prompt KIND=TEXT as (kind, text), in the order given."""
    rules = []
    for rule in given:
        kind, eq, text = rule.partition("=")
        if not eq or not text or kind not in POISONS:
            parser.error(
                f"--poison-prompt wants KIND=TEXT with KIND one of {', '.join(sorted(POISONS))} "
                f"and a non-empty TEXT, got {rule!r}"
            )
        rules.append((kind, text))
    return tuple(rules)


def _preferred(parser: _Parser, value: str | None) -> dict[str, Any] | None:
    """--preferred-sampling-params, a JSON object."""
    if not value:
        return None
    try:
        return json.loads(value)
    except ValueError as e:
        parser.error(f"--preferred-sampling-params is not JSON: {e}")


def _other_args(parser: _Parser, ns: argparse.Namespace) -> dict[str, Any]:
    """The SGLang flags given that the stub does not model: echoed in /server_info."""
    other = {
        f.dest: getattr(ns, f.dest, None)
        for f in parser.sglang_flags.flags
        if f.dest not in parser.modelled_dests and f.action != "help"
    }
    return {k: v for k, v in other.items() if v not in (None, False)}
