"""Tool-call sections of each family read back into OpenAI-style entries; what cannot be read is kept raw."""

from __future__ import annotations

import json

from toolkit.job.toolcalls import parse_tool_calls


def fn(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_kimi_sections_hold_one_entry_per_call():
    text = (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q": "x"}'
        "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    calls = parse_tool_calls(text)
    assert [fn(c) for c in calls] == [("search", {"q": "x"}), ("get_time", {})]
    assert [c["id"] for c in calls] == ["functions.search:0", "functions.get_time:1"]


def test_qwen3_json_blocks():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "neg", "arguments": {"a": 3}}\n</tool_call>'
    assert [fn(c) for c in parse_tool_calls(text)] == [("add", {"a": 1, "b": 2}), ("neg", {"a": 3})]


def test_glm_key_value_blocks():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    assert [fn(c) for c in parse_tool_calls(text)] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_deepseek_fenced_json():
    text = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n```json\n{"id": 7}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert [fn(c) for c in parse_tool_calls(text)] == [("lookup", {"id": 7})]


def test_what_cannot_be_read_is_kept_raw_not_dropped():
    truncated = '<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q": "x'
    assert parse_tool_calls(truncated) == [{"raw": truncated}]
    bad_json = '<tool_call>\n{"name": "add", "arguments": {oops}\n</tool_call>'
    assert parse_tool_calls(bad_json) == [{"raw": bad_json}]
    assert parse_tool_calls("<minimax:tool_call>x</minimax:tool_call>") == [
        {"raw": "<minimax:tool_call>x</minimax:tool_call>"}
    ]
    assert parse_tool_calls("  ") == []
