"""Prompt files: every bad line is reported with its file, line and field, before anything runs."""

import pytest

from toolkit.job.inputs import check_unique_ids, prompt_id, read_prompt_at, scan_dataset
from toolkit.job.promptline import InputError, content_digest


def scan(tmp_path, data: bytes, name="ds"):
    p = tmp_path / f"{name}.jsonl"
    p.write_bytes(data)
    return p, list(scan_dataset(p, name))


def test_both_forms_and_default_ids(tmp_path):
    p, prompts = scan(
        tmp_path,
        b'{"prompt": "hi"}\n\n{"id": 7, "messages": [{"role": "user", "content": "yo"}], "tools": [{"type": "function"}]}\n',
    )
    assert [x.id for x in prompts] == [
        f"ds:{content_digest([{'role': 'user', 'content': 'hi'}], None)}",
        "7",
    ]
    assert not prompts[0].named and prompts[1].named
    assert prompts[0].messages == [{"role": "user", "content": "hi"}]
    assert prompts[1].line == 3 and prompts[1].tools == [{"type": "function"}]
    again = read_prompt_at(p, "ds", 3, prompts[1].offset, prompts[1].length)
    assert again.messages == prompts[1].messages and again.id == "7"


@pytest.mark.parametrize(
    "line, field, words",
    [
        (b'{"prompt": "ok"', None, "malformed JSON"),
        (b'\xff\xfe{"prompt": "x"}', None, "not valid UTF-8"),
        (b'["prompt"]', None, "expected a JSON object"),
        (b'{"id": "x"}', "messages", "missing"),
        (b'{"prompt": 3}', "prompt", "must be a string"),
        (b'{"messages": []}', "messages", "non-empty list"),
        (b'{"messages": [{"content": "x"}]}', "messages[0].role", "missing or not a string"),
        (b'{"messages": [{"role": "user"}]}', "messages[0].content", "missing"),
        (
            b'{"messages": [{"role": "user", "content": 5}]}',
            "messages[0].content",
            "must be a string",
        ),
        (b'{"messages": ["hi"]}', "messages[0]", "must be an object"),
        (b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "messages", "both"),
        (b'{"id": [1], "prompt": "x"}', "id", "string or an integer"),
        (b'{"prompt": "x", "tools": "calc"}', "tools", "list of tool objects"),
        (b'{"prompt": ""}', "prompt", "is empty"),
        (b'{"prompt": " \\n "}', "prompt", "is empty"),
        (b'{"messages": [{"role": "user", "content": ""}]}', "messages[0].content", "is empty"),
        (
            b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": null}]}',
            "messages[1].content",
            "is empty",
        ),
        (b'{"messages": [{"role": "user", "content": []}]}', "messages[0].content", "is empty"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "  "}]}]}',
            "messages[0].content",
            "is empty",
        ),
        (
            b'{"messages": [{"role": "system", "content": "Be brief."}]}',
            "messages",
            "only instructions (system)",
        ),
        (
            b'{"messages": [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"}]}',
            "messages",
            "has no user message",
        ),
    ],
)
def test_bad_lines(tmp_path, line, field, words):
    with pytest.raises(InputError) as e:
        scan(tmp_path, b'{"prompt": "fine"}\n' + line + b"\n")
    err = e.value
    assert err.line == 2 and err.field == field
    assert "ds.jsonl:2:" in str(err) and words in str(err)
    assert "then run again" in str(err) or "UTF-8" in str(err)


def test_empty_dataset(tmp_path):
    with pytest.raises(InputError, match="has no prompts"):
        scan(tmp_path, b"\n\n")


def test_duplicate_ids_within_and_across(tmp_path):
    pa, a = scan(tmp_path, b'{"id": "x", "prompt": "1"}\n{"id": "y", "prompt": "2"}\n', "a")
    pb, b = scan(tmp_path, b'{"id": "z", "prompt": "1"}\n{"id": "x", "prompt": "2"}\n', "b")
    with pytest.raises(InputError) as e:
        check_unique_ids(a + b, {"a": str(pa), "b": str(pb)})
    assert e.value.line == 2 and str(pb) in str(e.value) and f"{pa}:1" in str(e.value)
    _, c = scan(tmp_path, b'{"id": "q", "prompt": "1"}\n{"id": "q", "prompt": "2"}\n', "c")
    with pytest.raises(InputError, match="duplicate id 'q'"):
        check_unique_ids(c, {"c": "c.jsonl"})


def test_scan_collects_every_bad_line_when_given_a_list(tmp_path):
    errors: list[InputError] = []
    p = tmp_path / "ds.jsonl"
    p.write_bytes(
        b'{"prompt": "a"}\n{"prompt": 1}\n{"prompt": "b"}\nnot json\n\n{"messages": []}\n'
    )
    prompts = list(scan_dataset(p, "ds", errors))
    assert [x.line for x in prompts] == [1, 3]
    assert [(e.line, e.field) for e in errors] == [(2, "prompt"), (4, None), (6, "messages")]
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_bytes(b"{\n")
    assert (
        list(scan_dataset(only_bad, "bad", errors)) == [] and errors[-1].line == 1
    )  # not "has no prompts"


