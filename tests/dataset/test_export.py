"""Exports: every format round-trips the stored ids; text is split at the think-end id; only ok records by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import ExportError, JsonlRecord, Selection, export_run
from toolkit.dataset.merge import merge_run
from toolkit.formats.records import unpack_ids

FIELDS = [
    "id",
    "dataset",
    "sample",
    "turn",
    "segments",
    "status",
    "error",
    "prompt_ids",
    "output_ids",
    "reasoning_end",
    "reasoning",
    "content",
    "finish_reason",
    "matched_stop",
    "matched_stop_str",
    "prompt_tokens",
    "completion_tokens",
    "meta",
]


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory, toy_tokenizer):
    """A merged kimi run: healthy outputs, one failure, one truncated and one without think-end, some tool prompts."""
    s = runs.plan_run(
        tmp_path_factory.mktemp("export"),
        toy_tokenizer("kimi"),
        datasets={"math": 8, "tools": 6},
        shards=2,
    )
    runs.write_run(s, runs.mix(runs.healthy(), p2=runs.truncated, p6=runs.no_think_end), failed=[3])
    merge_run(s.root)
    return s


def stored(s: runs.Synth, include_failed: bool = False):
    """The merged records in planned order, as the exports must see them."""
    recs = sorted(s.written.values(), key=lambda r: r.index)
    return [r for r in recs if include_failed or r.status == "ok"]


def test_jsonl_has_exactly_the_documented_fields_and_round_trips_ids(kimi_run, tmp_path):
    s = kimi_run
    out = tmp_path / "out.jsonl"
    assert export_run(s.root, "jsonl", out).rows == 13
    rows = lines(out)
    assert list(JsonlRecord.__struct_fields__) == FIELDS
    assert all(list(row) == FIELDS for row in rows)
    dec = lambda ids: s.tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    for row, rec in zip(rows, stored(s), strict=True):
        out_ids = unpack_ids(rec.output_ids)
        assert row["prompt_ids"] == unpack_ids(rec.prompt_ids) and row["output_ids"] == out_ids
        assert (row["id"], row["dataset"], row["status"], row["error"]) == (
            rec.id,
            rec.dataset,
            "ok",
            None,
        )
        assert (row["finish_reason"], row["matched_stop"], row["reasoning_end"]) == (
            rec.finish,
            rec.matched_stop,
            rec.reasoning_end,
        )
        assert (row["prompt_tokens"], row["completion_tokens"]) == (rec.prompt_tokens, len(out_ids))
        re_ = rec.reasoning_end
        if (
            re_ is not None
        ):  # the template opened <think>: reasoning is everything before </think>, eos excluded
            assert row["reasoning"] == dec(out_ids[:re_]) and row["content"] == dec(
                out_ids[re_ + 1 : -1]
            )
        else:  # no think-end in an output that started inside reasoning: all of it is reasoning
            end = -1 if rec.finish == "stop" else len(out_ids)
            assert row["reasoning"] == dec(out_ids[:end]) and row["content"] == ""
        assert (
            "</think>" not in row["reasoning"] + row["content"]
            and "<|im_end|>" not in row["content"]
        )
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}


def test_failed_records_only_with_include_failed(kimi_run, tmp_path):
    s = kimi_run
    out = tmp_path / "all.jsonl"
    assert export_run(s.root, "jsonl", out, include_failed=True).rows == 14
    rows = lines(out)
    assert [r["id"] for r in rows] == [r.id for r in stored(s, include_failed=True)]
    bad = rows[3]
    assert (
        bad["status"],
        bad["error"],
        bad["output_ids"],
        bad["reasoning"],
        bad["content"],
        bad["finish_reason"],
    ) == ("failed", "server error 500: boom", [], "", "", None)
    assert bad["prompt_ids"] == s.prompt_ids[3]


def test_parquet_has_the_same_columns_and_ids(kimi_run, tmp_path):
    import pyarrow.parquet as pq

    s = kimi_run
    export_run(s.root, "jsonl", tmp_path / "a.jsonl", include_failed=True)
    assert export_run(s.root, "parquet", tmp_path / "a.parquet", include_failed=True).rows == 14
    table = pq.read_table(tmp_path / "a.parquet")
    assert table.column_names == FIELDS
    import pyarrow as pa

    assert pa.types.is_list(table.schema.field("output_ids").type)
    assert table.schema.field("output_ids").type.value_type == pa.uint32()
    assert table.schema.field("matched_stop").type == pa.int64()
    assert table.schema.field("matched_stop_str").type == pa.string()
    for row, want in zip(table.to_pylist(), lines(tmp_path / "a.jsonl"), strict=True):
        row["meta"] = json.loads(row["meta"])  # an object in jsonl, JSON text in parquet
        assert row == want  # same values, same types: the stop id is an int in both


def test_a_stop_string_goes_to_matched_stop_str_in_both_formats(tmp_path, toy_tokenizer):
    import pyarrow.parquet as pq

    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 4}, shards=1)

    def by_string(s, pos, rng):
        ids = [*s.text(rng, 20), s.info.think_end_id, *s.text(rng, 10)]
        return (
            runs.Out(ids + [s.eos], "stop", s.eos)
            if pos % 2
            else runs.Out(ids, "stop", "</answer>")
        )

    runs.write_run(s, by_string)
    merge_run(s.root)
    export_run(s.root, "jsonl", tmp_path / "s.jsonl")
    export_run(s.root, "parquet", tmp_path / "s.parquet")
    rows = lines(tmp_path / "s.jsonl")
    assert [(r["matched_stop"], r["matched_stop_str"]) for r in rows] == [
        (None, "</answer>"),
        (s.eos, None),
    ] * 2
    assert [
        {**r, "meta": json.loads(r["meta"])}
        for r in pq.read_table(tmp_path / "s.parquet").to_pylist()
    ] == rows


def _extra(i: int) -> dict:
    """A dataset's own fields on prompt line i: some lines have none, values of every JSON kind."""
    if i % 3 == 2:
        return {}
    return {
        "source": f"gsm8k/{i}",
        "category": ["algebra", "geometry"][i % 2],
        "difficulty": i / 4,
        "tags": ["a", i],
        "extra": {"nested": True, "note": None},
    }


