"""The readiness and informational endpoints: /health*, /ready, /model_info, /server_info,
/v1/models, /v1/loads, /flush_cache, /metrics and the stub's own /stub/counters, and the route table
of every path.

Each handler takes the server state and returns a Reply (status, body bytes, content type or None),
or, for /health while generation is wedged, a coroutine resolving to one.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import sys
import time
from typing import Any, Callable

import msgspec

from toolkit.stub import faults
from toolkit.stub.config import LOG_PREFIX
from toolkit.stub.server import JSON, TEXT, Reply, StubServer

logger = logging.getLogger(__name__)

NOT_FOUND = (404, b'{"detail":"Not Found"}', JSON)
# Path prefixes that never need the api key (nor does OPTIONS): utils/auth.py of each release.
AUTH_EXEMPT = {"0.5.23": ("/health", "/ready", "/metrics"), "0.5.9": ("/health", "/metrics")}
_json_encode = msgspec.json.encode


def health(srv: StubServer):
    """/health and /health_generate: 503 at once while starting or exiting (or while --poison cuts
    every generation); else, as SGLang, a 1-token generation is sent and the answer comes after
    whole seconds of waiting (it sleeps 1 s, then looks whether anything came back: never sooner
    than 1 s), or 503 when nothing came back within the health-check timeout (wedged)."""
    if srv.exiting or srv.status == "starting" or faults.health_broken(srv.cfg, srv.generate_count):
        return 503, b"", None
    return _health_generate(srv)


async def _health_generate(srv: StubServer) -> Reply:
    if not srv.sched.hung:
        await asyncio.sleep(1.0)
        srv.status = "up"
        return 200, b"", None
    # SGLang: no output within the timeout
    await asyncio.sleep(max(1.0, srv.cfg.health_check_timeout))
    if not srv.sched.hung:
        srv.status = "up"
        return 200, b"", None
    if srv.status != "unhealthy":
        logger.error(
            "Health check failed. Server couldn't get a response from detokenizer for last "
            "%g seconds. (the stub's generation is wedged on purpose)",
            srv.cfg.health_check_timeout,
        )
    srv.status = "unhealthy"
    return 503, b"", None


def ready(srv: StubServer) -> Reply:
    return (200 if srv.status == "up" and not srv.exiting else 503), b"", None


def model_info(srv: StubServer) -> Reply:
    cfg, mc = srv.cfg, srv.model.model_config
    info: dict[str, Any] = {"model_path": cfg.model_path}
    if not srv.v9:
        info["served_model_name"] = srv.served_name
    info.update(
        tokenizer_path=cfg.tokenizer_path or cfg.model_path,
        is_generation=True,
        # parsed JSON, as SGLang's server args
        preferred_sampling_params=cfg.preferred_sampling_params or None,
        weight_version="default",
    )
    if not srv.v9:
        info.update(
            load_format="auto",
            reasoning_parser=cfg.reasoning_parser,
            tool_call_parser=cfg.tool_call_parser,
            disaggregation_mode="null",
        )
    info.update(
        has_image_understanding=False,
        has_audio_understanding=False,
        model_type=mc.get("model_type", "stub"),
        architectures=mc.get("architectures", ["StubEngine"]),
        stub_engine="not a model: a test double of SGLang's HTTP protocol",
    )
    return 200, _json_encode(info), JSON


def model_info_deprecated(srv: StubServer) -> Reply:
    logger.warning(
        "Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
        "Please use '/model_info' instead."
    )
    return model_info(srv)


def server_info(srv: StubServer) -> Reply:
    cfg = srv.cfg
    args = {
        f: getattr(cfg, f)
        for f in cfg.__struct_fields__
        if f not in ("api_key", "other_args", "fail_5xx")
    }
    args.update(cfg.other_args)
    args["fail_5xx"] = f"{cfg.fail_5xx[0]}:{cfg.fail_5xx[1]}" if cfg.fail_5xx else None
    args.update(
        served_model_name=srv.served_name,
        tokenizer_path=cfg.tokenizer_path or cfg.model_path,
        launch_command=_redacted_command(sys.argv, cfg.api_key),
        status="ready",
        max_total_num_tokens=srv.pool,
        max_req_input_len=srv.max_req_input_len,
        startup_time=round(time.time() - srv.started, 3),
        kv_events=None,
        internal_states=[
            {
                "last_gen_throughput": srv.sched.gen_throughput() / max(1, cfg.dp_size),
                "memory_usage": {"weight": 0.0, "kvcache": 0.0},
                "effective_max_running_requests_per_dp": srv.sched.max_running
                // max(1, cfg.dp_size),
                "max_running_requests": srv.sched.max_running,
            }
            for _ in range(max(1, cfg.dp_size))
        ],
        version=cfg.version,
        frontend="python",
        stub_engine="not a model: a test double of SGLang's HTTP protocol",
    )
    return 200, _json_encode(args), JSON


def loads(srv: StubServer) -> Reply:
    """GET /v1/loads: the load of each data-parallel rank, in the shape of the release the stub
    imitates.

    0.5.23 (sglang/srt/entrypoints/v1_loads.py; the rows are managers/load_snapshot.py's
    LoadSnapshot.to_dict): {timestamp, version, accelerator, num_accelerators, loads: [{timestamp
    (epoch float), dp_rank, num_running_reqs, ..., max_running_requests, token_usage, ...,
    decode_moments, disaggregation, queues}]}.
    0.5.9 (the same file then; rows from io_struct.GetLoadsReqOutput, timestamp and None values left
    out): {timestamp, version, dp_rank_count, loads: [{dp_rank, num_running_reqs, ...,
    num_total_reqs}], aggregate}. The stub has one scheduler; with --dp-size N its requests are
    shared out over N ranks for the report. It has no GPU: `accelerator` is null, and `memory`
    (0.5.23) says it holds no weights, its KV pool's capacity.
    """
    dp = max(1, srv.cfg.dp_size)
    used, now = srv.sched.used_tokens(), time.time()
    rows = [_rank_load(srv, i, dp, used, now) for i in range(dp)]
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat()
    if srv.v9:
        body = {
            "timestamp": stamp,
            "version": srv.cfg.version,
            "dp_rank_count": len(rows),
            "loads": rows,
            "aggregate": _aggregate(rows),
        }
    else:
        body = {
            "timestamp": stamp,
            "version": srv.cfg.version,
            "accelerator": None,
            "num_accelerators": max(1, srv.cfg.tp_size),
            "loads": rows,
        }
    return 200, _json_encode(body), JSON


def _share(total: int, i: int, dp: int) -> int:
    """Rank `i`'s share of `total` shared out over `dp` ranks (the first ranks take the rest)."""
    return total // dp + (i < total % dp)