def test_every_duplicate_id_is_found(tmp_path):
    _, a = scan(
        tmp_path,
        b'{"id": "x", "prompt": "1"}\n{"id": "x", "prompt": "2"}\n{"id": "x", "prompt": "3"}\n',
        "a",
    )
    errors: list[InputError] = []
    check_unique_ids(a, {"a": "a.jsonl"}, errors)
    assert [e.line for e in errors] == [2, 3] and all(
        "already used at a.jsonl:1" in str(e) for e in errors
    )


def plan_files(tmp_path, files: dict[str, bytes], inputs: str = ""):
    from toolkit.job.plan import plan_job
    from toolkit.job.spec import load_spec

    (tmp_path / "tok").mkdir(exist_ok=True)
    lines = [
        'name = "t"',
        'output_dir = "out"',
        "[model]",
        'path = "tok"',
        "[sampling]",
        "max_new_tokens = 8",
    ]
    if inputs:
        lines += ["[inputs]", inputs]
    for name, data in files.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{name}.jsonl"']
    (tmp_path / "job.toml").write_text("\n".join(lines) + "\n")
    return plan_job(load_spec(tmp_path / "job.toml"))


def test_plan_reports_every_bad_line_of_every_file(tmp_path):
    good = b'{"prompt": "fine"}\n'
    math = (
        b'{"id": "m1", "prompt": "fine"}\n'
        + good * 3
        + b'{"messages": [{"role": "user", "content": 5}]}\n'
        + b'{"prompt": 3}\n' * 14
    )
    chat = b'{"id": "m1", "prompt": "taken"}\n' + b"nope\n"
    with pytest.raises(InputError) as e:
        plan_files(tmp_path, {"math": math, "chat": chat})
    msg, err = str(e.value), e.value
    assert len(err.errors) == 17 and (err.path, err.line, err.field) == (
        str(tmp_path / "math.jsonl"),
        5,
        "messages[0].content",
    )
    assert msg.startswith(
        f"16 bad lines in 2 prompt files ({tmp_path / 'math.jsonl'}: 15, {tmp_path / 'chat.jsonl'}: 1) "
        "and 1 duplicate id; the first 10:"
    )
    assert (
        f"\n  {tmp_path / 'math.jsonl'}:5: field `messages[0].content`: must be a string or a list of parts, got int\n"
        in msg
    )
    assert msg.count("\n  ") == 11 and "... and 7 more" in msg
    assert msg.endswith(
        "fix or remove these lines, then run again (or skip them, each reported: [inputs] on_bad_line "
        '= "skip")'
    )


def test_plan_with_one_bad_line_keeps_the_single_message(tmp_path):
    with pytest.raises(InputError) as e:
        plan_files(tmp_path, {"math": b'{"prompt": "a"}\n{"prompt": 3}\n'})
    assert (
        str(e.value)
        == f"{tmp_path / 'math.jsonl'}:2: field `prompt`: must be a string, got int; fix or remove the line, then run again"
    )


# --- [inputs] on_bad_line = "skip" ---------------------------------------------------------------------------------


def test_bad_lines_are_skipped_each_reported_with_file_line_and_why(tmp_path):
    math = (
        b'{"id": "m1", "prompt": "fine"}\n'
        + b'{"prompt": 3}\n'
        + b'{"prompt": "two"}\n'
        + b"nope\n"
        + b'{"id": "m1", "prompt": "again"}\n'
    )
    plan, refs = plan_files(tmp_path, {"math": math}, 'on_bad_line = "skip"')
    d = plan.datasets[0]
    assert (d.prompts, d.bad_lines, d.too_long, plan.total) == (2, 3, 0, 2)
    assert [s.line for s in d.skipped] == [2, 4, 5] and d.skipped[1].reason.startswith(
        "malformed JSON ("
    )
    assert [(s.line, s.reason) for s in d.skipped if s.line != 4] == [
        (2, "field `prompt`: must be a string, got int"),
        (
            5,
            f"field `id`: duplicate id 'm1': already used at {tmp_path / 'math.jsonl'}:1; ids must be unique across "
            "the job",
        ),
    ]
    assert [r.line for r in refs] == [1, 3]  # nothing of a skipped line is planned


def test_skipping_every_line_of_a_dataset_is_an_error(tmp_path):
    with pytest.raises(
        InputError, match="dataset 'math' has no prompts left: all 2 of its lines are skipped"
    ):
        plan_files(tmp_path, {"math": b'{"prompt": 3}\nnope\n'}, 'on_bad_line = "skip"')


def test_the_default_still_fails_on_a_bad_line(tmp_path):
    with pytest.raises(InputError, match="math.jsonl:2: field `prompt`"):
        plan_files(tmp_path, {"math": b'{"prompt": "a"}\n{"prompt": 3}\n'}, 'on_bad_line = "fail"')


