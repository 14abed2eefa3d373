"""StubServer: the routes, /generate (normalisation, scheduling of delayed requests, aborts), start-up and
drain, and the counters and metrics the endpoints report (the response objects and streaming: responses)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
import uuid
from typing import Any, Callable

import msgspec

from . import faults
from .cache import PrefixCache
from .config import DEFAULT_MAX_RUNNING, LOG_PREFIX, StubConfig
from .contract import ContractError, RequestError, check_contract, make_sampling, verify_sampling
from .http import JSON, NOT_ALLOWED, NOT_FOUND, TEXT, Connection, Reply, Request
from .model import Item, StubModel, finish_item, plan_continuation, plan_output
from .responses import ABORTED, Responses

logger = logging.getLogger(__name__)
_json_encode = msgspec.json.encode
_json_decode = msgspec.json.decode


class InFlight(msgspec.Struct, kw_only=True):
    rid: str
    started: float
    aborted: asyncio.Event | None = None
    aborted_at: float = 0.0  # loop time of the abort
    prompt_len: int = 0
    begin: float | None = None  # loop time generation began (None: waiting in the queue, or not delayed)
    planned: int = 0  # tokens it will write if nothing stops it


class StubServer(Responses):
    """Server state and request handlers (one instance per process)."""

    def __init__(self, cfg: StubConfig, model: StubModel, started: float):
        self.cfg = cfg
        self.model = model
        self.v9 = cfg.version == "0.5.9"
        self.started = started
        self.status = "starting"  # starting -> up <-> unhealthy; `exiting` is separate, as in SGLang
        self.exiting = False
        self.stop = asyncio.Event()  # set when the process should exit (drained, or forced)
        self.hung = 0  # requests wedged by --hang / --hang-after
        self.connections: set[Connection] = set()
        self.in_flight: dict[str, InFlight] = {}
        self.generate_count = 0
        self.served_name = cfg.served_model_name or cfg.model_path
        self.pool = cfg.max_total_tokens or 16 * cfg.context_length
        self.max_req_len = min(cfg.context_length - 1, self.pool - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.prefix_cache = None if cfg.other_args.get("disable_radix_cache") else PrefixCache()
        self.stats = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "e2e_sum": 0.0, "aborted": 0}
        # The scheduler of delayed requests (--token-delay): at most max_running generate at once, the rest
        # wait in a FIFO queue; `generated` counts every token decoded, also those of requests aborted or
        # dropped by their client (what a GPU spent), `returned` those sent back in answers.
        self.max_running = (cfg.max_running_requests or DEFAULT_MAX_RUNNING) * max(1, cfg.dp_size)
        self.running: dict[int, InFlight] = {}  # by id(): Structs compare by value
        self.waiting: list[tuple[InFlight, asyncio.Future]] = []
        self.counters = {"generated_tokens": 0, "returned_tokens": 0, "aborted_running": 0, "aborted_waiting": 0,
                         "cancelled": 0, "continued": 0}
        self.window = [0, 0, time.monotonic()]  # requests, tokens since the last throughput log line
        self.routes: dict[str, tuple[tuple[str, ...], Callable]] = {
            "/health": (("GET",), self.health), "/health_generate": (("GET",), self.health),
            "/model_info": (("GET",), self.model_info), "/get_model_info": (("GET",), self.model_info_deprecated),
            "/server_info": (("GET",), self.server_info), "/get_server_info": (("GET",), self.server_info),
            "/v1/models": (("GET",), self.v1_models), "/generate": (("POST", "PUT"), self.generate),
            "/abort_request": (("POST",), self.abort_request), "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/v1/loads": (("GET",), self.loads), "/get_loads": (("GET",), self.loads),
            "/stub/counters": (("GET",), self.stub_counters),
        }
        if not self.v9:
            self.routes["/ready"] = (("GET",), self.ready)
        if cfg.enable_metrics:
            self.routes["/metrics"] = (("GET",), self.metrics)

    # -- routing ---------------------------------------------------------------------------------
    def dispatch(self, conn: Connection, req: Request):
        path = req.path
        key = self.cfg.api_key
        if key and req.method != "OPTIONS" and not path.startswith(("/health", "/ready", "/metrics")):
            given = req.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return 401, b'{"error":"Unauthorized"}', JSON
        route = self.routes.get(path)
        if route is None:
            if path.startswith("/v1/models/") and req.method == "GET":
                return self.v1_model(path[len("/v1/models/"):])
            return NOT_FOUND
        if req.method not in route[0]:
            return NOT_ALLOWED
        if path == "/generate":
            return self.generate(conn, req)
        return route[1](req)

    # -- readiness and information ---------------------------------------------------------------
    def health(self, req: Request):
        """/health and /health_generate: 503 while starting or exiting; a wedged generation times out."""
        if self.exiting or self.status == "starting":
            return 503, b"", None
        if not self.hung:
            self.status = "up"
            return 200, b"", None
        return self._health_timeout()

    async def _health_timeout(self) -> Reply:
        await asyncio.sleep(self.cfg.health_check_timeout)  # SGLang: no output within the timeout
        if not self.hung:
            self.status = "up"
            return 200, b"", None
        if self.status != "unhealthy":
            logger.error("Health check failed. Server couldn't get a response from detokenizer for last "
                         "%g seconds. (the stub's generation is wedged on purpose)", self.cfg.health_check_timeout)
        self.status = "unhealthy"
        return 503, b"", None

    def ready(self, req: Request) -> Reply:
        return (200 if self.status == "up" and not self.exiting else 503), b"", None

    def model_info(self, req: Request) -> Reply:
        cfg, mc = self.cfg, self.model.model_config
        info: dict[str, Any] = {"model_path": cfg.model_path}
        if not self.v9:
            info["served_model_name"] = self.served_name
        info.update(tokenizer_path=cfg.tokenizer_path or cfg.model_path, is_generation=True,
                    preferred_sampling_params=json.dumps(cfg.preferred_sampling_params)
                    if cfg.preferred_sampling_params else None, weight_version="default")
        if not self.v9:
            info.update(load_format="auto", reasoning_parser=cfg.reasoning_parser,
                        tool_call_parser=cfg.tool_call_parser, disaggregation_mode="null")
        info.update(has_image_understanding=False, has_audio_understanding=False,
                    model_type=mc.get("model_type", "stub"), architectures=mc.get("architectures", ["StubEngine"]),
                    stub_engine="not a model: a test double of SGLang's HTTP protocol")
        return 200, _json_encode(info), JSON

    def model_info_deprecated(self, req: Request) -> Reply:
        logger.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                       "Please use '/model_info' instead.")
        return self.model_info(req)

    def server_info(self, req: Request) -> Reply:
        cfg = self.cfg
        args = {f: getattr(cfg, f) for f in cfg.__struct_fields__ if f not in ("api_key", "other_args", "fail_5xx")}
        args.update(cfg.other_args)
        args["fail_5xx"] = f"{cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}" if cfg.fail_5xx else None
        args.update(
            served_model_name=self.served_name, tokenizer_path=cfg.tokenizer_path or cfg.model_path,
            launch_command=_redacted_command(sys.argv, cfg.api_key),
            status="ready", max_total_num_tokens=self.pool, max_req_input_len=self.max_req_input_len,
            startup_time=round(time.time() - self.started, 3), kv_events=None,
            internal_states=[{"last_gen_throughput": self._gen_throughput() / max(1, cfg.dp_size),
                              "memory_usage": {"weight": 0.0, "kvcache": 0.0},
                              "effective_max_running_requests_per_dp": self.max_running // max(1, cfg.dp_size)}
                             for _ in range(max(1, cfg.dp_size))],
            version=cfg.version, frontend="python",
            stub_engine="not a model: a test double of SGLang's HTTP protocol",
        )
        return 200, _json_encode(args), JSON

    def _gen_throughput(self) -> float:
        delay = self.cfg.token_delay
        return round(len(self.running) / delay, 1) if delay > 0 else 0.0

    def _used_tokens(self) -> int:
        now, delay = asyncio.get_running_loop().time(), self.cfg.token_delay
        used = sum(s.prompt_len for s, _ in self.waiting)
        for s in self.running.values():
            used += s.prompt_len + (min(s.planned, int((now - s.begin) / delay)) if s.begin is not None else 0)
        return used

    def loads(self, req: Request) -> Reply:
        """GET /v1/loads (0.5.23): the load of each data-parallel rank, as SGLang's load snapshot reports it.

        The stub has one scheduler; with --dp-size N its requests are shared out over N ranks for the report.
        """
        if self.v9:
            return NOT_FOUND  # assumed absent in the 0.5.9 profile: clients must do without it
        dp = max(1, self.cfg.dp_size)
        used, pool = self._used_tokens(), self.pool
        share = lambda total, i: total // dp + (i < total % dp)  # noqa: E731
        rows = []
        for i in range(dp):
            running, waiting = share(len(self.running), i), share(len(self.waiting), i)
            rank_used = share(used, i)
            rows.append({
                "dp_rank": i, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting, "num_used_tokens": rank_used,
                "max_total_num_tokens": pool, "max_running_requests": self.max_running // dp,
                "token_usage": round(rank_used / pool, 4), "gen_throughput": self._gen_throughput() / dp,
                "cache_hit_rate": 0.0, "utilization": round(running / max(1, self.max_running // dp), 4),
            })
        body = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": self.cfg.version,
                "dp_rank_count": dp, "loads": rows}
        return 200, _json_encode(body), JSON

    def stub_counters(self, req: Request) -> Reply:
        """Stub only: what the "GPU" did (tokens decoded, returned, aborts), for benchmarks and tests."""
        return 200, _json_encode({**self.counters, "answered": self.stats["requests"], "running": len(self.running),
                                  "waiting": len(self.waiting),
                                  "max_running": self.max_running}), JSON

    def _model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                "root": self.served_name, "parent": None, "max_model_len": self.cfg.context_length}

    def v1_models(self, req: Request) -> Reply:
        return 200, _json_encode({"object": "list", "data": [self._model_card()]}), JSON

    def v1_model(self, name: str) -> Reply:
        if name == self.served_name:
            return 200, _json_encode(self._model_card()), JSON
        err = {"message": f"The model '{name}' does not exist", "type": "invalid_request_error", "param": "model",
               "code": "model_not_found"}
        return 404, _json_encode({"error": err}), JSON

    def flush_cache(self, req: Request) -> Reply:
        if self.in_flight:
            return 400, b"Flush cache failed.\n", TEXT
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return 200, (b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     b"waiting requests, the operation will not be performed.)\n"), TEXT

    def metrics(self, req: Request) -> Reply:
        s, name = self.stats, self.served_name
        label = f'{{model_name="{name}"}}'
        lines = [f"# stub-engine metrics: {LOG_PREFIX}"]
        for metric, kind, value in (
            ("num_running_reqs", "gauge", len(self.running) if self.cfg.token_delay > 0 else len(self.in_flight)),
            ("num_queue_reqs", "gauge", len(self.waiting)),
            ("token_usage", "gauge", round(self._used_tokens() / self.pool, 4)),
            ("gen_throughput", "gauge", self._gen_throughput()), ("cache_hit_rate", "gauge", 0.0),
            ("prompt_tokens_total", "counter", s["prompt_tokens"]),
            ("generation_tokens_total", "counter", s["generation_tokens"]),
            ("num_requests_total", "counter", s["requests"]),
        ):
            lines += [f"# HELP sglang:{metric} {metric} (stub engine)", f"# TYPE sglang:{metric} {kind}",
                      f"sglang:{metric}{label} {value}"]
        lines += ["# HELP sglang:e2e_request_latency_seconds e2e latency (stub engine)",
                  "# TYPE sglang:e2e_request_latency_seconds summary",
                  f"sglang:e2e_request_latency_seconds_sum{label} {s['e2e_sum']}",
                  f"sglang:e2e_request_latency_seconds_count{label} {s['requests']}"]
        return 200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8"

    def abort_request(self, req: Request) -> Reply:
        try:
            obj = _json_decode(req.body) if req.body else {}
        except msgspec.DecodeError:
            obj = {}
        obj = obj if isinstance(obj, dict) else {}
        rid, abort_all = obj.get("rid") or "", bool(obj.get("abort_all"))
        if abort_all or (isinstance(rid, str) and rid in self.in_flight):
            for state in list(self.in_flight.values()):
                if (abort_all or state.rid.startswith(rid)) and state.aborted is not None \
                        and not state.aborted.is_set():
                    state.aborted_at = asyncio.get_running_loop().time()
                    state.aborted.set()
            logger.info("Abort request rid=%r abort_all=%s", rid, abort_all)
        return 200, b"", None

    # -- /generate -------------------------------------------------------------------------------
    def generate(self, conn: Connection, req: Request):
        cfg = self.cfg
        self.generate_count += 1
        number = self.generate_count
        t0 = time.perf_counter()
        if faults.crash_due(cfg, number):
            faults.crash(cfg, number)
        if faults.fail_5xx_due(cfg, number):
            return faults.fail_5xx_reply(cfg, number)
        hang = faults.hang_due(cfg, number)
        try:
            obj = _json_decode(req.body)
        except msgspec.DecodeError as e:
            body = {"object": "error", "message": f"JSON decode error: {e}", "type": "Bad Request", "param": None,
                    "code": 400}
            return 400, _json_encode(body), JSON
        try:
            check_contract(obj)
        except ContractError as e:
            if self.v9:  # no schema gate: the bad value raises a TypeError somewhere, which nobody catches
                logger.error("Exception in /generate (0.5.9 has no schema gate): %s", e)
                return 500, b"Internal Server Error", TEXT
            return 400, _json_encode({"error": str(e)}), JSON
        stream = bool(obj.get("stream"))
        try:
            items, single = self.prepare(obj)
        except RequestError as e:
            if stream:
                return self.stream_error(conn, str(e))
            return 400, _json_encode({"error": {"message": str(e)}}), JSON
        if faults.nan_due(cfg, number):
            faults.inject_nan(cfg, number, self.model, items)
        if hang:
            return faults.hang_forever(self, items)
        if stream:
            return self.stream(conn, items, single, t0)
        if cfg.token_delay > 0:
            return self.delayed(items, single, t0)
        return 200, self.render(items, single, t0), JSON

    def prepare(self, obj: dict) -> tuple[list[Item], bool]:
        """Normalise a /generate body into items (GenerateReqInput normalisation + tokenizer-manager checks)."""
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
                raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
            if len(raw_sp) != batch:
                raise RequestError(f"The length of sampling_params ({len(raw_sp)}) should be equal to the batch "
                                   f"size ({batch}).")
        else:
            n = (raw_sp or {}).get("n") or 1
        n = max(1, n)
        if ids is not None:
            prompts = [ids] if (single or (type(ids[0]) is int)) else ids
        else:
            if cfg.skip_tokenizer_init:
                raise RequestError("The engine initialized with skip_tokenizer_init=True cannot accept text "
                                   "prompts. Please provide input_ids or re-initialize the engine with "
                                   "skip_tokenizer_init=False.")
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
                raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
            if len(set(rid)) != len(rid):
                dups = sorted({r for r in rid if rid.count(r) > 1})
                raise RequestError(f"Duplicate request IDs detected within the request: {dups}")
            rids = list(rid)
        return_logprob = obj.get("return_logprob")
        start_len = obj.get("logprob_start_len")
        top_num = obj.get("top_logprobs_num")
        items: list[Item] = []
        for i, prompt in enumerate(prompts):
            sp_dict = raw_sp[i] if isinstance(raw_sp, list) else (raw_sp or {})
            for j in range(n):
                sp = make_sampling(sp_dict, cfg.preferred_sampling_params, cfg.skip_tokenizer_init, cfg.version)
                position = i * n + j
                item = Item(rid=rids[position], index=position, prompt=prompt, sp=sp, budget=0,
                            return_logprob=bool(_pick(return_logprob, i, False)),
                            logprob_start_len=_pick(start_len, i, -1), top_logprobs_num=_pick(top_num, i, 0) or 0)
                self.check_lengths(item)
                verify_sampling(sp, model.vocab_size, cfg.version)
                items.append(item)
        for item in items:
            if not self.v9 and item.rid in self.in_flight:
                raise RequestError(f"Duplicate request ID detected: {item.rid}")
            if len(item.prompt) >= self.max_req_input_len:
                raise RequestError(
                    f"Input length ({len(item.prompt)} tokens) exceeds the maximum allowed length "
                    f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
            if item.return_logprob and item.logprob_start_len is not None and item.logprob_start_len > len(item.prompt):
                raise RequestError(f"logprob_start_len ({item.logprob_start_len}) is superior to the number of "
                                   f"input tokens ({len(item.prompt)}).")
            if self.prefix_cache is not None:
                item.cached = self.prefix_cache.admit(item.prompt)
            segments = None
            if cfg.token_delay > 0:  # only a delayed request can be aborted mid-way, and so continued
                segments = plan_continuation(model, cfg, item.prompt, item.sp, item.budget, item.index % n)
            if segments is not None:
                self.counters["continued"] += 1
            else:
                segments = plan_output(model, cfg, item.prompt, item.sp, item.budget, item.index % n)
            item.segments = segments
            item.planned = [t for _, ids in item.segments for t in ids]
            finish_item(model, item)
        return items, single

    def check_lengths(self, item: Item) -> None:
        """The tokenizer manager's context checks, then the scheduler's silent clamp of max_new_tokens."""
        ctx, n_in, sp = self.cfg.context_length, len(item.prompt), item.sp
        if n_in >= ctx:
            raise RequestError(f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens).")
        if sp.max_new_tokens_given:
            total = sp.max_new_tokens + n_in
            if (total >= ctx) if self.v9 else (total > ctx):
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                    f"requested a total of {total} tokens: {n_in} tokens from the input messages and "
                    f"{sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                    "input messages or the completion to fit within the limit.")
        room = max(0, self.max_req_len - n_in - 1)
        item.budget = room if sp.max_new_tokens is None else max(0, min(sp.max_new_tokens, room))

    def register(self, items: list[Item], abortable: bool) -> list[InFlight]:
        now = time.monotonic()
        states = [InFlight(rid=it.rid, started=now, aborted=asyncio.Event() if abortable else None) for it in items]
        for state in states:
            self.in_flight[state.rid] = state
        return states

    def unregister(self, states: list[InFlight]) -> None:
        for state in states:
            if self.in_flight.get(state.rid) is state:
                del self.in_flight[state.rid]

    async def delayed(self, items: list[Item], single: bool, t0: float) -> Reply:
        """Answer after token_delay per generated token, or with partial output for the items aborted; items
        wait in the queue while max_running others generate."""
        states = self.register(items, abortable=True)
        try:
            objs = await asyncio.gather(*(self._run_item(it, st, t0) for it, st in zip(items, states)))
            return 200, _json_encode(objs[0] if single else objs), JSON
        finally:
            self.unregister(states)

    async def _admit(self, state: InFlight) -> bool:
        """Wait for a running slot (FIFO); False when aborted while waiting."""
        if len(self.running) < self.max_running and not self.waiting:
            self.running[id(state)] = state
            return True
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        entry = (state, granted)
        self.waiting.append(entry)
        aborted = loop.create_task(state.aborted.wait())
        try:
            await asyncio.wait([granted, aborted], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._release(state)
            raise
        finally:
            aborted.cancel()
            for i, e in enumerate(self.waiting):
                if e is entry:
                    del self.waiting[i]
                    break
        if state.aborted.is_set():  # aborted while queued (a slot freed by the same abort_all does not count)
            if granted.done() and not granted.cancelled():
                self._release(state)
            granted.cancel()
            return False
        return True

    def _release(self, state: InFlight) -> None:
        self.running.pop(id(state), None)
        while self.waiting and len(self.running) < self.max_running:
            nxt, fut = self.waiting.pop(0)
            if not fut.done() and not nxt.aborted.is_set():
                self.running[id(nxt)] = nxt
                fut.set_result(None)

    async def _run_item(self, it: Item, state: InFlight, t0: float) -> dict:
        loop = asyncio.get_running_loop()
        delay = self.cfg.token_delay
        state.prompt_len, state.planned = len(it.prompt), len(it.output)
        if not await self._admit(state):
            self.counters["aborted_waiting"] += 1
            self.stats["aborted"] += 1
            return self.waiting_abort_object(it, time.perf_counter() - t0)
        begin = state.begin = loop.time()
        end = begin + delay * len(it.output)
        made = 0
        try:
            while not state.aborted.is_set() and loop.time() < end:
                waiter = loop.create_task(state.aborted.wait())
                try:
                    await asyncio.wait([waiter], timeout=end - loop.time())
                finally:
                    waiter.cancel()
            if state.aborted.is_set() and state.aborted_at < end:
                made = min(len(it.output), max(0, int((state.aborted_at - begin) / delay)))
                self.counters["aborted_running"] += 1
                self.stats["aborted"] += 1
                obj = self.output_object(it, it.output[:made], dict(ABORTED), time.perf_counter() - t0)
            else:
                made = len(it.output)
                obj = self.output_object(it, it.output, it.finish, time.perf_counter() - t0)
            self.counters["returned_tokens"] += made
            return obj
        except asyncio.CancelledError:  # the client went away: what was decoded so far is spent all the same
            made = min(len(it.output), max(0, int((loop.time() - begin) / delay)))
            self.counters["cancelled"] += 1
            raise
        finally:
            self.counters["generated_tokens"] += made
            self._release(state)

    # -- background ------------------------------------------------------------------------------
    async def warmup(self) -> None:
        cfg = self.cfg
        if faults.never_ready(cfg):
            return
        delay = 0.0 if cfg.skip_server_warmup else cfg.warmup_delay
        if delay > 0:
            await asyncio.sleep(delay)
        faults.fail_warmup(cfg)
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
                logger.info("Decode batch. #running-req: %d, #finished-req: %d, gen throughput (token/s): %.1f",
                            len(self.in_flight), reqs, tokens / max(1e-9, now - since))
            self.window[:] = [0, 0, now]

    async def drain_watchdog(self) -> None:
        """SGLang's sigterm watchdog: poll until SIGTERM, then until no request is left (or at once when the
        last health check failed), then stop."""
        poll = self.cfg.drain_poll
        while not self.exiting:
            await asyncio.sleep(poll)
        while True:
            if self.status == "unhealthy":
                logger.error("Signal SIGTERM received while health check failed. Force exiting.")
                break
            logger.info("Gracefully exiting... Remaining number of requests %d. Remaining requests "
                        "remaining_rids=%s.", len(self.in_flight), list(self.in_flight)[:20])
            if not self.in_flight:
                break
            await asyncio.sleep(poll)
        self.stop.set()

    def on_sigterm(self, signame: str) -> None:
        if not self.exiting:
            logger.info("Received %s: gracefully_exit=True; /health* and /ready answer 503 while requests drain",
                        signame)
        self.exiting = True


def _pick(value: Any, i: int, default: Any) -> Any:
    if value is None:
        return default
    if isinstance(value, list):
        return value[i] if i < len(value) else default
    return value


def _redacted_command(argv: list[str], secret: str | None) -> str:
    words = [sys.executable, "-m", "toolkit.engines.stub_server"] + argv[1:]
    return " ".join("***" if secret and w == secret else w for w in words)
