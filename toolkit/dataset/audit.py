"""Audit: is a merged run complete and faithful (coverage, reasoning, truncation, consistency)?

Everything is checked on token ids (the stored packed uint32 ids, never re-tokenized text); the
run's tokenizer is loaded only for its think / eos ids and to re-render a sample of prompts with the
chat template. `Auditor` accumulates over records in a single pass — the merge feeds it as it writes
— with memory in a few bytes per record (its counters: `audit_counts`), then `finish` turns the
totals into an `AuditReport` (schema: `dataset.audit_report`; the checks: `audit_checks`;
re-rendering prompts: `rerender`) and
writes `failed_ids.txt`. Missing ids are the merge's (its manifest and `missing_ids.txt`).
`audit_run` audits an existing merged dataset.

An output is "expected to reason" unless its prompt ends with the think-end id (thinking switched
off by the template). Whitespace-only ids are ignored at the end of prompts and when deciding that a
part is empty.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import msgspec

from toolkit.dataset.audit_checks import run_checks
from toolkit.dataset.audit_counts import (
    EXAMPLES,
    DatasetTotals,
    Examples,
    Output,
    SampleRepeats,
    ShardTotals,
    TurnTotals,
    combine,
    count_reasoning,
    dataset_stats,
    hist_tops,
    note,
)
from toolkit.dataset.audit_report import (
    AUDIT_FORMAT,
    AuditReport,
    Check,
    DatasetStats,
    Integrity,
    Reprompt,
    ShardStats,
    TrainingShare,
    skipped_inputs,
    token_summary,
)
from toolkit.dataset.examples import SampleCollector, source_prompt
from toolkit.dataset.merge import planned_refs
from toolkit.dataset.merge_manifest import MERGED, MergeError, MergeManifest, load_manifest
from toolkit.dataset.quality import KEPT_FOR_DRAFTERS, Judge, record_loop
from toolkit.dataset.rerender import rerender, sample_positions
from toolkit.formats.files import atomic_write, sha256_file
from toolkit.formats.frames import CorruptShard, decode_batch, iter_frames, read_header
from toolkit.formats.progress import read_progress
from toolkit.formats.records import (
    OK,
    Record,
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
from toolkit.job.inputs import PromptReader
from toolkit.job.schema import JobSpec

__all__ = ["Auditor", "audit_run"]

log = logging.getLogger(__name__)


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
        self.ds = {d.name: DatasetTotals(d.name, d.planned) for d in plan.datasets}
        self.shards = [ShardTotals() for _ in plan.shards]
        eos = set(self.info.eos_ids)
        self.stop_ids = {
            d.name: eos | set(plan.spec.sampling_for(d.name).get("stop_token_ids") or [])
            for d in plan.datasets
        }
        self.integ = Integrity()
        self.failed_ids: list[str] = []
        self.problems: list[Check] = []  # failures found outside records (damaged merged file)
        self.examples = Examples()
        self.sample_at = sample_positions(plan.total, self.spec.reprompt_sample)
        self.sampled: dict[int, bytes] = {}
        self.turns = TurnTotals()
        self.max_new = {
            d.name: plan.spec.sampling_for(d.name).get("max_new_tokens") for d in plan.datasets
        }
        self.samples = SampleCollector([d.name for d in plan.datasets], self.max_new)
        self.repeats = SampleRepeats(plan)
        # what the default training export holds of the decoded tokens (the export's own judge)
        self.judge = Judge(
            self.info.think_start_id,
            self.info.think_end_id,
            self.info.blank_ids,
            model.expect_reasoning,
        )
        self.training = TrainingShare()

    def add(self, rec: Record) -> None:
        pos = rec.index
        ref = self.refs.at(pos)
        if ref is None or ref.id != rec.id or self.plan.datasets[ref.dataset].name != rec.dataset:
            note(self.integ, "id_mismatch", rec.id)
            return
        if not self.seen[pos] and self.plan.datasets[ref.dataset].regenerate:
            self.turns.add(rec, ref.turn)
        if not self.seen[pos] and rec.status == OK and ref.dataset in self.repeats.datasets:
            self.repeats.add(rec, ref, self.ds[rec.dataset].stats, self.examples)
        self._add(rec, pos)

    def _add(self, rec: Record, pos: int) -> None:
        if self.seen[pos]:
            note(self.integ, "seen_twice", rec.id)
            return
        self.seen[pos] = 1
        acc = self.ds[rec.dataset]
        sh = self.shards[self.refs.shard_of(pos)]
        n_prompt, n = len(rec.prompt_ids) >> 2, len(rec.output_ids) >> 2
        acc.add_record(rec, n_prompt)
        sh.add(rec, n, rec.status == OK)
        if pos in self.sample_at and n_prompt:
            self.sampled[pos] = rec.prompt_ids
        # (ok records: see defects)
        if rec.prompt_tokens != n_prompt and n_prompt and rec.status != OK:
            note(self.integ, "prompt_mismatch", rec.id)
        if rec.status != OK:
            self._add_failed(rec, acc, n)
            return
        out = self._read_output(rec, n)
        acc.add_output(rec, out)
        self._add_quality(rec, out)
        if (
            out.te_at is not None
            or id_positions(rec.output_ids, self.info.think_start_id) is not None
        ):
            acc.r.think_tokens += 1
            self.examples.add("think_tokens", rec.id)
        self.samples.offer(rec, out.parts, out.te_at is not None)
        count_reasoning(acc.r, rec, out, self.info, self.blank, self.examples)

    def _add_failed(self, rec: Record, acc: DatasetTotals, n: int) -> None:
        """A failed record: counted by kind, its id listed, its tokens left out of training."""
        kind = acc.add_failure(rec)
        self.samples.error(rec.dataset, kind, rec.error)
        if rec.failure == "nan":
            acc.r.nan_failed += 1
            self.examples.add("nan_stop", rec.id)
        self.failed_ids.append(rec.id)
        self.training.add(n, "nan" if rec.failure == "nan" else "failed", False)

    def _read_output(self, rec: Record, n: int) -> Output:
        """An ok record's output: its integrity problems noted, then its mode, think-end and
        parts."""
        info = self.info
        te_at = id_positions(rec.output_ids, info.think_end_id)
        for kind in defects(rec, info.vocab_size, te_at, self.max_new[rec.dataset]):
            note(self.integ, kind, rec.id)
        m = rec.matched_stop
        if (
            rec.finish == "stop"
            and isinstance(m, int)
            and not isinstance(m, bool)
            and ends_with_stop(rec)
            and m not in self.stop_ids[rec.dataset]
        ):
            note(self.integ, "unexpected_stop", rec.id)
        if is_nan_stop(rec.finish, m):
            self.ds[rec.dataset].r.nan_stops += 1
            self.examples.add("nan_stop", rec.id)
        mode = chat.reasoning_mode(rec.prompt_ids, info)
        parts = split_parts(rec, info.think_start_id, mode == chat.OPENED)
        return Output(n, mode, te_at, parts)

    def _add_quality(self, rec: Record, out: Output) -> None:
        """What the training export keeps of the output, and a repetition loop if it is one."""
        loop = record_loop(rec)
        reason = self.judge.skip_reason(rec, out.opened, loop is not None)
        self.training.add(out.n, reason, reason is None or reason in KEPT_FOR_DRAFTERS)
        if loop is not None:
            self.ds[rec.dataset].stats.degenerate += 1
            self.examples.add("degenerate", rec.id)
            self.samples.loop(rec, out.parts, out.te_at is not None, loop)

    def _samples(self, *, trust_sources: bool) -> list:
        """The report's sample outputs, each beside its prompt read from its source line (not when
        the prompt files changed since the run was planned: a line would be another prompt)."""
        if not trust_sources:
            return self.samples.finish(self.tok, self.info.think_end_id)
        with PromptReader() as reader:
            prompt_of = source_prompt(self.plan, self.refs, reader)
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
        datasets, overall = self._dataset_stats(manifest)
        shards = self._shard_stats(manifest)
        reprompt, problem = rerender(self.tok, plan, self.refs, self.sampled)
        if problem:
            self.problem("source_files", problem)
        checks = list(self.problems) + self._checks(manifest, overall, datasets, shards, reprompt)
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
            tokens=token_summary(plan.spec.model, self.info),
            overall=overall,
            datasets=datasets,
            shards=shards,
            integrity=self.integ,
            reprompt=reprompt,
            files=files,
            turns=self.turns.stats(),
            samples=self._samples(trust_sources=problem is None),
            continued=manifest.continued,
            skipped_inputs=skipped_inputs(plan),
        )
        bad = [c.name for c in checks if not c.passed]
        if bad:
            log.error("audit of %s failed: %s", rd.root, ", ".join(bad))
        else:
            log.info("audit of %s passed", rd.root)
        return report

    def _dataset_stats(self, manifest: MergeManifest) -> tuple[list[DatasetStats], DatasetStats]:
        """Each dataset's statistics (its missing records the merge's) and the run's, their
        histograms sharing their bins."""
        for name, acc in self.ds.items():
            counts = manifest.datasets.get(name)
            acc.stats.missing = counts.missing if counts is not None else 0
        tops = hist_tops(list(self.ds.values()))
        datasets = [dataset_stats(a, tops) for a in self.ds.values()]
        overall = dataset_stats(combine(list(self.ds.values()), "all", self.plan.total), tops)
        return datasets, overall

    def _checks(
        self,
        manifest: MergeManifest,
        overall: DatasetStats,
        datasets: list[DatasetStats],
        shards: list[ShardStats],
        reprompt: Reprompt,
    ) -> list[Check]:
        plan, rd = self.plan, self.rd
        return run_checks(
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
