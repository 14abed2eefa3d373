"""Multi-turn regeneration: planning one record per user turn, and the history each turn is rendered from."""

from __future__ import annotations

import json

import pytest

from toolkit.inputs import InputError
from toolkit.plan import plan_job
from toolkit.spec import load_spec
from toolkit.turns import answer_message, turn_messages, user_turns

from jobfiles import make_job

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
    assert all(m.get("content", "").startswith("source") is False for m in turn_messages(CONV, 2, a[:2]))
    with pytest.raises(ValueError):
        turn_messages(CONV, 2, a[:1])


def regen_job(tmp_path, tokenizer, convs, **kw):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(convs)))
    job = make_job(tmp_path, tokenizer, prompts=path, **kw)
    text = job.read_text().replace('name = "d"', 'name = "d"\nregenerate = true')
    job.write_text(text)
    return job


def test_a_regenerated_dataset_plans_one_record_per_user_turn(tmp_path, toy_tokenizer):
    two = CONV[:5]
    job = regen_job(tmp_path, toy_tokenizer("kimi"), [CONV, two])
    plan, refs = plan_job(load_spec(job))
    assert plan.total == 5 and plan.datasets[0].planned == 5 and plan.datasets[0].conversations == 2
    assert [(r.id, r.turn) for r in refs] == [("c0/t0", 0), ("c0/t1", 1), ("c0/t2", 2), ("c1/t0", 0), ("c1/t1", 1)]


def test_samples_of_a_regenerated_conversation_are_separate_chains(tmp_path, toy_tokenizer):
    job = regen_job(tmp_path, toy_tokenizer("kimi"), [CONV[:5]],
                    sampling={"max_new_tokens": 64, "n": 2, "temperature": 0.7})
    _, refs = plan_job(load_spec(job))
    assert [r.id for r in refs] == ["c0#0/t0", "c0#0/t1", "c0#1/t0", "c0#1/t1"]


def test_a_conversation_without_a_user_turn_is_named(tmp_path, toy_tokenizer):
    job = regen_job(tmp_path, toy_tokenizer("kimi"), [CONV, [{"role": "system", "content": "x"}]])
    with pytest.raises(InputError, match=r"chats.jsonl:2: field `messages`: has no user message"):
        plan_job(load_spec(job))
