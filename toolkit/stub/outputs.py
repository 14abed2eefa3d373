"""What the "model" writes: per-output seeds, the output plan, continuations of aborted outputs,
where an output stops (stop tokens, stop strings, length, the NaN stop), its text, and fake
logprobs."""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec

from toolkit.engines.rids import rid_sample
from toolkit.engines.sglang_contract.sampling import Sampling
from toolkit.stub.model import StubModel

if TYPE_CHECKING:
    from toolkit.stub.config import StubConfig

logger = logging.getLogger(__name__)

_json_encode = msgspec.json.encode


def load_model(cfg: StubConfig) -> StubModel:
    """The job's token material, with text sliced from the corpus if that was checked to give
    exactly `decode`."""
    model = StubModel(cfg)
    model.fast_text = model.can_slice_text and _slicing_matches_decode(model, cfg)
    return model


def _slicing_matches_decode(model: StubModel, cfg: StubConfig) -> bool:
    """Slicing the corpus text must give exactly `tokenizer.decode`; checked on sample outputs at
    start."""
    rng = random.Random(0)
    sp = Sampling(max_new_tokens=400)
    for k in range(60):
        prompt = [rng.randrange(model.vocab_size) for _ in range(8)]
        segments = plan_output(model, cfg, prompt, sp, 400, k)
        flat = [t for _, ids in segments for t in ids]
        for cut in (len(flat), rng.randrange(len(flat) + 1)):
            for skip in (True, False):
                sliced = model.sliced_text(segments, cut, skip)
                if sliced is not None and sliced != model.decode(flat[:cut], skip):
                    logger.info(
                        "text is decoded per request (slicing the corpus text differs from decode)"
                    )
                    return False
    return True


