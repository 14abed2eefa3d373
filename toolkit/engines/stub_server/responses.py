"""The response objects of /generate: meta_info, logprobs, finished and aborted outputs, and SSE streaming.

`Responses` is a part of StubServer (it uses the server's config, model, counters and in-flight registry).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from .http import Connection
from .model import Item, _IncrementalText, fake_logprob, item_text

_json_encode = msgspec.json.encode

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class Responses:
    """The answers StubServer writes (a mixin of it)."""

    # -- answers ---------------------------------------------------------------------------------
    def meta(self, item: Item, ids: list[int], finish: dict | None, e2e: float | None, first: bool) -> dict:
        m: dict[str, Any] = {"id": item.rid, "finish_reason": finish, "prompt_tokens": len(item.prompt)}
        done = finish is not None
        if done:
            m["weight_version"] = "default"
        if self.v9:
            m["total_retractions"] = 0
        else:
            m["num_retractions"] = 0
            m["reasoning_tokens"] = 0
        m["completion_tokens"] = len(ids)
        m["cached_tokens"] = item.cached
        if done and not self.v9:
            m["weight_versions"] = [{"version": "default", "start": 0, "end": len(ids)}]
        if not self.v9:
            m["dp_rank"] = None
        if item.return_logprob:
            self.add_logprobs(m, item, ids)
        if e2e is not None:
            m["e2e_latency"] = round(e2e, 6)
        if first or done:
            m["response_sent_to_client_ts"] = time.time()
        return m

    def add_logprobs(self, m: dict, item: Item, ids: list[int]) -> None:
        start = item.logprob_start_len
        start = len(item.prompt) if start is None or start < 0 else start
        m["input_token_logprobs"] = [[None if k == 0 else fake_logprob(t, k), t, None]
                                     for k, t in enumerate(item.prompt[start:], start)]
        m["output_token_logprobs"] = [[fake_logprob(t, k), t, None] for k, t in enumerate(ids)]
        m["output_token_logprobs_length"] = len(ids)
        if item.top_logprobs_num > 0:
            vocab = self.model.vocab_size
            m["output_top_logprobs"] = [
                [[fake_logprob(t, k)] + [t, None]] + [[fake_logprob(t, k) - 1.0 - r, (t + 7 * (r + 1)) % vocab, None]
                                                      for r in range(item.top_logprobs_num - 1)]
                for k, t in enumerate(ids)]

    def output_object(self, item: Item, ids: list[int], finish: dict, e2e: float) -> dict:
        out: dict[str, Any] = {}
        if not self.cfg.skip_tokenizer_init:
            out["text"] = item_text(self.model, item, ids, finish is item.finish)
        out["output_ids"] = ids
        out["meta_info"] = self.meta(item, ids, finish, e2e, first=False)
        self.account(item, ids, e2e)
        return out

    def account(self, item: Item, ids: list[int], e2e: float) -> None:
        s = self.stats
        s["requests"] += 1
        s["prompt_tokens"] += len(item.prompt)
        s["generation_tokens"] += len(ids)
        s["e2e_sum"] += e2e
        self.window[0] += 1
        self.window[1] += len(ids)

    def render(self, items: list[Item], single: bool, t0: float) -> bytes:
        e2e = time.perf_counter() - t0
        objs = [self.output_object(it, it.output, it.finish, e2e) for it in items]
        return _json_encode(objs[0] if single else objs)

    def waiting_abort_object(self, item: Item, e2e: float) -> dict:
        """A request aborted while still queued: no output, and no prompt_tokens / cached_tokens, as SGLang answers."""
        m: dict[str, Any] = {"id": item.rid, "finish_reason": dict(ABORTED_WAITING)}
        if not self.v9:
            m.update(weight_version="default", weight_versions=[])
        m.update(e2e_latency=round(e2e, 6), completion_tokens=0)
        out: dict[str, Any] = {} if self.cfg.skip_tokenizer_init else {"text": ""}
        out.update(output_ids=[], meta_info=m)
        return out

    def stream_error(self, conn: Connection, message: str):
        if self.v9:
            err = {"message": message}
        else:
            err = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}

        async def send() -> None:
            conn.start_stream()
            await conn.stream_chunk(b"data: " + _json_encode({"error": err}) + b"\n\n")
            await conn.stream_chunk(b"data: [DONE]\n\n")
            conn.end_stream()

        return send()

    async def stream(self, conn: Connection, items: list[Item], single: bool, t0: float) -> None:
        """SSE: an event every `stream_interval` tokens (cumulative, or incremental, text and output_ids)."""
        states = self.register(items, abortable=True)
        try:
            conn.start_stream()
            loop = asyncio.get_running_loop()
            delay, begin = self.cfg.token_delay, loop.time()
            incremental = self.cfg.incremental_streaming_output
            delta_text = incremental and not self.v9  # 0.5.9's --stream-output keeps text cumulative
            with_text = not self.cfg.skip_tokenizer_init
            intervals = [max(1, it.sp.stream_interval or self.cfg.stream_interval) for it in items]
            sent = [0] * len(items)
            texts = [_IncrementalText(self.model, it.sp.skip_special_tokens) for it in items]
            live = list(range(len(items)))

            def due(k: int) -> int:
                return min(len(items[k].output), sent[k] + intervals[k])

            while live:
                now = loop.time()
                for k in list(live):
                    it, state = items[k], states[k]
                    aborted = state.aborted.is_set()
                    if not aborted and delay > 0 and begin + delay * due(k) > now + 1e-4:
                        continue
                    upto = sent[k] if aborted else due(k)
                    last = aborted or upto >= len(it.output)
                    ids = it.output[:upto]
                    finish = None
                    if last:
                        finish = dict(ABORTED) if upto < len(it.output) else it.finish
                    chunk: dict[str, Any] = {}
                    if with_text:
                        if finish is it.finish or self.model.fast_text:
                            full = item_text(self.model, it, ids, finish is it.finish)
                        else:
                            full = texts[k].extend(ids)
                        chunk["text"] = full[texts[k].sent_chars:] if delta_text else full
                        texts[k].sent_chars = len(full)
                    chunk["output_ids"] = ids[sent[k]:] if incremental else ids
                    e2e = time.perf_counter() - t0 if last else None
                    chunk["meta_info"] = self.meta(it, ids, finish, e2e, first=sent[k] == 0)
                    if not single:
                        chunk["index"] = it.index
                    sent[k] = upto
                    await conn.stream_chunk(b"data: " + _json_encode(chunk) + b"\n\n")
                    if last:
                        live.remove(k)
                        self.account(it, ids, e2e or 0.0)
                if not live:
                    break
                if delay > 0:
                    target = min(begin + delay * due(k) for k in live)
                    waiters = [loop.create_task(states[k].aborted.wait()) for k in live]
                    await asyncio.wait(waiters, timeout=max(0.0, target - loop.time()),
                                       return_when=asyncio.FIRST_COMPLETED)
                    for w in waiters:
                        w.cancel()
                else:
                    await asyncio.sleep(0)
            await conn.stream_chunk(b"data: [DONE]\n\n")
            conn.end_stream()
        finally:
            self.unregister(states)
