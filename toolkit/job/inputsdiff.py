"""A job's prompts against its run's, by id and content digest (`compare`): which were added, moved,
changed or removed (`InputsDiff`), said by file:line and id. job/grow takes the added and moved
ones into the run."""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.formats.prompts import PromptRef
from toolkit.formats.runplan import RunPlan

SHOWN = 10  # prompts named per kind of change; the rest are counted


@dataclass(slots=True)
class _Prompt:
    """Where one prompt of a plan is, and what it says: the refs of its samples and turns, in
    planned order."""

    dataset: str
    line: int
    digest: str
    refs: list[PromptRef] = field(default_factory=list)


def base_id(ref: PromptRef, samples: int, regenerate: bool) -> str:
    """The prompt id of a record id: without its `/t<turn>` and `#<sample>` suffixes (turns.turn_id,
    plan.sample_id)."""
    rid = ref.id
    if regenerate:
        rid = rid.removesuffix(f"/t{ref.turn}")
    if samples > 1:
        rid = rid.removesuffix(f"#{ref.sample}")
    return rid


def prompts_of(plan: RunPlan, refs: list[PromptRef]) -> dict[str, _Prompt]:
    """The prompts of a plan by id, each with its refs."""
    out: dict[str, _Prompt] = {}
    for r in refs:
        d = plan.datasets[r.dataset]
        pid = base_id(r, d.samples, d.regenerate)
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
    mine, theirs = prompts_of(run, run_refs), prompts_of(plan, refs)
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