# --- ids derived from the content ---------------------------------------------------------------------------------


def test_ids_without_an_id_follow_the_content_not_the_line(tmp_path):
    lines = [
        b'{"prompt": "alpha"}',
        b'{"messages": [{"role": "user", "content": "beta"}], "tools": [{"type": "x"}]}',
        b'{"id": "g", "prompt": "gamma"}',
    ]
    _, first = scan(tmp_path, b"\n".join(lines) + b"\n")
    # reordered, reformatted (keys, spaces), a line inserted before: the same ids for the same prompts
    edited = [
        b'{"prompt": "new"}',
        b'{"tools": [{"type":"x"}], "messages": [{"content": "beta", "role": "user"}]}',
        lines[2],
        lines[0],
    ]
    _, again = scan(tmp_path, b"\n".join(edited) + b"\n")
    ids = {p.id: p.line for p in again}
    assert all(p.id in ids for p in first) and [ids[p.id] for p in first] == [4, 2, 3]
    assert first[0].id.startswith("ds:") and len(first[0].id) == len("ds:") + 16
    # a `prompt` line is the one user message it stands for; tools are part of what a prompt says
    _, same = scan(
        tmp_path,
        b'{"messages": [{"role": "user", "content": "alpha"}]}\n'
        b'{"messages": [{"role": "user", "content": "beta"}]}\n',
    )
    assert same[0].id == first[0].id and same[1].id != first[1].id
    assert first[2].id == "g" and first[2].digest == content_digest(
        [{"role": "user", "content": "gamma"}], None
    )
    # a pass that needs no ids does not hash: the id is derived when a message needs it
    unhashed = list(scan_dataset(tmp_path / "ds.jsonl", "ds", digest=False))
    assert (
        unhashed[0].id == "" and unhashed[0].digest == "" and prompt_id(unhashed[0]) == same[0].id
    )


def test_identical_lines_without_ids_are_numbered_by_occurrence(tmp_path):
    line = b'{"prompt": "same"}\n'
    _, prompts = scan(tmp_path, line + b'{"prompt": "other"}\n' + line + line)
    base = prompts[0].id
    assert [p.id for p in prompts] == [base, prompts[1].id, f"{base}-2", f"{base}-3"]
    plan, refs = plan_files(tmp_path, {"ds": line * 2})  # planned as two prompts, ids unique
    assert [r.id for r in refs] == [base, f"{base}-2"] and plan.total == 2


@pytest.mark.slow
def test_a_run_with_skipped_lines_says_them_in_its_audit(tmp_path, toy_tokenizer, capsys):
    import json

    from jobfiles import make_job, write_prompts
    from toolkit.cli import main as cli_main
    from toolkit.dataset.audit_report import read_report
    from toolkit.formats.rundir import RunDir

    prompts = write_prompts(tmp_path / "prompts.jsonl", 5)
    prompts.write_text(prompts.read_text() + '{"prompt": 5}\n')
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        prompts=prompts,
        inputs={"on_bad_line": "skip"},
        sampling={"max_new_tokens": 64},
        audit={"max_length_share": 1.0},
    )
    assert cli_main(["run", str(job)]) == 0
    out = capsys.readouterr().out
    assert (
        f"inputs skipped in d: 1 line (1 bad), not planned\n  {prompts}:6: field `prompt`: must be a string"
        in out
    )
    report = read_report(RunDir(tmp_path / "run"))
    assert report.passed and report.planned == 5
    assert [(s.dataset, s.bad_lines, s.too_long) for s in report.skipped_inputs] == [("d", 1, 0)]
    data = json.loads((tmp_path / "run" / "merged" / "audit.json").read_text())
    assert data["skipped_inputs"][0]["examples"] == [
        f"{prompts}:6: field `prompt`: must be a string, got int"
    ]


def test_check_refuses_empty_and_system_only_prompts_naming_file_line_and_field(
    tmp_path, toy_tokenizer, capsys
):
    """Before any GPU time: `toolkit check` lists each empty or system-only prompt with its place, in one error."""
    from jobfiles import make_job
    from toolkit.cli import main as cli_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            [
                '{"id": "a", "prompt": "What is 2 + 2?"}',
                '{"id": "b", "prompt": ""}',
                '{"id": "c", "messages": [{"role": "system", "content": "Answer in French."}]}',
                '{"id": "d", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": " "}]}',
            ]
        )
        + "\n"
    )
    job = make_job(tmp_path, toy_tokenizer("kimi"), prompts=prompts)
    assert cli_main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "3 bad lines in 1 prompt file" in err
    assert f"{prompts}:2: field `prompt`: is empty" in err
    assert f"{prompts}:3: field `messages`: has no user message, only instructions (system)" in err
    assert f"{prompts}:4: field `messages[1].content`: is empty" in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.zst"))