def test_a_prompt_lines_other_fields_follow_it_into_jsonl_and_parquet(
    tmp_path, toy_tokenizer, caplog
):
    import pyarrow.parquet as pq

    s = runs.plan_run(
        tmp_path,
        toy_tokenizer("kimi"),
        datasets={"math": 5, "chat": 4},
        shards=2,
        extra=_extra,
        sampling={"n": 2, "temperature": 0.7},
    )
    runs.write_run(s)
    merge_run(s.root)
    export_run(s.root, "jsonl", tmp_path / "m.jsonl")
    export_run(s.root, "parquet", tmp_path / "m.parquet")
    rows = lines(tmp_path / "m.jsonl")
    assert len(rows) == 18
    for row in rows:  # ids: "<dataset>-<line number from 0>#<sample>"
        assert row["meta"] == _extra(int(row["id"].split("-")[1].split("#")[0])), row["id"]
    assert {r["meta"].get("source") for r in rows} >= {"gsm8k/0", "gsm8k/1"} and {} in [
        r["meta"] for r in rows
    ]
    table = pq.read_table(tmp_path / "m.parquet").to_pylist()
    assert [json.loads(r["meta"]) for r in table] == [r["meta"] for r in rows]
    # the prompt file changed since planning: its lines can no longer be trusted at their offsets
    math = tmp_path / "math.jsonl"
    math.write_text(math.read_text().replace("gsm8k", "GSM8K"))
    export_run(s.root, "jsonl", tmp_path / "n.jsonl")
    after = lines(tmp_path / "n.jsonl")
    assert all(r["meta"] is None for r in after if r["dataset"] == "math")
    assert [r["meta"] for r in after if r["dataset"] == "chat"] == [
        r["meta"] for r in rows if r["dataset"] == "chat"
    ]
    assert f"{math} changed or is gone since the run was planned" in caplog.text


TRAINING = lambda s: [r for r in stored(s) if r.index not in (2, 6)]  # noqa: E731  (truncated, no think-end)
# the drafters' rows: the output cut by max_new_tokens too (the model's own tokens), not the one that never ended
DRAFTER = lambda s: [r for r in stored(s) if r.index != 6]  # noqa: E731


def test_tokens_are_prompt_plus_output_with_a_loss_mask_over_the_output(kimi_run, tmp_path):
    s = kimi_run
    assert export_run(s.root, "tokens", tmp_path / "t.jsonl").rows == 12
    for row, rec in zip(lines(tmp_path / "t.jsonl"), DRAFTER(s), strict=True):
        assert list(row) == [
            "id",
            "dataset",
            "sample",
            "turn",
            "segments",
            "input_ids",
            "loss_mask",
        ]
        assert (row["id"], row["dataset"]) == (rec.id, rec.dataset)
        p, o = unpack_ids(rec.prompt_ids), unpack_ids(rec.output_ids)
        # the template opened reasoning: the think-start it wrote after the assistant header is supervised too
        assert p[-1] == s.info.think_start_id
        assert row["input_ids"] == p + o and row["loss_mask"] == [0] * (len(p) - 1) + [1] * (
            1 + len(o)
        )


