"""One prompt's /generate, continued across aborts and segments: fresh rids per attempt
(worker.requests), continuations (input_ids = prompt + output so far, `segments` counting the
requests that brought output) sent to the data-parallel rank that holds the output so far,
repetition loops stopped between segments ([client] loop_stop), and each request's timeout. What
comes back becomes a record in worker.answers; worker.inflight sends the prompts of a shard."""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np

from toolkit.engines.endpoints import GenerateResult, generate
from toolkit.formats.loops import repetition_loop
from toolkit.formats.records import LOOP, Record
from toolkit.worker.answers import Generated, partial_record
from toolkit.worker.openshard import Shard

__all__ = [
    "Unanswered",
    "continued_params",
    "generate_output",
    "pinned_rank",
    "request_timeout",
    "segment_tokens",
]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger


def continued_params(params: dict, done: int) -> dict | None:
    """The sampling_params that go on from `done` tokens already generated (None: the budget is used
    up)."""
    if not done:
        return params
    params = dict(params)
    left = params["max_new_tokens"] - done
    if left <= 0:
        return None
    params["max_new_tokens"] = left
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, params["min_new_tokens"] - done)
    return params


# Sampling params under which an output continued from prompt + output so far is not the output of
# one request: SGLang matches stop strings and regexes in the new output's text only, starts a
# grammar at the output's start, and counts the penalties' tokens and a custom logit processor's
# state over the new output only.
_UNSEGMENTED = (
    "stop",
    "stop_regex",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
)
_PENALTIES = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0))


def segment_tokens(client, params: dict) -> int | None:
    """The most new tokens one request of these sampling params asks for, so that a repetition loop
    is looked for between segments ([client] loop_stop, segment_tokens); None: the output is asked
    for in one request (loop stop off, or params under which a segmented output would not be the
    same output)."""
    if not client.loop_stop:
        return None
    if any(params.get(k) for k in _UNSEGMENTED):
        return None
    if any(params.get(k, neutral) not in (None, neutral) for k, neutral in _PENALTIES):
        return None
    return client.segment_tokens


MIN_TIMEOUT_S = 300.0  # the least a request may take ([client] request_timeout_s when smaller)


def request_timeout(client, asked: int | None, full: int | None) -> float:
    """The timeout of one request asking for `asked` new tokens of a prompt whose output may have
    `full`: [client] request_timeout_s bounds an answer of the whole max_new_tokens; a request
    that asks for a part of it (a segment of segment_tokens, a continuation) gets that part's share,
    never less than MIN_TIMEOUT_S (or request_timeout_s when smaller)."""
    t = client.request_timeout_s
    if not asked or not full or asked >= full:
        return t
    return max(min(t, MIN_TIMEOUT_S), t * asked / full)


class Unanswered:
    """How long a prompt's requests have gone without an answer that brought output, in this run
    (`since`), and the bound of one try of the request it waits for (`try_s`: retries + 1 times its
    timeout)."""

    __slots__ = ("since", "try_s", "answered")

    def __init__(self):
        self.since, self.try_s, self.answered = time.monotonic(), 0.0, False


class _SentIds:
    """A continuation's input_ids (prompt + output so far) as JSON text, made of the prompt's
    encoded once and of each answer's output_ids as the server wrote them: sending prompt + output
    again costs a join, not an encode."""

    __slots__ = ("parts", "empty")

    def __init__(self, prompt: list[int], out: np.ndarray):
        self.parts = [msgspec.json.encode(prompt)[:-1]]  # '[1,2,3' : closed by json()
        self.empty = not prompt
        if len(out):
            self.add(None, out)

    def add(self, raw: bytes | None, new: np.ndarray) -> None:
        """Append `new` output ids; `raw`: their JSON array text from the answer (None: encoded
        here)."""
        body = (raw if raw is not None else msgspec.json.encode(new.tolist())).strip()[1:-1].strip()
        if body:
            self.parts.append(body if self.empty else b"," + body)
            self.empty = False

    def json(self) -> bytes:
        return b"".join(self.parts) + b"]"


