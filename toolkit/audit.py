"""Audit: is a merged run complete and faithful? Coverage, reasoning capture, truncation, consistency, statistics.

Everything is checked on token ids (the stored packed uint32 ids, never re-tokenized text); the run's tokenizer
is loaded only for its think / eos ids and to re-render a sample of prompts with the chat template. `Auditor`
accumulates over records in a single pass — the merge feeds it as it writes — with memory in a few bytes per
record; `audit_run` audits an existing merged dataset. Thresholds come from the job's [audit] table: breaking
one fails the audit with a message that says what was seen and what to check.

The checks exist because of a run whose reasoning fields were silently empty for days: outputs that stop
normally without a think-end id mean the reasoning sits in the content, and that must never pass unnoticed.

Checks (name: what must hold; [audit] key):
  coverage                every planned id present exactly once, ok or failed (ids of the rest: missing_ids.txt)
  damaged_frames          no damaged frame in any shard file; shard_checksums: finished files match their manifests
  failed_share            failed / planned <= max_failed_share (ids: failed_ids.txt)
  nan_stop                no output stopped by SGLang on NaN logits (failed records of kind nan, or ok ones of
                          older runs): they end in an EOS the model never wrote
  reasoning_mode          [model] expect_reasoning = true: no prompt the template rendered with reasoning closed,
                          and at least one output really in reasoning mode (no vacuous pass); outputs are counted
                          per mode (opened by the template, opened by the model itself, closed, unknown)
  no_reasoning            expect_reasoning = false instead of the reasoning checks: outputs holding a think token /
                          ok <= max_reasoning_share
  think_end_share         outputs holding the think-end id / ok outputs expected to reason >= min_think_end_share
  stop_without_think_end  outputs finished by a stop token without a think-end / those finished by a stop token
                          <= max_stop_without_think_end_share (the seed's failure)
  empty_reasoning         nothing but blanks before the think-end / outputs with a think-end <= max_empty_reasoning_share
  empty_content           nothing but blanks between think-end and stop / finished outputs with a think-end
                          <= max_empty_content_share
  double_think_start      a think-start in the output although the prompt ends with one / such prompts
                          <= max_double_think_start_share
  length_share            finished by length / ok, per dataset, <= max_length_share
  stop_tokens, token_counts, reasoning_split, vocabulary, prompt_rerender: no exception at all (a `stop` finish
                          ends with its matched id; completion/prompt_tokens equal the ids; reasoning_end is the first
                          think-end; every id inside the tokenizer; `reprompt_sample` prompts re-render identically)
An output is "expected to reason" unless its prompt ends with the think-end id (thinking switched off by the
template). Whitespace-only ids are ignored at the end of prompts and when deciding that a part is empty.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from array import array
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np

from . import chat
from .fmt import utc_now
from .inputs import InputError, PromptReader
from .merge import MERGED, MergeError, MergeManifest, load_manifest, planned_refs
from .plan import RunPlan, check_plan_inputs, load_run
from .rundir import RunDir
from .progress import read_progress
from .records import NAN_MATCHED, OK, Record, is_nan_stop, pack_ids
from .records import ends_with_stop, id_at as _id_at, last_meaningful as _last_meaningful, split_parts
from .turns import turn_prompt
from .samples import DatasetSamples, SampleCollector
from .shardfile import CorruptShard, decode_batch, iter_frames, read_header

__all__ = ["AuditReport", "Auditor", "Check", "audit_run", "split_parts"]

log = logging.getLogger(__name__)

AUDIT_FORMAT = 1
HIST_BINS = 30
EXAMPLES = 5                     # ids quoted per kind of problem


# ---------------------------------------------------------------------------------------------------
# report schema (audit.json)
# ---------------------------------------------------------------------------------------------------
class Check(msgspec.Struct):
    name: str
    passed: bool
    value: float | None      # the measured share or count
    limit: float | None      # the threshold it is held to
    message: str
    unit: str = "count"      # "share" (a fraction) or "count"


class Lengths(msgspec.Struct):
    count: int = 0
    total: int = 0
    mean: float = 0.0
    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0


class Histogram(msgspec.Struct):
    edges: list[int]         # bin i holds lengths in [edges[i], edges[i+1])
    counts: list[int]


class ReasoningCounts(msgspec.Struct):
    """Counts over ok records; `expected` are those whose prompt does not close reasoning (thinking on)."""

    expected: int = 0
    think_end: int = 0                   # output holds the think-end id
    stopped: int = 0                     # expected and finished with a stop token
    stopped_without_think_end: int = 0   # the seed's failure: reasoning left in the content
    length_without_think_end: int = 0    # truncated while reasoning
    empty_reasoning: int = 0             # think-end present, nothing but blanks before it
    stopped_with_think_end: int = 0
    empty_content: int = 0               # reasoning, then nothing but blanks after the think-end
    opened_by_template: int = 0          # prompt ends with the think-start id
    double_think_start: int = 0          # ... and the model wrote a think-start again
    closed_by_template: int = 0          # prompt ends with the think-end id (thinking off)
    # Every ok output by the reasoning mode its prompt left the model in (chat.reasoning_mode).
    mode_opened: int = 0                 # the template opened reasoning (= opened_by_template + closed ones: none)
    mode_model_opens: int = 0            # the prompt ends at the assistant header: the model opens it itself
    mode_unknown: int = 0                # a template that never mentions the think tokens
    in_reasoning: int = 0                # outputs really in reasoning mode: opened by the prompt or the model,
                                         # or holding the think-end id
    think_tokens: int = 0                # outputs holding a think-start or think-end id anywhere
    nan_stops: int = 0                   # ok records SGLang stopped on NaN logits (older runs stored them as ok)
    nan_failed: int = 0                  # failed records of the NaN stop (failure "nan"): to generate again


class DatasetStats(msgspec.Struct):
    name: str
    planned: int = 0
    records: int = 0
    ok: int = 0
    failed: int = 0
    missing: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0               # of prompt_tokens, found in the server's prefix cache
    output_tokens: int = 0
    prompt_len: Lengths = msgspec.field(default_factory=Lengths)
    output_len: Lengths = msgspec.field(default_factory=Lengths)
    reasoning_len: Lengths = msgspec.field(default_factory=Lengths)
    content_len: Lengths = msgspec.field(default_factory=Lengths)
    finish: dict[str, int] = {}
    errors: dict[str, int] = {}
    length_share: float = 0.0
    reasoning: ReasoningCounts = msgspec.field(default_factory=ReasoningCounts)
    histograms: dict[str, Histogram] = {}


class ShardStats(msgspec.Struct):
    index: int
    done: bool
    planned: int
    records: int = 0
    ok: int = 0
    failed: int = 0
    missing: int = 0
    duplicates: int = 0
    damaged_frames: int = 0
    torn_frames: int = 0
    output_tokens: int = 0
    matches_done: bool | None = None
    tok_per_s: float | None = None      # generation throughput of its last attempt (progress file)
    mean_latency_s: float | None = None
    host: str | None = None
    engine_restarts: int | None = None


class TurnStats(msgspec.Struct):
    """Per user turn of a regenerated dataset ([[datasets]] regenerate = true)."""

    dataset: str
    turn: int                    # 1-based, as people count turns
    records: int = 0
    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    think_end: int = 0           # ok outputs holding the think-end id
    length: int = 0              # ok outputs cut by max_new_tokens
    prompt_tokens: int = 0       # the history grows turn by turn


class Integrity(msgspec.Struct):
    id_mismatch: int = 0          # record id differs from the planned id at its position
    seen_twice: int = 0           # a position present more than once in the merged file
    completion_mismatch: int = 0  # completion_tokens != len(output_ids)
    prompt_mismatch: int = 0      # prompt_tokens != len(prompt_ids)
    split_mismatch: int = 0       # stored reasoning_end is not the first think-end id
    stop_mismatch: int = 0        # a `stop` finish whose matched id is not the last output id
    unexpected_stop: int = 0      # matched stop id neither an eos id nor a configured stop_token_id
    bad_finish: int = 0           # an ok record without a stop or length finish
    out_of_vocab: int = 0         # an id >= the tokenizer's size
    examples: dict[str, list[str]] = {}


class Reprompt(msgspec.Struct):
    sampled: int = 0
    mismatched: int = 0
    examples: list[str] = []


class TokenSummary(msgspec.Struct):
    tokenizer: str
    think_start: str
    think_start_id: int
    think_end: str
    think_end_id: int
    eos_ids: list[int]
    vocab_size: int
    template_opens_reasoning: bool


class AuditReport(msgspec.Struct):
    format: int
    run: str
    fingerprint: str
    created: str
    passed: bool
    checks: list[Check]
    planned: int
    present: int
    ok: int
    failed: int
    missing: int
    duplicates: int              # resolved by the merge (kept once)
    damaged_frames: int
    tokens: TokenSummary
    overall: DatasetStats
    datasets: list[DatasetStats]
    shards: list[ShardStats]
    integrity: Integrity
    reprompt: Reprompt
    files: dict[str, str] = {}
    turns: list[TurnStats] = []  # regenerated datasets only
    samples: list[DatasetSamples] = []   # a few decoded outputs and one message per failure kind, per dataset


# ---------------------------------------------------------------------------------------------------
# token-id helpers
# ---------------------------------------------------------------------------------------------------
def _find(packed: bytes, token: int, start: int = 0, end: int | None = None) -> int | None:
    """First index in [start, end) of `token` in packed uint32 LE ids."""
    needle = token.to_bytes(4, "little")
    hi = len(packed) if end is None else 4 * end
    i = packed.find(needle, 4 * start, hi)
    while i != -1 and i % 4:
        i = packed.find(needle, i + 1, hi)
    return None if i == -1 else i // 4


def _all_blank(packed: bytes, a: int, b: int, blank: frozenset[int]) -> bool:
    for i in range(a, b):
        if _id_at(packed, i) not in blank:
            return False
    return True



# ---------------------------------------------------------------------------------------------------
# accumulation
# ---------------------------------------------------------------------------------------------------
class _Acc:
    """Running totals of one dataset (or of the run)."""

    def __init__(self, name: str, planned: int):
        self.stats = DatasetStats(name=name, planned=planned)
        self.finish: Counter = Counter()
        self.errors: Counter = Counter()
        self.r = ReasoningCounts()
        self.prompt_len, self.output_len = array("I"), array("I")
        self.reasoning_len, self.content_len = array("I"), array("I")


class _ShardAcc:
    def __init__(self) -> None:
        self.records = self.ok = self.failed = self.output_tokens = 0
        self.latency = 0.0


_DIGITS = re.compile(r"\d+")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def _error_kind(error: str | None) -> str:
    """An error message with its particulars (numbers, quoted names) folded, to count failures by kind."""
    if not error:
        return "(no message)"
    text = _QUOTED.sub("'…'", _DIGITS.sub("N", error.splitlines()[0]))
    return text[:120]


def _note(integ: Integrity, kind: str, rec_id: str) -> None:
    setattr(integ, kind, getattr(integ, kind) + 1)
    ex = integ.examples.setdefault(kind, [])
    if len(ex) < EXAMPLES:
        ex.append(rec_id)


class Auditor:
    """Audits records fed one at a time, in planned order; `finish` makes the report and writes the id files."""

    def __init__(self, rd: RunDir, plan: RunPlan, *, tokenizer=None, info: chat.TokenInfo | None = None):
        self.rd, self.plan, self.spec = rd, plan, plan.spec.audit
        model = plan.spec.model
        self.tok = tokenizer if tokenizer is not None else chat.load_tokenizer(model)
        self.info = info if info is not None else chat.token_info(self.tok, model)
        self.blank = frozenset(self.info.blank_ids)
        self.refs = planned_refs(rd, plan)
        self.seen = bytearray(plan.total)
        self.ds = {d.name: _Acc(d.name, d.planned) for d in plan.datasets}
        self.shards = [_ShardAcc() for _ in plan.shards]
        eos = set(self.info.eos_ids)
        self.stop_ids = {
            d.name: eos | set(plan.spec.sampling_for(d.name).get("stop_token_ids") or []) for d in plan.datasets
        }
        self.integ = Integrity()
        self.failed_ids: list[str] = []
        self.problems: list[Check] = []   # failures found outside records (damaged merged file)
        self.examples: dict[str, list[str]] = {}
        k = min(self.spec.reprompt_sample, plan.total)
        self.sample_at = set(np.linspace(0, plan.total - 1, k).round().astype(int).tolist()) if k > 0 else set()
        self.sampled: dict[int, bytes] = {}
        self.turns: dict[tuple[str, int], TurnStats] = {}
        self.samples = SampleCollector([d.name for d in plan.datasets], {
            d.name: plan.spec.sampling_for(d.name).get("max_new_tokens") for d in plan.datasets})

    def _example(self, kind: str, rec_id: str) -> None:
        ex = self.examples.setdefault(kind, [])
        if len(ex) < EXAMPLES:
            ex.append(rec_id)

    def add(self, rec: Record) -> None:
        pos = rec.index
        ref = self.refs.at(pos)
        if ref is None or ref.id != rec.id or self.plan.datasets[ref.dataset].name != rec.dataset:
            _note(self.integ, "id_mismatch", rec.id)
            return
        if not self.seen[pos] and self.plan.datasets[ref.dataset].regenerate:
            self._add_turn(rec, ref.turn)
        self._add(rec, pos)

    def _add_turn(self, rec: Record, turn: int) -> None:
        t = self.turns.get((rec.dataset, turn))
        if t is None:
            t = self.turns[(rec.dataset, turn)] = TurnStats(dataset=rec.dataset, turn=turn + 1)
        t.records += 1
        t.prompt_tokens += rec.n_prompt
        if rec.status != OK:
            t.failed += 1
            return
        t.ok += 1
        t.output_tokens += rec.n_output
        t.think_end += rec.reasoning_end is not None
        t.length += rec.finish == "length"

    def _add(self, rec: Record, pos: int) -> None:
        if self.seen[pos]:
            _note(self.integ, "seen_twice", rec.id)
            return
        self.seen[pos] = 1
        acc = self.ds[rec.dataset]
        st = acc.stats
        sh = self.shards[self.refs.shard_of(pos)]
        sh.records += 1
        st.records += 1
        pk, out = rec.prompt_ids, rec.output_ids
        n_prompt, n = len(pk) >> 2, len(out) >> 2
        st.prompt_tokens += n_prompt
        st.cached_tokens += rec.cached_tokens
        acc.prompt_len.append(n_prompt)
        if pos in self.sample_at and n_prompt:
            self.sampled[pos] = pk
        if rec.prompt_tokens != n_prompt and (n_prompt or rec.status == OK):
            _note(self.integ, "prompt_mismatch", rec.id)
        if rec.status != OK:
            st.failed += 1
            sh.failed += 1
            kind = _error_kind(rec.error)
            acc.errors[kind] += 1
            self.samples.error(rec.dataset, kind, rec.error)
            if rec.failure == "nan":
                acc.r.nan_failed += 1
                self._example("nan_stop", rec.id)
            self.failed_ids.append(rec.id)
            return
        st.ok += 1
        sh.ok += 1
        sh.output_tokens += n
        sh.latency += rec.latency_s
        st.output_tokens += n
        acc.finish[rec.finish or "none"] += 1
        info, r = self.info, acc.r
        if rec.completion_tokens != n:
            _note(self.integ, "completion_mismatch", rec.id)
        if n and int(np.frombuffer(out, "<u4").max()) >= info.vocab_size or n_prompt and int(np.frombuffer(pk, "<u4").max()) >= info.vocab_size:
            _note(self.integ, "out_of_vocab", rec.id)
        m = rec.matched_stop
        if rec.finish == "stop":
            if isinstance(m, int) and not isinstance(m, bool):
                if not ends_with_stop(rec):
                    _note(self.integ, "stop_mismatch", rec.id)
                elif m not in self.stop_ids[rec.dataset]:
                    _note(self.integ, "unexpected_stop", rec.id)
        elif rec.finish != "length":
            _note(self.integ, "bad_finish", rec.id)
        te_at = _find(out, info.think_end_id)
        if te_at != rec.reasoning_end:
            _note(self.integ, "split_mismatch", rec.id)
        if is_nan_stop(rec.finish, m):
            r.nan_stops += 1
            self._example("nan_stop", rec.id)
        last_prompt = _last_meaningful(pk, self.blank)
        opened = last_prompt == info.think_start_id
        r0, r1, c0, c1 = split_parts(rec, info.think_start_id, opened)
        acc.output_len.append(n)
        acc.reasoning_len.append(r1 - r0)
        acc.content_len.append(c1 - c0)
        model_opened = n > 0 and _id_at(out, 0) == info.think_start_id
        if te_at is not None or _find(out, info.think_start_id) is not None:
            r.think_tokens += 1
            self._example("think_tokens", rec.id)
        self.samples.offer(rec, (r0, r1, c0, c1), te_at is not None)
        if last_prompt == info.think_end_id:
            r.closed_by_template += 1
            self._example("closed_by_template", rec.id)
            return
        if opened:
            r.mode_opened += 1
        elif info.template_knows_reasoning:
            r.mode_model_opens += 1
        else:
            r.mode_unknown += 1
        if opened or model_opened or te_at is not None:
            r.in_reasoning += 1
        r.expected += 1
        if te_at is not None:
            r.think_end += 1
            if _all_blank(out, r0, r1, self.blank):
                r.empty_reasoning += 1
                self._example("empty_reasoning", rec.id)
        if rec.finish == "stop":
            r.stopped += 1
            if te_at is None:
                r.stopped_without_think_end += 1
                self._example("stopped_without_think_end", rec.id)
            else:
                r.stopped_with_think_end += 1
                if _all_blank(out, c0, c1, self.blank):
                    r.empty_content += 1
                    self._example("empty_content", rec.id)
        elif rec.finish == "length" and te_at is None:
            r.length_without_think_end += 1
        if opened:
            r.opened_by_template += 1
            if _find(out, info.think_start_id, 0, te_at if te_at is not None else n) is not None:
                r.double_think_start += 1
                self._example("double_think_start", rec.id)

    def problem(self, name: str, message: str) -> None:
        """A failure found outside the records (e.g. a damaged merged file)."""
        self.problems.append(Check(name, False, None, None, message))

    # -----------------------------------------------------------------------------------------------
    def finish(self, manifest: MergeManifest) -> AuditReport:
        plan, rd = self.plan, self.rd
        seen = np.frombuffer(bytes(self.seen), np.uint8)
        missing_pos = np.flatnonzero(seen == 0)
        rd.merged_dir.mkdir(parents=True, exist_ok=True)
        files = {"missing_ids": str(rd.missing_file), "failed_ids": str(rd.failed_file)}
        missing_ids = []
        with open(_tmp(files["missing_ids"]), "w") as f:
            for pos in missing_pos.tolist():
                ref = self.refs.at(pos)
                self.ds[plan.datasets[ref.dataset].name].stats.missing += 1
                f.write(ref.id + "\n")
                if len(missing_ids) < EXAMPLES:
                    missing_ids.append(ref.id)
        with open(_tmp(files["failed_ids"]), "w") as f:
            f.writelines(i + "\n" for i in self.failed_ids)
        for p in files.values():
            os.replace(_tmp(p), p)
        tops = _hist_tops(list(self.ds.values()))
        datasets = [_finish_acc(a, tops) for a in self.ds.values()]
        overall = _finish_acc(_combine(list(self.ds.values()), "all", plan.total), tops)
        shards = self._shard_stats(manifest)
        reprompt = self._reprompt()
        checks = self._checks(manifest, datasets, overall, shards, reprompt, missing_ids)
        info, model = self.info, plan.spec.model
        report = AuditReport(
            format=AUDIT_FORMAT, run=plan.name, fingerprint=plan.fingerprint,
            created=utc_now(),
            passed=all(c.passed for c in checks), checks=checks, planned=plan.total,
            present=int(seen.sum()), ok=overall.ok, failed=overall.failed, missing=len(missing_pos),
            duplicates=manifest.duplicates, damaged_frames=len(manifest.corrupt),
            tokens=TokenSummary(
                tokenizer=model.tokenizer_path or model.path, think_start=model.think_start,
                think_start_id=info.think_start_id, think_end=model.think_end, think_end_id=info.think_end_id,
                eos_ids=list(info.eos_ids), vocab_size=info.vocab_size, template_opens_reasoning=info.opens_reasoning,
            ),
            overall=overall, datasets=datasets, shards=shards, integrity=self.integ, reprompt=reprompt, files=files,
            turns=[self.turns[k] for k in sorted(self.turns, key=lambda k: (k[0], k[1]))],
            samples=self.samples.finish(self.tok, info.think_end_id),
        )
        bad = [c.name for c in checks if not c.passed]
        if bad:
            log.error("audit of %s failed: %s", rd.root, ", ".join(bad))
        else:
            log.info("audit of %s passed", rd.root)
        return report

    def _shard_stats(self, manifest: MergeManifest) -> list[ShardStats]:
        by_index = {s.index: s for s in manifest.shards}
        damaged = Counter(p.shard for p in manifest.corrupt)
        torn = Counter(p.shard for p in manifest.torn)
        out = []
        for sp, acc in zip(self.plan.shards, self.shards):
            sm = by_index.get(sp.index)
            prog = read_progress(self.rd.progress_file(sp.index))
            out.append(ShardStats(
                index=sp.index, done=bool(sm and sm.done), planned=sp.count, records=acc.records, ok=acc.ok,
                failed=acc.failed, missing=sp.count - acc.records, duplicates=sm.duplicates if sm else 0,
                damaged_frames=damaged[sp.index], torn_frames=torn[sp.index], output_tokens=acc.output_tokens,
                matches_done=sm.matches_done if sm else None,
                tok_per_s=prog.tok_per_s if prog and prog.tok_per_s else None,
                mean_latency_s=round(acc.latency / acc.ok, 3) if acc.ok else None,
                host=prog.host if prog else None, engine_restarts=prog.engine_restarts if prog else None,
            ))
        return out

    def _reprompt(self) -> Reprompt:
        """Render the sampled prompts from their source lines again; the ids must equal the stored ones."""
        rp = Reprompt(sampled=len(self.sampled))
        if not self.sampled:
            return rp
        plan = self.plan
        try:
            check_plan_inputs(plan)
        except InputError as e:  # a changed file would pair other lines with the stored ids
            self.problem("source_files", f"{e}: the prompt files are not those the run was generated from, so "
                                         "prompts cannot be re-rendered or paired with their records")
            return rp
        prompts, stored = [], []
        with PromptReader() as reader:
            for pos, packed in sorted(self.sampled.items()):
                ref = self.refs.at(pos)
                ds = plan.datasets[ref.dataset]
                if ds.regenerate and ref.turn:  # its history holds earlier answers: the records are its source
                    rp.sampled -= 1
                    continue
                try:
                    prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
                    prompts.append(turn_prompt(prompt, 0, []) if ds.regenerate else prompt)
                    stored.append(packed)
                except (OSError, InputError) as e:
                    rp.mismatched += 1
                    if len(rp.examples) < EXAMPLES:
                        rp.examples.append(f"{ref.id}: source line unreadable ({e})")
        try:
            rendered = chat.render_many(self.tok, plan.spec.model, prompts)
        except chat.ChatError as e:
            rp.mismatched += len(prompts)
            rp.examples.append(f"rendering failed: {e}")
            return rp
        for p, ids, packed in zip(prompts, rendered, stored):
            if pack_ids(ids) != packed:
                rp.mismatched += 1
                if len(rp.examples) < EXAMPLES:
                    rp.examples.append(f"{p.id}: {len(ids)} ids rendered now, {len(packed) // 4} stored")
        return rp

    def _checks(self, manifest, datasets, overall, shards, reprompt, missing_ids) -> list[Check]:
        a, plan, integ = self.spec, self.plan, self.integ
        info, model = self.info, plan.spec.model
        r = overall.reasoning
        run = self.rd.root
        checks: list[Check] = list(self.problems)

        def add(name: str, passed: bool, value, limit, message: str) -> None:
            unit = "share" if isinstance(limit, float) else "count"
            checks.append(Check(name, bool(passed), value, limit, message, unit))

        # Coverage and integrity of the merge.
        present = overall.records
        lost = overall.planned - present
        if lost or integ.seen_twice or integ.id_mismatch:
            incomplete = [s.index for s in shards if s.missing]
            add("coverage", False, present / plan.total if plan.total else 1.0, 1.0,
                f"{present} of {plan.total} planned prompts present (ok + failed); {lost} missing "
                f"(e.g. {', '.join(missing_ids)}; all in {self.rd.missing_file}) in shards "
                f"{_short(incomplete)}; {integ.seen_twice} present twice, {integ.id_mismatch} not at their planned "
                f"position. Finish the shards with `toolkit resubmit {run}`, then `toolkit merge {run}` again.")
        else:
            add("coverage", True, 1.0, 1.0, f"all {plan.total} planned prompts present exactly once "
                f"({overall.ok} ok, {overall.failed} failed; {manifest.duplicates} duplicates kept once)")
        if manifest.corrupt:
            p = manifest.corrupt[0]
            add("damaged_frames", False, len(manifest.corrupt), 0,
                f"{len(manifest.corrupt)} damaged frame(s) in shard files, e.g. shard {p.shard} {p.file} at byte "
                f"{p.offset} ({p.why}); their records are missing. Move the damaged shard file and its .done aside "
                f"and `toolkit resubmit {run}` to generate that shard again (check the disk / file system).")
        else:
            add("damaged_frames", True, 0, 0, "every frame of every shard file intact")
        changed = [s.index for s in shards if s.matches_done is False]
        add("shard_checksums", not changed, len(changed), 0,
            f"shard files {_short(changed)} differ from the sha256 in their done manifests: they changed after "
            f"they were finished (a second writer, or a copy gone wrong); check them before trusting this run"
            if changed else "every finished shard file matches its done manifest")
        failed_share = overall.failed / plan.total if plan.total else 0.0
        top = ", ".join(f"{k} ({v})" for k, v in list(overall.errors.items())[:3])
        add("failed_share", failed_share <= a.max_failed_share, failed_share, a.max_failed_share,
            f"{overall.failed} of {plan.total} prompts failed ({failed_share:.1%}, limit {a.max_failed_share:.1%})"
            + (f": {top}. Ids in {self.rd.failed_file}; `toolkit retry {run}` generates the failures "
               f"that may pass (timeouts, 5xx, aborts, NaN) again, `toolkit retry {run} --ids "
               f"{self.rd.failed_file}` all of them; see `toolkit logs {run} --failed`" if overall.failed else ""))

        # Reasoning capture.
        te = f"think-end id {info.think_end_id} ({model.think_end!r})"
        where = (f"The chat template {'opens' if info.opens_reasoning else 'does not open'} reasoning "
                 f"(prompts {'end' if info.opens_reasoning else 'do not end'} with {model.think_start!r}).")
        what_to_check = (
            f"Check: [model] chat_template and chat_template_kwargs (e.g. thinking = true for Kimi, enable_thinking = "
            f"true for Qwen3) so the prompt puts the model in reasoning mode; [model] think_end is the token this "
            f"model writes (here {te}); the server flags (a chat template or reasoning parser overriding the "
            f"model's, stop / stop_token_ids that cut at the think-end). For a model that does not reason, set "
            f"[audit] min_think_end_share = 0 and max_stop_without_think_end_share = 1.")
        nan = r.nan_failed + r.nan_stops
        ex = ", ".join(self.examples.get("nan_stop", []))
        add("nan_stop", not nan, nan, 0,
            f"{nan} outputs were stopped by SGLang on NaN logits (finish_reason matched {NAN_MATCHED!r}: the engine "
            f"replaced a token sampled from NaN with a stop id, so the output ends in an EOS the model never wrote; "
            f"e.g. {ex}). {r.nan_stops} of them are stored as ok records (from an older toolkit): generate them "
            f"again. NaN logits point at the model's numerics: check the quantization, kv-cache dtype and attention "
            f"backend in [engine] extra_args. `toolkit retry {run}` generates the failed ones again"
            if nan else "no output was stopped on NaN logits")
        if not model.expect_reasoning:
            self._no_reasoning_checks(add, overall, te)
            return self._consistency_checks(checks, add, datasets, reprompt, te)
        closed, modes = r.closed_by_template, modes_text(r)
        if closed or not r.in_reasoning:
            ex = ", ".join(self.examples.get("closed_by_template", []))
            add("reasoning_mode", False, r.in_reasoning, overall.ok,
                (f"{closed} of {overall.ok} ok outputs were generated from prompts whose template CLOSED reasoning "
                 f"(they end with {model.think_end!r}: thinking switched off, e.g. {ex}), so they hold no reasoning; "
                 f"{chat.thinking_hint(info, True)}, or set [model] expect_reasoning = false for non-thinking data. "
                 if closed else "")
                + (f"No ok output is in reasoning mode ({modes}): the data holds no reasoning at all. {where} "
                   f"{what_to_check}" if not r.in_reasoning else f"({modes})"))
        else:
            add("reasoning_mode", True, r.in_reasoning, overall.ok,
                f"{r.in_reasoning} of {overall.ok} ok outputs are in reasoning mode ({modes})")
        share = r.think_end / r.expected if r.expected else 0.0
        add("think_end_share", share >= a.min_think_end_share, share, a.min_think_end_share,
            f"{r.think_end} of {r.expected} ok outputs in reasoning mode hold the {te} ({share:.1%}, minimum "
            f"{a.min_think_end_share:.0%})" + ("" if share >= a.min_think_end_share else
            f"; of those without it, {r.length_without_think_end} hit max_new_tokens while reasoning (raise "
            f"max_new_tokens for those) and {r.stopped_without_think_end} stopped normally (see "
            f"stop_without_think_end)"))
        share = r.stopped_without_think_end / r.stopped if r.stopped else 0.0
        ex = ", ".join(self.examples.get("stopped_without_think_end", []))
        add("stop_without_think_end", share <= a.max_stop_without_think_end_share, share,
            a.max_stop_without_think_end_share,
            f"{r.stopped_without_think_end} of {r.stopped} outputs that ended with a stop token have no {te} "
            f"({share:.1%}, limit {a.max_stop_without_think_end_share:.1%})"
            + ("" if share <= a.max_stop_without_think_end_share else
               f": the model finished without ever writing the think-end, so reasoning and answer cannot be told "
               f"apart: the reasoning sits in the content, mixed with the answer, and a reasoning field split from "
               f"it is empty (e.g. {ex}). {where} {what_to_check}"))
        share = r.empty_reasoning / r.think_end if r.think_end else 0.0
        add("empty_reasoning", share <= a.max_empty_reasoning_share, share, a.max_empty_reasoning_share,
            f"{r.empty_reasoning} of {r.think_end} outputs with a think-end have empty reasoning ({share:.1%}, limit "
            f"{a.max_empty_reasoning_share:.1%})" + ("" if share <= a.max_empty_reasoning_share else
            f" (e.g. {', '.join(self.examples.get('empty_reasoning', []))}): the model closes reasoning at once. "
            f"Check that thinking is enabled in chat_template_kwargs and the template does not pre-fill "
            f"{model.think_start!r}{model.think_end!r}."))
        share = r.empty_content / r.stopped_with_think_end if r.stopped_with_think_end else 0.0
        add("empty_content", share <= a.max_empty_content_share, share, a.max_empty_content_share,
            f"{r.empty_content} of {r.stopped_with_think_end} finished outputs with reasoning have empty content "
            f"({share:.1%}, limit {a.max_empty_content_share:.1%})" + ("" if share <= a.max_empty_content_share else
            f" (e.g. {', '.join(self.examples.get('empty_content', []))}): the answer after the {te} is missing. "
            f"Check stop / stop_token_ids (a stop at the think-end or right after it) and [model] think_end."))
        share = r.double_think_start / r.opened_by_template if r.opened_by_template else 0.0
        add("double_think_start", share <= a.max_double_think_start_share, share, a.max_double_think_start_share,
            f"{r.double_think_start} of {r.opened_by_template} outputs whose prompt already opened reasoning "
            f"contain another think-start id {info.think_start_id} ({share:.1%}, limit "
            f"{a.max_double_think_start_share:.1%})" + ("" if share <= a.max_double_think_start_share else
            f" (e.g. {', '.join(self.examples.get('double_think_start', []))}): the template opens "
            f"{model.think_start!r} and the model opens it again: the template does not match the model's training "
            f"format. Check [model] chat_template / chat_template_kwargs."))

        return self._consistency_checks(checks, add, datasets, reprompt, te)

    def _no_reasoning_checks(self, add, overall: DatasetStats, te: str) -> None:
        """expect_reasoning = false: the opposite of the reasoning checks — no think token in any output."""
        a, r, model = self.spec, overall.reasoning, self.plan.spec.model
        share = r.think_tokens / overall.ok if overall.ok else 0.0
        ex = ", ".join(self.examples.get("think_tokens", []))
        add("no_reasoning", share <= a.max_reasoning_share, share, a.max_reasoning_share,
            f"{r.think_tokens} of {overall.ok} ok outputs hold a think token ({model.think_start!r} or the {te}) "
            f"although [model] expect_reasoning = false ({share:.1%}, limit {a.max_reasoning_share:.1%}; modes: "
            f"{modes_text(r)})" + ("" if share <= a.max_reasoning_share else
            f" (e.g. {ex}): the model reasoned. {chat.thinking_hint(self.info, False)}, or set expect_reasoning = "
            f"true to keep the reasoning"))

    def _consistency_checks(self, checks, add, datasets, reprompt, te: str) -> list[Check]:
        a, integ, info = self.spec, self.integ, self.info
        # Truncation and consistency.
        over = [d for d in datasets if d.ok and d.length_share > a.max_length_share]
        worst = max((d.length_share for d in datasets if d.ok), default=0.0)
        add("length_share", not over, worst, a.max_length_share,
            "; ".join(f"dataset {d.name!r}: {d.finish.get('length', 0)} of {d.ok} outputs ({d.length_share:.1%}) hit "
                      f"max_new_tokens" for d in over)
            + (f" (limit {a.max_length_share:.0%}): raise max_new_tokens for those datasets ([[datasets]] sampling) "
               f"or accept truncated outputs by raising [audit] max_length_share" if over else
               f"at most {worst:.1%} of a dataset's outputs hit max_new_tokens (limit {a.max_length_share:.0%})"))
        ex = integ.examples
        bad = integ.stop_mismatch + integ.bad_finish
        add("stop_tokens", not bad, bad, 0,
            f"{integ.stop_mismatch} `stop` finishes whose matched id is not the last output id, {integ.bad_finish} ok "
            f"records without a stop/length finish (e.g. {', '.join(ex.get('stop_mismatch', []) + ex.get('bad_finish', []))}): "
            f"the engine's output_ids were cut or re-assembled; check the engine version and flags (no_stop_trim, "
            f"stream options)" if bad else
            f"every `stop` finish ends with its matched id ({integ.unexpected_stop} matched ids outside eos and "
            f"stop_token_ids)")
        bad = integ.completion_mismatch + integ.prompt_mismatch
        add("token_counts", not bad, bad, 0,
            f"{integ.completion_mismatch} records with completion_tokens != len(output_ids) and "
            f"{integ.prompt_mismatch} with prompt_tokens != len(prompt_ids) (e.g. "
            f"{', '.join(ex.get('completion_mismatch', []) + ex.get('prompt_mismatch', []))}): the server's counts "
            f"disagree with the ids it returned; check the engine version" if bad else
            "completion_tokens and prompt_tokens equal the stored ids everywhere")
        add("reasoning_split", not integ.split_mismatch, integ.split_mismatch, 0,
            f"{integ.split_mismatch} records whose reasoning_end is not the first {te} (e.g. "
            f"{', '.join(ex.get('split_mismatch', []))}): the run was generated with other think tokens than "
            f"[model] has now" if integ.split_mismatch else "reasoning_end is the first think-end id everywhere")
        add("vocabulary", not integ.out_of_vocab, integ.out_of_vocab, 0,
            f"{integ.out_of_vocab} records hold ids >= {info.vocab_size}, outside the tokenizer (e.g. "
            f"{', '.join(ex.get('out_of_vocab', []))}): the engine served another model or tokenizer than [model] "
            f"names" if integ.out_of_vocab else f"every id below the tokenizer size {info.vocab_size}")
        add("prompt_rerender", not reprompt.mismatched, reprompt.mismatched, 0,
            f"{reprompt.mismatched} of {reprompt.sampled} sampled prompts render to other ids than those stored "
            f"({'; '.join(reprompt.examples)}): the tokenizer, chat template or prompt files changed since "
            f"generation; restore them, or the dataset does not match its sources" if reprompt.mismatched else
            f"{reprompt.sampled} sampled prompts render to exactly the stored ids")
        return checks


def modes_text(r: ReasoningCounts) -> str:
    parts = [(r.mode_opened, "opened by the template"), (r.mode_model_opens, "opened by the model itself"),
             (r.closed_by_template, "closed by the template"), (r.mode_unknown, "template unaware of think tokens")]
    return ", ".join(f"{n} {what}" for n, what in parts if n) or "no ok output"


def _tmp(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f".{p.name}.{os.getpid()}.tmp"))


def _short(nums: list[int], limit: int = 12) -> str:
    if not nums:
        return "-"
    head = ", ".join(map(str, nums[:limit]))
    return head + (f" and {len(nums) - limit} more" if len(nums) > limit else "")


def _lengths(a: array) -> Lengths:
    if not len(a):
        return Lengths()
    v = np.frombuffer(a, np.uint32)
    p50, p90, p99 = (int(x) for x in np.percentile(v, [50, 90, 99], method="inverted_cdf"))
    total = int(v.sum(dtype=np.int64))
    return Lengths(count=len(v), total=total, mean=round(total / len(v), 1), p50=p50, p90=p90, p99=p99, max=int(v.max()))


def _hist_tops(accs: list[_Acc]) -> dict[str, int]:
    """The largest length of each kind over every dataset: the datasets' histograms share their bins."""
    def top(a: array) -> int:
        return int(np.frombuffer(a, np.uint32).max()) if len(a) else 0

    return {k: max((top(getattr(a, f"{k}_len")) for a in accs), default=0) + 1 for k in ("output", "reasoning", "content")}