def test_conversations_are_the_source_messages_then_the_answer(kimi_run, tmp_path):
    s = kimi_run
    export_run(s.root, "jsonl", tmp_path / "j.jsonl")
    assert export_run(s.root, "conversations", tmp_path / "c.jsonl").rows == 11
    tool_rows = 0
    kept = [j for j in lines(tmp_path / "j.jsonl") if j["id"] in {r.id for r in TRAINING(s)}]
    for row, j in zip(lines(tmp_path / "c.jsonl"), kept, strict=True):
        src = next(
            json.loads(x)
            for x in Path(s.plan.datasets[0 if j["dataset"] == "math" else 1].path)
            .read_text()
            .splitlines()
            if json.loads(x)["id"] == row["id"]
        )
        assert row["id"] == j["id"]
        assert row["conversations"] == [
            *src["messages"],
            {"role": "assistant", "content": j["content"], "reasoning_content": j["reasoning"]},
        ]
        assert row["tools"] == (
            src.get("tools") or []
        )  # on every row: a trainer takes its columns from the first
        tool_rows += "tools" in row
    assert tool_rows >= 1


def test_a_think_start_written_by_the_model_is_not_reasoning(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("qwen3"), "qwen3", datasets={"math": 4}, shards=1)
    runs.write_run(s)
    merge_run(s.root)
    export_run(s.root, "jsonl", tmp_path / "q.jsonl")
    for row in lines(tmp_path / "q.jsonl"):
        ids, re_ = row["output_ids"], row["reasoning_end"]
        assert ids[0] == s.info.think_start_id
        assert row["reasoning"] == s.tok.decode(ids[1:re_]) and not row["reasoning"].startswith(
            "<think>"
        )


def test_export_without_output_writes_under_the_run_and_says_where(kimi_run, capsys):
    s = kimi_run
    assert cli_main(["export", str(s.root), "--format", "jsonl"]) == 0
    out = capsys.readouterr().out
    path = s.root / "export" / "records.jsonl"
    assert len(lines(path)) == 13 and out.startswith("wrote 13 rows (13 records) to ")
    assert Path(out.split(" to ")[1].split()[0]).resolve() == path.resolve()
    assert cli_main(["export", str(s.root), "--format", "tokens"]) == 0
    assert (
        s.root / "export" / "tokens.jsonl"
    ).exists() and "export/tokens.jsonl" in capsys.readouterr().out


def test_export_command(kimi_run, tmp_path, capsys):
    s = kimi_run
    assert (
        cli_main(["export", str(s.root), "--format", "tokens", "-o", str(tmp_path / "x.jsonl")])
        == 0
    )
    assert "wrote 12 rows (12 records)" in capsys.readouterr().out
    assert (
        cli_main(
            ["export", str(s.root), "--format", "jsonl", "-o", str(tmp_path / "no" / "x.jsonl")]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["export", str(s.root), "--format", "xml", "-o", "x"])
    assert e.value.code == 2
    assert not list(tmp_path.glob(".*tmp"))


def test_export_needs_a_merged_run(tmp_path, toy_tokenizer, capsys):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 3}, shards=1)
    runs.write_run(s)
    assert (
        cli_main(["export", str(s.root), "--format", "jsonl", "-o", str(tmp_path / "o.jsonl")]) == 2
    )
    assert f"toolkit merge {s.root}" in capsys.readouterr().err


def test_a_tool_call_the_model_made_is_a_structured_entry_of_the_answer(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"tools": 4}, shards=1)
    section = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    tool_ids = s.tok.encode(section, add_special_tokens=False)

    def with_call(s, pos, rng):
        return runs.Out(
            [*s.text(rng, 30), s.info.think_end_id, *s.text(rng, 10), *tool_ids, s.eos],
            "stop",
            s.eos,
        )

    runs.write_run(s, runs.mix(runs.healthy(), p1=with_call))
    merge_run(s.root)
    export_run(s.root, "conversations", tmp_path / "c.jsonl")
    export_run(s.root, "jsonl", tmp_path / "j.jsonl")
    rows, jrows = lines(tmp_path / "c.jsonl"), lines(tmp_path / "j.jsonl")
    answer = rows[1]["conversations"][-1]
    assert answer["tool_calls"] == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert "<|tool_call" not in answer["content"] and jrows[1]["content"].startswith(
        answer["content"]
    )
    assert all("tool_calls" not in r["conversations"][-1] for i, r in enumerate(rows) if i != 1)
    # the exact ids are untouched: the jsonl export still holds the section's ids
    assert jrows[1]["output_ids"][-len(tool_ids) - 1 : -1] == tool_ids


