"""A run that grows: its job planned again with other prompt files, into the same run directory.

A prompt is known by its id (given on its line, or derived from its content: inputs.py) and its
content digest. When a job whose model, tokenizer, template, sampling and shard count are the run's
is planned again (`plan.may_grow`), its prompts are compared with the run's (`compare`):

- added (an id the run does not have, in a file it has or in a dataset the job gained): planned
  after the run's own, in new shards numbered after its last (`grow_run`), about as large as its
  first ones, dealt round-robin. Nothing already planned moves: every record keeps its position,
  shard and done manifest, so merge, audit, status and resubmit see one plan, with more shards;
- moved (same id and content, another line or byte offset: lines edited or inserted before it, the
  file reordered): the run's refs point at the new place; nothing is generated again;
- changed (same id, other content or dataset) or removed (an id the files no longer have): named by
  file:line and id, and refused; the run is left as it was (restore the lines, give changed prompts
  new ids, or plan a new run). With `allow_changed` (`--allow-changed`), prompts whose messages or
  tools changed (same id, same dataset) are generated again: their refs point at the new lines and
  each of their shards gets a retry request for their records (formats.manifests, as `toolkit retry
  --ids` asks), so the worker writes new records that the merge keeps over the old ones. Removed
  prompts stay refused: their records cannot be taken out of a pinned plan.

`fingerprint` stays the run's (its shard files and manifests carry it); the fingerprint the grown
job gives is added to `aliases`, so that the same job is resumed there from then on. A run planned
by a toolkit whose ids came from line numbers (plan format 1) keeps its ids: it resumes as long as
its prompts are where they were, and does not grow. The plan is not grown under a shard that a
worker is generating.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import msgspec

from toolkit.formats import pending
from toolkit.formats.manifests import RetryRequest
from toolkit.formats.pending import PendingChange
from toolkit.formats.prompts import PromptIndex, PromptRef, refs_bytes
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import Growth, PlanError, RunPlan, ShardPlan
from toolkit.formats.shardstate import BUSY, asked_again
from toolkit.formats.text import ranges, utc_now
from toolkit.job.plan import _digest
from toolkit.job.spec import JobSpec

log = logging.getLogger(__name__)

__all__ = ["InputsDiff", "compare", "grow_run", "grown_plan"]

SHOWN = 10  # prompts named per kind of change; the rest are counted
_ALLOW = (
    "pass --allow-changed to generate the changed prompts again (their new records replace "
    "the old), "
)


@dataclass(slots=True)
class _Prompt:
    """Where one prompt of a plan is, and what it says: the refs of its samples and turns, in
    planned order."""

    dataset: str
    line: int
    digest: str
    refs: list[PromptRef] = field(default_factory=list)


def _base_id(ref: PromptRef, samples: int, regenerate: bool) -> str:
    """The prompt id of a record id: without its `/t<turn>` and `#<sample>` suffixes (turns.turn_id,
    plan.sample_id)."""
    rid = ref.id
    if regenerate:
        rid = rid.removesuffix(f"/t{ref.turn}")
    if samples > 1:
        rid = rid.removesuffix(f"#{ref.sample}")
    return rid


def _prompts(plan: RunPlan, refs: list[PromptRef]) -> dict[str, _Prompt]:
    """The prompts of a plan by id, each with its refs."""
    out: dict[str, _Prompt] = {}
    for r in refs:
        d = plan.datasets[r.dataset]
        pid = _base_id(r, d.samples, d.regenerate)
        p = out.get(pid)
        if p is None:
            p = out[pid] = _Prompt(d.name, r.line, r.digest)
        p.refs.append(r)
    return out


@dataclass
class InputsDiff:
    """What a job's prompts are against a run's: by id, each (dataset, line, id) where it is now
    (removed: was)."""

    added: list[tuple[str, int, str]] = field(default_factory=list)
    removed: list[tuple[str, int, str]] = field(default_factory=list)
    changed: list[tuple[str, int, str, str]] = field(default_factory=list)  # ..., what changed
    # ids of the changed prompts only their content changed in
    rewritten: set[str] = field(default_factory=set)
    moved: int = 0
    legacy: bool = False  # the run was planned with line-number ids (plan format 1)
    new_datasets: list[str] = field(default_factory=list)

    def refused(self, allow_changed: bool = False) -> bool:
        """Whether the job cannot be planned into the run: prompts removed, or changed (unless
        `allow_changed` and only their content changed)."""
        if self.removed:
            return True
        return bool(self.changed) and not (
            allow_changed and not self.legacy and len(self.rewritten) == len(self.changed)
        )

    def describe(self, run: RunPlan, plan: RunPlan) -> str:
        """Which files, lines and ids differ, one kind per line."""
        paths = {d.name: d.path for d in run.datasets} | {d.name: d.path for d in plan.datasets}
        parts = []
        for what, items in (
            ("changed", self.changed),
            ("removed", self.removed),
            ("added", self.added),
        ):
            if not items:
                continue
            shown = []
            for item in items[:SHOWN]:
                ds, line, pid = item[:3]
                how = f" ({item[3]})" if len(item) > 3 else ""
                shown.append(
                    f"{paths[ds]}:{line}{' (was)' if what == 'removed' else ''}: id {pid!r}{how}"
                )
            more = f"\n    ... and {len(items) - SHOWN:,} more" if len(items) > SHOWN else ""
            parts.append(
                f"{len(items):,} prompt{'s' * (len(items) != 1)} {what}:"
                + "".join(f"\n    {s}" for s in shown)
                + more
            )
        if self.moved:
            parts.append(
                f"{self.moved:,} prompt{'s' * (self.moved != 1)} at another line or offset (same "
                "id and content: the run follows them)"
            )
        return "\n  ".join(parts)


def compare(
    run: RunPlan, run_refs: list[PromptRef], plan: RunPlan, refs: list[PromptRef]
) -> InputsDiff:
    """The job's prompts (`plan`, `refs`) against the run's, by id and content digest."""
    diff = InputsDiff(legacy=run.format < 2 or any(not r.digest for r in run_refs[:1]))
    have = {d.name for d in run.datasets}
    diff.new_datasets = [d.name for d in plan.datasets if d.name not in have]
    if diff.legacy:  # ids from line numbers: the same job only while every prompt is where it was
        names = [d.name for d in run.datasets]
        now = [d.name for d in plan.datasets]
        same = len(run_refs) == len(refs) and all(
            (names[a.dataset], a.line, a.offset, a.length, a.sample, a.turn)
            == (now[b.dataset], b.line, b.offset, b.length, b.sample, b.turn)
            for a, b in zip(run_refs, refs)
        )
        if not same:
            old = {(names[r.dataset], r.line): r.id for r in run_refs}
            new = {(now[r.dataset], r.line) for r in refs}
            diff.removed = [
                (ds, line, rid) for (ds, line), rid in old.items() if (ds, line) not in new
            ]
            diff.changed = [
                (ds, line, rid, "its file changed since the run was planned")
                for (ds, line), rid in old.items()
                if (ds, line) in new
            ][:SHOWN]
        return diff
    mine, theirs = _prompts(run, run_refs), _prompts(plan, refs)
    for pid, p in mine.items():
        q = theirs.get(pid)
        if q is None:
            diff.removed.append((p.dataset, p.line, pid))
        elif q.dataset != p.dataset:
            diff.changed.append(
                (q.dataset, q.line, pid, f"now in dataset {q.dataset!r}, was in {p.dataset!r}")
            )
        elif len(q.refs) != len(p.refs):
            diff.changed.append(
                (q.dataset, q.line, pid, f"{len(q.refs)} records instead of {len(p.refs)}")
            )
        elif q.digest != p.digest:
            diff.changed.append(
                (q.dataset, q.line, pid, f"its messages or tools changed; was line {p.line}")
            )
            diff.rewritten.add(pid)
        elif any(
            (a.line, a.offset, a.length) != (b.line, b.offset, b.length)
            for a, b in zip(p.refs, q.refs)
        ):
            diff.moved += 1
    diff.added = [(q.dataset, q.line, pid) for pid, q in theirs.items() if pid not in mine]
    order = {d.name: i for i, d in enumerate(plan.datasets)}
    for items in (diff.added, diff.changed, diff.removed):
        items.sort(key=lambda x: (order.get(x[0], -1), x[1]))
    return diff


def grown_plan(
    rd: RunDir, run: RunPlan, plan: RunPlan, refs: list[PromptRef], *, allow_changed: bool = False
) -> tuple[RunPlan, list[PromptRef], InputsDiff]:
    """The run's plan with the job's prompts (`plan`, `refs`) taken in: new shards for the added
    ones, refs of the moved (and, with `allow_changed`, the changed) ones updated; nothing is
    written. PlanError naming the changed and removed prompts."""
    run_refs = PromptIndex(rd, run).refs()
    diff = compare(run, run_refs, plan, refs)
    if diff.refused(allow_changed):
        what = (
            "its prompt files changed since the run was planned"
            if diff.legacy
            else "some of its prompts changed or are gone"
        )
        legacy = (
            " It was planned by an older toolkit, whose ids came from line numbers: it resumes "
            "while its prompts stay where they were, and cannot grow (its ids are kept)."
            if diff.legacy
            else ""
        )
        raise PlanError(
            f"{rd.root} holds this job's run {run.fingerprint}, but {what} (differs in: inputs):\n "
            f" {diff.describe(run, plan)}\nA run's records belong to the prompts it "
            f"planned.{legacy} Restore those lines (a prompt edited on purpose is a new prompt: "
            "give it a new id, and keep the old line), "
            f"{_ALLOW if diff.rewritten and not diff.removed and not diff.legacy else ''}point "
            "`output_dir` elsewhere, or pass --new-run to start a new run directory beside it."
        )
    grown = msgspec.convert(msgspec.to_builtins(run), RunPlan[JobSpec])  # a deep copy
    if diff.legacy:  # nothing to take in: the job planned again, exactly as it was
        grown.aliases.append(plan.fingerprint)
        return grown, run_refs, diff
    # datasets: the run's, in their order (refs hold their index), then those the job gained
    index = {d.name: i for i, d in enumerate(grown.datasets)}
    for d in plan.datasets:
        if d.name not in index:
            index[d.name] = len(grown.datasets)
            grown.datasets.append(d)
        else:
            grown.datasets[index[d.name]] = d
    names = [d.name for d in plan.datasets]
    where = {r.id: r for r in refs}
    out: list[PromptRef] = []
    for r in run_refs:
        now = where[r.id]
        out.append(
            PromptRef(
                r.id, r.dataset, now.line, now.offset, now.length, r.sample, r.turn, now.digest
            )
        )
    theirs = _prompts(plan, refs)
    added = [theirs[pid].refs for _, _, pid in diff.added]
    records = sum(len(a) for a in added)
    shards: list[int] = []
    if added:
        per_shard = max(1, math.ceil(run.total / max(1, len(run.shards))))
        m = max(1, min(run.spec.sharding.shards, len(added), round(records / per_shard)))
        for j in range(m):
            first = len(out)
            for group in added[j::m]:
                out.extend(
                    PromptRef(
                        r.id,
                        index[names[r.dataset]],
                        r.line,
                        r.offset,
                        r.length,
                        r.sample,
                        r.turn,
                        r.digest,
                    )
                    for r in group
                )
            k = len(grown.shards)
            grown.shards.append(ShardPlan(k, first, len(out) - first))
            shards.append(k)
        grown.grown.append(
            Growth(
                at=utc_now(),
                prompts=len(added),
                records=records,
                shards=shards,
                datasets=diff.new_datasets,
            )
        )
    grown.total = len(out)
    grown.spec.datasets = plan.spec.datasets
    grown.spec.inputs = plan.spec.inputs
    grown.parts = {
        **grown.parts,
        "inputs": plan.parts["inputs"],
        "sampling": plan.parts["sampling"],
        "shards": _digest([run.spec.sharding.shards, [r.id for r in out]]),
    }
    grown.aliases.append(plan.fingerprint)
    return grown, out, diff


def grow_run(
    rd: RunDir,
    run: RunPlan,
    plan: RunPlan,
    refs: list[PromptRef],
    *,
    allow_changed: bool = False,
    computed: tuple[RunPlan, list[PromptRef], InputsDiff] | None = None,
) -> RunPlan:
    """Take the job's prompts into its run (see the module's docstring) and pin the grown plan; the
    plan as pinned. PlanError (nothing written) for changed (unless `allow_changed`) or removed
    prompts, or a shard being generated. `computed`: what `grown_plan` gave for these arguments."""
    grown, out, diff = computed or grown_plan(rd, run, plan, refs, allow_changed=allow_changed)
    busy = [s.index for s in run.shards if Run(rd, run).shard_state(s.index, BUSY).busy]
    if busy and not diff.legacy:
        raise PlanError(
            f"{rd.root}: the job's prompt files changed and shard{'s' * (len(busy) != 1)} "
            f"{ranges(busy, sep=',')} of its run {'are' if len(busy) != 1 else 'is'} being "
            "generated (its file is locked): the plan cannot change under a worker; wait for it "
            "to end (or stop it), then run again"
        )
    prompts = None if diff.legacy else refs_bytes(grown, out)  # (sets what run.json records of it)
    change = PendingChange(
        what=_what(run, grown, diff),
        plan=msgspec.json.format(msgspec.json.encode(grown), indent=2),
        prompts=prompts,
        retries=_ask_again(rd, grown, out, diff.rewritten) if diff.rewritten else {},
    )
    pending.apply(rd, change)  # the prompt index, the plan and the retry requests change together
    if diff.rewritten:
        log.warning(
            "run %s: %d prompts changed (same ids, other messages or tools; --allow-changed): "
            "their records are generated again",
            rd.shown,
            len(diff.rewritten),
        )
    if diff.legacy:
        log.info(
            "run %s: planned by an older toolkit (ids from line numbers); resumed with its ids",
            rd.shown,
        )
    if diff.moved:
        log.info(
            "run %s: %d prompts are at another line or offset of their files (same ids and "
            "content); the run follows them",
            rd.shown,
            diff.moved,
        )
    if len(grown.shards) > len(run.shards):
        g = grown.grown[-1]
        log.info(
            "run %s grows by %d prompts (%d records%s) in new shard%s %s",
            rd.shown,
            g.prompts,
            g.records,
            f", datasets {', '.join(g.datasets)}" if g.datasets else "",
            "s" * (len(g.shards) != 1),
            ranges(g.shards, sep=","),
        )
    return grown


def _what(run: RunPlan, grown: RunPlan, diff: InputsDiff) -> str:
    """The change in words, for the log of a command that finishes it after a crash."""
    parts = []
    if grown.total > run.total:
        parts.append(f"{grown.total - run.total} records added in new shards")
    if diff.rewritten:
        parts.append(f"{len(diff.rewritten)} changed prompts generated again")
    return "the job's prompts taken into the run" + (f": {', '.join(parts)}" if parts else "")


def _ask_again(
    rd: RunDir, plan: RunPlan, refs: list[PromptRef], prompts: set[str]
) -> dict[int, RetryRequest]:
    """A retry request for the records of `prompts` in each of their shards (whose done manifest
    goes): the worker generates them again, and the merge keeps the newest record of each id."""
    by_shard: dict[int, list[str]] = {}
    for sp in plan.shards:
        for r in refs[sp.first : sp.first + sp.count]:
            d = plan.datasets[r.dataset]
            if _base_id(r, d.samples, d.regenerate) in prompts:
                by_shard.setdefault(sp.index, []).append(r.id)
    return {k: asked_again(rd, k, ids) for k, ids in by_shard.items()}
