"""The merged dataset an export reads: whether it is fit to export (`check_merged`: there, as its
merge left it, of this run, complete or merged with --allow-incomplete, not stale), what it lacks
of the plan (`short_merge`), what the run gained since it was made (`stale_merge`), the verdict of
the run's last audit (`audit_state`).
"""

from __future__ import annotations

import msgspec

from toolkit.dataset.export.selection import ExportError
from toolkit.dataset.merge_manifest import MERGED, MergeManifest
from toolkit.formats.frames import CorruptShard, read_header
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import ShardState
from toolkit.formats.text import ranges


def audit_state(rd: RunDir) -> tuple[str, str]:
    """("passed" | "failed" | "none", what failed): the verdict of the run's last audit
    (merged/audit.json)."""
    try:
        report = msgspec.json.decode(rd.audit_json.read_bytes())
    except (OSError, msgspec.DecodeError):
        return "none", ""
    if not isinstance(report, dict) or "passed" not in report:
        return "none", ""
    if report["passed"]:
        return "passed", ""
    bad = [
        c.get("name", "?")
        for c in report.get("checks", [])
        if isinstance(c, dict) and not c.get("passed", True)
    ]
    return "failed", ", ".join(bad)


def short_merge(rd: RunDir, manifest: MergeManifest) -> str | None:
    """What the merged dataset lacks of the plan (records missing, damaged frames), or None when it
    is complete."""
    if manifest.complete:
        return None
    return (
        f"{rd.merged_file} holds {manifest.records} of {manifest.planned} planned records "
        f"({manifest.missing} missing, {len(manifest.corrupt)} damaged frames): nothing exported. "
        f"`toolkit status {rd.shown}` names what is damaged and the command that repairs it; "
        f"`toolkit merge {rd.shown} --allow-incomplete` to export what is there"
    )


def stale_merge(rd: RunDir, plan: RunPlan, manifest: MergeManifest) -> str | None:
    """What the run gained or changed since its merged dataset was made (grown by new prompts, a
    shard written to or asked to generate records again since), or None when the merge is of the run
    as it is. Reads no record."""
    if manifest.planned != plan.total or len(manifest.shards) != len(plan.shards):
        return (
            f"the run plans {plan.total} records in {len(plan.shards)} shards, the merge had "
            f"{manifest.planned} in {len(manifest.shards)} (the job grew)"
        )
    changed, run = [], Run(rd, plan)
    for m in manifest.shards:
        path = rd.shard_file(m.index)
        size = path.stat().st_size if path.exists() else 0
        if size != m.bytes or run.shard_state(m.index).state is ShardState.RETRY:
            changed.append(m.index)
    if changed:
        return (
            f"shard{'s' * (len(changed) != 1)} {ranges(changed, sep=',')} changed since "
            "(records written, or asked for again)"
        )
    return None


def check_merged(run: Run, manifest: MergeManifest) -> str | None:
    """Refuse a merged dataset that is missing, changed since its merge, of another run, short
    (unless merged with --allow-incomplete) or older than the run; return what it lacks of the plan
    (`short_merge`)."""
    rd, plan = run.rd, run.plan
    path = rd.merged_file
    if not path.exists():
        raise ExportError(f"{path} is missing: run `toolkit merge {rd.root}` again")
    size = path.stat().st_size
    if size != manifest.bytes:
        raise ExportError(
            f"{path} has {size} bytes, its manifest says {manifest.bytes}: it changed after the "
            f"merge; run `toolkit merge {rd.root}` again"
        )
    try:
        head = read_header(path)
    except CorruptShard as e:
        raise _damaged(rd, e) from None
    if head != (plan.fingerprint, MERGED):
        raise ExportError(
            f"{path} is not the merged dataset of run {plan.fingerprint}; run `toolkit merge "
            f"{rd.root}` again"
        )
    short = short_merge(rd, manifest)
    if short and not manifest.allow_incomplete:
        raise ExportError(short)
    stale = stale_merge(rd, plan, manifest)
    if stale:
        raise ExportError(
            f"{path} is older than the run: {stale}; nothing exported. Run `toolkit merge "
            f"{rd.root}` once the run is complete (`--allow-incomplete` to merge what is there), "
            "then export"
        )
    return short


def _damaged(rd: RunDir, e: CorruptShard) -> ExportError:
    return ExportError(
        f"{rd.merged_file} is damaged ({e.why} at byte {e.offset}): nothing exported; run "
        f"`toolkit merge {rd.root}` again"
    )
