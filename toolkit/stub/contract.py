"""Request validation of /generate: 0.5.23's schema gate over the whole body (serde-style texts),
and the sampling checks of engines/sglang_contract/sampling (shared with the job spec) as the stub's
errors."""

from __future__ import annotations

from array import array
from typing import Any, Callable

from toolkit.engines.sglang_contract import sampling as sampling
from toolkit.engines.sglang_contract.sampling import Sampling


class ContractError(ValueError):
    """A schema-contract violation: 400 {"error": "<text>"} in 0.5.23 (a 500 in 0.5.9, which has no
    gate)."""


class RequestError(ValueError):
    """SGLang's ValueError path: 400 {"error": {"message": "<text>"}} (or an SSE error event when
    streaming)."""


class ParseError(ValueError):
    """A body FastAPI cannot parse into GenerateReqInput (`rid` not a string or list of strings,
    `input_ids` not int64 ids): its RequestValidationError handler answers 400 {"object": "error",
    "message": ..., ...}. The message follows pydantic's, whose exact words depend on the installed
    version."""


def _input_ids_problem(v: Any) -> str | None:
    """SGLang's validate_optional_list_i64_1d_2d (srt/utils/field_validators.py): what it raises, or
    None."""

    def row(r: Any) -> str | None:
        if not isinstance(r, list):
            return f"must be list; got {type(r).__name__}"
        if r and not isinstance(r[0], int):
            return f"elements must be int; got {type(r[0]).__name__}"
        try:
            array("q", r)  # as SGLang checks it: one pass in C over every id of a request
            return None
        except (TypeError, OverflowError):
            bad = next(x for x in r if not isinstance(x, int) or not -(2**63) <= x < 2**63)
            return f"contains non-int64 element: {bad!r}"

    if v is None:
        return None
    if not isinstance(v, list):
        return f"must be list or null; got {type(v).__name__}"
    if not v or isinstance(v[0], int):
        return row(v)
    if isinstance(v[0], list):
        for i, r in enumerate(v):
            problem = row(r)
            if problem:
                return f"row {i}: {problem}"
        return None
    return f"elements must be int or list; got {type(v[0]).__name__}"


def parse_body(obj: Any) -> None:
    """FastAPI's parse of the body into GenerateReqInput, before SGLang's own gate: ParseError."""
    if type(obj) is not dict:
        return  # the gate says what it wanted
    problem = _input_ids_problem(obj.get("input_ids"))
    if problem:
        raise ParseError(
            f"1 validation error:\n  {{'type': 'value_error', 'loc': ('body', 'input_ids'), "
            f"'msg': 'Value error, {problem}'}}"
        )
    rid = obj.get("rid")
    if (
        rid is not None
        and not isinstance(rid, str)
        and not (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise ParseError(
            "2 validation errors:\n  {'type': 'string_type', 'loc': ('body', 'rid', 'str'), "
            "'msg': 'Input should be a valid string'}\n  {'type': 'list_type', 'loc': ('body', "
            "'rid', 'list[str]'), 'msg': 'Input should be a valid list'}"
        )


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(str(sampling.mismatch(v, expected)))


def _want_int(v: Any, expected: str = "i64") -> None:
    if type(v) is not int:
        raise _invalid(v, expected)


def _want_bool(v: Any, expected: str = "a boolean") -> None:
    if type(v) is not bool:
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


def _str_or_list(v: Any) -> None:
    try:
        sampling.want(v, "strs")
    except sampling.TypeMismatch as e:
        raise ContractError(str(e)) from None


def _sampling_params(v: dict) -> None:
    try:
        sampling.check_types(v)
    except sampling.TypeMismatch as e:
        raise ContractError(str(e)) from None


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
            _value_or_list(x, _want_bool, "a value or an array of values for BoolOrList")
        elif key == "logprob_start_len" or key == "top_logprobs_num":
            _value_or_list(x, _want_int, "a value or an array of values for Int64OrList")
        elif key == "routed_dp_rank" or key == "disagg_prefill_dp_rank":
            _want_int(x)


def _value_or_list(x: Any, want: Callable, what: str) -> None:
    """A field that is one value or a list of them: each checked by `want` (`what`: the type named
    when a lone value is wrong)."""
    if type(x) is list:
        for e in x:
            want(e)
    else:
        want(x, what)


def not_taken(obj: dict, version: str) -> str | None:
    """A sampling field SamplingParams(**params) of `version` does not take (SGLang then answers
    500), or None."""
    raw = obj.get("sampling_params")
    for params in raw if isinstance(raw, list) else [raw or {}]:
        for key in params:
            if key in sampling.NOT_TAKEN[version]:
                return key
    return None


def make_sampling(raw: dict, preferred: dict | None, skip_tokenizer: bool) -> Sampling:
    """SamplingParams(**raw) with SGLang's defaults, and the checks a server without a tokenizer
    adds."""
    sp = sampling.make_sampling(raw, preferred)
    g = raw.get
    if skip_tokenizer:
        if sp.stop:
            raise RequestError(
                f"stop={sp.stop!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
        if g("stop_regex"):
            regex = g("stop_regex")
            regex = [regex] if isinstance(regex, str) else regex
            raise RequestError(
                f"stop_regex={regex!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
        if sp.min_new_tokens > 0:
            raise RequestError(
                f"min_new_tokens={sp.min_new_tokens} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer for eos_token_id)."
            )
    return sp


def verify_sampling(sp: Sampling, vocab_size: int, version: str) -> None:
    """SGLang's SamplingParams.verify, as a RequestError."""
    try:
        sampling.verify(sp, vocab_size, version)
    except sampling.SamplingError as e:
        raise RequestError(str(e)) from None
