"""The real chat templates of six reasoning-model families (tests/fixtures/chat-templates), end to end: a run with
the stub engine, the audit, and the export's split of reasoning and content on the think-end id."""

from __future__ import annotations

import json

import pytest

from jobfiles import make_job
from toolkit.cli import main as cli_main
from toolkit.dataset.export import export_run

# template -> (chat_template_kwargs, the reasoning mode its prompts leave the model in)
CASES = {
    "kimi-k2-thinking": ({}, "model_opens"),
    "qwen3": ({}, "model_opens"),
    "glm-4.6": ({}, "model_opens"),
    "deepseek-v3.1": ({"thinking": True}, "opened"),
    "deepseek-r1-distill": ({}, "opened"),
    "minimax-m2": ({}, "opened"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_real_template_gives_split_reasoning_and_content(tmp_path, real_tokenizer, name):
    kwargs, mode = CASES[name]
    tok_dir = real_tokenizer(name)
    job = make_job(
        tmp_path,
        tok_dir,
        n=12,
        model={"path": str(tok_dir), "chat_template_kwargs": kwargs},
        sampling={"max_new_tokens": 400},
        stub={"fixed_output_tokens": 120},
        audit={"max_length_share": 1.0},
    )
    assert cli_main(["run", str(job)]) == 0
    run = tmp_path / "run"
    audit = json.loads((run / "merged" / "audit.json").read_text())
    counts = audit["overall"]["reasoning"]
    assert audit["passed"], [c for c in audit["checks"] if not c["passed"]]
    assert (
        counts["mode_" + mode] == 12
        and counts["in_reasoning"] == 12
        and counts["closed_by_template"] == 0
    )
    export_run(run, "jsonl", tmp_path / "out.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    think_start, think_end = "<think>", "</think>"
    tokens = audit["tokens"]
    assert len(rows) == 12
    for row in rows:
        out = row["output_ids"]
        assert row["reasoning_end"] == out.index(
            tokens["think_end_id"]
        )  # split on the id, never on text
        assert think_start not in row["reasoning"] and think_end not in row["reasoning"]
        assert think_start not in row["content"] and think_end not in row["content"]
        assert row["reasoning"].strip() and row["content"].strip()
        if (
            mode == "model_opens"
        ):  # the model wrote <think> itself, and it is not part of the reasoning
            assert out[0] == tokens["think_start_id"]
        else:
            assert tokens["think_start_id"] not in out[: row["reasoning_end"]]


def test_deepseek_v31_without_the_thinking_kwarg_is_refused_before_any_engine(
    tmp_path, real_tokenizer, capsys
):
    tok_dir = real_tokenizer("deepseek-v3.1")
    job = make_job(tmp_path, tok_dir, n=3)
    assert cli_main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert "closes reasoning" in err and "thinking = true" in err and "3 prompts" in err
    assert not (tmp_path / "run" / "logs").exists() or not list(
        (tmp_path / "run" / "logs").glob("*.server.log")
    )