def _histogram(a: array, top: int | None = None) -> Histogram:
    v = np.frombuffer(a, np.uint32) if len(a) else np.zeros(0, np.uint32)
    top = top or (int(v.max()) + 1 if len(v) else 1)
    width = max(1, -(-top // HIST_BINS))
    edges = list(range(0, width * HIST_BINS + 1, width))
    counts, _ = np.histogram(v, bins=edges)
    return Histogram(edges=edges, counts=counts.tolist())


def _finish_acc(acc: _Acc, tops: dict[str, int] | None = None) -> DatasetStats:
    st = acc.stats
    st.prompt_len = _lengths(acc.prompt_len)
    st.output_len = _lengths(acc.output_len)
    st.reasoning_len = _lengths(acc.reasoning_len)
    st.content_len = _lengths(acc.content_len)
    st.finish = dict(acc.finish.most_common())
    st.errors = dict(acc.errors.most_common(20))
    st.length_share = acc.finish.get("length", 0) / st.ok if st.ok else 0.0
    st.reasoning = acc.r
    tops = tops or {}
    st.histograms = {
        "output": _histogram(acc.output_len, tops.get("output")),
        "reasoning": _histogram(acc.reasoning_len, tops.get("reasoning")),
        "content": _histogram(acc.content_len, tops.get("content")),
    }
    return st


def _combine(accs: list[_Acc], name: str, planned: int) -> _Acc:
    out = _Acc(name, planned)
    s = out.stats
    for a in accs:
        for f in ("records", "ok", "failed", "missing", "prompt_tokens", "cached_tokens", "output_tokens"):
            setattr(s, f, getattr(s, f) + getattr(a.stats, f))
        out.finish.update(a.finish)
        out.errors.update(a.errors)
        for f in ReasoningCounts.__struct_fields__:
            setattr(out.r, f, getattr(out.r, f) + getattr(a.r, f))
        for f in ("prompt_len", "output_len", "reasoning_len", "content_len"):
            getattr(out, f).extend(getattr(a, f))
    return out


# ---------------------------------------------------------------------------------------------------
# auditing a merged dataset on disk
# ---------------------------------------------------------------------------------------------------
def audit_run(run_dir: str | os.PathLike) -> AuditReport:
    """Audit `RUN/merged/records.zst` against the plan (the merged dataset must exist)."""
    rd, plan = load_run(run_dir)
    manifest = load_manifest(rd)
    path = rd.merged_file
    if not path.exists():
        raise MergeError(f"{path} is missing although {rd.manifest_file} exists: run `toolkit merge {rd.root}` again")
    auditor = Auditor(rd, plan)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != manifest.sha256:
        auditor.problem("merged_file", f"{path} differs from the sha256 in its manifest: it changed after the merge; "
                                       f"run `toolkit merge {rd.root}` again")
    try:
        head = read_header(path)
        if head != (plan.fingerprint, MERGED):
            auditor.problem("merged_file", f"{path} is not this run's merged dataset (header {head}); merge again")
        tail: list = []
        for frame in iter_frames(path, tail=tail):
            for rec in decode_batch(frame):
                auditor.add(rec)
        if tail:
            auditor.problem("merged_file", f"{path} ends with a torn frame at byte {tail[0][0]} ({tail[0][1]}); "
                                           f"run `toolkit merge {rd.root}` again")
    except (CorruptShard, msgspec.MsgspecError) as e:
        auditor.problem("merged_file", f"{path} is damaged ({e}); run `toolkit merge {rd.root}` again")
    return auditor.finish(manifest)
