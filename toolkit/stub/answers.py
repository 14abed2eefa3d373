"""The bodies the stub answers /generate with, as SGLang builds them: meta_info in SGLang's key
order (0.5.23's or 0.5.9's), logprobs, a plain answer, one delayed by --token-delay (queued while
--max-running-requests others generate, partial when aborted), a stream of SSE events, the answer
of a request aborted while queued, and a stream's error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

import msgspec

from toolkit.stub import faults
from toolkit.stub.config import StubConfig
from toolkit.stub.model import StubModel
from toolkit.stub.outputs import IncrementalText, Item, fake_logprob, item_text
from toolkit.stub.scheduler import ABORTED, ABORTED_WAITING, InFlight, Scheduler

JSON = "application/json"
Reply = tuple  # (status, body bytes, content type or None)
_json_encode = msgspec.json.encode


class Answers:
    """The answers of one server: `account` is told of every sequence that finished (its item, its
    output ids, its end-to-end latency)."""

    def __init__(
        self,
        cfg: StubConfig,
        model: StubModel,
        sched: Scheduler,
        account: Callable[[Item, list[int], float], None],
    ):
        self.cfg = cfg
        self.model = model
        self.v9 = cfg.version == "0.5.9"
        self.sched = sched
        self.account = account

    def meta(
        self, item: Item, ids: list[int], finish: dict | None, e2e: float | None, first: bool
    ) -> dict:
        """meta_info in the order SGLang builds it (0.5.23: managers/tokenizer_manager.py, the
        output handler)."""
        m: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.prompt),
        }
        done = finish is not None
        if self.v9:
            if done:
                m["weight_version"] = "default"
            m["total_retractions"] = 0
            m["completion_tokens"] = len(ids)
            m["cached_tokens"] = item.cached
        else:
            m["weight_version"] = "default"
            m["num_retractions"] = 0
            if item.return_logprob:
                self.add_logprobs(m, item, ids)
            m["reasoning_tokens"] = 0
            m["completion_tokens"] = len(ids)
            m["cached_tokens"] = item.cached
            if done:
                m["weight_versions"] = [{"version": "default", "start": 0, "end": len(ids)}]
            m["cached_tokens_details"] = {"device": item.cached, "host": 0} if item.cached else None
            m["dp_rank"] = item.dp_rank
        if self.v9 and item.return_logprob:
            self.add_logprobs(m, item, ids)
        if e2e is not None:
            m["e2e_latency"] = round(e2e, 6)
        if first or done:
            m["response_sent_to_client_ts"] = time.time()
        return m

    def add_logprobs(self, m: dict, item: Item, ids: list[int]) -> None:
        start = item.logprob_start_len
        start = len(item.prompt) if start is None or start < 0 else start
        m["input_token_logprobs"] = [
            [None if k == 0 else fake_logprob(t, k), t, None]
            for k, t in enumerate(item.prompt[start:], start)
        ]
        m["output_token_logprobs"] = [[fake_logprob(t, k), t, None] for k, t in enumerate(ids)]
        m["output_token_logprobs_length"] = len(ids)
        if item.top_logprobs_num > 0:
            vocab = self.model.vocab_size
            m["output_top_logprobs"] = [
                [[fake_logprob(t, k)] + [t, None]]
                + [
                    [fake_logprob(t, k) - 1.0 - r, (t + 7 * (r + 1)) % vocab, None]
                    for r in range(item.top_logprobs_num - 1)
                ]
                for k, t in enumerate(ids)
            ]

    def output_object(self, item: Item, ids: list[int], finish: dict, e2e: float) -> dict:
        out: dict[str, Any] = {}
        if not self.cfg.skip_tokenizer_init:
            out["text"] = item_text(self.model, item, ids, finish is item.finish)
        out["output_ids"] = ids
        out["meta_info"] = self.meta(item, ids, finish, e2e, first=False)
        if item.poison:
            faults.spoil(item.poison, out, item.budget, self.model.vocab_size)
        self.account(item, ids, e2e)
        return out

    def render(self, items: list[Item], single: bool, t0: float) -> bytes:
        e2e = time.perf_counter() - t0
        objs = [self.output_object(it, it.output, it.finish, e2e) for it in items]
        return _json_encode(objs[0] if single else objs)

    async def delayed(self, items: list[Item], single: bool, t0: float) -> Reply:
        """Answer after token_delay per generated token, or with partial output for the items
        aborted; items wait in the queue while max_running others generate."""
        states = self.sched.register([it.rid for it in items], abortable=True)
        try:
            objs = await asyncio.gather(
                *(self._run_item(it, st, t0) for it, st in zip(items, states))
            )
            return 200, _json_encode(objs[0] if single else objs), JSON
        finally:
            self.sched.unregister(states)

    async def _run_item(self, it: Item, state: InFlight, t0: float) -> dict:
        made = await self.sched.decode(state, len(it.prompt), len(it.output))
        if made is None:
            return self.waiting_abort_object(it, time.perf_counter() - t0)
        if made < len(it.output):
            return self.output_object(it, it.output[:made], dict(ABORTED), time.perf_counter() - t0)
        return self.output_object(it, it.output, it.finish, time.perf_counter() - t0)

    def waiting_abort_object(self, item: Item, e2e: float) -> dict:
        """A request aborted while still queued: no output, and no prompt_tokens / cached_tokens, as
        SGLang answers."""
        m: dict[str, Any] = {"id": item.rid, "finish_reason": dict(ABORTED_WAITING)}
        if self.v9:
            m.update(e2e_latency=round(e2e, 6))
        else:
            m.update(
                weight_version="default",
                e2e_latency=round(e2e, 6),
                weight_versions=[{"version": "default", "start": 0, "end": 0}],
                response_sent_to_client_ts=time.time(),
            )
        m["completion_tokens"] = 0
        out: dict[str, Any] = {} if self.cfg.skip_tokenizer_init and self.v9 else {"text": ""}
        out.update(output_ids=[], meta_info=m)
        return out

    async def stream_error(self, message: str) -> AsyncIterator[bytes]:
        if self.v9:
            err = {"message": message}
        else:
            err = {
                "message": message,
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        yield b"data: " + _json_encode({"error": err}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def stream(self, items: list[Item], single: bool, t0: float) -> AsyncIterator[bytes]:
        """SSE: an event every `stream_interval` tokens (cumulative, or incremental, text and
        output_ids)."""
        states = self.sched.register([it.rid for it in items], abortable=True)
        try:
            loop = asyncio.get_running_loop()
            delay, begin = self.cfg.token_delay, loop.time()
            incremental = self.cfg.incremental_streaming_output
            # 0.5.9's --stream-output keeps text cumulative
            delta_text = incremental and not self.v9
            with_text = not self.cfg.skip_tokenizer_init
            intervals = [max(1, it.sp.stream_interval or self.cfg.stream_interval) for it in items]
            sent = [0] * len(items)
            texts = [IncrementalText(self.model, it.sp.skip_special_tokens) for it in items]
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
                        chunk["text"] = full[texts[k].sent_chars :] if delta_text else full
                        texts[k].sent_chars = len(full)
                    chunk["output_ids"] = ids[sent[k] :] if incremental else ids
                    e2e = time.perf_counter() - t0 if last else None
                    chunk["meta_info"] = self.meta(it, ids, finish, e2e, first=sent[k] == 0)
                    if not single:
                        chunk["index"] = it.index
                    sent[k] = upto
                    yield b"data: " + _json_encode(chunk) + b"\n\n"
                    if last:
                        live.remove(k)
                        self.account(it, ids, e2e or 0.0)
                if not live:
                    break
                if delay > 0:
                    target = min(begin + delay * due(k) for k in live)
                    waiters = [loop.create_task(states[k].aborted.wait()) for k in live]
                    await asyncio.wait(
                        waiters,
                        timeout=max(0.0, target - loop.time()),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for w in waiters:
                        w.cancel()
                else:
                    await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
        finally:
            self.sched.unregister(states)
