"""Stand-in SGLang server: a test double of SGLang's native HTTP protocol, not of a model.

The toolkit's `stub` engine runs it for dry runs on CPU nodes and as the test suite's engine:

    python -m toolkit.stub --model-path DIR --host 127.0.0.1 --port P [options]

It speaks the wire contract of SGLang 0.5.23 (or of 0.5.9 with `--version 0.5.9`): the start-up
sequence (port closed while "loading weights", health 503 during warm-up, then 200), `/generate`
with SGLang's validation errors, response shape, stop-token and finish-reason rules, streaming,
batches and `n > 1`, `/abort_request`, auth, `/metrics` and graceful SIGTERM drain. Outputs are
invented, reproducibly, from what the request asks for (a prompt sent again without a sampling_seed
draws another output, as a sampling server does, unless its rid names the sample it asks for:
`planning.Draws`), from the job's own tokenizer: English text from Python's help topics as
"reasoning", the think-end token, an answer, sometimes a tool-call section, then EOS (see
`planning.plan_output`). Fault injection flags (`--crash-after`, `--fail-5xx`, `--hang-after`, ...;
see `faults`) make it misbehave on purpose. For benchmarks, `--token-delay` gives it a GPU's pace
(at most `--max-running-requests` sequences decoding at once, the rest queued),
`--lognormal-lengths` a heavy tail of output lengths, and it reports its batch occupancy
(time-weighted running / max running, from the first request to the last answer) in `/stub/counters`
and in its log at shutdown. Every log line says it is the stub.

Modules: `config` (StubConfig), `command_line` (SGLang's flags and a `--config` file parsed into it)
with `own_flags` (the stub's own), `contract` (request validation), `model` (token material of the
tokenizer), `planning` (what the "model" writes), `outputs` (where an output stops, its text),
`cache` (prefix cache), `scheduler` (running limit, queue, aborts, counters, batch occupancy),
`faults` (fault injection), `server` (state and /generate) with `normalise` (a body read into
items) and `answers` (the bodies sent back), `info` (the other endpoints and the route table), `app`
(the FastAPI routes, served by uvicorn), and `__main__` (the process).
"""

from toolkit.stub.command_line import build_parser, parse_config
from toolkit.stub.config import StubConfig

__all__ = ["StubConfig", "build_parser", "parse_config"]
