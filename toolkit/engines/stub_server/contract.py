"""Request validation of /generate: 0.5.23's schema gate (serde-style texts), SamplingParams with SGLang's
defaults, and SamplingParams.verify's errors."""

from __future__ import annotations

from typing import Any

import msgspec

TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6


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
