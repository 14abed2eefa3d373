"""The exports as each trainer takes them (the trainers' own code runs in tests/trainers/): the tokens loss mask per
trainer and the switch for the template's think-start; the conversations export's tool rows (a tool call alone is
left out with its own reason, SpecForge's validator refusing its empty content, and kept by --include tool_call_only;
an unreadable call is left out with its own reason, arguments a trainer would re-serialise are counted),
its round trip and the SpecForge registration of the model's template, checked against real chat templates."""

from __future__ import annotations

import json

import pytest

import runs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import export_run
from toolkit.dataset.finish import merge_and_audit
from toolkit.dataset.trainers import (
    builtin_problems,
    registration,
    trainer_json,
    writes_default_system,
)


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def kimi_run(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6}, shards=1)
    runs.write_run(s, runs.healthy())
    assert merge_and_audit(s.root).passed
    return s


def test_the_think_start_the_template_wrote_is_supervised_for_specforge_and_not_for_speculators(
    kimi_run, tmp_path
):
    s = kimi_run
    assert s.info.opens_reasoning  # the template ends the prompt with <think>
    sf = export_run(s.root, output=tmp_path / "sf.jsonl")
    sp = export_run(s.root, output=tmp_path / "sp.jsonl", trainer="speculators")
    off = export_run(s.root, output=tmp_path / "off.jsonl", supervise_think_start=False)
    assert (sf.format, sf.trainer, sf.supervise_think_start) == ("tokens", "specforge", True)
    assert (sp.trainer, sp.supervise_think_start, off.supervise_think_start) == (
        "speculators",
        False,
        False,
    )
    for a, b, c in zip(
        lines(tmp_path / "sf.jsonl"), lines(tmp_path / "sp.jsonl"), lines(tmp_path / "off.jsonl")
    ):
        rec = s.written[a["id"]]
        n = rec.prompt_tokens
        assert a["input_ids"] == b["input_ids"] == c["input_ids"]  # the same exact ids
        ts = a["input_ids"][:n][::-1].index(s.info.think_start_id)
        head = n - 1 - ts
        assert a["loss_mask"] == [0] * head + [1] * (len(a["input_ids"]) - head)
        assert b["loss_mask"] == c["loss_mask"] == [0] * n + [1] * (len(a["input_ids"]) - n)


def test_export_without_a_format_writes_the_tokens_for_the_trainer_asked(kimi_run, capsys):
    s = kimi_run
    assert cli_main(["export", str(s.root)]) == 0
    out = capsys.readouterr().out
    assert (
        s.root / "export" / "tokens.jsonl"
    ).is_file() and "(tokens, the default: the model's exact ids" in out
    assert cli_main(["export", str(s.root), "--trainer", "speculators"]) == 0
    assert (s.root / "export" / "tokens_speculators.jsonl").is_file()
    assert (
        "loss mask for speculators, the template's think-start not supervised"
        in capsys.readouterr().out
    )
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--trainer",
                "speculators",
                "--think-start",
                "supervised",
                "-o",
                str(s.root / "x.jsonl"),
            ]
        )
        == 0
    )
    rows = lines(s.root / "x.jsonl")
    assert rows == lines(
        s.root / "export" / "tokens.jsonl"
    )  # the switch alone gives SpecForge's mask


def tool_section(s: runs.Synth, calls: str) -> list[int]:
    return s.tok(calls, add_special_tokens=False)["input_ids"]


CALLS = {
    "kimi": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.calc:0<|tool_call_argument_begin|>"
        "{ARGS}<|tool_call_end|><|tool_calls_section_end|>"
    ),
    "deepseek": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{ARGS}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
}


