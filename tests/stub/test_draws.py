"""What a sampled request without a seed gets from the stub depends on the request alone (its prompt, the
partial output it continues, the sample its rid names, its seed), never on what the process served before: a
stub started again answers sample 1 of a prompt with sample 1, not with a twin of sample 0, and goes on with a
partial output without opening its reasoning a second time."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from toolkit.engines.rids import make_rid, rid_sample
from toolkit.engines.sglang_contract.sampling import Sampling
from toolkit.stub import parse_config
from toolkit.stub.outputs import load_model
from toolkit.stub.planning import Draws, open_section, plan_continuation, plan_output


@pytest.fixture(scope="module", params=["kimi", "qwen3"])
def stub(request, toy_tokenizer):
    """(config, model, tokenizer) of one family: kimi's template opens the reasoning, qwen3's output opens it."""
    folder = toy_tokenizer(request.param)
    cfg = parse_config(["--model-path", str(folder)])
    return cfg, load_model(cfg), AutoTokenizer.from_pretrained(folder)


def _prompt(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(rendered, add_special_tokens=False)


SAMPLED = Sampling(max_new_tokens=400, temperature=1.0)


def _answer(
    cfg, model, draws: Draws, prompt: list[int], rid: str | None, sp: Sampling = SAMPLED
) -> list[int]:
    """What one server process answers (as StubServer does): a continuation if it is one, else a new draw."""
    segments = plan_continuation(model, cfg, prompt, sp, 4000, draws.drawn(0, 1, rid))
    if segments is None:
        segments = plan_output(model, cfg, prompt, sp, 4000, draws.draw(prompt, sp, 0, 1, rid))
    return [t for _, ids in segments for t in ids]


def test_the_worker_rids_name_their_sample_and_keep_one_width():
    rids = [
        make_rid("a1b2c3", shard, pos, sample, seq)
        for shard, pos, sample, seq in (
            (0, 0, 0, 1),
            (3, 17, 1, 2),
            (99999, 10**10 - 1, 999999, 10**8 - 1),
        )
    ]
    assert [rid_sample(r) for r in rids] == [0, 1, 999999]
    assert len({len(r) for r in rids}) == 1
    assert rid_sample("tk-a1b2c3-00000-0000000000-00000001") is None  # no sample named
    assert rid_sample("c0") is None and rid_sample(None) is None and rid_sample(5) is None


def test_a_rid_naming_its_sample_draws_that_sample_in_any_process_in_any_order(stub):
    cfg, model, tok = stub
    prompt = _prompt(tok, "Why is the sky blue?")
    first = Draws()  # the process that served sample 0 then sample 1
    s0 = _answer(cfg, model, first, prompt, make_rid("aaaaaa", 0, 0, 0, 1))
    s1 = _answer(cfg, model, first, prompt, make_rid("aaaaaa", 0, 1, 1, 2))
    again = Draws()  # started again: only sample 1 is left to generate
    assert _answer(cfg, model, again, prompt, make_rid("bbbbbb", 0, 1, 1, 1)) == s1 != s0
    # a rid-less request still draws anew when sent again, and its first draw is sample 0
    other = Draws()
    assert _answer(cfg, model, other, prompt, None) == s0
    assert _answer(cfg, model, other, prompt, None) != s0


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.95])
def test_a_partial_output_of_sample_1_is_continued_by_a_new_process_token_for_token(stub, share):
    cfg, model, tok = stub
    prompt = _prompt(tok, f"Continue me after {share:.0%} of the output.")
    whole = _answer(cfg, model, Draws(), prompt, make_rid("aaaaaa", 2, 7, 1, 5))
    cut = max(
        2, int(len(whole) * share)
    )  # a lone think-start is taken for a template that opens reasoning
    part = whole[:cut]
    sp = Sampling(max_new_tokens=400 - cut, temperature=1.0)
    rest = _answer(cfg, model, Draws(), prompt + part, make_rid("cccccc", 2, 7, 1, 1), sp)
    assert part + rest == whole
    assert (prompt + part + rest).count(model.think_start_id) == prompt.count(
        model.think_start_id
    ) + (0 if model.prompt_ends_with(prompt, model.think_start_id) else 1)


@pytest.mark.parametrize("phase", ["reasoning", "answer"])
def test_a_partial_of_a_draw_this_process_never_made_goes_on_without_opening_the_reasoning_again(
    stub, phase
):
    """A rid that names no sample, drawn twice by one process, continued by another: the draw is not known there,
    but the output goes on inside its reasoning (or its answer), with one think-start and one think-end."""
    cfg, model, tok = stub
    prompt = _prompt(tok, f"Cut me in the {phase}.")
    served = Draws()
    _answer(cfg, model, served, prompt, None)
    whole = _answer(cfg, model, served, prompt, None)  # the prompt's second draw
    end = whole.index(model.think_end_id)
    cut = end // 2 if phase == "reasoning" else end + len(model.sep_ids) + 3
    assert cut < len(whole) - 1
    part = whole[:cut]
    assert open_section(model, prompt + part) == phase and open_section(model, prompt) is None
    rest = _answer(
        cfg,
        model,
        Draws(),
        prompt + part,
        None,
        Sampling(max_new_tokens=400 - cut, temperature=1.0),
    )
    assert rest and rest[-1] == model.eos_id
    out = part + rest
    opened_by_template = model.prompt_ends_with(prompt, model.think_start_id)
    assert out.count(model.think_start_id) == (0 if opened_by_template else 1)
    assert out.count(model.think_end_id) == 1


def test_lognormal_lengths_have_their_median_and_a_heavy_tail_cut_by_the_budget(toy_tokenizer):
    """--lognormal-lengths 100:0.9: half the outputs under about 100 tokens, a tail of some 5x the median, and
    none longer than the budget once the server cuts them (the plan itself may run past it)."""
    cfg = parse_config(
        ["--model-path", str(toy_tokenizer("qwen3")), "--lognormal-lengths", "100:0.9"]
    )
    model = load_model(cfg)
    sp = Sampling(max_new_tokens=400)
    lengths = sorted(
        sum(
            len(ids)
            for _, ids in plan_output(model, cfg, [5, 6, 7 + i % 200, 3 + i // 200], sp, 400, 0)
        )
        for i in range(600)
    )
    median, p99 = lengths[300], lengths[int(0.99 * 600)]
    assert 80 <= median <= 125, median
    assert p99 >= 4 * median, (median, p99)
    assert (
        sum(n > 400 for n in lengths) >= 3
    )  # drawn past the budget: finish "length" at the server
