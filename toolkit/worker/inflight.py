"""One prompt's requests: fresh rids per attempt, continuations across aborts (input_ids = prompt +
output so far, `segments` counting the requests that brought output) sent to the data-parallel rank
that holds the output so far, repetition loops stopped between segments, the partial outputs kept
at a stop, and the records of what came back. `consume` is one request slot of a shard: it takes
prompts from the shard's feed until the feed is empty or the shard stops; `save_in_flight` keeps the
partial outputs of every open shard at a stop."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import numpy as np

from toolkit.engines.base import EngineDied, EngineUnreachable
from toolkit.engines.client import (
    ClientError,
    HttpClient,
    RequestRejected,
    ServerError,
    TimedOut,
    Unreachable,
)
from toolkit.engines.endpoints import GenerateResult, abort_requests, generate, health_generate
from toolkit.engines.rids import make_rid
from toolkit.formats.loops import repetition_loop
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import (
    ABORTED,
    FAILED,
    LOOP,
    NAN,
    NAN_MATCHED,
    OK,
    PARTIAL,
    TIMEOUT,
    TRANSIENT,
    Record,
    failed_record,
    pack_ids,
    split_output,
)
from toolkit.worker.feed import Feed
from toolkit.worker.shard import Batch, Shard, health_timeout

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

ABORT_GRACE_S = 30.0  # after a stop's abort, how long the partial outputs may take to come back
# _answer: the request failed while the engine failed every request; no try, the prompt goes again
AGAIN = "again"


def rid_maker(sh: Shard, pos: int, sample: int, made: list[str]):
    """A fresh rid per HTTP attempt (engines/rids: one width, so an abort by rid never takes another
    request with it; naming the sample asked for)."""

    def make() -> str:
        sh.rid_seq += 1
        rid = make_rid(sh.rid_tag, sh.shard, pos, sample, sh.rid_seq)
        made.append(rid)
        sh.rids.add(rid)
        return rid

    return make


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


class _Unanswered:
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


class _Generated:
    """The outcome of _generate: the (combined) result, how many requests it took, whether it is
    partial, and the continuation requests' input and cached tokens (`continued`)."""

    __slots__ = ("res", "segments", "partial", "continued")

    def __init__(
        self, res: GenerateResult, segments: int, partial: bool, continued: tuple[int, int] = (0, 0)
    ):
        self.res, self.segments, self.partial = res, segments, partial
        self.continued = continued