def _rank_load(srv: StubServer, i: int, dp: int, used: int, now: float) -> dict:
    """The /v1/loads row of data-parallel rank `i` of `dp`, in the release's shape."""
    pool = srv.pool
    running, waiting, rank_used = (
        _share(len(srv.sched.running), i, dp),
        _share(len(srv.sched.waiting), i, dp),
        _share(used, i, dp),
    )
    limit = srv.sched.max_running // dp
    core = {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": rank_used,
        "max_total_num_tokens": pool,
        "token_usage": round(rank_used / pool, 4),
        "gen_throughput": round(srv.sched.gen_throughput() / dp, 2),
        "cache_hit_rate": 0.0,
        "utilization": round(running / max(1, limit), 4),
        "max_running_requests": limit,
    }
    queues = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
    if srv.v9:
        return {
            "dp_rank": i,
            **core,
            "disaggregation": _disaggregation(srv.v9),
            "queues": queues,
            "num_total_reqs": running + waiting,
        }
    return _load_snapshot(i, now, core, queues)


def _disaggregation(v9: bool) -> dict:
    """A rank's disaggregation state: none."""
    # 0.5.23 renamed the first queue (prefill_prealloc -> prefill_bootstrap)
    first_queue = "prefill_prealloc_queue_reqs" if v9 else "prefill_bootstrap_queue_reqs"
    return {
        "mode": "null",
        first_queue: 0,
        "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0,
        "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }


def _load_snapshot(i: int, now: float, core: dict, queues: dict) -> dict:
    """0.5.23's row of rank `i` (LoadSnapshot.to_dict), from the counts 0.5.9's row holds."""
    used, pool = core["num_used_tokens"], core["max_total_num_tokens"]
    return {
        "timestamp": now,
        "dp_rank": i,
        "num_running_reqs": core["num_running_reqs"],
        "num_waiting_reqs": core["num_waiting_reqs"],
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": pool,
        "max_running_requests": core["max_running_requests"],
        "token_usage": core["token_usage"],
        "gen_throughput": core["gen_throughput"],
        "cache_hit_rate": 0.0,
        "utilization": core["utilization"],
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
        "memory": {
            "weight_gb": 0.0,
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": pool,
        },
        "disaggregation": _disaggregation(False),
        "queues": {**queues, "prealloc_ready": 0},
    }


def _aggregate(rows: list[dict]) -> dict:
    """0.5.9's `aggregate` of the ranks' rows."""
    n = len(rows)
    return {
        "total_running_reqs": sum(r["num_running_reqs"] for r in rows),
        "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
        "total_reqs": sum(r["num_total_reqs"] for r in rows),
        "avg_token_usage": round(sum(r["token_usage"] for r in rows) / n, 4),
        "avg_throughput": round(sum(r["gen_throughput"] for r in rows) / n, 2),
        "avg_utilization": round(sum(r["utilization"] for r in rows) / n, 4),
    }


def stub_counters(srv: StubServer) -> Reply:
    """Stub only: what the "GPU" did (tokens decoded, returned, aborts; the batch occupancy,
    time-weighted running / max_running from the first request to the last answer, null before any
    ran), for benchmarks and tests."""
    occ = srv.sched.occupancy
    share = occ.share()
    return (
        200,
        _json_encode(
            {
                **srv.sched.counters,
                "answered": srv.stats["requests"],
                "running": len(srv.sched.running),
                "waiting": len(srv.sched.waiting),
                "max_running": srv.sched.max_running,
                "occupancy": None if share is None else round(share, 4),
                "occupancy_s": round(occ.span(), 3),
            }
        ),
        JSON,
    )


def _model_card(srv: StubServer) -> dict:
    return {
        "id": srv.served_name,
        "object": "model",
        "created": int(srv.started),
        "owned_by": "sglang",
        "root": srv.served_name,
        "parent": None,
        "max_model_len": srv.cfg.context_length,
    }


def v1_models(srv: StubServer) -> Reply:
    return 200, _json_encode({"object": "list", "data": [_model_card(srv)]}), JSON


def v1_model(srv: StubServer, name: str) -> Reply:
    if name == srv.served_name:
        return 200, _json_encode(_model_card(srv)), JSON
    err = {
        "message": f"The model '{name}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return 404, _json_encode({"error": err}), JSON


def flush_cache(srv: StubServer) -> Reply:
    if srv.in_flight:
        return 400, b"Flush cache failed.\n", TEXT
    for cache in srv.prefix_caches or ():
        cache.clear()
    return (
        200,
        (
            b"Cache flushed.\nPlease check backend logs for more details. (When there are running "
            b"or waiting requests, the operation will not be performed.)\n"
        ),
        TEXT,
    )


def metrics(srv: StubServer) -> Reply:
    s, name = srv.stats, srv.served_name
    label = f'{{model_name="{name}"}}'
    lines = [f"# stub-engine metrics: {LOG_PREFIX}"]
    for metric, kind, value in (
        (
            "num_running_reqs",
            "gauge",
            len(srv.sched.running) if srv.cfg.token_delay > 0 else len(srv.in_flight),
        ),
        ("num_queue_reqs", "gauge", len(srv.sched.waiting)),
        ("token_usage", "gauge", round(srv.sched.used_tokens() / srv.pool, 4)),
        ("gen_throughput", "gauge", srv.sched.gen_throughput()),
        ("cache_hit_rate", "gauge", 0.0),
        ("prompt_tokens_total", "counter", s["prompt_tokens"]),
        ("generation_tokens_total", "counter", s["generation_tokens"]),
        ("num_requests_total", "counter", s["requests"]),
    ):
        lines += [
            f"# HELP sglang:{metric} {metric} (stub engine)",
            f"# TYPE sglang:{metric} {kind}",
            f"sglang:{metric}{label} {value}",
        ]
    lines += [
        "# HELP sglang:e2e_request_latency_seconds e2e latency (stub engine)",
        "# TYPE sglang:e2e_request_latency_seconds summary",
        f"sglang:e2e_request_latency_seconds_sum{label} {s['e2e_sum']}",
        f"sglang:e2e_request_latency_seconds_count{label} {s['requests']}",
    ]
    return 200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8"


def _redacted_command(argv: list[str], secret: str | None) -> str:
    words = [sys.executable, "-m", "toolkit.stub"] + argv[1:]
    return " ".join("***" if secret and w == secret else w for w in words)


def routes(srv: StubServer) -> dict[str, tuple[tuple[str, ...], Callable | None]]:
    """path -> (methods, handler of the state); None: /generate and /abort_request, which take the
    body."""
    table: dict[str, tuple[tuple[str, ...], Callable | None]] = {
        "/health": (("GET",), health),
        "/health_generate": (("GET",), health),
        "/model_info": (("GET",), model_info),
        "/get_model_info": (("GET",), model_info_deprecated),
        "/server_info": (("GET",), server_info),
        "/get_server_info": (("GET",), server_info),
        "/v1/models": (("GET",), v1_models),
        "/generate": (("POST", "PUT"), None),
        "/abort_request": (("POST",), None),
        "/flush_cache": (("GET", "POST"), flush_cache),
        "/v1/loads": (("GET",), loads),
        "/stub/counters": (("GET",), stub_counters),
    }
    if not srv.v9:
        table["/ready"] = (("GET",), ready)
    if srv.cfg.enable_metrics:
        table["/metrics"] = (("GET",), metrics)
    return table
