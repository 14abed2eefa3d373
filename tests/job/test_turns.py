"""Multi-turn regeneration: planning one record per user turn, and the history each turn is rendered from."""

from __future__ import annotations

import json

import pytest

from jobfiles import make_job, prepared_run
from toolkit.job.plan import plan_job
from toolkit.job.promptline import InputError
from toolkit.job.spec import load_spec
from toolkit.job.turns import answer_message, turn_messages, user_turns

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "source answer 1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "source answer 2"},
    {"role": "user", "content": "u3"},
    {"role": "assistant", "content": "source answer 3"},
]


def test_each_turn_sees_the_generated_answers_never_the_source_ones():
    a = [answer_message(f"r{i}", f"c{i}") for i in range(3)]
    assert user_turns(CONV) == 3
    assert turn_messages(CONV, 0, []) == CONV[:2]
    assert turn_messages(CONV, 1, a[:1]) == [CONV[0], CONV[1], a[0], CONV[3]]
    assert turn_messages(CONV, 2, a[:2]) == [CONV[0], CONV[1], a[0], CONV[3], a[1], CONV[5]]
    assert all(
        m.get("content", "").startswith("source") is False for m in turn_messages(CONV, 2, a[:2])
    )
    with pytest.raises(ValueError):
        turn_messages(CONV, 2, a[:1])


def regen_job(tmp_path, tokenizer, convs, **kw):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(convs))
    )
    job = make_job(tmp_path, tokenizer, prompts=path, **kw)
    text = job.read_text().replace('name = "d"', 'name = "d"\nregenerate = true')
    job.write_text(text)
    return job


def test_a_regenerated_dataset_plans_one_record_per_user_turn(tmp_path, toy_tokenizer):
    two = CONV[:5]
    job = regen_job(tmp_path, toy_tokenizer("kimi"), [CONV, two])
    plan, refs = plan_job(load_spec(job))
    assert plan.total == 5 and plan.datasets[0].planned == 5 and plan.datasets[0].conversations == 2
    assert [(r.id, r.turn) for r in refs] == [
        ("c0/t0", 0),
        ("c0/t1", 1),
        ("c0/t2", 2),
        ("c1/t0", 0),
        ("c1/t1", 1),
    ]


def test_samples_of_a_regenerated_conversation_are_separate_chains(tmp_path, toy_tokenizer):
    job = regen_job(
        tmp_path,
        toy_tokenizer("kimi"),
        [CONV[:5]],
        sampling={"max_new_tokens": 64, "n": 2, "temperature": 0.7},
    )
    _, refs = plan_job(load_spec(job))
    assert [r.id for r in refs] == ["c0#0/t0", "c0#0/t1", "c0#1/t0", "c0#1/t1"]


def test_a_conversation_without_a_user_turn_is_named(tmp_path, toy_tokenizer):
    job = regen_job(tmp_path, toy_tokenizer("kimi"), [CONV, [{"role": "system", "content": "x"}]])
    with pytest.raises(InputError, match=r"chats.jsonl:2: field `messages`: has no user message"):
        plan_job(load_spec(job))


# ---------------------------------------------------------------------------------------------------
# end to end with the stub engine
# ---------------------------------------------------------------------------------------------------
from toolkit.cli import main as cli_main  # noqa: E402
from toolkit.dataset.export import export_run  # noqa: E402
from toolkit.formats.frames import read_shard  # noqa: E402
from toolkit.formats.records import unpack_ids  # noqa: E402
from toolkit.job import chat  # noqa: E402
from toolkit.job.inputs import scan_dataset  # noqa: E402
from toolkit.job.turns import answer_of, turn_prompt  # noqa: E402
from toolkit.worker.run import run_shard
from toolkit.worker.shard import ShardFailed


def chats(k: int) -> list[list[dict]]:
    convs = []
    for i in range(k):
        turns = 2 + i % 2
        msgs = [{"role": "system", "content": "Answer briefly."}]
        for t in range(turns):
            msgs += [
                {"role": "user", "content": f"question {t} of chat {i}: what is {i} plus {t}?"},
                {"role": "assistant", "content": f"SOURCE ANSWER {i}.{t}"},
            ]
        convs.append(msgs)
    return convs


def check_histories(job, rd):
    """Every turn's stored prompt is the template's render of the source up to that turn, with the answers the
    model generated for the turns before it (decoded from their stored ids), never the source's."""
    spec = load_spec(job)
    tok = chat.load_tokenizer(spec.model)
    info = chat.token_info(tok, spec.model)
    recs = {}
    for rec in read_shard(rd.shard_file(0)):
        recs[rec.id] = rec
    prompts = {p.id: p for p in scan_dataset(spec.datasets[0].path, "d")}
    for pid, p in prompts.items():
        answers = []
        for t in range(user_turns(p.messages)):
            rec = recs[f"{pid}/t{t}"]
            assert rec.status == "ok"
            want = chat.render(tok, spec.model, turn_prompt(p, t, answers))
            assert unpack_ids(rec.prompt_ids) == want
            assert "SOURCE ANSWER" not in tok.decode(want)
            answers.append(answer_of(rec, tok, info))
    return recs