def output_seed(prompt: list[int], sp: Sampling, sample: int) -> int:
    """The PRNG seed of one output: a hash of the prompt ids and of the params that change sampling.

    Length and stop params (max_new_tokens, stop, ignore_eos, ...) are left out; parallel samples (n
    > 1) differ by their index unless decoding is greedy.
    """
    h = hashlib.blake2b(_json_encode(prompt), digest_size=8)
    h.update(
        _json_encode(
            [
                sp.temperature,
                sp.top_p,
                sp.top_k,
                sp.min_p,
                sp.frequency_penalty,
                sp.presence_penalty,
                sp.repetition_penalty,
                sp.sampling_seed,
            ]
        )
    )
    if sp.top_k != 1:
        h.update(sample.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little")


# [(corpus offset, or -1 for control tokens, [ids])]: the plan of one output, in order
Segments = list


def plan_output(
    model: StubModel,
    cfg: StubConfig,
    prompt: list[int],
    sp: Sampling,
    budget: int,
    sample: int,
    within: str | None = None,
) -> Segments:
    """What the "model" writes for this prompt, before the server cuts at a stop or at `budget`.

    Rule: seed a PRNG from (prompt ids, sampling params). The output is [think-start] + reasoning +
    think-end + "\\n\\n" + answer + [tool-call section] + EOS. Think-start is written unless the
    prompt already ends with it (template-opened, Kimi/DeepSeek style), or always with
    --double-think-start. A prompt ending with think-end (thinking disabled by the template) gets an
    answer only. Reasoning and answer are contiguous runs of the help-topics token stream at
    PRNG-chosen offsets. The total length is a PRNG fraction of max_new_tokens (the budget), or of
    --output-scale; `truncate_fraction` of outputs are drawn longer than it (with
    --lognormal-lengths MEDIAN:SIGMA the total is drawn from that lognormal instead), and
    `tool_call_fraction` end their answer with a tool-call section of the tokenizer's family. With
    --fixed-output-tokens N the total is exactly N and there is no tool call. `degenerate_fraction`
    of outputs (drawn only when it is set) fall into a repetition loop instead: after some
    reasoning, one span of 4-24 corpus tokens repeated until the budget cuts them (finish length),
    as reasoning models do (the other outputs are the same as without it). The plan is a function of
    its arguments: samples of one prompt differ by their `sampling_seed` (the toolkit offsets it per
    sample) or by `sample` (their index in a request with n > 1, and the draw of a seedless request
    sent again: `Draws`); with `identical_samples` by neither. `within` ("reasoning" or "answer")
    says the prompt ends inside an output of the stub's (`open_section`): it goes on from there,
    never opening its reasoning again.
    """
    if cfg.identical_samples:  # a sampler that ignores the seed and the sample index
        sp, sample = msgspec.structs.replace(sp, sampling_seed=None), 0
    seed = output_seed(prompt, sp, sample)
    rng = random.Random(seed)
    # its own draw: the outputs that do not loop are those of a run without loops
    if cfg.degenerate_fraction:
        looping = random.Random(seed ^ 0x100B)
        if looping.random() < cfg.degenerate_fraction:
            return _loop(model, prompt, looping, budget, cfg.output_scale or budget)
    fixed = cfg.fixed_output_tokens
    if cfg.output_scale:  # a model's output does not depend on the budget it is given
        scale = max(1, cfg.output_scale)
    else:
        scale = sp.max_new_tokens if sp.max_new_tokens is not None else min(budget, 2048)
        scale = max(1, min(scale, budget) if scale else 1)
    if fixed is not None:
        total = max(0, fixed)
    elif cfg.lognormal_lengths is not None:  # a heavy tail, cut by the budget
        median, sigma = cfg.lognormal_lengths
        total = max(1, round(rng.lognormvariate(math.log(median), sigma)))
    elif rng.random() < cfg.truncate_fraction:
        total = scale + 1 + int(scale * rng.uniform(0.05, 0.5))
    else:
        total = max(1, min(scale, round(scale * rng.uniform(0.08, 0.95))))
    total = max(total, sp.min_new_tokens)

    thinking = (
        model.think_end_id is not None
        and within != "answer"
        and not model.prompt_ends_with(prompt, model.think_end_id)
    )
    head, end, sep = [], [], []
    if thinking:
        opened = within == "reasoning" or model.prompt_ends_with(prompt, model.think_start_id)
        if not opened or cfg.double_think_start:
            head = [model.think_start_id]
        if not cfg.no_think_end:
            end = [model.think_end_id]
        sep = model.sep_ids
    tool: list[int] = []
    if fixed is None and model.tool_sections and rng.random() < cfg.tool_call_fraction:
        tool = model.tool_sections[rng.randrange(len(model.tool_sections))]
    content = total - len(head) - len(end) - len(sep) - len(tool) - 1
    if content < 2 and tool:
        content += len(tool)
        tool = []
    if content < 2 and sep:
        content += len(sep)
        sep = []
    content = max(content, 2 if thinking else 1)
    reasoning = round(content * rng.uniform(0.55, 0.85)) if thinking else 0
    reasoning = min(max(reasoning, 1 if thinking else 0), content - 1)
    segments: Segments = []
    corpus, size = model.corpus, len(model.corpus)

    def run(n: int) -> None:  # n corpus tokens from a PRNG offset, wrapping around
        offset = rng.randrange(size)
        while n > 0:
            part = corpus[offset : offset + n]
            segments.append((offset, part))
            n -= len(part)
            offset = 0

    segments.append((-1, head))
    run(reasoning)
    segments += [(-1, end), (-1, sep)]
    run(content - reasoning)
    segments += [(-1, tool), (-1, [model.eos_id])]
    segments = [seg for seg in segments if seg[1]]
    written = sum(len(ids) for _, ids in segments)
    # a tiny fixed length keeps the plan's end (think-end, EOS)
    while fixed is not None and written > total:
        start, ids = segments[0]
        drop = min(written - total, len(ids))
        segments[0] = (start + drop if start >= 0 else -1, ids[drop:])
        if not segments[0][1]:
            segments.pop(0)
        written -= drop
    if (sp.ignore_eos or model.eos_id not in model.eos_ids) and written < budget:
        run(budget - written)  # nothing stops it: the model writes on past its EOS
    return segments


def _loop(
    model: StubModel, prompt: list[int], rng: random.Random, budget: int, scale: int
) -> Segments:
    """A degenerate output: [think-start], some reasoning (its length a share of `scale`), then one
    short span repeated past `budget`."""
    corpus, size = model.corpus, len(model.corpus)
    opened = model.prompt_ends_with(prompt, model.think_start_id)
    segments: Segments = (
        [] if opened or model.think_start_id is None else [(-1, [model.think_start_id])]
    )
    lead = max(1, min(rng.randint(8, 40), scale // 20))
    start = rng.randrange(size - lead - 24)
    segments.append((start, corpus[start : start + lead]))
    span = rng.randint(4, 24)
    at = rng.randrange(size - span)
    written = lead + len(segments) - 1
    while written <= budget:
        segments.append((at, corpus[at : at + span]))
        written += span
    return segments


def _positions(ids: list[int], token: int | None) -> list[int]:
    out: list[int] = []
    if token is None:
        return out
    i = -1
    try:
        while True:
            i = ids.index(token, i + 1)
            out.append(i)
    except ValueError:
        return out


def drop_planned(segments: Segments, n: int) -> Segments:
    """The plan without its first `n` tokens (corpus offsets moved along, so text slicing still
    works)."""
    out: Segments = []
    for start, ids in segments:
        if n >= len(ids):
            n -= len(ids)
            continue
        out.append((start + n if start >= 0 and n else start, ids[n:] if n else ids))
        n = 0
    return out


def plan_continuation(
    model: StubModel, cfg: StubConfig, prompt: list[int], sp: Sampling, budget: int, drawn
) -> Segments | None:
    """The rest of an output when `prompt` is an earlier prompt plus the start of what the stub
    wrote for it.

    A request aborted mid-generation is continued by sending `input_ids = prompt + partial output`
    with max_new_tokens (and min_new_tokens) reduced by the partial's length. A model would go on
    writing from there; the stub does the same: it looks for a split `prompt[:k] | prompt[k:]` where
    the second part is the start of plan_output(prompt[:k]) with the original budget, and answers
    with the rest of that plan — so a stopped-and-continued output is token for token the
    uninterrupted one. Split candidates are only where an output can begin (at a think-start, or
    after a think-start / think-end that ends a prompt, give or take newline tokens), so a plain
    prompt costs a few list scans. A last token that is a think-start is not taken for a one-token
    output: a prompt the template opens in reasoning would be mistaken for a shorter prompt plus the
    think-start its output begins with. `drawn(head, sp)` is the sample numbers already drawn for an
    earlier prompt (`Draws.drawn`): the output continued may be any of them. None: not a
    continuation.
    """
    n = len(prompt)
    cands: set[int] = set()
    for j in _positions(prompt, model.think_start_id):
        cands.update((j, j + 1, j + 2, j + 3))
    for j in _positions(prompt, model.think_end_id):
        cands.update((j + 1, j + 2, j + 3))
    for k in sorted(c for c in cands if 0 < c < n):
        head, p = prompt[:k], n - k
        if p == 1 and prompt[k] == model.think_start_id:
            continue
        sp0 = msgspec.structs.replace(
            sp,
            max_new_tokens=None if sp.max_new_tokens is None else sp.max_new_tokens + p,
            min_new_tokens=sp.min_new_tokens + p if sp.min_new_tokens else 0,
        )
        for sample in drawn(head, sp0):
            segments = plan_output(model, cfg, head, sp0, budget + p, sample)
            got, need = 0, prompt[k:]
            # compare the plan's first p tokens with the tail, segment by segment
            for _, ids in segments:
                m = min(len(ids), p - got)
                if ids[:m] != need[got : got + m]:
                    break
                got += m
                if got == p:
                    break
            if got == p:
                return drop_planned(segments, p)
    within = open_section(model, prompt)
    # a draw not known here (sent to another process): it goes on all the same
    if within is not None:
        return plan_output(model, cfg, prompt, sp, budget, 0, within)
    return None


def open_section(model: StubModel, prompt: list[int]) -> str | None:
    """Where a prompt that ends inside an output of the stub's stands: "reasoning" (a think-start,
    then only corpus text) or "answer" (a think-start, corpus text, the think-end, then corpus
    text); None for any other prompt (a prompt the template ends with a think-start or think-end is
    not inside an output)."""
    if model.think_start_id is None:
        return None
    starts = _positions(prompt, model.think_start_id)
    if not starts:
        return None
    tail = prompt[starts[-1] + 1 :]
    if not tail or tail[-1] == model.think_end_id:
        return None
    words, sep = model.corpus_ids, set(model.sep_ids)
    if model.think_end_id in tail:
        e = tail.index(model.think_end_id)
        before, after = tail[:e], tail[e + 1 :]
        ok = all(t in words for t in before) and all(t in words or t in sep for t in after)
        return "answer" if ok else None
    return "reasoning" if all(t in words for t in tail) else None


class Draws:
    """Requests that sample (not greedy) without a `sampling_seed`: a real server draws another
    output each time the same prompt comes with the same params, so n samples sent as n requests
    differ. Which output a request gets depends on the request alone where it can: a rid that names
    its sample (`engines.rids`, as the worker's do) draws that sample, in any process, and so does
    the continuation of its partial output. Any other request is numbered: the first of a prompt and
    its params gets the output it always gets (sample 0 of a request), the next one the next sample,
    and so on, remembered for the last `size` prompts. A request with a seed, or greedy, or with
    `identical_samples` set, is answered the same every time."""

    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        self._count: OrderedDict[int, int] = OrderedDict()

    @staticmethod
    def applies(sp: Sampling) -> bool:
        return sp.sampling_seed is None and sp.top_k != 1

    def draw(
        self, prompt: list[int], sp: Sampling, index: int, n: int, rid: str | None = None
    ) -> int:
        """The sample number of sequence `index` of a request of `n` sequences (a new draw per
        request)."""
        if not self.applies(sp):
            return index
        named = rid_sample(rid)
        if named is not None:
            return index + n * named
        key = output_seed(prompt, sp, 0)
        drawn = self._count.pop(key, 0)
        self._count[key] = drawn + 1
        if len(self._count) > self.size:
            self._count.popitem(last=False)
        return index + n * drawn

    def drawn(self, index: int, n: int, rid: str | None = None):
        """For plan_continuation: the sample numbers sequence `index` may have been given for
        `head`."""
        named = rid_sample(rid)

        def numbers(head: list[int], sp: Sampling) -> list[int]:
            if not self.applies(sp):
                return [index]
            if named is not None:
                return [index + n * named]
            return [
                index + n * d for d in range(max(1, self._count.get(output_seed(head, sp, 0), 0)))
            ]

        return numbers


class Item(msgspec.Struct, kw_only=True):
    """One sequence of a /generate request (a batch or n > 1 has several)."""

    rid: str
    index: int
    prompt: list[int]
    sp: Sampling
    budget: int  # max_new_tokens after the scheduler's clamp
    cached: int = 0  # prompt tokens found in the prefix cache
    segments: Segments = []  # the plan of what the "model" writes (see plan_output)
    planned: list[int] = []  # the same, flat and uncut
    output: list[int] = []  # generated tokens, through the stop token
    finish: dict | None = None
    trim: int = 0  # tokens of `output` left out of text (a trimmed stop token)
    stop_str: str | None = None  # matched stop string (text is cut at it)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # the data-parallel rank that "ran" it (None without data parallelism)
    dp_rank: int | None = None
    poison: str | None = None  # --poison: how its answer is spoiled (faults.spoil)


def finish_item(model: StubModel, item: Item) -> None:
    """Cut the planned tokens where SGLang would stop: stop string, stop token, or max_new_tokens.

    The plan holds an EOS only as its last token (the corpus is free of control ids), so only
    request `stop_token_ids` need a scan.
    """
    sp, planned, budget = item.sp, item.planned, item.budget
    window = planned[:budget]
    k_tok = None
    if not sp.ignore_eos:
        if planned and len(planned) <= budget and planned[-1] in model.eos_ids:
            k_tok = len(planned)
        for t in sp.stop_token_ids:
            if t in window:
                k = window.index(t) + 1
                k_tok = k if k_tok is None else min(k, k_tok)
    k_str, matched_str = _first_stop_string(model, window, sp) if sp.stop else (None, None)
    if k_str is not None and (k_tok is None or k_str <= k_tok):
        item.output = window[:k_str]
        item.finish = {"type": "stop", "matched": matched_str}
        item.stop_str = matched_str
    elif k_tok is not None:
        item.output = window[:k_tok]
        item.finish = {"type": "stop", "matched": window[k_tok - 1]}
        item.trim = 0 if sp.no_stop_trim else 1
    else:
        item.output = window
        item.finish = {"type": "length", "length": budget}


NAN_MATCHED = "NaN happened"


def nan_stop(model: StubModel, item: Item) -> None:
    """SGLang 0.5.23's NaN stop: the token sampled from NaN logits is replaced by a stop id and the
    output ends there, as if stopped, with finish_reason {"type": "stop", "matched": "NaN happened"}
    (schedule_batch.py). The detokenizer trims a matched stop string only where the text holds it,
    so the replacement id stays in the text (visible with skip_special_tokens = false)."""
    item.output = item.output[: len(item.output) // 2] + [model.eos_id]
    item.finish = {"type": "stop", "matched": NAN_MATCHED}
    item.trim, item.stop_str = 0, None


def _first_stop_string(
    model: StubModel, ids: list[int], sp: Sampling
) -> tuple[int | None, str | None]:
    """The shortest prefix of ids whose text contains a stop string (binary search over decodes)."""
    skip = sp.skip_special_tokens
    full = model.decode(ids, skip)
    if not any(s and s in full for s in sp.stop):
        return None, None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = model.decode(ids[:mid], skip)
        if any(s and s in text for s in sp.stop):
            hi = mid
        else:
            lo = mid + 1
    text = model.decode(ids[:lo], skip)
    first = min((text.find(s), s) for s in sp.stop if s and s in text)
    return lo, first[1]


def item_text(model: StubModel, item: Item, ids: list[int], final: bool) -> str:
    """The `text` of ids (a prefix of the plan); a finished output loses its stop token or string
    (unless no_stop_trim)."""
    skip = item.sp.skip_special_tokens
    if final and item.stop_str is not None:
        text = model.decode(ids, skip)
        cut = text.find(item.stop_str)
        return text[: cut + len(item.stop_str)] if item.sp.no_stop_trim else text[:cut]
    k = len(ids) - (item.trim if final else 0)
    return model.prefix_text(item.segments, item.planned, k, skip)


def fake_logprob(token_id: int, position: int) -> float:
    """A deterministic, plausible log-probability (the stub has no model)."""
    return -round(((token_id * 2654435761 + position * 40503) % 9973) / 9973 * 3.0, 6)


class IncrementalText:
    """Text of a growing id list, decoded through a short window (the detokenizer's incremental
    scheme)."""

    def __init__(self, model: StubModel, skip: bool):
        self.model, self.skip = model, skip
        self.text = ""
        self.prefix_offset = self.read_offset = 0
        self.sent_chars = 0

    def extend(self, ids: list[int]) -> str:
        if len(ids) > self.read_offset:
            prefix = self.model.decode(ids[self.prefix_offset : self.read_offset], self.skip)
            full = self.model.decode(ids[self.prefix_offset :], self.skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text