async def _generate(
    sh: Shard,
    ids: list[int],
    ds: str,
    ref,
    engine,
    pos: int = 0,
    prior: Record | None = None,
    wait: _Unanswered | None = None,
    rank: int | None = None,
):
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
    out = np.frombuffer(prior.output_ids, dtype="<u4").copy() if prior else np.zeros(0, dtype="<u4")
    segments = prior.segments if prior else 0
    attempts = prior.attempts if prior else 0
    latency = prior.latency_s if prior else 0.0
    cached = prior.cached_tokens if prior else None
    if prior is not None:
        rank = prior.dp_rank
    # continuation requests: their input tokens, and those found in the prefix cache
    cont = [prior.continued_tokens, prior.continued_cached] if prior else [0, 0]
    stalled = 0
    res = None
    seg = segment_tokens(c, params)
    sent = _SentIds(ids, out)
    try:
        while True:
            sp = continued_params(params, len(out))
            # already at max_new_tokens: what an uninterrupted request would have ended with
            if sp is None:
                res = GenerateResult(
                    output_ids=out,
                    finish="length",
                    matched=None,
                    prompt_tokens=len(ids),
                    completion_tokens=len(out),
                    cached_tokens=cached or 0,
                    latency_s=latency,
                    attempts=attempts,
                    dp_rank=rank,
                )
                return _Generated(res, max(segments, 1), False, tuple(cont))
            capped = seg is not None and sp.get("max_new_tokens", 0) > seg
            if capped:  # one segment: the loop check below, then on from prompt + output so far
                sp = {**sp, "max_new_tokens": seg}
                if sp.get("min_new_tokens", 0) > seg:
                    sp["min_new_tokens"] = seg
            sh.in_flight += 1
            made: list[str] = []
            timeout = request_timeout(c, sp.get("max_new_tokens"), params.get("max_new_tokens"))
            if wait is not None:
                wait.try_s = (c.retries + 1) * timeout
            try:
                res = await generate(
                    sh.http,
                    ids,
                    sp,
                    rid=rid_maker(sh, pos, ref.sample, made),
                    timeout=timeout,
                    retries=c.retries,
                    backoff_s=c.backoff_s,
                    backoff_max_s=c.backoff_max_s,
                    engine_alive=engine.alive,
                    expect=sh.expect,
                    input_json=sent.json() if len(out) else None,
                    n_input=len(ids) + len(out),
                    routed_dp_rank=pinned_rank(rank, sh.dp_ranks),
                )
            finally:
                sh.in_flight -= 1
                sh.rids.difference_update(made)
            sh.last_answer = time.monotonic()
            attempts += res.attempts
            latency += res.latency_s
            new = res.output_ids
            sh.tokens += len(new)
            if cached is None:
                cached = res.cached_tokens
            if len(out):
                cont[0] += len(ids) + len(out)
                cont[1] += res.cached_tokens
            if res.dp_rank is not None:
                rank = res.dp_rank
            if len(new):
                if wait is not None:
                    wait.since, wait.answered = time.monotonic(), True
                segments += 1
                out = np.concatenate([out, new]) if len(out) else new
                sent.add(res.output_json, new)
            if segments > 1 or prior is not None:
                res = GenerateResult(
                    output_ids=out,
                    finish=res.finish,
                    matched=res.matched,
                    prompt_tokens=len(ids),
                    completion_tokens=len(out),
                    cached_tokens=cached,
                    latency_s=round(latency, 4),
                    attempts=attempts,
                    dp_rank=rank,
                )
            else:
                res.attempts, res.dp_rank = attempts, rank
            # a segment's end, not the output's
            if capped and res.finish == "length" and len(new) == seg:
                stalled = 0
                period = repetition_loop(out, c.loop_window, c.loop_max_period, c.loop_match)
                if period is None:
                    # kept as a partial output, continued by the next run of the shard
                    if sh.stopping:
                        return _Generated(res, segments, True, tuple(cont))
                    continue
                res.finish, res.matched = LOOP, None
                sh.progress.loops_stopped += 1
                log.info(
                    "prompt %s: a repetition loop (a span of %d ids repeated) after %d generated "
                    "tokens: stopped there, %d tokens short of max_new_tokens",
                    ref.id,
                    period,
                    len(out),
                    params["max_new_tokens"] - len(out),
                )
                return _Generated(res, segments, False, tuple(cont))
            if res.finish != "abort":
                return _Generated(res, max(segments, 1), False, tuple(cont))
            if sh.stopping:
                return _Generated(res, segments, True, tuple(cont))
            if not len(new):
                stalled += 1
                if stalled > c.retries:
                    return _Generated(res, segments, len(out) > 0, tuple(cont))
            log.warning(
                "prompt %s aborted by the server (%s) after %d tokens; %s",
                ref.id,
                res.matched,
                len(out),
                "continuing from there" if len(out) else "retrying",
            )
    except BaseException:
        # Unanswered (engine died, cancelled): what was generated so far is continued when it is
        # sent again.
        if len(out) > (prior.n_output if prior else 0) and res is not None:
            sh.partial[ref.id] = _partial_record(
                ref, ds, pos, ids, _Generated(res, segments, True, tuple(cont)), None
            )
        elif prior is not None:
            sh.partial[ref.id] = prior
        raise


def _partial_record(
    ref: PromptRef, ds: str, pos: int, ids: list[int], g: _Generated, info
) -> Record:
    """A PARTIAL record: the output so far of a request stopped mid-way, continued by the next
    run."""
    res, out = g.res, g.res.output_ids
    reasoning_end, tool_call_at = (
        split_output(out, info.think_end_id, info.tool_call_start_id) if info else (None, None)
    )
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=PARTIAL,
        prompt_ids=pack_ids(ids),
        output_ids=out.tobytes(),
        reasoning_end=reasoning_end,
        tool_call_at=tool_call_at,
        finish="abort",
        matched_stop=None,
        prompt_tokens=len(ids),
        completion_tokens=len(out),
        cached_tokens=res.cached_tokens,
        latency_s=round(res.latency_s, 4),
        attempts=res.attempts,
        error=f"stopped after {len(out)} generated tokens; continued from there on the next run of "
        "the shard",
        failure=PARTIAL,
        segments=g.segments,
        dp_rank=res.dp_rank,
        continued_tokens=g.continued[0],
        continued_cached=g.continued[1],
    )