@pytest.mark.slow
def test_every_turn_is_generated_from_the_models_own_earlier_answers(tmp_path, toy_tokenizer):
    job = regen_job(
        tmp_path,
        toy_tokenizer("kimi"),
        chats(5),
        sampling={"max_new_tokens": 96},
        audit={"max_length_share": 1.0},
    )
    assert cli_main(["run", str(job)]) == 0
    rd, _ = prepared_run(job)
    recs = check_histories(job, rd)
    assert len(recs) == 12  # 2 + 3 + 2 + 3 + 2 turns
    audit = json.loads((rd.merged_dir / "audit.json").read_text())
    assert [(t["turn"], t["ok"]) for t in audit["turns"]] == [(1, 5), (2, 5), (3, 2)]
    out = tmp_path / "c.jsonl"
    assert export_run(rd.root, "conversations", out).rows == 5
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(5)] and [
        r["turns"] for r in rows
    ] == [2, 3, 2, 3, 2]
    spec = load_spec(job)
    tok = chat.load_tokenizer(spec.model)
    info = chat.token_info(tok, spec.model)
    conv = rows[1]["conversations"]
    assert [m["role"] for m in conv] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert conv[-1] == answer_of(recs["c1/t2"], tok, info) and "SOURCE ANSWER" not in json.dumps(
        conv
    )
    tokens = tmp_path / "t.jsonl"
    export_run(rd.root, "tokens", tokens)
    last = next(
        json.loads(x) for x in tokens.read_text().splitlines() if json.loads(x)["id"] == "c1/t2"
    )
    assert (last["sample"], last["turn"]) == (0, 2)
    assert last["input_ids"] == unpack_ids(recs["c1/t2"].prompt_ids) + unpack_ids(
        recs["c1/t2"].output_ids
    )


@pytest.mark.slow
def test_turns_resume_from_the_answers_already_recorded(tmp_path, toy_tokenizer):
    """A shard killed midway: the next run renders each remaining turn from the answers in the shard file."""
    job = regen_job(
        tmp_path,
        toy_tokenizer("kimi"),
        chats(6),
        sampling={"max_new_tokens": 96},
        stub={"crash_after": 5},
        engine={"max_restarts": 0},
        client={"concurrency": 2},
    )
    rd, _ = prepared_run(job)
    with pytest.raises(ShardFailed):
        run_shard(rd.root, 0)
    first = [r.id for r in read_shard(rd.shard_file(0))]
    assert 0 < len(first) < 15
    job = regen_job(tmp_path, toy_tokenizer("kimi"), chats(6), sampling={"max_new_tokens": 96})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == "done"
    recs = check_histories(job, rd)
    assert len(recs) == 15


@pytest.mark.slow
def test_a_failed_turn_fails_the_turns_after_it_and_they_are_generated_again_with_it(
    tmp_path, toy_tokenizer
):
    """A turn whose failure is final for the run (here after [client] max_tries = 1 try) fails the turns after it,
    final too; `toolkit retry` generates them all again, each rendered with the new answers."""
    from toolkit.cluster.retry import request_retry

    job = regen_job(
        tmp_path,
        toy_tokenizer("kimi"),
        chats(3),
        sampling={"max_new_tokens": 96},
        stub={
            "extra_args": [
                "--poison-prompt",
                "status_503=question 0 of chat 0",
                "--poison-prompt",
                "status_503=question 0 of chat 1",
            ]
        },
        client={"concurrency": 1, "retries": 0, "max_tries": 1},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == "done"
    recs = {r.id: r for r in read_shard(rd.shard_file(0))}
    # the first turns of c0 and c1 get a 503 (the engine's probe does not): the turns after them cannot be rendered
    assert {i: r.failure for i, r in recs.items()} == {
        "c0/t0": "server_error",
        "c0/t1": "previous_turn",
        "c1/t0": "server_error",
        "c1/t1": "previous_turn",
        "c1/t2": "previous_turn",
        "c2/t0": None,
        "c2/t1": None,
    }
    assert all(r.final == (r.status == "failed") for r in recs.values())
    assert "turn 1 of this conversation failed (server_error)" in recs["c0/t1"].error
    job = regen_job(tmp_path, toy_tokenizer("kimi"), chats(3), sampling={"max_new_tokens": 96})
    rd, _ = prepared_run(job)
    request_retry(rd.root)
    assert run_shard(rd.root, 0).end == "done"
    check_histories(job, rd)


@pytest.mark.slow
def test_a_turn_that_fails_once_is_tried_again_before_the_turns_after_it_are_rendered(
    tmp_path, toy_tokenizer
):
    """Within max_tries, a failed turn is tried again in the same run; the turns after it wait for its answer, so
    the conversation completes in one run, each turn rendered with the answers before it."""
    job = regen_job(
        tmp_path,
        toy_tokenizer("kimi"),
        chats(3),
        sampling={"max_new_tokens": 96},
        stub={"fail_5xx": "2:1"},
        client={"concurrency": 1, "retries": 0, "backoff_s": 0.05},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == "done"
    failed = [(r.id, r.tries) for r in read_shard(rd.shard_file(0)) if r.status != "ok"]
    # request 2, c0's first turn, fails; the engine's probe (request 3) passes: a try of c0/t0, which then passes
    assert failed == [("c0/t0", 1)]
    assert len(check_histories(job, rd)) == 7
