"""SGLang's `sampling_params` contract as data: the fields /generate accepts, their types, SGLang's
defaults and `SamplingParams.verify`'s checks, with SGLang's own messages, for each supported
release.

Read from each release's source (0.5.23: api/v1/api_types.py `_FIELDS_SamplingParams` and
srt/sampling/ sampling_params.py; 0.5.9: srt/sampling/sampling_params.py). Two users, so that they
cannot drift apart: `spec` refuses a job whose sampling SGLang would refuse on every request, before
a node is allocated, and the stub server answers a request with the same checks and texts as the
release it imitates.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

__all__ = [
    "FIELDS",
    "MAX_STOP_COUNT",
    "NOT_TAKEN",
    "RELEASES",
    "Sampling",
    "SamplingError",
    "TypeMismatch",
    "check_types",
    "make_sampling",
    "verify",
    "want",
]

RELEASES = ("0.5.23", "0.5.9")  # newest first
TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6
# 0.5.23: more stop strings are refused when the request is normalised (0.5.9 has no limit)
MAX_STOP_COUNT = 32

# Every field 0.5.23's schema gate lets through, in its order, with the JSON type it wants. `choice`
# passes the gate but SamplingParams has no such argument: SGLang then fails with a TypeError (HTTP
# 500).
FIELDS: dict[str, str] = {
    "max_new_tokens": "int",
    "stop": "strs",
    "stop_token_ids": "ints",
    "stop_regex": "strs",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "frequency_penalty": "float",
    "presence_penalty": "float",
    "repetition_penalty": "float",
    "min_new_tokens": "int",
    "n": "int",
    "json_schema": "str",
    "regex": "str",
    "ebnf": "str",
    "structural_tag": "str",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "stream_interval": "int",
    "logit_bias": "float_map",
    "sampling_seed": "int",
    "custom_params": "any",
    "beam_width": "int",
    "watermark": "any",
    "choice": "any",
}
# Fields SamplingParams(**params) of a release does not take: a TypeError nobody catches, HTTP 500.
# 0.5.23 lets
# `choice` through its gate; 0.5.9 has no gate and no beam search or watermark yet.
NOT_TAKEN = {
    "0.5.23": frozenset({"choice"}),
    "0.5.9": frozenset({"choice", "beam_width", "watermark"}),
}


class SamplingError(ValueError):
    """What SamplingParams / verify would raise: SGLang answers 400 {"error": {"message":
    <text>}}."""


class TypeMismatch(ValueError):
    """A value of the wrong JSON type: 0.5.23's schema gate answers 400 {"error": <serde's
    text>}."""


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
    beam_width: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] = {}
    sampling_seed: int | None = None
    # json_schema, regex, ebnf, structural_tag: those given (not null)
    grammars: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------------
# types: 0.5.23's schema gate (serde-style texts)
# --------------------------------------------------------------------------------------------------
def describe(v: Any) -> str:
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


def mismatch(v: Any, expected: str) -> TypeMismatch:
    return TypeMismatch(f"invalid type: {describe(v)}, expected {expected}")


def want(v: Any, kind: str) -> None:
    """TypeMismatch unless `v` is of `kind` (a value of FIELDS), with serde's text."""
    if kind == "int":
        if type(v) is not int:
            raise mismatch(v, "i64")
    elif kind == "float":
        if type(v) not in (int, float):
            raise mismatch(v, "f64")
    elif kind == "bool":
        if type(v) is not bool:
            raise mismatch(v, "a boolean")
    elif kind == "str":
        if type(v) is not str:
            raise mismatch(v, "a string")
    elif kind == "strs":
        if type(v) is list:
            for x in v:
                want(x, "str")
        elif type(v) is not str:
            raise mismatch(v, "a value or an array of values for StringOrList")
    elif kind == "ints":
        if type(v) is not list:
            raise mismatch(v, "a sequence")
        for x in v:
            want(x, "int")
    elif kind == "float_map":
        if type(v) is not dict:
            raise mismatch(v, "a map")
        for x in v.values():
            want(x, "float")


def check_types(params: dict) -> None:
    """0.5.23's gate over one sampling_params object: unknown fields and wrong types raise
    TypeMismatch."""
    for key, value in params.items():
        kind = FIELDS.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in FIELDS)
            raise TypeMismatch(f"unknown field `{key}`, expected one of {listed}")
        if value is not None and kind != "any":
            want(value, kind)