@pytest.mark.parametrize("family", ["kimi", "deepseek"])
def test_conversations_keep_tool_call_answers_leave_out_unreadable_calls_and_write_tools_on_every_row(
    tmp_path, toy_tokenizer, capsys, family
):
    """A tool call alone is left out by default (`tool_call_only`: SpecForge's validate_regenerated_data.py refuses
    "message N content must be a non-empty string"), kept with `content` "" by --include tool_call_only."""
    s = runs.plan_run(tmp_path, toy_tokenizer(family), family, datasets={"tools": 8}, shards=1)
    call = CALLS[family]
    healthy = runs.healthy()

    def out(args: str, content: bool = False):
        def make(s, pos, rng):
            ids = s.text(rng, 40) + [s.info.think_end_id] + (s.text(rng, 10) if content else [])
            return runs.Out(
                ids + tool_section(s, call.replace("{ARGS}", args)) + [s.eos], "stop", s.eos
            )

        return make

    runs.write_run(
        s,
        runs.mix(
            healthy,
            p0=out('{"x": "1+1"}'),
            p1=out('{"x":"2+2"}', content=True),
            p2=out("no json at all"),
        ),
    )
    merge_and_audit(s.root)
    capsys.readouterr()
    ids = [r.id for r in s.refs]
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "conversations",
                "-o",
                str(tmp_path / "default.jsonl"),
            ]
        )
        == 0
    )
    default = {r["id"] for r in lines(tmp_path / "default.jsonl")}
    assert ids[0] not in default and ids[1] in default
    assert {r["id"]: r["reason"] for r in lines(tmp_path / "default_skipped.jsonl")} == {
        ids[0]: "tool_call_only",
        ids[2]: "unreadable_tool_call",
    }
    assert (
        json.loads((tmp_path / "default_summary.json").read_text())["skipped_by_reason"][
            "tool_call_only"
        ]
        == 1
    )
    assert all(
        m["content"].strip() for r in lines(tmp_path / "default.jsonl") for m in r["conversations"]
    )
    capsys.readouterr()
    assert (
        cli_main(
            ["export", str(s.root), "--format", "conversations", "--include", "tool_call_only"]
        )
        == 0
    )
    printed = capsys.readouterr()
    rows = {r["id"]: r for r in lines(s.root / "export" / "conversations.jsonl")}
    skipped = {
        r["id"]: r["reason"] for r in lines(s.root / "export" / "conversations_skipped.jsonl")
    }
    answer = rows[ids[0]]["conversations"][-1]
    assert answer["content"] == "" and answer["tool_calls"][0]["function"] == {
        "name": "calc",
        "arguments": '{"x": "1+1"}',
    }
    assert rows[ids[1]]["conversations"][-1]["tool_calls"]
    assert skipped == {ids[2]: "unreadable_tool_call"}
    assert all(isinstance(r["tools"], list) for r in rows.values())
    assert any(r["tools"] == [] for r in rows.values()) and any(r["tools"] for r in rows.values())
    summary = json.loads((s.root / "export" / "conversations_summary.json").read_text())
    assert (
        summary["arguments_reformatted"] == 1
    )  # '{"x":"2+2"}': SpecForge would train '{"x": "2+2"}'
    assert "1 tool calls have arguments SpecForge would train re-serialised" in printed.out
    trip = lines(s.root / "export" / "conversations_roundtrip.jsonl")
    assert [t["id"] for t in trip] == list(rows)
    assert {t["id"]: t["arguments_reformatted"] for t in trip if t["arguments_reformatted"]} == {
        ids[1]: 1
    }
    assert summary["roundtrip_rows"] == len(rows) and summary["roundtrip_identical"] == sum(
        t["identical"] for t in trip
    )
    assert (
        f"round trip as SpecForge renders the rows: {summary['roundtrip_identical']} of {len(rows)} rows give the "
        "model's exact ids"
    ) in printed.out


def test_trainer_json_is_what_json_dumps_writes():
    assert trainer_json('{"a": 1, "b": [1, 2]}') and trainer_json("{}")
    assert (
        not trainer_json('{"a":1}')
        and not trainer_json("not json")
        and not trainer_json('{"a": 1.50}')
    )


@pytest.mark.parametrize(
    "name, header, end, parser, warned",
    [
        (
            "kimi-k2-thinking",
            "<|im_assistant|>assistant<|im_middle|>",
            "<|im_end|>",
            "thinking",
            ["kimi-k2-thinking", "kimi-k2-instruct"],
        ),
        (
            "deepseek-r1-distill",
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
            "general",
            ["deepseek-r1-distill", "deepseek-v3"],
        ),
        (
            "qwen3",
            "<|im_start|>assistant\n",
            "<|im_end|>",
            "thinking",
            ["qwen3-thinking", "qwen3-instruct", "qwen3-next-thinking"],
        ),
    ],
)
def test_the_registration_reproduces_the_models_header_and_warns_about_the_builtins(
    real_tokenizer, name, header, end, parser, warned
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_tokenizer(name))
    stops = [tok.eos_token, "<|im_end|>"]
    reg = registration(tok, "<think>", [t for t in stops if t], name="m", think_end="</think>")
    assert (reg.assistant_header, reg.end_of_turn_token, reg.parser_type) == (header, end, parser)
    problems = builtin_problems(reg, writes_default_system(tok))
    assert [p.split("'")[2] for p in problems] == warned
    code = reg.python()
    assert "system_prompt=None" in code and f"assistant_header={header!r}" in code
    compile(code, "registration", "exec")  # a Python file SpecForge's process can import


def test_a_template_that_closes_reasoning_has_its_empty_think_block_left_out_of_the_loss(
    real_tokenizer,
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_tokenizer("qwen3"))
    reg = registration(
        tok, "<think>", ["<|im_end|>"], think_end="</think>", kwargs={"enable_thinking": False}
    )
    assert reg.assistant_header == "<|im_start|>assistant\n" and reg.ignore_token == [
        "<think>\n\n</think>\n\n"
    ]
