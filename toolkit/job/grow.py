"""A run that grows: its job planned again with other prompt files, into the same run directory.

A prompt is known by its id (given on its line, or derived from its content: inputs.py) and its
content digest. When a job whose model, tokenizer, template, sampling and shard count are the run's
is planned again (`findrun.may_grow`), its prompts are compared with the run's (`compare`, in
job/inputsdiff):

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
from toolkit.job.inputsdiff import InputsDiff, base_id, compare, prompts_of
from toolkit.job.plan import _digest
from toolkit.job.schema import JobSpec

log = logging.getLogger(__name__)

__all__ = ["grow_run", "grown_plan"]

_ALLOW = (
    "pass --allow-changed to generate the changed prompts again (their new records replace "
    "the old), "
)


def grown_plan(
    rd: RunDir, run: RunPlan, plan: RunPlan, refs: list[PromptRef], *, allow_changed: bool = False
) -> tuple[RunPlan, list[PromptRef], InputsDiff]:
    """The run's plan with the job's prompts (`plan`, `refs`) taken in: new shards for the added
    ones, refs of the moved (and, with `allow_changed`, the changed) ones updated; nothing is
    written. PlanError naming the changed and removed prompts."""
    run_refs = PromptIndex(rd, run).refs()
    diff = compare(run, run_refs, plan, refs)
    if diff.refused(allow_changed):
        raise _refusal(rd, run, plan, diff)
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
    where = {r.id: r for r in refs}
    out: list[PromptRef] = []
    for r in run_refs:
        now = where[r.id]
        out.append(
            PromptRef(
                r.id, r.dataset, now.line, now.offset, now.length, r.sample, r.turn, now.digest
            )
        )
    _add_shards(grown, run, plan, refs, diff, index, out)
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


def _refusal(rd: RunDir, run: RunPlan, plan: RunPlan, diff: InputsDiff) -> PlanError:
    """Why the job's prompts cannot be taken into its run (some changed or are gone), and what to
    do."""
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
    return PlanError(
        f"{rd.root} holds this job's run {run.fingerprint}, but {what} (differs in: inputs):\n "
        f" {diff.describe(run, plan)}\nA run's records belong to the prompts it "
        f"planned.{legacy} Restore those lines (a prompt edited on purpose is a new prompt: "
        "give it a new id, and keep the old line), "
        f"{_ALLOW if diff.rewritten and not diff.removed and not diff.legacy else ''}point "
        "`output_dir` elsewhere, or pass --new-run to start a new run directory beside it."
    )


def _add_shards(
    grown: RunPlan,
    run: RunPlan,
    plan: RunPlan,
    refs: list[PromptRef],
    diff: InputsDiff,
    index: dict[str, int],
    out: list[PromptRef],
) -> None:
    """The added prompts dealt to new shards of `grown` (about as many records a shard as the run's
    have, at most [sharding] shards of them), their refs appended to `out`, the growth recorded."""
    names = [d.name for d in plan.datasets]
    theirs = prompts_of(plan, refs)
    added = [theirs[pid].refs for _, _, pid in diff.added]
    records = sum(len(a) for a in added)
    shards: list[int] = []
    if not added:
        return
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
            if base_id(r, d.samples, d.regenerate) in prompts:
                by_shard.setdefault(sp.index, []).append(r.id)
    return {k: asked_again(rd, k, ids) for k, ids in by_shard.items()}
