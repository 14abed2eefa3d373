"""The exports a drafter trainer takes as they are: the conversations of a reasoning run, of a non-reasoning run, of a
regenerated multi-turn dataset and of a dataset with a source history pass SpecForge's own contract (written from
its source in `specforge_rules`), every planned record is accounted for, and the tokens export's loss mask is the one
SpecForge builds from the same conversation and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import specforge_rules as sf

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.cli import main as cli_main
from toolkit.dataset.export import Selection, export_run
from toolkit.job import chat
from toolkit.job.spec import load_spec

pytestmark = pytest.mark.slow


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def chats(k: int) -> list[list[dict]]:
    out = []
    for i in range(k):
        msgs = [{"role": "system", "content": "Answer briefly."}]
        for t in range(2 + i % 2):
            msgs += [
                {
                    "role": "user",
                    "content": f"question {t} of chat {i}: what is {i} times {t + 3}?",
                },
                {"role": "assistant", "content": f"source answer {i}.{t}"},
            ]
        out.append(msgs)
    return out


def with_history(k: int) -> list[list[dict]]:
    """Conversations whose history (assistant turns included) comes from the source; the last user turn is asked."""
    return [c[:-1] for c in chats(k)]


def write_chats(path: Path, convs: list[list[dict]], prefix: str) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{i}", "messages": m}) + "\n" for i, m in enumerate(convs)
        )
    )
    return path


def run_job(tmp: Path, tokenizer: Path, **tables) -> Path:
    """A stub job of three datasets: single prompts (some with tools), regenerated chats, chats with a history."""
    tmp.mkdir(parents=True, exist_ok=True)
    single = write_prompts(tmp / "single.jsonl", 16, tools_every=4)
    job = make_job(
        tmp,
        tokenizer,
        prompts=single,
        audit={"max_length_share": 1.0, "max_failed_share": 1.0},
        **tables,
    )
    regen = write_chats(tmp / "chats.jsonl", chats(6), "c")
    hist = write_chats(tmp / "history.jsonl", with_history(4), "h")
    job.write_text(
        job.read_text() + f'[[datasets]]\nname = "chats"\npath = "{regen}"\nregenerate = true\n'
        f'[[datasets]]\nname = "history"\npath = "{hist}"\n'
    )
    assert cli_main(["run", str(job)]) in (
        0,
        1,
    )  # the audit may fail: the stub truncates some outputs
    return job


@pytest.fixture(scope="module")
def reasoning_run(tmp_path_factory, toy_tokenizer):
    job = run_job(
        tmp_path_factory.mktemp("sf-reasoning"),
        toy_tokenizer("kimi"),
        sampling={"max_new_tokens": 160},
        stub={"degenerate_fraction": 0.05},
    )
    return prepared_run(job)[0], job


def accounted(summary, rd) -> None:
    s = summary
    assert s.exported + s.skipped + s.failed + s.missing + s.filtered == s.planned
    written = json.loads(Path(str(s.output).replace(".jsonl", "_summary.json")).read_text())
    assert (
        written["planned"] == s.planned
        and written["exported"] == s.exported
        and written["skipped"] == s.skipped
    )


def test_a_reasoning_run_passes_the_validator_with_expect_reasoning_and_strict_think_markers(
    reasoning_run, tmp_path
):
    rd, job = reasoning_run
    out = tmp_path / "conv.jsonl"
    summary = export_run(
        rd.root, "conversations", out, select=Selection(datasets=frozenset({"d", "chats"}))
    )
    rows = lines(out)
    assert sf.file_problems(rows, expect_reasoning=True, strict_think_markers=True) == []
    accounted(summary, rd)
    assert summary.planned == 16 + 15 and summary.missing == 0 and summary.filtered == 0
    skipped = lines(tmp_path / "conv_skipped.jsonl")
    assert summary.skipped >= 1 and {r["reason"] for r in skipped} <= {
        "truncated",
        "degenerate",
        "other_turn",
        "empty_answer",
    }
    # every planned record is in the export or in the skipped file, once
    regenerated = {f"{r['id']}/t{t}" for r in rows if "turns" in r for t in range(r["turns"])}
    single = {r["id"] for r in rows if "turns" not in r}
    left = [r["id"] for r in skipped]
    assert len(left) == len(set(left)) and not (set(left) & (regenerated | single))
    assert len(regenerated) + len(single) + len(left) == summary.planned
    assert any(r.get("tools") for r in rows) and all(r["dataset"] in ("d", "chats") for r in rows)
    assert all({"dataset", "sample", "turn", "segments"} <= set(r) for r in rows)


def test_a_regenerated_conversation_expands_into_one_row_per_turn_as_specforge_trains_it(
    reasoning_run, tmp_path
):
    rd, _ = reasoning_run
    out = tmp_path / "chats.jsonl"
    summary = export_run(
        rd.root, "conversations", out, select=Selection(datasets=frozenset({"chats"}))
    )
    rows = lines(out)
    assert rows and summary.exported == sum(r["turns"] for r in rows)
    assert sf.file_problems(rows, expect_reasoning=True, strict_think_markers=True) == []
    for row in rows:
        events = sf.expand(row)
        assert len(events) == row["turns"]
        for ev in events:  # what SpecForge trains with train_only_last_turn: the supervised turn last, with reasoning
            *history, last = ev["conversations"]
            assert last["role"] == "assistant" and last["reasoning_content"].strip()
            assert all("reasoning_content" not in m for m in history if m["role"] == "assistant")
            assert "source answer" not in json.dumps(ev)
    # --turn 0: the first turn of every conversation, as a row of its own
    first = export_run(
        rd.root,
        "conversations",
        out,
        select=Selection(datasets=frozenset({"chats"}), turns=frozenset({0})),
    )
    assert first.planned == 6 and first.exported + first.skipped + first.failed == 6
    rows = lines(out)
    assert all(r["turns"] == 1 and r["turn"] == 0 for r in rows) and len(rows) == first.exported
    assert sf.file_problems(rows, expect_reasoning=True, strict_think_markers=True) == []


def test_a_source_history_is_written_with_the_supervised_turn_last(reasoning_run, tmp_path):
    rd, job = reasoning_run
    out = tmp_path / "history.jsonl"
    summary = export_run(
        rd.root, "conversations", out, select=Selection(datasets=frozenset({"history"}))
    )
    rows = lines(out)
    accounted(summary, rd)
    assert rows and summary.planned == 4
    # the history's assistant turns have no reasoning: the validator takes the rows without --expect-reasoning,
    # and they are already the rows SpecForge's expansion makes (train them with train_only_last_turn: true)
    assert sf.file_problems(rows, strict_think_markers=True) == []
    src = {f"h{i}": c for i, c in enumerate(with_history(4))}
    for row in rows:
        *history, last = row["conversations"]
        assert history == src[row["id"]]  # the source history, as it is
        assert (
            last["role"] == "assistant"
            and last["reasoning_content"].strip()
            and last["content"].strip()
        )
        assert sf.expand(row)[-1]["conversations"] == row["conversations"]


def test_a_non_reasoning_run_passes_the_validator_with_expect_non_reasoning(
    tmp_path, toy_tokenizer
):
    job = run_job(
        tmp_path,
        toy_tokenizer("qwen3"),
        sampling={"max_new_tokens": 120},
        model={"chat_template_kwargs": {"enable_thinking": False}, "expect_reasoning": False},
    )
    rd, _ = prepared_run(job)
    out = tmp_path / "conv.jsonl"
    summary = export_run(
        rd.root, "conversations", out, select=Selection(datasets=frozenset({"d", "chats"}))
    )
    rows = lines(out)
    assert len(rows) >= 10
    assert sf.file_problems(rows, expect_non_reasoning=True, strict_think_markers=True) == []
    assert all(
        m.get("reasoning_content") == ""
        for r in rows
        for m in r["conversations"]
        if m["role"] == "assistant"
    )
    accounted(summary, rd)
    assert summary.planned == 31 and summary.missing == 0


def test_the_tokens_loss_mask_is_the_one_specforge_builds_from_the_conversation(
    reasoning_run, tmp_path
):
    """SpecForge renders the conversation with the chat template and supervises from the end of the assistant header
    through the end-of-turn token (kimi-k2-thinking: `<|im_assistant|>assistant<|im_middle|>` ... `<|im_end|>`),
    the last turn only with train_only_last_turn. The tokens export must supervise the same characters; where
    re-encoding the text gives the stored ids, the same positions."""
    rd, job = reasoning_run
    spec = load_spec(job)
    tok = chat.load_tokenizer(spec.model)
    export_run(rd.root, "conversations", tmp_path / "c.jsonl")
    export_run(rd.root, "tokens", tmp_path / "t.jsonl")
    tokens = {r["id"]: r for r in lines(tmp_path / "t.jsonl")}
    cases = []
    for row in lines(tmp_path / "c.jsonl"):
        if "turns" in row:  # regenerated: turn k's tokens row against the expanded event k
            cases += [
                (f"{row['id']}/t{k}", ev["conversations"]) for k, ev in enumerate(sf.expand(row))
            ]
        else:
            cases.append((row["id"], row["conversations"]))
    tools = {r["id"]: r.get("tools") for r in lines(tmp_path / "c.jsonl")}
    same_ids = 0
    for rid, conv in cases:
        if any(m.get("tool_calls") for m in conv):
            continue  # a tool call is re-rendered from its structured form: its text is the template's, not the model's
        ours = tokens[rid]
        ids, mask, text, spans = sf.specforge_mask(
            tok, conv, tools.get(rid.split("/t")[0]), sf.KIMI_HEADER, sf.KIMI_END, thinking=True
        )
        assert tok.decode(ours["input_ids"], skip_special_tokens=False) == text, rid
        first = ours["loss_mask"].index(1)
        assert all(ours["loss_mask"][first:]) and not any(ours["loss_mask"][:first])
        decoded_before = tok.decode(ours["input_ids"][:first], skip_special_tokens=False)
        assert spans == [(len(decoded_before), len(text))], rid  # the same characters supervised
        if ids == ours["input_ids"]:
            same_ids += 1
            assert mask == ours["loss_mask"], rid
    assert same_ids >= 10
