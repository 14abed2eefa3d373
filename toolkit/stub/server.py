"""The stub's state and /generate: validation order, faults, each sequence admitted to its
data-parallel rank and its output planned (normalise: the body read into items; answers: what is
sent back), /abort_request, and the process lifecycle (warm-up, SIGTERM drain).

Handlers return a Reply `(status, body bytes, content type or None)`, a coroutine that resolves to
one (the request waits: token delay, queue, hang), an async iterator of SSE event bytes (a stream,
HTTP 200), or a faults.Cut (--poison reset or truncate: the connection is cut). The HTTP layer only
maps these onto the wire and cancels the coroutine or stream when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from toolkit.stub import faults
from toolkit.stub.answers import JSON, Answers, Reply
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
from toolkit.stub.normalise import (
    batch_shape,
    check_lengths,
    parallel_n,
    pick,
    prompts_of,
    request_ids,
    routed_rank,
)
from toolkit.stub.outputs import Item, finish_item, nan_stop
from toolkit.stub.planning import Draws, plan_continuation, plan_output
from toolkit.stub.scheduler import Scheduler

logger = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"
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
        # sampled requests without a seed: another output each time (planning.Draws)
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
        self.answers = Answers(cfg, model, self.sched, self.account)

    # -- /generate -------------------------------------------------------------------------------
    def generate(self, body: bytes):
        """/generate, in SGLang's order: the request faults, the body's schema and contract, the
        items normalised, then the answer (poisoned, NaN-stopped or hung when the faults say)."""
        cfg = self.cfg
        self.generate_count += 1
        number = self.generate_count
        t0 = time.perf_counter()
        fault = self.request_faults(number)
        if fault.crash:
            faults.crash(cfg, number)
        if fault.fail_5xx:
            return cfg.fail_status, _json_encode(faults.fail_5xx_body(cfg, number)), JSON
        obj, refused = self.validate(body)
        if refused is not None:
            return refused
        stream = bool(obj.get("stream"))
        try:
            items, single = self.prepare(obj)
        except RequestError as e:
            if stream:
                return self.answers.stream_error(str(e))
            return 400, _json_encode({"error": {"message": str(e)}}), JSON
        kind = faults.poison_of(
            cfg, number, [it.prompt for it in items], self.model.tokenizer.decode
        )
        if kind is not None:
            spoiled = self.poison(kind, number, items, single, t0)
            if spoiled is not None:
                return spoiled
        if fault.nan:
            faults.log_nan(cfg, number)
            for item in items:
                nan_stop(self.model, item)
        if fault.hang:
            faults.log_hang(number)
            return self.sched.hang([it.rid for it in items])
        if stream:
            return self.answers.stream(items, single, t0)
        if cfg.token_delay > 0:
            return self.answers.delayed(items, single, t0)
        return 200, self.answers.render(items, single, t0), JSON

    def request_faults(self, number: int) -> faults.RequestFaults:
        """The faults the command line injects into the `number`-th /generate (--fail-5xx-for's
        clock starts at its START-th request)."""
        burst = self.cfg.fail_5xx_for
        if burst is not None and number >= burst[0] and self.burst_t0 is None:
            self.burst_t0 = time.monotonic()
        since = None if self.burst_t0 is None else time.monotonic() - self.burst_t0
        return faults.request_faults(self.cfg, number, since)

    def validate(self, body: bytes) -> tuple[dict | None, Reply | None]:
        """(the body as JSON, None), or (None, SGLang's answer refusing it): its schema (FastAPI's
        RequestValidationError, a 400), its contract, then the sampling fields the release takes."""
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
            return None, (400, _json_encode(err), JSON)
        try:
            check_contract(obj)
        except ContractError as e:
            # no schema gate: the bad value raises a TypeError somewhere, which nobody catches
            if self.v9:
                logger.error("Exception in /generate (0.5.9 has no schema gate): %s", e)
                return None, (500, b"Internal Server Error", TEXT)
            return None, (400, _json_encode({"error": str(e)}), JSON)
        unknown = not_taken(obj, self.cfg.version)
        if unknown is not None:  # SamplingParams(**params) raises a TypeError, which nobody catches
            logger.error(
                "Exception in /generate: SamplingParams.__init__() got an unexpected keyword "
                "argument %r",
                unknown,
            )
            return None, (500, b"Internal Server Error", TEXT)
        return obj, None

    def poison(self, kind: str, number: int, items: list[Item], single: bool, t0: float):
        """A poisoned request (--poison, --poison-prompt): the answer that replaces its own (a cut
        connection, an error status, a hang), or None when its items are spoiled in place."""
        faults.log_poison(kind, number)
        if kind in faults.CUTS:
            return faults.Cut(kind, self.answers.render(items, single, t0))
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
        return None

    def prepare(self, obj: dict) -> tuple[list[Item], bool]:
        """Normalise a /generate body into items (GenerateReqInput normalisation + tokenizer-manager
        checks), each admitted to its data-parallel rank with its output planned."""
        text, ids = obj.get("text"), obj.get("input_ids")
        single, batch = batch_shape(text, ids)
        raw_sp = obj.get("sampling_params")
        n = parallel_n(raw_sp, batch)
        prompts = prompts_of(text, ids, single, batch, self.cfg, self.model.tokenizer)
        if n > 1:
            single = False
        rids = request_ids(obj.get("rid"), single, batch, n)
        routed = routed_rank(obj.get("routed_dp_rank"), self.ranks)
        items = self.make_items(obj, prompts, raw_sp, n, rids)
        for item in items:
            self.admit(item, routed, n)
        return items, single

    def make_items(
        self, obj: dict, prompts: list, raw_sp: Any, n: int, rids: list[str]
    ) -> list[Item]:
        """An Item per sequence (n per prompt), its sampling parameters and lengths checked."""
        cfg = self.cfg
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
                    return_logprob=bool(pick(return_logprob, i, False)),
                    logprob_start_len=pick(start_len, i, -1),
                    top_logprobs_num=pick(top_num, i, 0) or 0,
                )
                check_lengths(item, cfg, self.max_req_len)
                verify_sampling(sp, self.model.vocab_size, cfg.version)
                items.append(item)
        return items

    def admit(self, item: Item, routed: int | None, n: int) -> None:
        """The tokenizer manager's last checks of one sequence; then its data-parallel rank (the one
        asked for, or the round robin's), its cached prefix there, and its output planned."""
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
        self.plan(item, n)

    def plan(self, item: Item, n: int) -> None:
        """What the "model" writes for one sequence: the next segment of an output asked for in
        segments when it is one, else a new draw."""
        cfg, model = self.cfg, self.model
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

    # -- answers ---------------------------------------------------------------------------------

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
