"""Builders of synthetic runs for the merge, audit and export tests.

A synthetic run is a real run directory: a job spec planned with `plan_job`/`create_run`, prompts rendered with
a real tokenizer's chat template, and shard files written with `ShardWriter` holding records whose outputs are
real token ids (English text encoded by that tokenizer) shaped like a reasoning model's: reasoning, the
think-end id, an answer, the eos id. Only the engine is skipped. Output makers choose the shape per record, so
a test can plant exactly the fault it checks (no think-end, truncation, a wrong count, ...).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from jobfiles import toml_value, write_prompts
from toolkit.formats.manifests import write_done
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import OK, Record, failed_record, pack_ids
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardfile import ShardWriter
from toolkit.job import chat
from toolkit.job.inputs import PromptReader
from toolkit.job.plan import create_run, plan_job
from toolkit.job.schema import JobSpec
from toolkit.job.spec import load_spec

THINKING_KWARGS = {"kimi": {"thinking": True}, "qwen3": {"enable_thinking": True}, "deepseek": {}}


@dataclass
class Out:
    """One generated output: exact ids, finish type, matched stop."""

    ids: list[int]
    finish: str = "stop"
    matched: int | str | None = None
    completion_tokens: int | None = None  # None: len(ids)


@dataclass
class Synth:
    rd: RunDir
    plan: RunPlan
    refs: list[PromptRef]
    tok: Any
    info: chat.TokenInfo
    pool: np.ndarray  # English text as token ids, control ids removed
    prompt_ids: list[list[int]]  # rendered prompt of each planned position
    written: dict[str, Record] = field(
        default_factory=dict
    )  # the record kept per id (what merge must output)

    @property
    def root(self) -> Path:
        return self.rd.root

    @property
    def eos(self) -> int:
        return self.info.eos_ids[0]

    def text(self, rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(0, len(self.pool) - n)
        return self.pool[start : start + n].tolist()


_POOLS: dict[tuple[str, int], np.ndarray] = {}


def text_pool(tok: Any, key: str, chars: int = 120_000) -> np.ndarray:
    """The first `chars` characters of English text that ships with Python, as token ids without control tokens."""
    from toolkit.stub.toy_tokenizer import corpus

    if (key, chars) not in _POOLS:
        ids = np.array(
            tok("".join(corpus())[:chars], add_special_tokens=False)["input_ids"], np.uint32
        )
        _POOLS[key, chars] = ids[~np.isin(ids, list(tok.added_tokens_decoder))]
    return _POOLS[key, chars]


def planned_refs(rd: RunDir) -> list[PromptRef]:
    """Every planned prompt ref of a run, in planned order (opened read-only)."""
    return Run.open(rd.root, JobSpec).prompts().refs()


def plan_run(
    tmp: Path,
    tokenizer: Path,
    family: str = "kimi",
    *,
    datasets: dict[str, int] | None = None,
    shards: int = 3,
    audit: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    pool_chars: int = 120_000,
    extra: Callable[[int], dict[str, Any]] | None = None,
) -> Synth:
    """Plan a run in `tmp/run` with one prompt file per dataset ({name: prompts}); no shard written yet. `extra(i)`:
    more fields of line i of each file."""
    datasets = datasets or {"math": 10, "chat": 8}
    tmp.mkdir(parents=True, exist_ok=True)
    m = {"path": str(tokenizer), "chat_template_kwargs": THINKING_KWARGS[family], **(model or {})}
    lines = [f'name = "synthetic-{family}"', f'output_dir = "{tmp / "run"}"', "[model]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in m.items()]
    lines += ["[engine]", 'kind = "stub"', "[sampling]"]
    lines += [
        f"{k} = {toml_value(v)}" for k, v in {"max_new_tokens": 4096, **(sampling or {})}.items()
    ]
    lines += ["[sharding]", f"shards = {shards}"]
    if audit:
        lines += ["[audit]"] + [f"{k} = {toml_value(v)}" for k, v in audit.items()]
    for name, n in datasets.items():
        path = write_prompts(
            tmp / f"{name}.jsonl",
            n,
            prefix=f"{name}-",
            tools_every=4 if name == "tools" else 0,
            extra=extra,
        )
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{path}"']
    job = tmp / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    spec = load_spec(job)
    plan, refs = plan_job(spec)
    rd = create_run(plan, refs)
    tok = chat.load_tokenizer(spec.model)
    info = chat.token_info(tok, spec.model)
    with PromptReader() as reader:
        prompts = [
            reader.read(
                plan.datasets[r.dataset].path,
                plan.datasets[r.dataset].name,
                r.line,
                r.offset,
                r.length,
            )
            for r in planned_refs(rd)
        ]
    pool = text_pool(tok, str(tokenizer), pool_chars)
    return Synth(rd, plan, refs, tok, info, pool, chat.render_many(tok, spec.model, prompts))


# ---------------------------------------------------------------------------------------------------
# output makers: (synth, planned position, rng) -> Out
# ---------------------------------------------------------------------------------------------------
OutputMaker = Callable[[Synth, int, random.Random], Out]


def _opens(s: Synth) -> bool:
    return s.info.opens_reasoning


def healthy(
    reasoning: tuple[int, int] = (30, 120), content: tuple[int, int] = (10, 60)
) -> OutputMaker:
    """Reasoning, think-end, answer, eos; a think-start first when the template does not open reasoning."""

    def make(s: Synth, pos: int, rng: random.Random) -> Out:
        head = [] if _opens(s) else [s.info.think_start_id]
        ids = (
            head
            + s.text(rng, rng.randint(*reasoning))
            + [s.info.think_end_id]
            + s.text(rng, rng.randint(*content))
        )
        return Out(ids + [s.eos], "stop", s.eos)

    return make


def no_think_end(s: Synth, pos: int, rng: random.Random) -> Out:
    """The seed's failure: the model answers and stops, no think-end anywhere."""
    return Out(s.text(rng, rng.randint(40, 150)) + [s.eos], "stop", s.eos)