@pytest.mark.parametrize(
    "damage, words",
    [
        ("format", "shard format 253"),
        ("fingerprint", "damaged header"),
        ("first frame", "checksum"),
        ("last frame", "at byte"),
        ("cut", "bytes, its manifest says"),
    ],
)
def test_a_damaged_merged_file_is_one_line_and_nothing_is_exported(
    tmp_path, toy_tokenizer, capsys, damage, words
):
    from toolkit.formats.frames import iter_frames

    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 12}, shards=1)
    runs.write_run(s)
    merge_run(s.root)
    merged = s.rd.merged_file
    frames = list(iter_frames(merged))
    data = bytearray(merged.read_bytes())
    if damage == "cut":
        data = data[:-7]
    else:
        at = {
            "format": 12,
            "fingerprint": 14,
            "first frame": frames[0].offset + 40,
            "last frame": frames[-1].end - 5,
        }
        data[at[damage]] = 253 if damage == "format" else data[at[damage]] ^ 0xC0
    merged.write_bytes(bytes(data))
    out = tmp_path / "out.jsonl"
    assert cli_main(["export", str(s.root), "--format", "jsonl", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolkit: error: ") and err.count("\n") == 1 and "Traceback" not in err, (
        err
    )
    assert words in err and f"toolkit merge {s.root}" in err, err
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))