def pinned_rank(rank: int | None, ranks: int) -> int | None:
    """The data-parallel rank to send a continuation to: the one whose prefix cache holds its
    output so far, as SGLang said it (`rank`), while the engine has that rank (`ranks`, from
    /server_info at the engine's start: a restart with fewer ranks drops the pins past them). None:
    not pinned (a new output, an engine without data parallelism, a rank the engine lacks)."""
    if rank is None or ranks <= 1 or not 0 <= rank < ranks:
        return None
    return rank


class _Output:
    """A prompt's output so far, across its requests: the ids, the requests that brought output
    (`segments`), their attempts and latency summed, the prefix-cache hits of the first, the
    data-parallel rank that holds it, the continuation requests' input and cached tokens, the
    input_ids of the next continuation (`sent`), and the last answer combined with the ones before
    (`res`)."""

    def __init__(self, ids: list[int], prior: Record | None, rank: int | None):
        self.ids = ids
        p = prior
        self.out = np.frombuffer(p.output_ids, dtype="<u4").copy() if p else np.zeros(0, "<u4")
        self.segments = p.segments if p else 0
        self.attempts = p.attempts if p else 0
        self.latency = p.latency_s if p else 0.0
        self.cached = p.cached_tokens if p else None
        self.rank = p.dp_rank if p is not None else rank
        # continuation requests: their input tokens, and those found in the prefix cache
        self.cont = [p.continued_tokens, p.continued_cached] if p else [0, 0]
        self.combined = p is not None  # the answer is more than one request's
        self.sent = _SentIds(ids, self.out)
        self.res: GenerateResult | None = None

    def at_limit(self) -> Generated:
        """Already at max_new_tokens: what an uninterrupted request would have ended with."""
        self.res = self._result("length", None, self.cached or 0, self.latency)
        return self.generated(False, at_least_one=True)

    def take(self, res: GenerateResult, wait: Unanswered | None) -> np.ndarray:
        """One request's answer added to the output so far; its new output ids."""
        new, n_ids, done = res.output_ids, len(self.ids), len(self.out)
        self.attempts += res.attempts
        self.latency += res.latency_s
        if self.cached is None:
            self.cached = res.cached_tokens
        if done:
            self.cont[0] += n_ids + done
            self.cont[1] += res.cached_tokens
        if res.dp_rank is not None:
            self.rank = res.dp_rank
        if len(new):
            if wait is not None:
                wait.since, wait.answered = time.monotonic(), True
            self.segments += 1
            self.out = np.concatenate([self.out, new]) if done else new
            self.sent.add(res.output_json, new)
        if self.segments > 1 or self.combined:
            res = self._result(res.finish, res.matched, self.cached, round(self.latency, 4))
        else:
            res.attempts, res.dp_rank = self.attempts, self.rank
        self.res = res
        return new

    def _result(self, finish: str, matched, cached: int, latency: float) -> GenerateResult:
        return GenerateResult(
            output_ids=self.out,
            finish=finish,
            matched=matched,
            prompt_tokens=len(self.ids),
            completion_tokens=len(self.out),
            cached_tokens=cached,
            latency_s=latency,
            attempts=self.attempts,
            dp_rank=self.rank,
        )

    def generated(self, partial: bool, *, at_least_one: bool = False) -> Generated:
        segments = max(self.segments, 1) if at_least_one else self.segments
        return Generated(self.res, segments, partial, tuple(self.cont))


def _segment(sp: dict, seg: int | None) -> tuple[dict, bool]:
    """The sampling params of one request, capped at one segment of `seg` new tokens (then the
    loop check, then on from prompt + output so far); whether it was capped."""
    if seg is None or sp.get("max_new_tokens", 0) <= seg:
        return sp, False
    sp = {**sp, "max_new_tokens": seg}
    if sp.get("min_new_tokens", 0) > seg:
        sp["min_new_tokens"] = seg
    return sp, True