def truncated(s: Synth, pos: int, rng: random.Random) -> Out:
    """Cut by max_new_tokens while reasoning."""
    return Out(s.text(rng, 200), "length", None)


def mix(default: OutputMaker, **by_pos: OutputMaker) -> OutputMaker:
    """`default`, except at the planned positions given as keyword `p<pos>`."""
    table = {int(k[1:]): v for k, v in by_pos.items()}
    return lambda s, pos, rng: table.get(pos, default)(s, pos, rng)


def record(
    s: Synth,
    pos: int,
    out: Out | None,
    *,
    error: str | None = None,
    attempts: int = 1,
    failure: str | None = "rejected",
) -> Record:
    """The Record the worker would write for planned position `pos` (failed when `out` is None)."""
    ref = s.refs[pos]
    ds = s.plan.datasets[ref.dataset].name
    if out is None:
        return failed_record(
            ref.id, ds, pos, s.prompt_ids[pos], error or "server error 500: boom", attempts, failure
        )
    re_, tc = None, None
    if s.info.think_end_id in out.ids:
        re_ = out.ids.index(s.info.think_end_id)
    if s.info.tool_call_start_id is not None and s.info.tool_call_start_id in out.ids:
        tc = out.ids.index(s.info.tool_call_start_id)
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=OK,
        prompt_ids=pack_ids(s.prompt_ids[pos]),
        output_ids=pack_ids(out.ids),
        reasoning_end=re_,
        tool_call_at=tc,
        finish=out.finish,
        matched_stop=out.matched,
        prompt_tokens=len(s.prompt_ids[pos]),
        completion_tokens=len(out.ids) if out.completion_tokens is None else out.completion_tokens,
        cached_tokens=pos % 5,
        latency_s=round(0.5 + (pos % 7) * 0.1, 3),
        attempts=attempts,
    )


def write_shard(
    s: Synth, k: int, records: Iterable[Record], *, done: bool = True, flush_records: int = 4
) -> Path:
    """Append `records` to shard k's file in the given order (frames of `flush_records`); then its done manifest."""
    path = s.rd.shard_file(k)
    sp = s.plan.shards[k]
    w = ShardWriter(path, s.plan.fingerprint, k, flush_records=flush_records)
    w.open(range(sp.first, sp.first + sp.count))
    try:
        for r in records:
            w.add(r)
    finally:
        w.close()
    if done:
        write_done(
            s.rd.done_file(k),
            path,
            k,
            s.plan.fingerprint,
            positions=range(sp.first, sp.first + sp.count),
        )
    return path


def completion_order(recs: list[Record], rng: random.Random, window: int | None) -> list[Record]:
    """Records in the order a worker finishes them: each moves by up to `window` positions (its concurrency);
    None shuffles completely, 0 keeps the planned order."""
    if window is None:
        recs = list(recs)
        rng.shuffle(recs)
        return recs
    return sorted(recs, key=lambda r: r.index + rng.random() * window)


def write_run(
    s: Synth,
    outputs: OutputMaker | None = None,
    *,
    seed: int = 0,
    window: int | None = 8,
    done: bool | Iterable[int] = True,
    skip: Iterable[int] = (),
    failed: Iterable[int] = (),
    flush_records: int = 4,
    edit: Callable[[Record], Record] | None = None,
) -> dict[str, Record]:
    """Write every shard, records in completion order (see `completion_order`); `done` True/False or the shards
    that get a done manifest; `skip` planned positions never written; `failed` positions written as failed;
    `edit` changes each record before it is written (to plant a fault)."""
    outputs = outputs or healthy()
    rng = random.Random(seed)
    skip, failed = set(skip), set(failed)
    done_set = (
        set(range(len(s.plan.shards))) if done is True else set() if done is False else set(done)
    )
    for sp in s.plan.shards:
        recs = []
        for pos in range(sp.first, sp.first + sp.count):
            if pos in skip:
                continue
            rec = record(s, pos, None if pos in failed else outputs(s, pos, rng))
            if edit is not None:
                rec = edit(rec)
            recs.append(rec)
            s.written[rec.id] = rec
        recs = completion_order(recs, rng, window)
        write_shard(s, sp.index, recs, done=sp.index in done_set, flush_records=flush_records)
    return s.written


def comparable(r: Record) -> bytes:
    return msgspec.msgpack.encode(r)


def each_id_once(rd: RunDir, shards: int, n: int) -> list[Record]:
    """Assert that the shard files of a run of prompts p0000 .. p{n-1} hold each id once: its newest record ok,
    every older one a partial output that it continued. The records written, in file order."""
    from toolkit.formats.frames import read_shard

    written = [rec for k in range(shards) for rec in read_shard(rd.shard_file(k))]
    newest = {rec.id: rec for rec in written}
    assert sorted(newest) == [f"p{i:04d}" for i in range(n)] and all(
        x.status == "ok" for x in newest.values()
    )
    assert all(rec.status == "partial" for rec in written if newest[rec.id] is not rec), (
        "each id once"
    )
    return written