def test_ok_records_the_audit_fails_refuse_the_export_unless_forced(
    tmp_path, toy_tokenizer, capsys, caplog
):
    """Records stored ok by an older toolkit (or a server the worker did not check) that fail the audit's checks of
    one record are not exported as data without a word: the export is refused, naming them; --force exports them
    with a warning."""
    import msgspec

    from toolkit.formats.records import pack_ids

    s = runs.plan_run(
        tmp_path,
        toy_tokenizer("kimi"),
        datasets={"math": 8},
        shards=1,
        sampling={"max_new_tokens": 400},
    )

    def plant(r):
        if r.index == 1:  # an id outside the tokenizer
            return msgspec.structs.replace(
                r, output_ids=pack_ids([s.info.vocab_size + 3]) + r.output_ids[4:]
            )
        if r.index == 4:  # more output ids than max_new_tokens
            ids = unpack_ids(r.output_ids)
            ids = ids[:-1] * (401 // len(ids) + 2) + ids[-1:]
            return msgspec.structs.replace(r, output_ids=pack_ids(ids), completion_tokens=len(ids))
        return r

    runs.write_run(s, edit=plant)
    merge_run(s.root)
    from toolkit.dataset.audit import audit_run

    checks = {c.name: c for c in audit_run(s.root).checks}
    assert not checks["vocabulary"].passed and not checks["token_counts"].passed
    assert (
        "1 with more output ids than max_new_tokens (e.g. math-0004)"
        in checks["token_counts"].message
    )
    out = tmp_path / "out.jsonl"
    assert cli_main(["export", str(s.root), "--format", "tokens", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 ok records fail the audit's record checks" in err, err
    assert (
        "more output ids than max_new_tokens (math-0004)" in err
        and "an id outside the tokenizer (math-0001)" in err
    )
    assert "--force" in err and not out.exists() and not list(tmp_path.glob(".*tmp"))
    assert cli_main(["export", str(s.root), "--format", "tokens", "-o", str(out), "--force"]) == 0
    assert len(lines(out)) == 7 and "exporting them anyway (--force): 2 ok records" in caplog.text
    # the planted output repeats its reasoning, think-end included: a second think-end is not training data
    assert [(r["id"], r["reason"]) for r in lines(tmp_path / "out_skipped.jsonl")] == [
        ("math-0004", "think_marker")
    ]


def test_what_is_not_training_data_goes_to_the_skipped_file_and_every_planned_id_is_accounted_for(
    kimi_run, tmp_path, capsys
):
    s = kimi_run
    out = tmp_path / "c.jsonl"
    assert cli_main(["export", str(s.root), "--format", "conversations", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "14 planned: 11 exported, 2 skipped (" in printed and "1 failed (rejected 1)" in printed
    skipped = {r["id"]: r for r in lines(tmp_path / "c_skipped.jsonl")}
    ids = [r.id for r in stored(s, include_failed=True)]
    assert (skipped[ids[2]]["reason"], skipped[ids[6]]["reason"], skipped[ids[3]]["reason"]) == (
        "truncated",
        "no_think_end",
        "rejected",
    )
    assert (skipped[ids[3]]["status"], skipped[ids[3]]["error"]) == (
        "failed",
        "server error 500: boom",
    )
    exported = {r["id"] for r in lines(out)}
    assert sorted(exported | set(skipped)) == sorted(ids) and not exported & set(skipped)
    summary = json.loads((tmp_path / "c_summary.json").read_text())
    assert (
        summary["planned"],
        summary["exported"],
        summary["skipped"],
        summary["failed"],
        summary["missing"],
    ) == (14, 11, 2, 1, 0)
    assert summary["skipped_by_reason"] == {"truncated": 1, "no_think_end": 1}
    # the drafters' export keeps the cut output (the model's own tokens), not the one that never ended its reasoning
    assert (
        cli_main(["export", str(s.root), "--format", "tokens", "-o", str(tmp_path / "t.jsonl")])
        == 0
    )
    assert {r["id"] for r in lines(tmp_path / "t.jsonl")} == exported | {ids[2]}
    assert (
        "14 planned: 12 exported (truncated 1 kept), 1 skipped (no_think_end 1)"
        in capsys.readouterr().out
    )
    # ... unless told to leave it out, with its reason
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "tokens",
                "-o",
                str(tmp_path / "t.jsonl"),
                "--exclude",
                "truncated",
            ]
        )
        == 0
    )
    assert {r["id"] for r in lines(tmp_path / "t.jsonl")} == exported
    assert json.loads((tmp_path / "t_summary.json").read_text())["skipped_by_reason"] == {
        "truncated": 1,
        "no_think_end": 1,
    }
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "tokens",
                "-o",
                str(tmp_path / "t.jsonl"),
                "--include",
                "truncated",
                "--exclude",
                "truncated",
            ]
        )
        == 2
    )
    assert "truncated both included and excluded" in capsys.readouterr().err
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "tokens",
                "-o",
                str(tmp_path / "t.jsonl"),
                "--exclude",
                "y",
            ]
        )
        == 2
    )
    assert "unknown reason y to exclude" in capsys.readouterr().err
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "tokens",
                "-o",
                str(tmp_path / "t.jsonl"),
                "--include",
                "all",
            ]
        )
        == 0
    )
    assert len(lines(tmp_path / "t.jsonl")) == 13
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "tokens",
                "-o",
                str(tmp_path / "t.jsonl"),
                "--include",
                "x",
            ]
        )
        == 2
    )
    assert "unknown reason x" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tokens", "conversations"])
def test_filters_work_on_every_format_and_every_row_says_where_it_comes_from(
    kimi_run, tmp_path, fmt
):
    s = kimi_run
    out = tmp_path / ("o.parquet" if fmt == "parquet" else "o.jsonl")

    def rows(**kw) -> list[dict]:
        summary = export_run(s.root, fmt, out, select=Selection(**kw))
        assert (
            summary.exported + summary.skipped + summary.failed + summary.missing + summary.filtered
            == summary.planned
        )
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(out).to_pylist()
        return lines(out)

    # a conversation turn needs an answer: the two outputs without one stay out of it even when included
    n = 11 if fmt == "conversations" else 13
    every = rows(include=frozenset({"truncated", "no_think_end"}))
    assert len(every) == n and all(
        {"dataset", "sample", "turn", "segments"} <= set(r) for r in every
    )
    assert all((r["sample"], r["turn"], r["segments"]) == (0, 0, 1) for r in every)
    tools = rows(datasets=frozenset({"tools"}), include=frozenset({"truncated", "no_think_end"}))
    assert {r["dataset"] for r in tools} == {"tools"} and len(tools) == sum(
        r["dataset"] == "tools" for r in every
    )
    cut = rows(finish=frozenset({"length"}), include=frozenset({"truncated"}))
    assert [r["id"] for r in cut] == ([] if fmt == "conversations" else [stored(s)[2].id])
    assert (
        rows(mode="non-reasoning") == []
    )  # the template opens reasoning: every output is in reasoning mode
    assert len(rows(mode="reasoning", include=frozenset({"truncated", "no_think_end"}))) == n
    assert len(rows(samples=frozenset({0}), include=frozenset({"truncated", "no_think_end"}))) == n
    assert rows(samples=frozenset({1})) == [] and rows(turns=frozenset({1})) == []
    with pytest.raises(ExportError, match="no dataset nope in run"):
        export_run(s.root, fmt, out, select=Selection(datasets=frozenset({"nope"})))


