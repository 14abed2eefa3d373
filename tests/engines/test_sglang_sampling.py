"""SGLang's sampling contract as data (toolkit.engines.sglang_contract.sampling): the differences between releases."""

import pytest

from toolkit.engines.sglang_contract.sampling import (
    FIELDS,
    NOT_TAKEN,
    SamplingError,
    TypeMismatch,
    check_types,
    make_sampling,
    verify,
)


def refused(params: dict, version: str, vocab: int | None = 100) -> str | None:
    try:
        verify(make_sampling(params), vocab, version)
    except SamplingError as e:
        return str(e)
    return None


def test_the_releases_differ_where_their_sources_do():
    assert refused({"repetition_penalty": 0.0}, "0.5.9") is None
    assert refused({"repetition_penalty": 0.0}, "0.5.23").startswith(
        "repetition_penalty must be in (0, 2]"
    )
    two = {"regex": "a", "structural_tag": "{}"}
    assert refused(two, "0.5.9") is None  # 0.5.9 does not count structural_tag
    assert (
        refused(two, "0.5.23")
        == "Only one of json_schema, regex, ebnf, or structural_tag can be set."
    )
    assert (
        refused({"regex": "a", "ebnf": ""}, "0.5.23") is None
    )  # an empty grammar is none in 0.5.23
    assert (
        refused({"regex": "a", "ebnf": ""}, "0.5.9")
        == "Only one of regex, json_schema, or ebnf can be set."
    )
    many = {"stop": [str(i) for i in range(33)]}
    assert refused(many, "0.5.9") is None and refused(many, "0.5.23").startswith(
        "at most 32 stop strings"
    )
    assert (
        refused({"temperature": float("inf")}, "0.5.9")
        == "temperature must be non-negative, got inf."
    )
    assert refused({"beam_width": 0}, "0.5.23") == "beam_width must be at least 1, got 0."
    assert NOT_TAKEN["0.5.9"] > NOT_TAKEN["0.5.23"] == {"choice"}


def test_defaults_greedy_and_logit_bias():
    sp = make_sampling({"temperature": 0, "top_k": -1})
    assert (sp.temperature, sp.top_k) == (1.0, 1)  # greedy is top_k = 1
    assert (
        refused({"logit_bias": {"100": 1.0}}, "0.5.23")
        == "logit_bias must has keys in [0, 99], got 100."
    )
    assert (
        refused({"logit_bias": {"100": 1.0}}, "0.5.23", vocab=None) is None
    )  # no tokenizer: not checked
    assert refused({}, "0.5.23") is None and make_sampling({}).max_new_tokens == 128


@pytest.mark.parametrize(
    "params, text",
    [
        ({"top_p": "1"}, 'invalid type: string "1", expected f64'),
        ({"n": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"stop": [1]}, "invalid type: integer `1`, expected a string"),
        ({"logit_bias": {"1": "x"}}, 'invalid type: string "x", expected f64'),
        ({"seed": 1}, "unknown field `seed`, expected one of `max_new_tokens`"),
    ],
)
def test_the_schema_gate_names_the_type_it_wanted(params, text):
    with pytest.raises(TypeMismatch) as e:
        check_types(params)
    assert str(e.value).startswith(text)
    check_types({k: None for k in FIELDS})  # null is every field's default
