"""An output as the server sends it: the job's token material loaded (`load_model`), the sequence
in flight (`Item`), where its output stops (stop tokens, stop strings, length, the NaN stop), its
text, and fake logprobs. What it writes is planned in `planning`."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import msgspec

from toolkit.engines.sglang_contract.sampling import Sampling
from toolkit.stub.model import StubModel
from toolkit.stub.planning import Segments, plan_output

if TYPE_CHECKING:
    from toolkit.stub.config import StubConfig

logger = logging.getLogger(__name__)


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