# --------------------------------------------------------------------------------------------------
# values: SamplingParams(**params), normalize() and verify()
# --------------------------------------------------------------------------------------------------
def make_sampling(raw: dict, preferred: dict | None = None) -> Sampling:
    """SamplingParams(**raw): SGLang's defaults for absent or null keys (and the server's preferred
    params under the request's), greedy temperature as top_k = 1."""
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
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        v = g(name)
        # kept as given, as SamplingParams does: its errors print an int as an int ("got 0.")
        if v is not None:
            setattr(sp, name, v)
    for name in ("min_new_tokens", "n", "beam_width", "stream_interval", "sampling_seed"):
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
    sp.grammars = {
        k: g(k) for k in ("json_schema", "regex", "ebnf", "structural_tag") if g(k) is not None
    }
    if 0 <= sp.temperature < SAMPLING_EPS:  # greedy is top_k = 1
        sp.temperature, sp.top_k = 1.0, 1
    return sp


def verify(sp: Sampling, vocab_size: int | None, version: str) -> None:
    """SamplingParams.verify (and the stop-string limit of normalize) of `version`: SamplingError
    with SGLang's text. Without `vocab_size` (no tokenizer at hand) logit_bias keys are not
    checked."""
    old = version == "0.5.9"
    if not old and sp.beam_width is not None and sp.beam_width < 1:
        raise SamplingError(f"beam_width must be at least 1, got {sp.beam_width}.")
    t = sp.temperature
    if not math.isfinite(t) or t < 0.0:
        raise SamplingError(
            f"temperature must be non-negative, got {t}."
            if old
            else f"temperature must be a non-negative finite number, got {t}."
        )
    if not 0.0 < sp.top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {sp.top_p}.")
    if not 0.0 <= sp.min_p <= 1.0:
        raise SamplingError(f"min_p must be in [0, 1], got {sp.min_p}.")
    if sp.top_k < 1:
        raise SamplingError(f"top_k must be -1 (disable) or at least 1, got {sp.top_k}.")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        raise SamplingError(f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}.")
    if not -2.0 <= sp.presence_penalty <= 2.0:
        raise SamplingError(f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}.")
    if old:
        if not 0.0 <= sp.repetition_penalty <= 2.0:
            raise SamplingError(
                f"repetition_penalty must be in [0, 2], got {sp.repetition_penalty}."
            )
    elif not 0.0 < sp.repetition_penalty <= 2.0:
        raise SamplingError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {sp.repetition_penalty}."
        )
    if not 0 <= sp.min_new_tokens:
        raise SamplingError(
            f"min_new_tokens must be in [0, max_new_tokens], got {sp.min_new_tokens}."
        )
    if sp.max_new_tokens is not None:
        if sp.max_new_tokens < 0:
            raise SamplingError(f"max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
        if not sp.min_new_tokens <= sp.max_new_tokens:
            raise SamplingError(
                f"min_new_tokens must be in [0, max_new_tokens({sp.max_new_tokens})], "
                f"got {sp.min_new_tokens}."
            )
    if vocab_size is not None:
        _verify_logit_bias(sp, vocab_size)
    if not old and sp.sampling_seed is not None and not -(2**63) <= sp.sampling_seed <= 2**63 - 1:
        raise SamplingError(
            f"sampling_seed must be in [-2**63, 2**63 - 1], got {sp.sampling_seed}."
        )
    _verify_grammars(sp, old)
    if not old and len(sp.stop) > MAX_STOP_COUNT:
        raise SamplingError(
            f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(sp.stop)}"
        )


def _verify_logit_bias(sp: Sampling, vocab_size: int) -> None:
    """Every logit_bias key a token id of the vocabulary."""
    for token_id in sp.logit_bias:
        try:
            ok = 0 <= int(token_id) < vocab_size
        except ValueError:
            ok = False
        if not ok:
            raise SamplingError(
                f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
            )


def _verify_grammars(sp: Sampling, old: bool) -> None:
    """At most one constrained-decoding grammar (`old`: 0.5.9's count)."""
    if old:  # structural_tag not counted; an empty grammar counts
        grammars = sum(k != "structural_tag" for k in sp.grammars)
    else:  # an empty grammar means none
        grammars = sum(bool(v) for v in sp.grammars.values())
    if grammars > 1:
        raise SamplingError(
            "Only one of regex, json_schema, or ebnf can be set."
            if old
            else "Only one of json_schema, regex, ebnf, or structural_tag can be set."
        )