async def consume(sh: Shard, feed: Feed, engine, info) -> None:
    """One request slot: take prompts from the feed and record what comes back, until the feed is
    empty or the shard stops. A prompt whose failure may pass is tried again here, after a backoff,
    up to client.max_tries tries in all (counted in its records: `_settle`); then its failure is
    final for the run."""
    while True:
        # stopping, or fewer in flight wanted (pool)
        if sh.stopping or sh.batch.live > sh.batch.target:
            return
        item = await feed.get()
        if item is None or sh.stopping:
            return
        if item.error is not None:
            kind, message = item.error
            ds = sh.plan.datasets[item.ref.dataset].name
            sh.add(failed_record(item.ref.id, ds, item.pos, item.ids or [], message, 0, kind))
            continue
        try:
            # bounded: every failed try counts (sh.tries), the last one is final (_settle)
            while True:
                rec = await _answer(sh, item, engine, info)
                if rec is AGAIN:  # the engine's failure, not the prompt's: no try counted
                    if _stopped(sh):
                        break
                    continue
                if rec is None or not await _settle(sh, rec):
                    break
        # cancelled, or the engine died: the prompt goes out again after the restart
        except BaseException:
            feed.redo.append(item)
            raise


async def _answer(sh: Shard, item, engine, info) -> Record | str | None:
    """One try of a prompt: its record, None when what came back is a partial output (recorded
    here), or AGAIN when its request failed because the engine failed every request at the time
    (worker.enginecheck): that is no try of the prompt."""
    pos, ref, ids = item.pos, item.ref, item.ids
    ds = sh.plan.datasets[ref.dataset].name
    prior = _prior(sh, ref.id, ids)
    wait = _Unanswered()
    try:
        res = await _generate(sh, ids, ds, ref, engine, pos, prior, wait, item.dp_rank)
    except asyncio.CancelledError:
        if _stopped(sh):  # a stop cut the try short: its time without an answer is kept
            keep_unanswered(sh, ref, ds, pos, ids, prior, wait)
        raise
    except RequestRejected as e:
        sh.last_answer = time.monotonic()
        return failed_record(ref.id, ds, pos, ids, str(e), e.attempts, e.kind)
    except ClientError as e:  # not answered, a 5xx, or an answer that breaks the protocol
        if not engine.alive():
            raise EngineDied(str(e)) from None  # (the item goes back to the feed: see consume)
        check = getattr(sh.session, "check", None)
        engine_wide = isinstance(e, ServerError) or (
            isinstance(e, Unreachable) and not isinstance(e, TimedOut)
        )
        if engine_wide and check is not None and await check.unwell(f"prompt {ref.id}: {e}"):
            return AGAIN
        message = str(e)
        if isinstance(e, Unreachable) and not isinstance(e, TimedOut):
            # raises EngineUnreachable for a dead engine
            message = await _poisoned(sh, engine, ref.id, e)
        # unreachable: one request's connection cut
        return failed_record(ref.id, ds, pos, ids, message, e.attempts, e.kind)
    # the server's aborts ran out without progress: a failed try (aborted)
    if res.partial and not sh.stopping:
        return _result_record(ref, ds, pos, ids, res.res, info, res.segments, res.continued)
    if res.partial:
        if res.res.completion_tokens > (prior.n_output if prior else 0):
            rec = _partial_record(ref, ds, pos, ids, res, info)
            rec.tries = sh.tries.get(ref.id, 0)
            sh.add(rec)
            sh.progress.partial_saved += 1
        else:  # aborted at the stop with nothing new: its time without an answer is kept
            keep_unanswered(sh, ref, ds, pos, ids, prior, wait)
        return None
    return _result_record(ref, ds, pos, ids, res.res, info, res.segments, res.continued)


def _stopped(sh: Shard) -> bool:
    """Whether the shard is stopping (a stop signal, a handover), with or without saving."""
    return sh.stopping or (sh.session is not None and sh.session.stop.is_set())


