"""Audit: is a merged run complete and faithful? Coverage, reasoning capture, truncation,
consistency, statistics.

Everything is checked on token ids (the stored packed uint32 ids, never re-tokenized text); the
run's tokenizer is loaded only for its think / eos ids and to re-render a sample of prompts with the
chat template. `Auditor` accumulates over records in a single pass — the merge feeds it as it writes
— with memory in a few bytes per record, then `finish` turns the totals into an `AuditReport`
(schema: `dataset.audit_report`; the checks: `audit_checks`; re-rendering prompts: `rerender`) and
writes `failed_ids.txt`. Missing ids are the merge's (its manifest and `missing_ids.txt`).
`audit_run` audits an existing merged dataset.

An output is "expected to reason" unless its prompt ends with the think-end id (thinking switched
off by the template). Whitespace-only ids are ignored at the end of prompts and when deciding that a
part is empty.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from array import array
from collections import Counter

import msgspec
import numpy as np

from toolkit.dataset.audit_checks import run_checks
from toolkit.dataset.audit_report import (
    AUDIT_FORMAT,
    AuditReport,
    Check,
    DatasetStats,
    Histogram,
    Integrity,
    Lengths,
    ReasoningCounts,
    ShardStats,
    SkippedInputs,
    TokenSummary,
    TrainingShare,
    TurnStats,
)
from toolkit.dataset.examples import SampleCollector, last_user_text
from toolkit.dataset.merge import MERGED, MergeError, MergeManifest, load_manifest, planned_refs
from toolkit.dataset.quality import KEPT_FOR_DRAFTERS, Judge, record_loop
from toolkit.dataset.rerender import rerender, sample_positions
from toolkit.formats.files import atomic_write, sha256_file
from toolkit.formats.frames import CorruptShard, decode_batch, iter_frames, read_header
from toolkit.formats.progress import read_progress
from toolkit.formats.records import (
    OK,
    Record,
    all_blank,
    defects,
    ends_with_stop,
    id_positions,
    is_nan_stop,
    split_parts,
)
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.text import utc_now
from toolkit.job import chat
from toolkit.job.inputs import InputError, PromptReader
from toolkit.job.spec import JobSpec

__all__ = ["Auditor", "audit_run"]

log = logging.getLogger(__name__)

HIST_BINS = 30
EXAMPLES = 5  # ids quoted per kind of problem


# --------------------------------------------------------------------------------------------------
# accumulation
# --------------------------------------------------------------------------------------------------
class _Acc:
    """Running totals of one dataset (or of the run)."""

    def __init__(self, name: str, planned: int):
        self.stats = DatasetStats(name=name, planned=planned)
        self.finish: Counter = Counter()
        self.errors: Counter = Counter()
        # failure kind -> the first real message of that kind
        self.error_examples: dict[str, str] = {}
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
    """A failure without a kind (written by an older toolkit): its message with the particulars
    (numbers, quoted names) folded, to count such failures by what they say."""
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
    """Audits records fed one at a time, in planned order; `finish` makes the report and writes
    failed_ids.txt."""

    def __init__(
        self, rd: RunDir, plan: RunPlan, *, tokenizer=None, info: chat.TokenInfo | None = None
    ):
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
            d.name: eos | set(plan.spec.sampling_for(d.name).get("stop_token_ids") or [])
            for d in plan.datasets
        }
        self.integ = Integrity()
        self.failed_ids: list[str] = []
        self.problems: list[Check] = []  # failures found outside records (damaged merged file)
        self.examples: dict[str, list[str]] = {}
        self.sample_at = sample_positions(plan.total, self.spec.reprompt_sample)
        self.sampled: dict[int, bytes] = {}
        self.turns: dict[tuple[str, int], TurnStats] = {}
        self.max_new = {
            d.name: plan.spec.sampling_for(d.name).get("max_new_tokens") for d in plan.datasets
        }
        self.samples = SampleCollector([d.name for d in plan.datasets], self.max_new)
        # n > 1 at temperature > 0: the outputs of the samples of the prompt being read ((dataset,
        # line); its samples are adjacent in planned order), by turn and hash of their ids -> the
        # first sample's id
        self.sampled_at = {
            i
            for i, d in enumerate(plan.datasets)
            if (plan.spec.sampling_for(d.name).get("n") or 1) > 1
            and (plan.spec.sampling_for(d.name).get("temperature", 1.0) or 0) > 0
        }
        self.prompt_at: tuple[int, int] | None = None
        self.outputs_seen: dict[tuple[int, bytes], str] = {}
        # what the default training export holds of the decoded tokens (the export's own judge)
        self.judge = Judge(
            self.info.think_start_id,
            self.info.think_end_id,
            self.info.blank_ids,
            model.expect_reasoning,
        )
        self.training = TrainingShare()

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
        if not self.seen[pos] and rec.status == OK and ref.dataset in self.sampled_at:
            self._compare_sample(rec, ref)
        self._add(rec, pos)

    def _compare_sample(self, rec: Record, ref) -> None:
        """Count an ok sample whose output ids equal an earlier sample's of the same prompt (and
        turn)."""
        at = (ref.dataset, ref.line)
        if at != self.prompt_at:
            self.prompt_at, self.outputs_seen = at, {}
        key = (ref.turn, hashlib.blake2b(rec.output_ids, digest_size=16).digest())
        st = self.ds[rec.dataset].stats
        if any(k[0] == ref.turn for k in self.outputs_seen):
            st.samples_compared += 1
        first = self.outputs_seen.setdefault(key, rec.id)
        if first != rec.id:
            st.identical_samples += 1
            self._example("identical_samples", f"{rec.id} = {first}")

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
        st.continued_tokens += rec.continued_tokens
        st.continued_cached += rec.continued_cached
        acc.prompt_len.append(n_prompt)
        if pos in self.sample_at and n_prompt:
            self.sampled[pos] = pk
        # (ok records: see defects)
        if rec.prompt_tokens != n_prompt and n_prompt and rec.status != OK:
            _note(self.integ, "prompt_mismatch", rec.id)
        if rec.status != OK:
            st.failed += 1
            sh.failed += 1
            # records of older toolkits carry no failure kind
            kind = rec.failure or _error_kind(rec.error)
            acc.errors[kind] += 1
            acc.error_examples.setdefault(kind, (rec.error or "(no message)").splitlines()[0][:300])
            self.samples.error(rec.dataset, kind, rec.error)
            if rec.failure == "nan":
                acc.r.nan_failed += 1
                self._example("nan_stop", rec.id)
            self.failed_ids.append(rec.id)
            self.training.add(n, "nan" if rec.failure == "nan" else "failed", False)
            return
        st.ok += 1
        sh.ok += 1
        sh.output_tokens += n
        sh.latency += rec.latency_s
        st.output_tokens += n
        acc.finish[rec.finish or "none"] += 1
        info, r = self.info, acc.r
        te_at = id_positions(out, info.think_end_id)
        for kind in defects(rec, info.vocab_size, te_at, self.max_new[rec.dataset]):
            _note(self.integ, kind, rec.id)
        m = rec.matched_stop
        if (
            rec.finish == "stop"
            and isinstance(m, int)
            and not isinstance(m, bool)
            and ends_with_stop(rec)
            and m not in self.stop_ids[rec.dataset]
        ):
            _note(self.integ, "unexpected_stop", rec.id)
        if is_nan_stop(rec.finish, m):
            r.nan_stops += 1
            self._example("nan_stop", rec.id)
        mode = chat.reasoning_mode(pk, info)
        opened = mode == chat.OPENED
        r0, r1, c0, c1 = split_parts(rec, info.think_start_id, opened)
        acc.output_len.append(n)
        acc.reasoning_len.append(r1 - r0)
        acc.content_len.append(c1 - c0)
        loop = record_loop(rec)
        reason = self.judge.skip_reason(rec, opened, loop is not None)
        self.training.add(n, reason, reason is None or reason in KEPT_FOR_DRAFTERS)
        if loop is not None:
            st.degenerate += 1
            self._example("degenerate", rec.id)
            self.samples.loop(rec, (r0, r1, c0, c1), te_at is not None, loop)
        if te_at is not None or id_positions(out, info.think_start_id) is not None:
            r.think_tokens += 1
            self._example("think_tokens", rec.id)
        self.samples.offer(rec, (r0, r1, c0, c1), te_at is not None)
        if mode == chat.CLOSED:
            r.closed_by_template += 1
            self._example("closed_by_template", rec.id)
            return
        if mode == chat.OPENED:
            r.mode_opened += 1
        elif mode == chat.MODEL_OPENS:
            r.mode_model_opens += 1
        else:
            r.mode_unknown += 1
        if chat.output_in_reasoning(rec, info, opened):
            r.in_reasoning += 1
        r.expected += 1
        if te_at is not None:
            r.think_end += 1
            if all_blank(out, r0, r1, self.blank):
                r.empty_reasoning += 1
                self._example("empty_reasoning", rec.id)
        if rec.finish == "stop":
            r.stopped += 1
            if te_at is None:
                r.stopped_without_think_end += 1
                self._example("stopped_without_think_end", rec.id)
            else:
                r.stopped_with_think_end += 1
                if all_blank(out, c0, c1, self.blank):
                    r.empty_content += 1
                    self._example("empty_content", rec.id)
        elif rec.finish == "length" and te_at is None:
            r.length_without_think_end += 1
        if opened:
            r.opened_by_template += 1
            if (
                id_positions(out, info.think_start_id, 0, te_at if te_at is not None else n)
                is not None
            ):
                r.double_think_start += 1
                self._example("double_think_start", rec.id)

    def _samples(self, *, trust_sources: bool) -> list:
        """The report's sample outputs, each beside its prompt read from its source line (not when
        the prompt files changed since the run was planned: a line would be another prompt)."""
        plan = self.plan
        with PromptReader() as reader:

            def prompt_of(rec) -> str | None:
                ref = self.refs.at(rec.index) if trust_sources else None
                if ref is None:
                    return None
                ds = plan.datasets[ref.dataset]
                try:
                    prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
                except (OSError, InputError):
                    return None
                return last_user_text(prompt.messages, ref.turn if ds.regenerate else None)

            return self.samples.finish(self.tok, self.info.think_end_id, prompt_of)

    def problem(self, name: str, message: str) -> None:
        """A failure found outside the records (e.g. a damaged merged file)."""
        self.problems.append(Check(name, False, None, None, message))

    # ----------------------------------------------------------------------------------------------
    def finish(self, manifest: MergeManifest) -> AuditReport:
        """The report of everything added, with the merge's `manifest` (its missing ids); writes
        failed_ids.txt."""
        plan, rd = self.plan, self.rd
        rd.merged_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(rd.failed_file, "".join(i + "\n" for i in self.failed_ids).encode())
        files = {"missing_ids": str(rd.missing_file), "failed_ids": str(rd.failed_file)}
        for name, acc in self.ds.items():
            counts = manifest.datasets.get(name)
            acc.stats.missing = counts.missing if counts is not None else 0
        tops = _hist_tops(list(self.ds.values()))
        datasets = [_finish_acc(a, tops) for a in self.ds.values()]
        overall = _finish_acc(_combine(list(self.ds.values()), "all", plan.total), tops)
        shards = self._shard_stats(manifest)
        reprompt, problem = rerender(self.tok, plan, self.refs, self.sampled)
        if problem:
            self.problem("source_files", problem)
        checks = list(self.problems) + run_checks(
            a=self.spec,
            model=plan.spec.model,
            info=self.info,
            overall=overall,
            datasets=datasets,
            shards=shards,
            integ=self.integ,
            reprompt=reprompt,
            corrupt=manifest.corrupt,
            duplicates=manifest.duplicates,
            continued=manifest.continued,
            noun=plan.noun,
            missing_ids=manifest.missing_ids[:EXAMPLES],
            examples=self.examples,
            missing_file=rd.missing_file,
            failed_file=rd.failed_file,
            run=rd.root,
            finish=rd.finish_command(),
        )
        info, model = self.info, plan.spec.model
        report = AuditReport(
            format=AUDIT_FORMAT,
            run=plan.name,
            fingerprint=plan.fingerprint,
            # what made the records, as the run pinned it: not the [engine] kind taken since
            engine="stub" if plan.synthetic else plan.spec.engine.kind,
            training=self._training(),
            created=utc_now(),
            passed=all(c.passed for c in checks),
            checks=checks,
            planned=plan.total,
            present=overall.records,
            ok=overall.ok,
            failed=overall.failed,
            missing=manifest.missing,
            duplicates=manifest.duplicates,
            damaged_frames=len(manifest.corrupt),
            tokens=TokenSummary(
                tokenizer=model.tokenizer_path or model.path,
                think_start=model.think_start,
                think_start_id=info.think_start_id,
                think_end=model.think_end,
                think_end_id=info.think_end_id,
                eos_ids=list(info.eos_ids),
                vocab_size=info.vocab_size,
                template_opens_reasoning=info.opens_reasoning,
            ),
            overall=overall,
            datasets=datasets,
            shards=shards,
            integrity=self.integ,
            reprompt=reprompt,
            files=files,
            turns=[self.turns[k] for k in sorted(self.turns, key=lambda k: (k[0], k[1]))],
            samples=self._samples(trust_sources=problem is None),
            continued=manifest.continued,
            skipped_inputs=[
                SkippedInputs(
                    d.name,
                    d.path,
                    d.bad_lines,
                    d.too_long,
                    [f"{d.path}:{x.line}: {x.reason}" for x in d.skipped],
                )
                for d in plan.datasets
                if d.skipped_lines
            ],
        )
        bad = [c.name for c in checks if not c.passed]
        if bad:
            log.error("audit of %s failed: %s", rd.root, ", ".join(bad))
        else:
            log.info("audit of %s passed", rd.root)
        return report

    def _training(self) -> TrainingShare:
        t = self.training
        t.share = round(t.exported_tokens / t.decoded_tokens, 6) if t.decoded_tokens else 0.0
        return t

    def _shard_stats(self, manifest: MergeManifest) -> list[ShardStats]:
        by_index = {s.index: s for s in manifest.shards}
        damaged = Counter(p.shard for p in manifest.corrupt)
        torn = Counter(p.shard for p in manifest.torn)
        out = []
        for sp, acc in zip(self.plan.shards, self.shards):
            sm = by_index.get(sp.index)
            prog = read_progress(self.rd, sp.index)
            out.append(
                ShardStats(
                    index=sp.index,
                    done=bool(sm and sm.done),
                    planned=sp.count,
                    records=acc.records,
                    ok=acc.ok,
                    failed=acc.failed,
                    missing=sp.count - acc.records,
                    duplicates=sm.duplicates if sm else 0,
                    damaged_frames=damaged[sp.index],
                    torn_frames=torn[sp.index],
                    output_tokens=acc.output_tokens,
                    matches_done=sm.matches_done if sm else None,
                    tok_per_s=prog.tok_per_s if prog and prog.tok_per_s else None,
                    mean_latency_s=round(acc.latency / acc.ok, 3) if acc.ok else None,
                    host=prog.host if prog else None,
                    engine_restarts=prog.engine_restarts if prog else None,
                )
            )
        return out


def _lengths(a: array) -> Lengths:
    if not len(a):
        return Lengths()
    v = np.frombuffer(a, np.uint32)
    p50, p90, p99 = (int(x) for x in np.percentile(v, [50, 90, 99], method="inverted_cdf"))
    total = int(v.sum(dtype=np.int64))
    return Lengths(
        count=len(v),
        total=total,
        mean=round(total / len(v), 1),
        p50=p50,
        p90=p90,
        p99=p99,
        max=int(v.max()),
    )


def _hist_tops(accs: list[_Acc]) -> dict[str, int]:
    """The largest length of each kind over every dataset: the datasets' histograms share their
    bins."""

    def top(a: array) -> int:
        return int(np.frombuffer(a, np.uint32).max()) if len(a) else 0

    return {
        k: max((top(getattr(a, f"{k}_len")) for a in accs), default=0) + 1
        for k in ("output", "reasoning", "content")
    }


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
    st.error_examples = {k: acc.error_examples[k] for k in st.errors if k in acc.error_examples}
    st.length_share = acc.finish.get("length", 0) / st.ok if st.ok else 0.0
    if st.continued_tokens:
        st.continued_cache_hit = round(st.continued_cached / st.continued_tokens, 4)
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
        for f in (
            "records",
            "ok",
            "failed",
            "missing",
            "prompt_tokens",
            "cached_tokens",
            "continued_tokens",
            "continued_cached",
            "output_tokens",
            "degenerate",
            "identical_samples",
            "samples_compared",
        ):
            setattr(s, f, getattr(s, f) + getattr(a.stats, f))
        out.finish.update(a.finish)
        out.errors.update(a.errors)
        for k, v in a.error_examples.items():
            out.error_examples.setdefault(k, v)
        for f in ReasoningCounts.__struct_fields__:
            setattr(out.r, f, getattr(out.r, f) + getattr(a.r, f))
        for f in ("prompt_len", "output_len", "reasoning_len", "content_len"):
            getattr(out, f).extend(getattr(a, f))
    return out


# --------------------------------------------------------------------------------------------------
# auditing a merged dataset on disk
# --------------------------------------------------------------------------------------------------
def audit_run(run_dir: str | os.PathLike) -> AuditReport:
    """Audit `RUN/merged/records.zst` against the plan (the merged dataset must exist)."""
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    manifest = load_manifest(rd)
    path = rd.merged_file
    if not path.exists():
        raise MergeError(
            f"{path} is missing although {rd.manifest_file} exists: run `toolkit merge {rd.root}` "
            "again"
        )
    auditor = Auditor(rd, plan)
    if sha256_file(path) != manifest.sha256:
        auditor.problem(
            "merged_file",
            f"{path} differs from the sha256 in its manifest: it changed after the merge; "
            f"run `toolkit merge {rd.root}` again",
        )
    try:
        head = read_header(path)
        if head != (plan.fingerprint, MERGED):
            auditor.problem(
                "merged_file",
                f"{path} is not this run's merged dataset (header {head}); merge again",
            )
        tail: list = []
        for frame in iter_frames(path, tail=tail):
            for rec in decode_batch(frame):
                auditor.add(rec)
        if tail:
            auditor.problem(
                "merged_file",
                f"{path} ends with a torn frame at byte {tail[0][0]} ({tail[0][1]}); "
                f"run `toolkit merge {rd.root}` again",
            )
    except (CorruptShard, msgspec.MsgspecError) as e:
        auditor.problem(
            "merged_file", f"{path} is damaged ({e}); run `toolkit merge {rd.root}` again"
        )
    return auditor.finish(manifest)
