"""Tool calls: the tool-call section a model wrote, read back into OpenAI-style `tool_calls`
entries.

The section is found on token ids (`Record.tool_call_at`, the index of the tool-call start id); this
module only reads the decoded text of that section, in the format of the model family whose start
token opens it:

  Kimi-K2     <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
              <|tool_call_argument_begin|>{json} <|tool_call_end|>...<|tool_calls_section_end|>
  Qwen3       <tool_call>\\n{"name": NAME, "arguments": {json}}\\n</tool_call> (one block per call)
  GLM-4.6     <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>
  DeepSeek    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
              \\n```json\\n{json}\\n```<｜tool▁call▁end｜>...

A call that cannot be read (a truncated output, a format not listed) is kept as `{"raw": text}`
rather than dropped or guessed, so nothing the model wrote is lost; the exact ids are in the record
either way.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["parse_tool_calls"]

_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)
_QWEN_CALL = re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(?P<k>.*?)</arg_key>\s*<arg_value>(?P<v>.*?)</arg_value>", re.S)
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n<]*)\n"
    r"(?P<args>.*?)<｜tool▁call▁end｜>",
    re.S,
)
_NAME = re.compile(r"[\w.\-:]+")
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(?P<json>.*?)\n?```\s*$", re.S)


def _call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _kimi(text: str) -> list[dict[str, Any]]:
    calls = []
    for i, m in enumerate(_KIMI_CALL.finditer(text)):
        call_id = m["id"].strip()
        # "functions.get_weather:0" -> get_weather
        name = call_id.split(".", 1)[-1].rsplit(":", 1)[0] if call_id else ""
        args = m["args"].strip()
        calls.append(
            _call(name, args, call_id or f"call_{i}")
            if name and _json_or_none(args) is not None
            else {"raw": m.group(0)}
        )
    return calls


def _qwen_or_glm(text: str) -> list[dict[str, Any]]:
    calls = []
    for i, m in enumerate(_QWEN_CALL.finditer(text)):
        body = m["body"].strip()
        obj = _json_or_none(body)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(_call(obj["name"], obj.get("arguments", {}), f"call_{i}"))
            continue
        name, _, rest = body.partition("\n")
        args = {a["k"].strip(): _glm_value(a["v"]) for a in _GLM_ARG.finditer(rest)}
        if _NAME.fullmatch(name.strip()) and (args or not rest.strip()):
            calls.append(_call(name.strip(), args, f"call_{i}"))
        else:
            calls.append({"raw": m.group(0)})
    return calls


def _glm_value(v: str) -> Any:
    parsed = _json_or_none(v)
    return v if parsed is None or isinstance(parsed, str) else parsed


def _deepseek(text: str) -> list[dict[str, Any]]:
    calls = []
    for i, m in enumerate(_DEEPSEEK_CALL.finditer(text)):
        fence = _FENCE.match(m["args"])
        args = (fence["json"] if fence else m["args"]).strip()
        ok = m["name"].strip() and _json_or_none(args) is not None
        calls.append(_call(m["name"].strip(), args, f"call_{i}") if ok else {"raw": m.group(0)})
    return calls


_FAMILIES = (
    ("<|tool_calls_section_begin|>", _kimi),
    ("<｜tool▁calls▁begin｜>", _deepseek),
    ("<tool_call>", _qwen_or_glm),
)


def parse_tool_calls(section: str) -> list[dict[str, Any]]:
    """The calls in the decoded text of a tool-call section (which starts with the family's start
    token).

    Returns [] for text holding no call; a call that cannot be read is `{"raw": its text}`; a
    section of an unknown format is one `{"raw": section}`.
    """
    text = section.lstrip()
    for start, parse in _FAMILIES:
        if text.startswith(start):
            calls = parse(text)
            return calls or ([{"raw": section}] if section.strip() else [])
    return [{"raw": section}] if section.strip() else []
