"""A /generate body normalised as SGLang's GenerateReqInput does it: one prompt or a batch, given as
text or input_ids; `n` parallel samples of each; their rids; the per-prompt options of a batch; the
data-parallel rank asked for; then the tokenizer manager's length checks of each sequence. Each
refusal is a RequestError with SGLang's own message."""

from __future__ import annotations

import uuid
from typing import Any

from toolkit.stub.config import StubConfig
from toolkit.stub.contract import RequestError
from toolkit.stub.outputs import Item


def batch_shape(text: Any, ids: Any) -> tuple[bool, int]:
    """(single: one prompt, not a batch; the batch size) of a body's text or input_ids."""
    if text is None and ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        single = isinstance(text, str)
        return single, 1 if single else len(text)
    if len(ids) == 0:
        raise RequestError("input_ids cannot be empty.")
    single = type(ids[0]) is int
    return single, 1 if single else len(ids)


def parallel_n(raw_sp: Any, batch: int) -> int:
    """`n`, the samples of each prompt: one for the whole batch, at least 1."""
    if isinstance(raw_sp, list):
        n = raw_sp[0].get("n") or 1 if raw_sp else 1
        if any((s.get("n") or 1) != n for s in raw_sp):
            raise RequestError(
                "The parallel_sample_num should be the same for all samples in sample params."
            )
        if len(raw_sp) != batch:
            raise RequestError(
                f"The length of sampling_params ({len(raw_sp)}) should be equal to the batch "
                f"size ({batch})."
            )
    else:
        n = (raw_sp or {}).get("n") or 1
    return max(1, n)


def prompts_of(text: Any, ids: Any, single: bool, batch: int, cfg: StubConfig, tokenizer):
    """The batch's prompts as token ids (text encoded with the tokenizer), none empty."""
    if ids is not None:
        prompts = [ids] if (single or (type(ids[0]) is int)) else ids
    else:
        if cfg.skip_tokenizer_init:
            raise RequestError(
                "The engine initialized with skip_tokenizer_init=True cannot accept text "
                "prompts. Please provide input_ids or re-initialize the engine with "
                "skip_tokenizer_init=False."
            )
        prompts = [tokenizer.encode(t) for t in ([text] if single else text)]
    if len(prompts) != batch:
        prompts = (prompts * batch)[:batch]
    for p in prompts:
        if not p:
            raise RequestError("input_ids cannot be empty.")
    return prompts


def request_ids(rid: Any, single: bool, batch: int, n: int) -> list[str]:
    """The rid of each of the batch * n sequences: the one asked for, `RID_i` for a batch given one
    rid, a list given per prompt, else new ones (always new with n > 1)."""
    total = batch * n
    if single:
        return [rid if isinstance(rid, str) else uuid.uuid4().hex]
    if n > 1 or rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(total)]
    if len(rid) != batch:
        raise RequestError(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    if len(set(rid)) != len(rid):
        dups = sorted({r for r in rid if rid.count(r) > 1})
        raise RequestError(f"Duplicate request IDs detected within the request: {dups}")
    return list(rid)


def routed_rank(rank: Any, ranks: int) -> int | None:
    """The data-parallel rank a request asks for (`routed_dp_rank`), as SGLang 0.5.23 takes it:
    ignored when 0 without data parallelism, refused outside the `ranks` (its tokenizer manager's
    ValueError, a 400); None: the round robin chooses (managers/data_parallel_controller.py,
    round_robin, the default load_balance_method)."""
    if rank is None or (ranks <= 1 and rank == 0):
        return None
    if rank < 0 or rank >= ranks:
        raise RequestError(f"routed_dp_rank={rank} out of range [0, {ranks})")
    return rank


def check_lengths(item: Item, cfg: StubConfig, max_req_len: int) -> None:
    """The tokenizer manager's context checks, then the scheduler's silent clamp of
    max_new_tokens (`max_req_len`: SGLang's limit of prompt + output + 1)."""
    ctx, n_in, sp = cfg.context_length, len(item.prompt), item.sp
    if n_in >= ctx:
        raise RequestError(
            f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    if sp.max_new_tokens_given:
        total = sp.max_new_tokens + n_in
        if (total >= ctx) if cfg.version == "0.5.9" else (total > ctx):
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {total} tokens: {n_in} tokens from the "
                f"input messages and {sp.max_new_tokens} tokens for the completion. Please "
                "reduce the number of tokens in the input messages or the completion to fit "
                "within the limit."
            )
    room = max(0, max_req_len - n_in - 1)
    item.budget = room if sp.max_new_tokens is None else max(0, min(sp.max_new_tokens, room))


def pick(value: Any, i: int, default: Any) -> Any:
    """A batch option's value for prompt `i`: the option itself, or its i-th item when a list."""
    if value is None:
        return default
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return value