async def _request(
    sh: Shard, o: _Output, sp: dict, params: dict, ref, pos: int, engine, wait: Unanswered | None
) -> np.ndarray:
    """One /generate of the output so far (retried on the client's terms), taken into `o`; the new
    output ids."""
    c = sh.spec.client
    sh.requests.sent()
    made: list[str] = []
    timeout = request_timeout(c, sp.get("max_new_tokens"), params.get("max_new_tokens"))
    if wait is not None:
        wait.try_s = (c.retries + 1) * timeout
    done = len(o.out)
    try:
        res = await generate(
            sh.session.http,
            o.ids,
            sp,
            rid=sh.requests.rid_maker(pos, ref.sample, made),
            timeout=timeout,
            retries=c.retries,
            backoff_s=c.backoff_s,
            backoff_max_s=c.backoff_max_s,
            engine_alive=engine.alive,
            expect=sh.expect,
            input_json=o.sent.json() if done else None,
            n_input=len(o.ids) + done,
            routed_dp_rank=pinned_rank(o.rank, sh.dp_ranks),
        )
    finally:
        sh.requests.back(made)
    sh.requests.answered(len(res.output_ids))
    return o.take(res, wait)


async def generate_output(
    sh: Shard,
    ids: list[int],
    ds: str,
    ref,
    engine,
    pos: int = 0,
    prior: Record | None = None,
    wait: Unanswered | None = None,
    rank: int | None = None,
) -> Generated:
    """One prompt's /generate, continued across aborts: an abort that leaves partial output (the
    server's own, or the worker's at a stop) goes on from where it stopped, with input_ids = prompt
    + output so far and max_new_tokens reduced by its length; the combined output is token for token
    what the server produced. An abort that brought nothing new is retried, up to client.retries.
    `prior` is a PARTIAL record to continue. A continuation goes to the data-parallel rank of the
    output so far (`prior`'s, then each answer's meta_info.dp_rank; `rank`: what a new output
    continues, a regenerated turn's turn before it); a new output goes where the server sends it.

    While the worker stops (sh.stopping), the output so far comes back as partial; so it does when
    the aborts without progress run out and there is output to keep."""
    c = sh.spec.client
    params = sh.spec.request_sampling(ds, ref.sample)
    o = _Output(ids, prior, rank)
    seg = segment_tokens(c, params)
    stalled = 0
    try:
        while True:
            sp = continued_params(params, len(o.out))
            if sp is None:
                return o.at_limit()
            sp, capped = _segment(sp, seg)
            new = await _request(sh, o, sp, params, ref, pos, engine, wait)
            res = o.res
            # a segment's end, not the output's
            if capped and res.finish == "length" and len(new) == seg:
                stalled = 0
                if not _looping(sh, o, ref, params):
                    # kept as a partial output, continued by the next run of the shard
                    if sh.stopping:
                        return o.generated(True)
                    continue
                return o.generated(False)
            if res.finish != "abort":
                return o.generated(False, at_least_one=True)
            if sh.stopping:
                return o.generated(True)
            if not len(new):
                stalled += 1
                if stalled > c.retries:
                    return o.generated(len(o.out) > 0)
            log.warning(
                "prompt %s aborted by the server (%s) after %d tokens; %s",
                ref.id,
                res.matched,
                len(o.out),
                "continuing from there" if len(o.out) else "retrying",
            )
    except BaseException:
        # Unanswered (engine died, cancelled): what was generated so far is continued when it is
        # sent again.
        if len(o.out) > (prior.n_output if prior else 0) and o.res is not None:
            sh.requests.keep_partial(
                ref.id, partial_record(ref, ds, pos, ids, o.generated(True), None)
            )
        elif prior is not None:
            sh.requests.keep_partial(ref.id, prior)
        raise


def _looping(sh: Shard, o: _Output, ref, params: dict) -> bool:
    """Whether the output so far ends in a repetition loop: its answer then ends there (LOOP)."""
    c = sh.spec.client
    period = repetition_loop(o.out, c.loop_window, c.loop_max_period, c.loop_match)
    if period is None:
        return False
    o.res.finish, o.res.matched = LOOP, None
    sh.loop_stopped()
    log.info(
        "prompt %s: a repetition loop (a span of %d ids repeated) after %d generated tokens: "
        "stopped there, %d tokens short of max_new_tokens",
        ref.id,
        period,
        len(o.out),
        params["max_new_tokens"] - len(o.out),
    )
    return True
