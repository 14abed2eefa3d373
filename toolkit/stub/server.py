"""The stub's state and /generate: validation order, request normalisation, length checks, the
answers (plain, delayed, streamed, batches, n > 1), /abort_request, and the process lifecycle
(warm-up, SIGTERM drain).

Handlers return a Reply `(status, body bytes, content type or None)`, a coroutine that resolves to
one (the request waits: token delay, queue, hang), an async iterator of SSE event bytes (a stream,
HTTP 200), or a faults.Cut (--poison reset or truncate: the connection is cut). The HTTP layer only
maps these onto the wire and cancels the coroutine or stream when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import msgspec

from toolkit.stub import faults
from toolkit.stub.cache import PrefixCache
from toolkit.stub.config import DEFAULT_MAX_RUNNING, StubConfig
from toolkit.stub.contract import (
    ContractError,
    ParseError,
    RequestError,
    check_contract,
    make_sampling,
    not_taken,
    parse_body,
    verify_sampling,
)
from toolkit.stub.model import StubModel
from toolkit.stub.outputs import (
    Draws,
    IncrementalText,
    Item,
    fake_logprob,
    finish_item,
    item_text,
    nan_stop,
    plan_continuation,
    plan_output,
)
from toolkit.stub.scheduler import ABORTED, ABORTED_WAITING, InFlight, Scheduler

logger = logging.getLogger(__name__)

JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
Reply = tuple  # (status, body bytes, content type or None)
_json_encode = msgspec.json.encode
_json_decode = msgspec.json.decode


class StubServer:
    """Server state and the /generate path (one instance per process)."""

    def __init__(self, cfg: StubConfig, model: StubModel, started: float):
        self.cfg = cfg
        self.model = model
        self.v9 = cfg.version == "0.5.9"
        self.started = started
        # starting -> up <-> unhealthy; `exiting` is separate, as in SGLang
        self.status = "starting"
        self.exiting = False
        self.stop = asyncio.Event()  # set when the process should exit (drained, or forced)
        self.generate_count = 0
        self.burst_t0: float | None = None  # when --fail-5xx-for's START-th request came
        self.dispatched = 0  # sequences sent to a data-parallel rank by the round robin
        # sampled requests without a seed: another output each time (outputs.Draws)
        self.draws = Draws()
        self.served_name = cfg.served_model_name or cfg.model_path
        self.pool = cfg.max_total_tokens or 16 * cfg.context_length
        self.max_req_len = min(cfg.context_length - 1, self.pool - 1)
        self.max_req_input_len = self.max_req_len - 5
        # one prefix cache per data-parallel rank (SGLang's schedulers each keep their own tree)
        self.ranks = max(1, cfg.dp_size)
        self.prefix_caches = (
            None
            if cfg.other_args.get("disable_radix_cache")
            else [PrefixCache() for _ in range(self.ranks)]
        )
        self.stats = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "e2e_sum": 0.0}
        self.sched = Scheduler(
            (cfg.max_running_requests or DEFAULT_MAX_RUNNING) * max(1, cfg.dp_size), cfg.token_delay
        )
        self.in_flight = self.sched.in_flight
        # requests, tokens since the last throughput log line
        self.window = [0, 0, time.monotonic()]

    # -- /generate -------------------------------------------------------------------------------
    def generate(self, body: bytes):
        cfg = self.cfg
        self.generate_count += 1
        number = self.generate_count
        t0 = time.perf_counter()
        burst = cfg.fail_5xx_for
        if burst is not None and number >= burst[0] and self.burst_t0 is None:
            self.burst_t0 = time.monotonic()
        since = None if self.burst_t0 is None else time.monotonic() - self.burst_t0
        fault = faults.request_faults(cfg, number, since)
        if fault.crash:
            faults.crash(cfg, number)
        if fault.fail_5xx:
            return cfg.fail_status, _json_encode(faults.fail_5xx_body(cfg, number)), JSON
        try:
            obj = _json_decode(body)
            parse_body(obj)
        # FastAPI's RequestValidationError, as SGLang answers it
        except (msgspec.DecodeError, ParseError) as e:
            message = f"JSON decode error: {e}" if isinstance(e, msgspec.DecodeError) else str(e)
            err = {
                "object": "error",
                "message": message,
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
            return 400, _json_encode(err), JSON
        try:
            check_contract(obj)
        except ContractError as e:
            # no schema gate: the bad value raises a TypeError somewhere, which nobody catches
            if self.v9:
                logger.error("Exception in /generate (0.5.9 has no schema gate): %s", e)
                return 500, b"Internal Server Error", TEXT
            return 400, _json_encode({"error": str(e)}), JSON
        unknown = not_taken(obj, cfg.version)
        if unknown is not None:  # SamplingParams(**params) raises a TypeError, which nobody catches
            logger.error(
                "Exception in /generate: SamplingParams.__init__() got an unexpected keyword "
                "argument %r",
                unknown,
            )
            return 500, b"Internal Server Error", TEXT
        stream = bool(obj.get("stream"))
        try:
            items, single = self.prepare(obj)
        except RequestError as e:
            if stream:
                return self.stream_error(str(e))
            return 400, _json_encode({"error": {"message": str(e)}}), JSON
        kind = faults.poison_of(
            cfg, number, [it.prompt for it in items], self.model.tokenizer.decode
        )
        if kind is not None:
            faults.log_poison(kind, number)
            if kind in faults.CUTS:
                return faults.Cut(kind, self.render(items, single, t0))
            if kind in faults.STATUSES:
                body = _json_encode(faults.poison_status_body(kind, number))
                return faults.STATUSES[kind], body, JSON
            if kind == "hang":
                return self.sched.hang([it.rid for it in items], wedge=False)
            for item in items:
                if kind == "nan":
                    nan_stop(self.model, item)
                else:
                    item.poison = kind
        if fault.nan:
            faults.log_nan(cfg, number)
            for item in items:
                nan_stop(self.model, item)
        if fault.hang:
            faults.log_hang(number)
            return self.sched.hang([it.rid for it in items])
        if stream:
            return self.stream(items, single, t0)
        if cfg.token_delay > 0:
            return self.delayed(items, single, t0)
        return 200, self.render(items, single, t0), JSON

    def prepare(self, obj: dict) -> tuple[list[Item], bool]:
        """Normalise a /generate body into items (GenerateReqInput normalisation + tokenizer-manager
        checks)."""
        cfg, model = self.cfg, self.model
        text, ids = obj.get("text"), obj.get("input_ids")
        if text is None and ids is None:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            single = isinstance(text, str)
            batch = 1 if single else len(text)
        else:
            if len(ids) == 0:
                raise RequestError("input_ids cannot be empty.")
            single = type(ids[0]) is int
            batch = 1 if single else len(ids)
        raw_sp = obj.get("sampling_params")
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
        n = max(1, n)
        if ids is not None:
            prompts = [ids] if (single or (type(ids[0]) is int)) else ids
        else:
            if cfg.skip_tokenizer_init:
                raise RequestError(
                    "The engine initialized with skip_tokenizer_init=True cannot accept text "
                    "prompts. Please provide input_ids or re-initialize the engine with "
                    "skip_tokenizer_init=False."
                )
            prompts = [model.tokenizer.encode(t) for t in ([text] if single else text)]
        if len(prompts) != batch:
            prompts = (prompts * batch)[:batch]
        for p in prompts:
            if not p:
                raise RequestError("input_ids cannot be empty.")
        if n > 1:
            single = False
        rid = obj.get("rid")
        total = batch * n
        if single:
            rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
        elif n > 1:
            rids = [uuid.uuid4().hex for _ in range(total)]
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in range(total)]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(total)]
        else:
            if len(rid) != batch:
                raise RequestError(
                    "The specified rids length mismatch with the batch_size for batch processing."
                )
            if len(set(rid)) != len(rid):
                dups = sorted({r for r in rid if rid.count(r) > 1})
                raise RequestError(f"Duplicate request IDs detected within the request: {dups}")
            rids = list(rid)
        routed = self.routed_rank(obj.get("routed_dp_rank"))
        return_logprob = obj.get("return_logprob")
        start_len = obj.get("logprob_start_len")
        top_num = obj.get("top_logprobs_num")
        items: list[Item] = []
        for i, prompt in enumerate(prompts):
            sp_dict = raw_sp[i] if isinstance(raw_sp, list) else (raw_sp or {})
            for j in range(n):
                sp = make_sampling(sp_dict, cfg.preferred_sampling_params, cfg.skip_tokenizer_init)
                position = i * n + j
                item = Item(
                    rid=rids[position],
                    index=position,
                    prompt=prompt,
                    sp=sp,
                    budget=0,
                    return_logprob=bool(_pick(return_logprob, i, False)),
                    logprob_start_len=_pick(start_len, i, -1),
                    top_logprobs_num=_pick(top_num, i, 0) or 0,
                )
                self.check_lengths(item)
                verify_sampling(sp, model.vocab_size, cfg.version)
                items.append(item)
        for item in items:
            if not self.v9 and item.rid in self.in_flight:
                raise RequestError(f"Duplicate request ID detected: {item.rid}")
            if len(item.prompt) >= self.max_req_input_len:
                raise RequestError(
                    f"Input length ({len(item.prompt)} tokens) exceeds the maximum allowed length "
                    f"({self.max_req_input_len} tokens). Use a shorter input or enable "
                    "--allow-auto-truncate."
                )
            if (
                item.return_logprob
                and item.logprob_start_len is not None
                and item.logprob_start_len > len(item.prompt)
            ):
                raise RequestError(
                    f"logprob_start_len ({item.logprob_start_len}) is superior to the number of "
                    f"input tokens ({len(item.prompt)})."
                )
            if routed is not None:
                item.dp_rank = routed
            elif self.ranks > 1:  # round robin over the data-parallel ranks
                item.dp_rank = self.dispatched % self.ranks
                self.dispatched += 1
            if self.prefix_caches is not None:
                item.cached = self.prefix_caches[item.dp_rank or 0].admit(item.prompt)
            segments = None
            # only a delayed request can be aborted mid-way, and so continued; with --output-scale,
            # a request may also be the next segment of an output asked for in segments
            if cfg.token_delay > 0 or cfg.output_scale:
                segments = plan_continuation(
                    model,
                    cfg,
                    item.prompt,
                    item.sp,
                    item.budget,
                    self.draws.drawn(item.index % n, n, item.rid),
                )
            if segments is not None:
                self.sched.counters["continued"] += 1
            else:
                sample = self.draws.draw(item.prompt, item.sp, item.index % n, n, item.rid)
                segments = plan_output(model, cfg, item.prompt, item.sp, item.budget, sample)
            item.segments = segments
            item.planned = [t for _, ids in item.segments for t in ids]
            finish_item(model, item)
        return items, single

    def routed_rank(self, rank) -> int | None:
        """The data-parallel rank a request asks for (`routed_dp_rank`), as SGLang 0.5.23 takes it:
        ignored when 0 without data parallelism, refused outside the ranks (its tokenizer manager's
        ValueError, a 400); None: the round robin chooses (managers/data_parallel_controller.py,
        round_robin, the default load_balance_method)."""
        if rank is None or (self.ranks <= 1 and rank == 0):
            return None
        if rank < 0 or rank >= self.ranks:
            raise RequestError(f"routed_dp_rank={rank} out of range [0, {self.ranks})")
        return rank

    def check_lengths(self, item: Item) -> None:
        """The tokenizer manager's context checks, then the scheduler's silent clamp of
        max_new_tokens."""
        ctx, n_in, sp = self.cfg.context_length, len(item.prompt), item.sp
        if n_in >= ctx:
            raise RequestError(
                f"The input ({n_in} tokens) is longer than the model's context length ({ctx} "
                "tokens)."
            )
        if sp.max_new_tokens_given:
            total = sp.max_new_tokens + n_in
            if (total >= ctx) if self.v9 else (total > ctx):
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} "
                    f"tokens. You requested a total of {total} tokens: {n_in} tokens from the "
                    f"input messages and {sp.max_new_tokens} tokens for the completion. Please "
                    "reduce the number of tokens in the input messages or the completion to fit "
                    "within the limit."
                )
        room = max(0, self.max_req_len - n_in - 1)
        item.budget = room if sp.max_new_tokens is None else max(0, min(sp.max_new_tokens, room))

    # -- answers ---------------------------------------------------------------------------------
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

    def account(self, item: Item, ids: list[int], e2e: float) -> None:
        """A finished sequence: counted, and its tokens kept in its rank's prefix cache (SGLang
        caches a finished or aborted request's prompt + output, all but the last output token,
        whose KV was never computed), so that a continuation sent to that rank finds them."""
        if self.prefix_caches is not None and ids:
            self.prefix_caches[item.dp_rank or 0].admit(item.prompt + ids[:-1])
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

    def abort_request(self, body: bytes) -> Reply:
        """POST /abort_request: the body is parsed as SGLang's AbortReq (400 in the ErrorResponse
        shape when it cannot be: no JSON, or `rid` / `abort_all` of the wrong type); then 200 and an
        empty body, whatever was found ({} aborts nothing)."""
        try:
            obj = _json_decode(body)
            if not isinstance(obj, dict):
                raise ValueError("Input should be an object")
            if not isinstance(obj.get("rid"), (str, type(None))) or not isinstance(
                obj.get("abort_all", False), bool
            ):
                raise ValueError("rid must be a string and abort_all a boolean")
        except (msgspec.DecodeError, ValueError) as e:
            err = {
                "object": "error",
                "message": f"1 validation error for AbortReq: {e}",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
            return 400, _json_encode(err), JSON
        rid, abort_all = obj.get("rid") or "", bool(obj.get("abort_all"))
        if self.sched.abort(rid if isinstance(rid, str) else "", abort_all):
            logger.info("Abort request rid=%r abort_all=%s", rid, abort_all)
        return 200, b"", None

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

    # -- background ------------------------------------------------------------------------------
    async def warmup(self) -> None:
        cfg = self.cfg
        if cfg.hang:
            logger.warning("Injected hang (--hang): the server will never become ready")
            return
        delay = 0.0 if cfg.skip_server_warmup else cfg.warmup_delay
        if delay > 0:
            await asyncio.sleep(delay)
        if cfg.warmup_fails:
            faults.fail_warmup()
        if self.exiting:
            return
        self.status = "up"
        logger.info("The server is fired up and ready to roll!")

    async def throughput_log(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            reqs, tokens, since = self.window
            now = time.monotonic()
            if reqs:
                logger.info(
                    "Decode batch. #running-req: %d, #finished-req: %d, gen throughput (token/s): "
                    "%.1f",
                    len(self.in_flight),
                    reqs,
                    tokens / max(1e-9, now - since),
                )
            self.window[:] = [0, 0, now]

    async def drain_watchdog(self) -> None:
        """SGLang's sigterm watchdog: poll until SIGTERM, then until no request is left (or at once
        when the last health check failed), then stop."""
        poll = self.cfg.drain_poll
        while not self.exiting:
            await asyncio.sleep(poll)
        while True:
            if self.status == "unhealthy":
                logger.error("Signal SIGTERM received while health check failed. Force exiting.")
                break
            logger.info(
                "Gracefully exiting... Remaining number of requests %d. Remaining requests "
                "remaining_rids=%s.",
                len(self.in_flight),
                list(self.in_flight)[:20],
            )
            if not self.in_flight:
                break
            await asyncio.sleep(poll)
        self.stop.set()

    def on_sigterm(self, signame: str) -> None:
        if not self.exiting:
            logger.info(
                "Received %s: gracefully_exit=True; /health* and /ready answer 503 while requests "
                "drain",
                signame,
            )
        self.exiting = True


def _pick(value: Any, i: int, default: Any) -> Any:
    if value is None:
        return default
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return value
