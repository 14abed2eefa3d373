"""Stand-in SGLang server: a test double of SGLang's native HTTP protocol, not of a model.

The toolkit's `stub` engine runs this for dry runs on CPU nodes and as the test suite's engine:

    python -m toolkit.engines.stub_server --model-path DIR --host 127.0.0.1 --port P [options]

It speaks the wire contract of SGLang 0.5.23 (or of 0.5.9 with `--version 0.5.9`): the start-up sequence
(port closed while "loading weights", health 503 during warm-up, then 200), `/generate` with SGLang's
validation errors, response shape, stop-token and finish-reason rules, streaming, batches and `n > 1`,
`/abort_request`, auth, `/metrics` and graceful SIGTERM drain. Outputs are invented, deterministically, from
the job's own tokenizer: English text from Python's help topics as "reasoning", the think-end token, an
answer, sometimes a tool-call section, then EOS (see `plan_output`). Fault injection flags (`--crash-after`,
`--fail-5xx`, `--hang-after`, ...) make it misbehave on purpose. Every log line says it is the stub.

HTTP/1.1 is served by a small asyncio protocol (keep-alive, Content-Length or chunked bodies, pipelining);
JSON goes through msgspec, and a plain `/generate` is answered synchronously with no task per request, so
the server stays cheap next to the client it is benchmarked with.

Modules: config (command line), contract (request validation, sampling params), model (token material and
the output rule), cache (prefix cache), faults (fault injection), http (the connection protocol), server
and responses (StubServer), __main__ (the process).
"""

from __future__ import annotations

from .cache import PrefixCache
from .config import DEFAULT_MAX_RUNNING, LOG_PREFIX, MODELLED, VERSIONS, StubConfig, build_parser, parse_config
from .contract import (SAMPLING_EPS, SAMPLING_FIELDS, TOP_K_ALL, ContractError, RequestError, Sampling,
                       check_contract, make_sampling, verify_sampling)
from .faults import NAN_MATCHED, nan_stop
from .http import Connection, Request
from .model import (CORPUS_CHARS, TOOL_CALLS, TOOL_FORMATS, Item, Segments, StubModel, drop_planned, fake_logprob,
                    finish_item, item_text, output_seed, plan_continuation, plan_output)
from .responses import ABORTED, ABORTED_WAITING
from .server import InFlight, StubServer

__all__ = [
    "ABORTED", "ABORTED_WAITING", "CORPUS_CHARS", "DEFAULT_MAX_RUNNING", "LOG_PREFIX", "MODELLED", "NAN_MATCHED",
    "SAMPLING_EPS", "SAMPLING_FIELDS", "TOOL_CALLS", "TOOL_FORMATS", "TOP_K_ALL", "VERSIONS", "Connection",
    "ContractError", "InFlight", "Item", "PrefixCache", "Request", "RequestError", "Sampling", "Segments",
    "StubConfig", "StubModel", "StubServer", "build_parser", "check_contract", "drop_planned", "fake_logprob",
    "finish_item", "item_text", "make_sampling", "nan_stop", "output_seed", "parse_config", "plan_continuation",
    "plan_output", "verify_sampling",
]
