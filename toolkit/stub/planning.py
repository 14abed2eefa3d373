"""What the "model" writes: per-output seeds, the output plan (`plan_output`), the continuation of
an output asked for in segments or aborted (`plan_continuation`), where a prompt ends inside an
output of the stub's (`open_section`), and the draws of a prompt sent again (`Draws`).
"""

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
    total = _output_length(cfg, sp, budget, rng)
    thinking, head, end, sep = _markers(model, cfg, prompt, within)
    fixed = cfg.fixed_output_tokens
    tool = _tool_section(model, cfg, rng) if fixed is None else []
    content, sep, tool = _fit(total, thinking, head, end, sep, tool)
    reasoning = round(content * rng.uniform(0.55, 0.85)) if thinking else 0
    reasoning = min(max(reasoning, 1 if thinking else 0), content - 1)
    segments: Segments = [(-1, head)]
    _run(segments, model.corpus, rng, reasoning)
    segments += [(-1, end), (-1, sep)]
    _run(segments, model.corpus, rng, content - reasoning)
    segments += [(-1, tool), (-1, [model.eos_id])]
    segments = [seg for seg in segments if seg[1]]
    if fixed is not None:
        _cut_to(segments, total)
    written = sum(len(ids) for _, ids in segments)
    if (sp.ignore_eos or model.eos_id not in model.eos_ids) and written < budget:
        # nothing stops it: the model writes on past its EOS
        _run(segments, model.corpus, rng, budget - written)
    return segments


def _output_length(cfg: StubConfig, sp: Sampling, budget: int, rng: random.Random) -> int:
    """The output's drawn length in tokens, before it is cut at `budget`."""
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
    return max(total, sp.min_new_tokens)


def _markers(
    model: StubModel, cfg: StubConfig, prompt: list[int], within: str | None
) -> tuple[bool, list[int], list[int], list[int]]:
    """(whether it reasons, the think-start it writes, its think-end, the separator after it)."""
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
    return thinking, head, end, sep


def _tool_section(model: StubModel, cfg: StubConfig, rng: random.Random) -> list[int]:
    """A tool-call section of the tokenizer's family for `tool_call_fraction` of outputs, else
    none."""
    if model.tool_sections and rng.random() < cfg.tool_call_fraction:
        return model.tool_sections[rng.randrange(len(model.tool_sections))]
    return []


def _fit(
    total: int, thinking: bool, head: list[int], end: list[int], sep: list[int], tool: list[int]
) -> tuple[int, list[int], list[int]]:
    """(corpus tokens, separator, tool section) of an output of `total` tokens: a tool section,
    then the separator, left out when the corpus text would be shorter than 2 tokens."""
    content = total - len(head) - len(end) - len(sep) - len(tool) - 1
    if content < 2 and tool:
        content += len(tool)
        tool = []
    if content < 2 and sep:
        content += len(sep)
        sep = []
    return max(content, 2 if thinking else 1), sep, tool


def _run(segments: Segments, corpus: list[int], rng: random.Random, n: int) -> None:
    """n corpus tokens from a PRNG offset, wrapping around, added to `segments`."""
    offset = rng.randrange(len(corpus))
    while n > 0:
        part = corpus[offset : offset + n]
        segments.append((offset, part))
        n -= len(part)
        offset = 0


def _cut_to(segments: Segments, total: int) -> None:
    """A fixed length shorter than the plan: tokens dropped from its start, which keeps the plan's
    end (think-end, EOS)."""
    written = sum(len(ids) for _, ids in segments)
    while written > total:
        start, ids = segments[0]
        drop = min(written - total, len(ids))
        segments[0] = (start + drop if start >= 0 else -1, ids[drop:])
        if not segments[0][1]:
            segments.pop(0)
        written -= drop


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