def keep_unanswered(
    sh: Shard, ref, ds: str, pos: int, ids: list[int], prior: Record | None, wait: _Unanswered
) -> None:
    """At a stop, a prompt whose try was cut short without an answer: the time it waited (added to
    what its partial record carried, unless output came meanwhile) counts — each try's bound of it
    (retries + 1 request timeouts) as one try — and what is left is carried by a PARTIAL record
    (Record.unanswered_s) to the next run of the shard, in whatever task. Past [client] max_tries it
    is a final timeout, as a try that ran to its end would have been."""
    c = sh.spec.client
    carried = 0.0 if wait.answered or prior is None else prior.unanswered_s
    waited = carried + time.monotonic() - wait.since
    if wait.try_s <= 0 or waited < 1.0:
        return
    kept = sh.partial.pop(ref.id, None) or prior
    tries = sh.tries.get(ref.id, 0)
    counted = int(waited // wait.try_s)
    if tries + counted >= c.max_tries:
        rec = failed_record(
            ref.id,
            ds,
            pos,
            ids,
            f"failed {_times(c.max_tries)}: timeout; last: no answer in {waited:.0f} s in flight, "
            f"cut short by a stop; every {wait.try_s:g} s in flight without an answer (a try's "
            "bound), across stops, counts as a try",
            kept.attempts if kept else 0,
            TIMEOUT,
        )
        rec.tries, rec.final = c.max_tries, True
        sh.tries.pop(ref.id, None)
        log.warning(
            "prompt %s (%s): no answer in %.0f s in flight across stops: final for this "
            "run after %s",
            ref.id,
            ds,
            waited,
            _times(c.max_tries),
        )
    else:
        rec = _empty_partial(ref, ds, pos, ids) if kept is None else msgspec.structs.replace(kept)
        rec.tries, rec.unanswered_s = tries + counted, round(waited - counted * wait.try_s, 3)
        if counted:
            sh.tries[ref.id] = rec.tries
            log.warning(
                "prompt %s (%s): no answer in %.0f s in flight, its try cut short by a "
                "stop: counted as %s ([client] max_tries = %d)",
                ref.id,
                ds,
                waited,
                f"try {rec.tries}" if counted == 1 else f"tries up to {rec.tries}",
                c.max_tries,
            )
    sh.add(rec)


def _empty_partial(ref: PromptRef, ds: str, pos: int, ids: list[int]) -> Record:
    """A PARTIAL record with no output: what it carries (tries, unanswered_s) to the next run."""
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=PARTIAL,
        prompt_ids=pack_ids(ids),
        output_ids=b"",
        reasoning_end=None,
        tool_call_at=None,
        finish="abort",
        matched_stop=None,
        prompt_tokens=len(ids),
        completion_tokens=0,
        cached_tokens=0,
        latency_s=0.0,
        attempts=0,
        error="stopped before any answer; the time it waited counts on the next run of the shard",
        failure=PARTIAL,
        segments=0,
    )


async def _settle(sh: Shard, rec: Record) -> bool:
    """Record one try's outcome; whether to try the prompt again (after the backoff, already
    waited). A failure that may pass counts one more try of its id (Record.tries); at
    client.max_tries it is final for this run. A stop during the backoff leaves the try recorded as
    it is: the next run of the shard goes on counting from it."""
    c = sh.spec.client
    if rec.status == OK or rec.failure not in TRANSIENT:
        sh.add(rec)
        sh.tries.pop(rec.id, None)
        return False
    tries = rec.tries = sh.tries.get(rec.id, 0) + 1
    if tries >= c.max_tries:
        rec.final = True
        rec.error = f"failed {_times(tries)}: {rec.failure}; last: {rec.error}"
        sh.add(rec)
        sh.tries.pop(rec.id, None)
        return False
    sh.tries[rec.id] = tries
    delay = min(c.backoff_max_s, c.backoff_s * 2 ** (tries - 1))
    sh.add(rec, settled=False)
    log.warning(
        "prompt %s (%s) failed (%s), try %d of %d ([client] max_tries): %s; trying again in %.1f s",
        rec.id,
        rec.dataset,
        rec.failure,
        tries,
        c.max_tries,
        rec.error,
        delay,
    )
    return await _backoff(sh, delay)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


async def _backoff(sh: Shard, seconds: float) -> bool:
    """Wait `seconds` unless the shard stops meanwhile; whether it did not stop."""
    deadline = time.monotonic() + seconds
    while not sh.stopping and (left := deadline - time.monotonic()) > 0:  # bounded by the deadline
        await asyncio.sleep(min(0.1, left))
    return not sh.stopping