def test_the_loss_mask_starts_after_the_assistant_header():
    from toolkit.dataset.export import loss_mask
    from toolkit.formats.records import pack_ids
    from toolkit.job.chat import TokenInfo

    ts, nl = 90, 7
    info = TokenInfo(
        think_start_id=ts,
        think_end_id=91,
        eos_ids=[2],
        tool_call_start_id=None,
        tool_call_end_id=None,
        vocab_size=100,
        opens_reasoning=True,
        blank_ids=[nl],
    )
    # DeepSeek-R1's template ends the prompt with "<think>\n": the think-start and the newline after it are the
    # assistant turn's, as SpecForge counts them
    assert loss_mask(pack_ids([1, 2, 3, ts, nl]), 4, info) == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    # Qwen3's prompt ends at the header: the model writes the think-start itself, in its output
    assert loss_mask(pack_ids([1, 2, 3, nl]), 2, info) == [0, 0, 0, 0, 1, 1]
    # a think-start earlier in the prompt (a history) is not the turn's
    assert loss_mask(pack_ids([ts, 5, 6]), 1, info) == [0, 0, 0, 1]
    assert loss_mask(pack_ids([1, ts, nl]), 2, info, supervise_think_start=False) == [0, 0, 0, 1, 1]


def test_a_nan_stop_is_named_in_the_skipped_file_whether_it_was_stored_failed_or_ok(
    tmp_path, toy_tokenizer
):
    import msgspec

    from toolkit.formats.records import NAN_MATCHED

    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 4}, shards=1)

    def nan(r):
        if r.status != "ok":  # as the worker stores it now: a failed record of kind nan
            return msgspec.structs.replace(r, failure="nan", error="NaN happened")
        if r.index == 2:  # as an older toolkit stored it: ok, finish stop, matched "NaN happened"
            return msgspec.structs.replace(r, matched_stop=NAN_MATCHED)
        return r

    runs.write_run(s, failed=[1], edit=nan)
    merge_run(s.root)
    summary = export_run(s.root, "tokens", tmp_path / "t.jsonl", force=True)
    assert (summary.exported, summary.skipped, summary.failed) == (2, 1, 1)
    assert (summary.skipped_by_reason, summary.failed_by_kind) == ({"nan": 1}, {"nan": 1})
    skipped = sorted((r["status"], r["reason"]) for r in lines(tmp_path / "t_skipped.jsonl"))
    assert skipped == [("failed", "nan"), ("skipped", "nan")]


def test_the_export_help_names_every_reason(capsys):
    from toolkit.dataset.export import EXPORT_REASONS

    with pytest.raises(SystemExit):
        cli_main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(reason in text for reason in EXPORT_REASONS)


def test_export_refuses_a_merged_dataset_short_of_the_plan_unless_merged_with_allow_incomplete(
    tmp_path, toy_tokenizer, capsys
):
    from toolkit.formats.manifests import write_done

    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 12}, shards=1)
    runs.write_run(s, window=0, flush_records=3)
    path = s.rd.shard_file(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= (
        0xFF  # a frame damaged before the shard was done: its done manifest vouches for it
    )
    path.write_bytes(bytes(data))
    write_done(s.rd.done_file(0), path, 0, s.plan.fingerprint, positions=range(12))
    m = merge_run(s.root)
    assert not m.complete and m.missing > 0
    with pytest.raises(
        ExportError,
        match=rf"holds {m.records} of 12 planned records \({m.missing} missing, 1 damaged "
        r"frames\): nothing exported. `toolkit status .*` names what is damaged",
    ):
        export_run(s.root)
    assert not s.rd.export_dir.exists() or not any(s.rd.export_dir.iterdir())
    merge_run(s.root, allow_incomplete=True)  # asked for: exported, and said
    capsys.readouterr()
    assert cli_main(["export", str(s.root), "--format", "jsonl"]) == 0
    err = capsys.readouterr().err
    assert f"holds {m.records} of 12 planned records (merged with --allow-incomplete)" in err
    assert len(lines(s.rd.export_file("jsonl"))) == m.records