async def _poisoned(sh: Shard, engine, id: str, e: Unreachable) -> str:
    """A request whose connection failed past its retries: one poisoned request (the engine still
    generates: /health_generate answers 200), whose failure is recorded and the shard goes on — the
    message saying so — or an engine that cannot be reached (EngineUnreachable: the shard cannot
    finish in this task)."""
    http = HttpClient(engine.url, api_key=engine.api_key, max_connections=1)
    try:
        why = await health_generate(http, timeout=health_timeout(sh.spec.engine.hang_timeout_s))
    finally:
        http.close()
    if why is not None:
        if await _ends_within(engine, DYING_S):
            raise EngineDied(f"engine exited with code {engine.exit_code()}") from None
        raise EngineUnreachable(
            f"engine at {engine.url} unreachable: prompt {id} got no answer after {e.attempts} "
            f"attempts ({e}), and /health_generate {why}"
        ) from None
    return (
        f"no complete answer after {e.attempts} attempts ({e}), while the engine answers "
        "/health_generate: only this request fails"
    )


# A dying engine refuses connections before its process ends: a multi-node engine whose rank died is
# ended by srun (--kill-on-bad-exit), seconds after rank 0 closed its port. Waited for before
# calling it unreachable.
DYING_S = 30.0


async def _ends_within(engine, seconds: float) -> bool:
    """Whether the engine's process ends within `seconds` (at once if it has ended)."""
    deadline = time.monotonic() + seconds
    while engine.alive():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def _prior(sh: Shard, id: str, ids: list[int]) -> Record | None:
    """The PARTIAL record to continue for this prompt, if any (and if it was made from the same
    prompt ids)."""
    prior = sh.partial.pop(id, None)
    if prior is not None and prior.prompt_ids != pack_ids(ids):
        log.warning(
            "prompt %s: its partial output was made from other prompt ids; generating it from "
            "scratch",
            id,
        )
        return None
    return prior


def _result_record(
    ref: PromptRef,
    ds: str,
    pos: int,
    ids: list[int],
    res,
    info,
    segments: int = 1,
    continued: tuple[int, int] = (0, 0),
) -> Record:
    """The record of a 200 answer: ok, or failed when the server aborted it or hit SGLang's NaN
    stop."""
    out = res.output_ids
    reasoning_end, tool_call_at = split_output(out, info.think_end_id, info.tool_call_start_id)
    failure = error = None
    if res.finish == "abort":
        failure, error = ABORTED, "aborted by the server"
    elif res.finish == "stop" and res.matched == NAN_MATCHED:
        failure = NAN
        error = (
            f"SGLang's NaN stop (finish_reason matched {NAN_MATCHED!r}): a token sampled from NaN "
            f"logits was replaced by a stop id after {len(out) - 1} tokens; the output is not the "
            "model's"
        )
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=OK if failure is None else FAILED,
        prompt_ids=pack_ids(ids),
        output_ids=out.tobytes(),
        reasoning_end=reasoning_end,
        tool_call_at=tool_call_at,
        finish=res.finish,
        matched_stop=res.matched,
        prompt_tokens=res.prompt_tokens,
        completion_tokens=res.completion_tokens,
        cached_tokens=res.cached_tokens,
        latency_s=res.latency_s,
        attempts=res.attempts,
        error=error,
        failure=failure,
        segments=segments,
        dp_rank=res.dp_rank,
        continued_tokens=continued[0],
        continued_cached=continued[1],
    )


async def save_in_flight(batch: Batch, stop: asyncio.Event, engine) -> None:
    """On a stop request: send nothing new from any open shard, abort every request in flight so
    that each comes back with its partial output (recorded PARTIAL by the consumers of its own
    shard, continued next time), and return after ABORT_GRACE_S (the session's loop ends earlier,
    once every shard's consumers are back). The engine is still up (it ignores SIGUSR2; the worker
    stops it afterwards)."""
    await stop.wait()
    for sh in batch.shards:
        sh.stopping = True
        if sh.feed is not None:
            sh.feed.close()
    n = batch.in_flight
    if n:
        # abort_all would also end other clients' requests on a shared server
        owned = engine.kind != "external"
        log.warning(
            "stopping: aborting the %d requests in flight (%s) to keep their partial outputs",
            n,
            "abort_all" if owned else "by rid",
        )
        http = HttpClient(engine.url, api_key=engine.api_key, max_connections=1)
        try:
            rids = None if owned else sorted(r for sh in batch.shards for r in sh.rids)
            await abort_requests(http, rids)
        except Unreachable as e:
            log.warning(
                "could not abort the requests in flight (%s): their outputs are generated again", e
            )
            return
        finally:
            http.close()
    deadline = time.monotonic() + ABORT_GRACE_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.warning(
        "%d requests still unanswered %.0f s after the abort: generated again next time",
        batch.in_flight,
        ABORT_GRACE_S,
    )
